from __future__ import annotations

import pytest

from spec_compat.adapters.remote_errors import decode, encode, raise_decoded
from spec_compat.errors import WorkerError


def _raise_empty_assertion() -> None:
    raise AssertionError()


def test_empty_message_keeps_type_rank_and_traceback() -> None:
    try:
        _raise_empty_assertion()
    except AssertionError as exc:
        encoded = encode(exc, rank=1, method="_get_captured_states")
    # What vLLM's driver raises: the worker's str(exc) inside its own message.
    vllm_error = RuntimeError(f"Worker failed with error '{encoded}', please check the stack trace above")
    with pytest.raises(WorkerError) as info:
        raise_decoded(vllm_error)
    error = info.value
    assert (error.exc_type, error.message, error.rank, error.method) == (
        "AssertionError",
        "",
        1,
        "_get_captured_states",
    )
    assert "_raise_empty_assertion" in error.remote_traceback
    assert "AssertionError: (empty message) [in worker TP rank 1" in str(error)


def test_plain_errors_pass_through() -> None:
    assert decode("Worker failed with error 'boom'") is None
    raise_decoded(RuntimeError("boom"))  # nothing to decode: no exception
