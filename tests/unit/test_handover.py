"""driver-states-handover without an engine: through the real transfer (one process playing worker
and driver), speculators' clones are plain tensors with exactly their own storage, equal to a copy,
that keep the segment from the worker; a second clone copies; the held limit falls back to copies."""

from __future__ import annotations

import gc
import io
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from spec_compat.adapters import handover, transfer

ROWS = (5, 17, 3)


@pytest.fixture
def directory(tmp_path: Path) -> str:
    path = tmp_path / f"{transfer.DIR_PREFIX}{os.getpid()}-test"
    path.mkdir()
    return str(path)


def reply_04(fill: float = 0.0) -> dict[str, list[torch.Tensor]]:
    """speculators 0.4.x's reply: per request, one tensor per layer."""
    generator = torch.Generator().manual_seed(int(fill))
    return {
        f"req_0_{i}": [(torch.randn(rows, 8, generator=generator) + fill).bfloat16() for _ in range(2)]
        for i, rows in enumerate(ROWS)
    }


def open_reply(value: Any, pool: transfer.SegmentPool, mappings: transfer.DriverMappings) -> Any:
    packed = transfer.pack(value, pool)
    assert isinstance(packed, transfer.SharedStates)
    return mappings.open(packed, handover.as_clone_sources)


def test_clones_keep_the_segment_bytes_as_plain_tensors_of_their_own(directory: str) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    sent = reply_04()
    reply = open_reply(sent, pool, mappings)
    assert all(type(h) is handover.CloneSource for states in reply.values() for h in states)
    results = {key: [h.clone().cpu() for h in reply[key]] for key in sorted(reply)}  # as speculators 0.4.x
    del reply
    gc.collect()
    for key, states in results.items():
        for got, want in zip(states, sent[key], strict=True):
            assert type(got) is torch.Tensor and got.dtype == want.dtype and torch.equal(got, want)
            assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
    assert mappings.held_count == 1 and mappings.held_bytes == pool.segments[0].size
    assert pool.segments[0].leased(), "the results keep the segment from the worker"
    saved = io.BytesIO()
    torch.save(results["req_0_1"][0], saved)  # one result's bytes, not the segment's
    assert saved.tell() < 4096 + results["req_0_1"][0].numel() * 2
    copy = pickle.loads(pickle.dumps(results["req_0_0"][1]))
    assert torch.equal(copy, sent["req_0_0"][1])
    # The next reply goes to another segment and leaves these results as they were.
    second = reply_04(fill=5.0)
    again = {key: [h.clone() for h in states] for key, states in open_reply(second, pool, mappings).items()}
    assert len(pool.segments) == 2 and torch.equal(again["req_0_2"][1], second["req_0_2"][1])
    assert all(torch.equal(got, sent[key][i]) for key, states in results.items() for i, got in enumerate(states))
    del results, again, states, got, want, copy
    gc.collect()
    assert mappings.held_bytes == 0 and not any(s.leased() for s in pool.segments)
    pool.close()


def test_sliced_sources_are_handed_over_too(directory: str) -> None:
    """speculators 0.3.0: one tensor per layer for the batch, sliced per request, then cloned."""
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    layers = [torch.randn(25, 8), torch.randn(25, 8)]
    reply = open_reply(layers, pool, mappings)
    part = reply[0][5:22]
    assert type(part) is handover.CloneSource
    clone = part.clone().cpu()
    assert type(clone) is torch.Tensor and torch.equal(clone, layers[0][5:22]) and mappings.held_count == 1
    assert clone.data_ptr() == part.data_ptr(), "the clone keeps the bytes it views: no copy"
    # Anything that is not a view of the segment comes back plain.
    assert type(reply[1].float() + 1) is torch.Tensor and type(reply[1].sum()) is torch.Tensor
    pool.close()


def test_a_second_clone_of_the_same_bytes_is_an_independent_copy(directory: str) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    layers = [torch.randn(9, 8)]
    source = open_reply(layers, pool, mappings)[0]
    first, second, overlapping = source.clone(), source.clone(), source[2:4].clone()
    assert first.data_ptr() == source.data_ptr() and second.data_ptr() != source.data_ptr()
    first.fill_(7)
    assert torch.equal(second, layers[0]) and torch.equal(overlapping, layers[0][2:4])
    pool.close()


def test_non_contiguous_views_and_clone_options_copy(directory: str) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    layers = [torch.randn(6, 8)]
    source = open_reply(layers, pool, mappings)[0]
    transposed = source.t()
    assert type(transposed) is handover.CloneSource
    copy = transposed.clone()
    assert type(copy) is torch.Tensor and torch.equal(copy, layers[0].t()) and mappings.held_count == 0
    channels_last = source.view(1, 6, 8, 1).clone(memory_format=torch.channels_last)
    assert torch.equal(channels_last, layers[0].view(1, 6, 8, 1)) and mappings.held_count == 0
    pool.close()


def test_the_held_limit_falls_back_to_copies(directory: str) -> None:
    pool = transfer.SegmentPool(directory, "w")
    mappings = transfer.DriverMappings(directory, held_limit=transfer.SIZE_STEP)  # one small segment
    kept = [h.clone() for h in open_reply([torch.randn(4, 8)], pool, mappings)]
    assert mappings.held_count == 1
    plain = open_reply([torch.randn(4, 8)], pool, mappings)
    assert type(plain[0]) is torch.Tensor and mappings.refused == 1  # speculators' clone copies
    del kept, plain
    gc.collect()
    handed = open_reply([torch.randn(4, 8)], pool, mappings)
    assert type(handed[0]) is handover.CloneSource
    pool.close()


def test_the_held_segments_limit_falls_back_to_copies(directory: str) -> None:
    """Results kept from many calls: past the limit, replies are copied (and their segments reused)."""
    pool = transfer.SegmentPool(directory, "w")
    mappings = transfer.DriverMappings(directory, held_segments_limit=2)
    kept = [[h.clone() for h in open_reply([torch.randn(4, 8)], pool, mappings)] for _ in range(2)]
    assert mappings.held_segments == 2 and pool.made == 2
    for _ in range(3):
        copied = [h.clone() for h in open_reply([torch.randn(4, 8)], pool, mappings)]
        assert type(copied[0]) is torch.Tensor
    assert mappings.refused == 3 and pool.made == 3, "the copied replies share one segment"
    del kept, copied
    gc.collect()
    assert mappings.held_segments == 0
    pool.close()


def test_results_released_from_another_thread_free_the_segment(directory: str) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    reply = open_reply(reply_04(), pool, mappings)
    results = [[h.clone() for h in reply[key]] for key in ("req_0_0", "req_0_1")]
    del reply
    gc.collect()
    assert pool.segments[0].leased()
    worker = threading.Thread(target=results.clear)  # a writer thread dropping the batch it wrote
    worker.start()
    worker.join()
    gc.collect()
    assert mappings.held_bytes == 0 and not pool.segments[0].leased()
    open_reply(reply_04(), pool, mappings)
    assert len(pool.segments) == 1, "the freed segment is reused"
    pool.close()


def test_the_lease_is_released_without_the_garbage_collector(directory: str) -> None:
    """Reference counting alone frees a reply's segment once its results are dropped (a reference cycle
    once kept it until the collector ran: the worker then made a new segment per call)."""
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            reply = open_reply(reply_04(), pool, mappings)
            results = [[h.clone() for h in reply[key]] for key in sorted(reply)]
            del reply
            assert pool.segments[0].leased()
            del results
            assert not pool.segments[0].leased() and mappings.held_bytes == 0
        assert pool.made == 1
    finally:
        gc.enable()
    pool.close()


MIB = 1 << 20


def _batches_held_by_a_writer(pool: transfer.SegmentPool, mappings: transfer.DriverMappings) -> list[int]:
    """spec-compat extract's pattern: calls in three parts (two full steps, a short last one), each
    call's clones kept until the writer has written it, two calls later. ``pool.made`` after each call."""
    made = []
    in_writer: list[list[torch.Tensor]] = []
    for call in range(8):
        if len(in_writer) == 2:
            in_writer.pop(0)  # the oldest batch is on disk: its clones go
            gc.collect()
        clones = []
        for nbytes in (10 * MIB, 10 * MIB, 3 * MIB):
            reply = open_reply([torch.full((nbytes // 4,), float(call))], pool, mappings)
            clones += [h.clone() for h in reply]
            del reply
        in_writer.append(clones)
        made.append(pool.made)
    assert all(bool((batch[0] == batch[0][0]).all()) for batch in in_writer), "kept clones were not overwritten"
    return made


def test_batches_held_by_a_writer_keep_their_bytes_and_the_pool_counts_its_segments(directory: str) -> None:
    """The counts extract_stats.json records: every segment the worker made is one the driver saw, and
    every segment made and not kept was freed; the acquire that made one reports its seconds."""
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    made = _batches_held_by_a_writer(pool, mappings)
    assert made[-1] >= 3, f"three parts in use at once need three segments: {made}"
    assert len(mappings.segments_seen) == pool.made
    assert pool.freed == pool.made - len(pool.segments)
    assert mappings.held_count + mappings.refused == 8 * 3, "every part handed over or copied"
    open_reply([torch.zeros(64 * MIB // 4)], pool, mappings)  # larger than any segment: a new one
    assert pool.new_segment_s > 0
    pool.close()


def test_prefetch_makes_the_next_segment_before_a_reply_needs_it(directory: str) -> None:
    """extract's pattern with prefetch on: the segments a later call needs are made in the background
    (the acquire then only adopts one), the kept clones keep their bytes, and the pool frees all at close."""
    pool = transfer.SegmentPool(directory, "w", prefetch=True)
    mappings = transfer.DriverMappings(directory)
    made = _batches_held_by_a_writer(pool, mappings)
    assert pool.prefetched >= 1, f"no segment was made in the background: {made}"
    assert pool.freed == pool.made - len(pool.segments)
    on_demand = transfer.SegmentPool(directory, "o")
    _batches_held_by_a_writer(on_demand, transfer.DriverMappings(directory))
    assert pool.made - pool.prefetched < on_demand.made, "prefetching did not spare any reply a segment of its own"
    pool.close()
    on_demand.close()
    assert not [name for name in os.listdir(directory) if name.startswith(("w-", "o-"))]


def test_a_segment_being_made_in_the_background_is_in_the_directory_from_the_decision_on(
    directory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetch's file is created when the pool decides to make it, not when the background thread
    gets to it: a listing of the transfer directory (what the engine cells compare between calls) sees
    every segment the pool has decided on, however late the thread runs."""
    stalled, proceed = threading.Event(), threading.Event()
    real_segment = transfer.Segment

    def segment(path: str, size: int, pin: bool, fd: int | None = None) -> transfer.Segment:
        if threading.current_thread() is not threading.main_thread():  # the background one: held back
            stalled.set()
            proceed.wait(10)
        return real_segment(path, size, pin, fd)

    monkeypatch.setattr(transfer, "Segment", segment)
    pool = transfer.SegmentPool(directory, "p", prefetch=True)
    pool.acquire(1 << 16, pin=False)  # made on demand; no other fits a reply this large: one in the background
    assert stalled.wait(10), "no segment was started in the background"
    names = sorted(name for name in os.listdir(directory) if name.startswith("p-"))
    proceed.set()
    assert names == ["p-0", "p-1"], names
    pool.close()
    assert pool.prefetched == 1 and not [name for name in os.listdir(directory) if name.startswith("p-")]
