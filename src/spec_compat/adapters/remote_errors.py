"""Carry a worker exception's type, rank and traceback through vLLM's ``str(exc)`` channel.

vLLM's worker loop replies ``(FAILURE, str(exc))`` and the caller raises
``RuntimeError("Worker failed with error '<str(exc)>' ...")``: the type and traceback are lost
and ``AssertionError()`` arrives as ``''``. Exceptions raised by speculators' worker code are
re-raised as ``EncodedWorkerException`` whose ``str`` is a JSON record between markers; the
driver side decodes it into ``errors.WorkerError``.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

from ..errors import WorkerError

_BEGIN = "<<spec_compat-worker-error "
_END = " spec_compat-worker-error>>"


class EncodedWorkerException(RuntimeError):
    """Raised inside a worker; its message is the encoded original exception."""


def encode(exc: BaseException, rank: int | None, method: str) -> EncodedWorkerException:
    record = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "rank": rank,
        "method": method,
        "traceback": "".join(traceback.format_exception(exc)),
    }
    return EncodedWorkerException(_BEGIN + json.dumps(record) + _END)


def is_encoded(text: str) -> bool:
    """Whether ``text`` carries an encoded worker exception (one that must not be encoded again)."""
    return _BEGIN in text


def decode(text: str) -> WorkerError | None:
    start = text.find(_BEGIN)
    end = text.find(_END, start + len(_BEGIN))
    if start < 0 or end < 0:
        return None
    try:
        record: dict[str, Any] = json.loads(text[start + len(_BEGIN) : end])
    except json.JSONDecodeError:
        return None
    return WorkerError(
        exc_type=str(record.get("type")),
        message=str(record.get("message", "")),
        rank=record.get("rank"),
        remote_traceback=str(record.get("traceback", "")),
        method=str(record.get("method", "?")),
    )


def raise_decoded(exc: BaseException) -> None:
    """Re-raise ``exc`` as a WorkerError when it carries an encoded worker exception."""
    decoded = decode(str(exc))
    if decoded is not None:
        raise decoded from exc
