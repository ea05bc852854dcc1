"""The streamed reply (adapters/stream.py, adapter captured-states-streamed) on CPU tensors: each step's
rows placed by speculators-shaped metadata give, through the driver's mapping, exactly the reply
speculators 0.4.x builds after the last step (its walk re-done here on the same tensors); anything the
stream cannot place leaves the reply to speculators."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from spec_compat.adapters import stream, transfer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

# speculators 0.4.x's _get_captured_states walk, re-done on the same tensors (one copy, the benchmark's)
from stream_cuda import speculators_reply

Metadata = list[list[tuple[str, int]]]


@pytest.fixture
def directory(tmp_path: Path) -> str:
    path = tmp_path / f"{transfer.DIR_PREFIX}{os.getpid()}-test"
    path.mkdir()
    return str(path)


def _steps(metadata: Metadata, seed: int, layers: int = 3, width: int = 8) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    rows = [sum(count for _, count in step) for step in metadata]
    return [[torch.randn(n, width, generator=generator).bfloat16() for _ in range(layers)] for n in rows]


def _prompts(metadata: Metadata) -> dict[str, int]:
    totals: defaultdict[str, int] = defaultdict(int)
    for step in metadata:
        for req_id, count in step:
            totals[req_id] += count
    return dict(totals)


def _run(streamer: stream.StatesStreamer, metadata: Metadata, seed: int, **overrides: Any) -> tuple[Any, Any]:
    """Stream one reply; (what finish returned, speculators' reply for the same tensors)."""
    steps = _steps(metadata, seed)
    prompts = {**_prompts(metadata), **overrides.get("prompts", {})}
    placed = overrides.get("placed", metadata)
    for index, (tensors, step) in enumerate(zip(steps, placed, strict=True)):
        streamer.step(tensors, index == 0, step, prompts.get)
    return streamer.finish(metadata), speculators_reply(steps, metadata)


# A call chunked over four steps: req_b and req_d continue in the next step, where a new request has
# taken the slot of one that finished and comes first (what vLLM's persistent batch does).
CHUNKED: Metadata = [
    [("req_a", 5), ("req_b", 3)],
    [("req_c", 4), ("req_b", 4)],
    [("req_c", 2), ("req_d", 6)],
    [("req_e", 1), ("req_d", 2), ("req_f", 5)],
]


def _assert_equal(opened: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]]) -> None:
    assert list(opened) == list(want)  # speculators' order: first appearance
    for req_id, layers in want.items():
        for got, expected in zip(opened[req_id], layers, strict=True):
            assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)


def test_streamed_reply_is_speculators_reply_bitwise(directory: str) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    streamer = stream.StatesStreamer(pool)
    first, _ = _run(streamer, CHUNKED, seed=0)
    assert first is None and streamer.last_declined is not None and "first reply" in streamer.last_declined
    for seed in (1, 2):  # the next replies of the same size are streamed, in a reused segment
        states, want = _run(streamer, CHUNKED, seed=seed)
        assert isinstance(states, transfer.SharedStates) and states.streamed and states.all_finite
        _assert_equal(mappings.open(states), want)
    assert (streamer.streamed, streamer.declined) == (2, 1)
    # a smaller call fits the room the larger ones made
    small: Metadata = [[("req_x", 3)], [("req_y", 2), ("req_x", 1)]]
    states, want = _run(streamer, small, seed=3)
    assert isinstance(states, transfer.SharedStates)
    _assert_equal(mappings.open(states), want)
    pool.close()


def _streamer_with_history(directory: str, rows: int) -> stream.StatesStreamer:
    streamer = stream.StatesStreamer(transfer.SegmentPool(directory, "w"))
    streamer.recent_rows.append(rows)
    return streamer


@pytest.mark.parametrize(
    ("case", "overrides", "why"),
    [
        ("too large", {"metadata": [[("req_a", 30)], [("req_a", 10)]]}, "room"),
        ("unknown prompt", {"prompts": {"req_b": None}}, "prompt length"),
        ("prompt shorter than its rows", {"prompts": {"req_d": 7}}, "more rows than its prompt"),
        ("rows not the metadata's", {"placed": [[("req_a", 5), ("req_b", 2)], *CHUNKED[1:]]}, "names 7 rows"),
        ("no metadata for a step", {"placed": [CHUNKED[0], None, *CHUNKED[2:]]}, "no request metadata"),
    ],
)
def test_what_cannot_be_placed_is_left_to_speculators(
    directory: str, case: str, overrides: dict[str, Any], why: str
) -> None:
    streamer = _streamer_with_history(directory, 31)
    metadata = overrides.pop("metadata", CHUNKED)
    states, _ = _run(streamer, metadata, seed=4, **overrides)
    assert states is None, case
    assert streamer.last_declined is not None and why in streamer.last_declined, streamer.last_declined
    # the next reply is streamed again
    states, want = _run(streamer, CHUNKED, seed=5)
    assert isinstance(states, transfer.SharedStates)
    _assert_equal(transfer.DriverMappings(directory).open(states), want)


def test_metadata_changed_after_the_steps_is_left_to_speculators(directory: str) -> None:
    streamer = _streamer_with_history(directory, 31)
    steps = _steps(CHUNKED, seed=6)
    for index, (tensors, step) in enumerate(zip(steps, CHUNKED, strict=True)):
        streamer.step(tensors, index == 0, step, _prompts(CHUNKED).get)
    assert streamer.finish([*CHUNKED[:-1], [("req_f", 5), ("req_d", 2), ("req_e", 1)]]) is None
    assert streamer.last_declined is not None and "not the one the rows were placed by" in streamer.last_declined


def test_reset_drops_the_reply_being_streamed(directory: str) -> None:
    streamer = _streamer_with_history(directory, 31)
    steps = _steps(CHUNKED, seed=7)
    streamer.step(steps[0], True, CHUNKED[0], _prompts(CHUNKED).get)
    streamer.drop()  # speculators' _reset_capture
    assert streamer.finish(CHUNKED[:1]) is None and streamer.declined == 0  # nothing left to describe


def test_non_finite_rows_are_counted_per_tensor_as_pack_does(directory: str) -> None:
    streamer = _streamer_with_history(directory, 31)
    steps = _steps(CHUNKED, seed=8)
    steps[1][2][5, 3] = float("nan")  # req_b's second chunk, layer 2
    steps[3][0][0, 0] = float("inf")  # req_e, layer 0
    for index, (tensors, step) in enumerate(zip(steps, CHUNKED, strict=True)):
        streamer.step(tensors, index == 0, step, _prompts(CHUNKED).get)
    states = streamer.finish(CHUNKED)
    assert isinstance(states, transfer.SharedStates) and not states.all_finite
    packed = transfer.pack(speculators_reply(steps, CHUNKED), transfer.SegmentPool(directory, "ref"))
    assert isinstance(packed, transfer.SharedStates)
    assert states.non_finite == packed.non_finite == ((5, 1), (12, 1))


def test_a_failing_step_leaves_the_reply_to_speculators(directory: str) -> None:
    streamer = _streamer_with_history(directory, 31)
    steps = _steps(CHUNKED, seed=9)

    def broken(req_id: str) -> int | None:
        raise RuntimeError("no model runner")

    streamer.step(steps[0], True, CHUNKED[0], _prompts(CHUNKED).get)
    with pytest.raises(RuntimeError):
        streamer.step(steps[1], False, CHUNKED[1], broken)
    streamer.fail(RuntimeError("no model runner"))  # what the adapter does with the error
    for tensors, step in zip(steps[2:], CHUNKED[2:], strict=True):
        streamer.step(tensors, False, step, _prompts(CHUNKED).get)
    assert streamer.finish(CHUNKED) is None
    assert streamer.last_declined is not None and "the stream failed: RuntimeError" in streamer.last_declined


def test_the_stream_never_waits_for_or_starts_a_segment_inside_the_steps(directory: str) -> None:
    pool = transfer.SegmentPool(directory, "w", prefetch=True)
    streamer = stream.StatesStreamer(pool)
    streamer.recent_rows.append(31)
    being_made: Future[transfer.Segment] = Future()
    pool._prefetching = being_made  # the next segment, still being made in the background
    assert _run(streamer, CHUNKED, seed=10)[0] is None
    assert streamer.last_declined == "the next segment is still being made in the background"
    assert pool.segments == [] and pool._prefetching is being_made  # nothing made, nothing waited for
    being_made.set_result(transfer.Segment(os.path.join(directory, "w-background"), 1 << 16, pin=False))
    steps = _steps(CHUNKED, seed=11)
    for index, (tensors, step) in enumerate(zip(steps, CHUNKED, strict=True)):
        streamer.step(tensors, index == 0, step, _prompts(CHUNKED).get)
    # streamed into the segment made in the background; no other started while the steps ran
    assert [s.path for s in pool.segments] == [os.path.join(directory, "w-background")]
    assert pool._prefetching is None
    states = streamer.finish(CHUNKED)
    assert isinstance(states, transfer.SharedStates) and states.path == os.path.join(directory, "w-background")
    _assert_equal(transfer.DriverMappings(directory).open(states), speculators_reply(steps, CHUNKED))
    assert pool._prefetching is not None  # the next one, started once the reply is done (as pack's acquire does)
    pool.close()


class _CudaRows:
    """What _begin reads of a CUDA tensor (no GPU here): device, rows, dtype."""

    device = torch.device("cuda", 0)
    dtype = torch.bfloat16
    shape = (4, 8)

    def dim(self) -> int:
        return 2

    def is_contiguous(self) -> bool:
        return True

    def element_size(self) -> int:
        return 2


def test_cuda_streams_only_when_asked_until_measured(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    streamer = _streamer_with_history(directory, 4)
    monkeypatch.delenv(stream.CUDA_ENV, raising=False)
    declined = streamer._begin([_CudaRows()]).declined
    assert declined == f"on CUDA only with {stream.CUDA_ENV}=1 (not faster yet on a GPU)", declined
    monkeypatch.setenv(stream.CUDA_ENV, "1")
    # asked: it goes on to a segment, which must be pinned for a copy that does not wait (none can be here)
    declined = streamer._begin([_CudaRows()]).declined
    assert declined is not None and "not pinned" in declined, declined
