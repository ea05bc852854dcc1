"""The output contract of ``VllmHiddenStatesGenerator.generate``.

One entry per input, in input order; ``input_ids`` equal to the (truncated) input; one tensor
per requested layer id; each ``[num_tokens, hidden_size]``, floating point and finite.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..errors import ResultContractError

_MAX_REPORTED = 8


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__}{list(shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


# The int64 bytes of each input row of the generate() call in progress, by the row object's identity
# (the object is kept with its bytes, so an id is never mistaken for another row's). input-validation
# converts every row once while checking it; the reordering and the contract check read the bytes here
# instead of converting every row again (two more passes over all of a call's ids: about 10 ms of a
# 58k-token call on the H200 host's CPU, a third of spec_compat's own time there).
_INPUT_KEYS: ContextVar[dict[int, tuple[Sequence[int], bytes]] | None] = ContextVar(
    "spec_compat_input_keys", default=None
)


@contextmanager
def known_input_keys(rows: Sequence[Sequence[int]], keys: Sequence[bytes | None]) -> Iterator[None]:
    """While inside, ``int64_key(row)`` of each of ``rows`` (the same objects) returns its ``keys`` entry."""
    token = _INPUT_KEYS.set({id(row): (row, key) for row, key in zip(rows, keys, strict=True) if key is not None})
    try:
        yield
    finally:
        _INPUT_KEYS.reset(token)


def int64_key(ids: Any) -> bytes:
    """Token ids (a 1-D integer tensor or a sequence of ints) as int64 bytes: an exact key that hashes
    and compares in C. TypeError / OverflowError for ids that are not int64 values."""
    import torch

    if isinstance(ids, torch.Tensor):
        return bytes(ids.to(torch.int64).contiguous().numpy().tobytes())
    known = _INPUT_KEYS.get()
    entry = known.get(id(ids)) if known else None
    if entry is not None and entry[0] is ids:
        return entry[1]
    return array("q", ids).tobytes()


def _same_ids(ids: Any, expected: Sequence[int]) -> bool:
    """``ids`` (a tensor or a sequence) equals ``expected``, compared as int64 bytes where possible."""
    import torch

    if isinstance(ids, torch.Tensor) and not ids.dtype.is_floating_point and ids.ndim == 1:
        try:
            wanted = int64_key(expected)
        except (TypeError, OverflowError):
            return bool(ids.tolist() == list(expected))
        return int64_key(ids) == wanted
    return bool((ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)) == list(expected))


def contract_violations(
    results: Any,
    inputs: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    hidden_size: int | None,
    check_finite: bool = True,
) -> list[str]:
    """Every way ``results`` breaks the contract (empty when it holds). ``check_finite=False`` when
    every value was already checked where it was computed (spec_compat's worker-side check)."""
    import torch

    problems: list[str] = []
    if not isinstance(results, list):
        return [f"expected a list of {len(inputs)} results, got {_shape(results)}"]
    if len(results) != len(inputs):
        problems.append(f"expected {len(inputs)} results (one per input), got {len(results)}")
    for index, (result, expected) in enumerate(zip(results, inputs, strict=False)):  # read only: no copies
        where = f"result[{index}]"
        if not isinstance(result, dict) or "input_ids" not in result or "hidden_states" not in result:
            problems.append(f"{where}: expected a dict with input_ids and hidden_states, got {_shape(result)}")
            continue
        ids = result["input_ids"]
        if not _same_ids(ids, expected):
            actual = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            problems.append(
                f"{where}: input_ids differ from input {index} "
                f"(expected {len(expected)} tokens starting {list(expected[:6])}, got {len(actual)} starting "
                f"{actual[:6]})"
            )
        states = result["hidden_states"]
        if not isinstance(states, (list, tuple)) or len(states) != len(layer_ids):
            problems.append(
                f"{where}: expected {len(layer_ids)} hidden-state tensors (one per layer id "
                f"{list(layer_ids)}), got {_shape(states)}"
                + (f" with first item {_shape(states[0])}" if isinstance(states, (list, tuple)) and states else "")
            )
            continue
        for layer_pos, tensor in enumerate(states):
            label = f"{where}.hidden_states[{layer_pos}] (layer {layer_ids[layer_pos]})"
            if not isinstance(tensor, torch.Tensor):
                problems.append(f"{label}: expected a tensor, got {type(tensor).__name__}")
                continue
            want = [len(expected), hidden_size if hidden_size is not None else "hidden_size"]
            if (
                tensor.ndim != 2
                or tensor.shape[0] != len(expected)
                or (hidden_size is not None and tensor.shape[1] != hidden_size)
            ):
                problems.append(f"{label}: expected shape {want}, got {list(tensor.shape)}")
                continue
            if not tensor.is_floating_point():
                problems.append(f"{label}: expected a floating-point tensor, got {tensor.dtype}")
            elif check_finite and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                problems.append(f"{label}: {bad} non-finite values (NaN/Inf)")
    return problems


def check_results(
    results: Any,
    inputs: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    hidden_size: int | None,
    check_finite: bool = True,
) -> None:
    problems = contract_violations(results, inputs, layer_ids, hidden_size, check_finite)
    if problems:
        shown = "\n  - ".join(problems[:_MAX_REPORTED])
        more = f"\n  ... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise ResultContractError(
            f"VllmHiddenStatesGenerator.generate returned results that break the contract "
            f"({len(problems)} problem(s)):\n  - {shown}{more}"
        )
