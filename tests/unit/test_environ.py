"""spec_compat.environ.scoped_environ: variables set for a scope and put back as they were."""

from __future__ import annotations

import os

import pytest

from spec_compat.environ import scoped_environ


def test_values_are_scoped_and_restored_even_after_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEC_COMPAT_TEST_KEPT", "user")
    monkeypatch.delenv("SPEC_COMPAT_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), scoped_environ({"SPEC_COMPAT_TEST_KEPT": "1", "SPEC_COMPAT_TEST_NEW": "2"}):
        assert os.environ["SPEC_COMPAT_TEST_KEPT"] == "1" and os.environ["SPEC_COMPAT_TEST_NEW"] == "2"
        raise RuntimeError
    assert os.environ["SPEC_COMPAT_TEST_KEPT"] == "user" and "SPEC_COMPAT_TEST_NEW" not in os.environ
