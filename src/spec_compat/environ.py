"""Temporary environment variables: set for a scope, each put back (or removed) as it was on exit."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ.update(values)`` inside the ``with`` block only: every key gets its earlier
    value back afterwards, and a key that was unset is removed again."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
