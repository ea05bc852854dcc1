"""The shared-memory transfer on its own (CPU tensors, one process playing worker and driver)."""

from __future__ import annotations

import errno
import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from spec_compat.adapters import transfer


@pytest.fixture
def directory(tmp_path: Path) -> str:
    path = tmp_path / f"{transfer.DIR_PREFIX}{os.getpid()}-test"
    path.mkdir()
    return str(path)


def _reply() -> dict[str, Any]:
    """A speculators 0.4-shaped reply, with odd shapes, mixed dtypes and an empty tensor."""
    generator = torch.Generator().manual_seed(0)
    return {
        "req_0_0": [torch.randn(7, 16, generator=generator).bfloat16(), torch.randn(7, 16, generator=generator)],
        "req_0_1": [torch.randn(1, 16, generator=generator).bfloat16(), torch.randn(1, 16, generator=generator)],
        "req_0_2": [torch.empty(0, 16, dtype=torch.bfloat16), torch.arange(5, dtype=torch.int64)],
        "meta": ("kept", 3),
    }


def _roundtrip(reply: Any, pool: transfer.SegmentPool, mappings: transfer.DriverMappings) -> Any:
    packed = transfer.pack(reply, pool)
    assert isinstance(packed, transfer.SharedStates)
    return mappings.open(packed)


def test_roundtrip_is_bitwise_and_keeps_structure(directory: str) -> None:
    reply = _reply()
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    packed = transfer.pack(reply, pool)
    assert isinstance(packed, transfer.SharedStates) and packed.all_finite and packed.non_finite == ()
    opened = mappings.open(packed)
    assert opened.keys() == reply.keys() and opened["meta"] == ("kept", 3)
    for key in ("req_0_0", "req_0_1", "req_0_2"):
        for got, want in zip(opened[key], reply[key], strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    # 0.3.0's reply shape: a list of per-layer tensors
    layers = [torch.randn(33, 8), torch.randn(33, 8)]
    opened_list = _roundtrip(layers, pool, mappings)
    assert isinstance(opened_list, list) and all(torch.equal(a, b) for a, b in zip(opened_list, layers, strict=True))
    pool.close()


def test_replies_without_tensors_pass_through(directory: str) -> None:
    pool = transfer.SegmentPool(directory, "w")
    assert transfer.pack(None, pool) is None
    assert transfer.pack({"a": [1, 2]}, pool) == {"a": [1, 2]}
    assert pool.segments == []


def test_layout_chunks_by_dtype_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK_BYTES", 1024)
    tensors = [torch.zeros(64, dtype=torch.float32)] * 5 + [torch.zeros(3, dtype=torch.bfloat16)]
    chunks, offsets, total = transfer.layout(tensors)
    assert [c.indices for c in chunks] == [(0, 1, 2, 3), (4,), (5,)]
    assert all(c.offset % transfer.ALIGN == 0 for c in chunks)
    assert offsets[:4] == [0, 256, 512, 768] and total == chunks[-1].offset + 6


def test_segment_is_reused_once_released_and_not_while_held(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SPARE_SEGMENTS", 0)  # every free segment but the one used is freed
    monkeypatch.setattr(transfer, "USE_WINDOW", 1)  # ... however many were in use at once before
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    held = _roundtrip([torch.randn(100, 64)], pool, mappings)
    first = pool.segments[0].path
    again = _roundtrip([torch.randn(100, 64)], pool, mappings)  # `held` still alive: a second segment
    assert len(pool.segments) == 2 and pool.segments[1].path != first
    expected = held[0].clone()
    del again
    gc.collect()
    third = _roundtrip([torch.randn(100, 64)], pool, mappings)
    assert len(pool.segments) == 2, "the released segment is reused, the held one kept"
    assert torch.equal(held[0], expected), "a held reply is never overwritten"
    del held, third
    gc.collect()
    _roundtrip([torch.randn(100, 64)], pool, mappings)
    assert len(pool.segments) == 1, "free segments beyond the one used are freed"
    assert sorted(os.listdir(directory)) == [os.path.basename(pool.segments[0].path)]
    pool.close()
    assert os.listdir(directory) == []


def test_repeated_calls_do_not_leak(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SPARE_SEGMENTS", 0)  # every free segment but the one used is freed
    monkeypatch.setattr(transfer, "USE_WINDOW", 1)  # ... however many were in use at once before
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    fds_after_first = 0
    for call in range(200):
        opened = _roundtrip([torch.full((50 + call % 7, 32), float(call))], pool, mappings)
        assert float(opened[0][0, 0]) == call
        del opened
        if call == 0:
            fds_after_first = len(os.listdir("/proc/self/fd"))
    gc.collect()
    assert len(pool.segments) == 1 and len(os.listdir(directory)) == 1
    assert len(mappings.maps) == 1
    # the pool's fd and the two mappings' own descriptors, made by the first call; leases are closed
    assert len(os.listdir("/proc/self/fd")) == fds_after_first
    pool.close()


def test_growing_replies_get_a_larger_segment(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SPARE_SEGMENTS", 0)  # every free segment but the one used is freed
    monkeypatch.setattr(transfer, "USE_WINDOW", 1)  # ... however many were in use at once before
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    _roundtrip([torch.zeros(10, 10)], pool, mappings)
    small = pool.segments[0].size
    big = _roundtrip([torch.ones(small // 4 + 100)], pool, mappings)
    assert pool.segments[-1].size > small and bool((big[0] == 1).all())
    del big
    gc.collect()
    _roundtrip([torch.zeros(10, 10)], pool, mappings)
    assert len(pool.segments) == 1
    assert len(mappings.maps) == 1, "the driver unmaps segments the worker freed"
    pool.close()


def test_free_segments_are_kept_as_spares_up_to_the_limit(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call in parts (or results held while the next call runs) needs several segments in turn: the
    most recently used free ones are kept, at most SPARE_SEGMENTS besides the one in use."""
    monkeypatch.setattr(transfer, "SPARE_SEGMENTS", 2)
    monkeypatch.setattr(transfer, "USE_WINDOW", 1)
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    held = [_roundtrip([torch.randn(100 + 50 * k, 64)], pool, mappings) for k in range(4)]
    assert len(pool.segments) == 4 and pool.made == 4
    del held
    gc.collect()
    for _ in range(3):  # two parts in turn, each reply dropped after its part (as speculators' clones copy)
        part_a = _roundtrip([torch.randn(100, 64)], pool, mappings)
        part_b = _roundtrip([torch.randn(250, 64)], pool, mappings)
        del part_a, part_b
        gc.collect()
    assert pool.made == 4, "no segment was made for the parts"
    assert len(pool.segments) == 3, "one in use and two spares; the oldest free one is freed"
    pool.close()


def test_as_many_free_segments_are_kept_as_were_in_use_at_once(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call in 5 parts whose results are held until it returns needs 5 segments every call: they are
    kept (not freed and made again) while that many were in use within the last USE_WINDOW replies."""
    monkeypatch.setattr(transfer, "SPARE_SEGMENTS", 1)
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    for _ in range(4):
        parts = [_roundtrip([torch.randn(100, 64)], pool, mappings) for _ in range(5)]
        del parts
        gc.collect()
    assert pool.made == 5 and len(pool.segments) == 5
    monkeypatch.setattr(transfer, "USE_WINDOW", 2)  # the window moves past the parts: back to the spare
    pool._in_use = transfer.collections.deque(pool._in_use, maxlen=2)
    for _ in range(3):
        _roundtrip([torch.randn(100, 64)], pool, mappings)
        gc.collect()
    assert len(pool.segments) == 2, "one in use and SPARE_SEGMENTS spare"
    pool.close()


def test_non_finite_values_are_found_and_counted(directory: str) -> None:
    pool = transfer.SegmentPool(directory, "w")
    bad = torch.randn(6, 4)
    bad[2, 1] = float("nan")
    worse = torch.randn(3, 4).bfloat16()
    worse[0, 0], worse[1, 1] = float("inf"), float("-inf")
    packed = transfer.pack([torch.randn(5, 4), bad, worse], pool)
    assert isinstance(packed, transfer.SharedStates)
    assert not packed.all_finite and packed.non_finite == ((1, 1), (2, 2))
    pool.close()


def test_no_space_falls_back_to_the_inline_reply(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    pool = transfer.SegmentPool(directory, "w")
    reply = [torch.randn(4, 4)]
    packed = transfer.pack(reply, pool)
    assert isinstance(packed, transfer.InlineStates) and "No space left" in packed.reason
    assert packed.value is reply and packed.all_finite
    assert os.listdir(directory) == [], "a segment that could not be made leaves no file"


def test_driver_refuses_paths_outside_its_directory(directory: str, tmp_path: Path) -> None:
    pool = transfer.SegmentPool(directory, "w")
    packed = transfer.pack([torch.zeros(2)], pool)
    assert isinstance(packed, transfer.SharedStates)
    with pytest.raises(ValueError, match="outside"):
        transfer.DriverMappings(str(tmp_path / "elsewhere")).open(packed)
    pool.close()


def test_stale_directories_of_dead_drivers_are_swept(tmp_path: Path) -> None:
    dead = tmp_path / f"{transfer.DIR_PREFIX}999999999-abc"
    alive = tmp_path / f"{transfer.DIR_PREFIX}{os.getpid()}-abc"
    other = tmp_path / "unrelated-999999999-abc"
    for path in (dead, alive, other):
        path.mkdir()
        (path / "seg").write_bytes(b"x")
    assert transfer.sweep_stale_directories(str(tmp_path)) == [dead.name]
    assert not dead.exists() and alive.exists() and other.exists()


def test_failed_pinning_is_not_retried(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[int] = []

    def refuse(host: Any, piece: int | None = None) -> bool:
        attempts.append(host.numel())
        return False

    monkeypatch.setattr(transfer, "_pin", refuse)
    pool = transfer.SegmentPool(directory, "w")
    for _ in range(3):
        pool.acquire(1000, pin=True)
    assert len(attempts) == 1 and pool.pinning_failed and len(pool.segments) == 1
    pool.close()


class _Runtime:
    """The two CUDA runtime calls a segment makes, recorded (no GPU here); registration ``fail_at`` fails."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: dict[int, int] = {}
        self.calls = 0
        self.fail_at = fail_at

    def cudaHostRegister(self, address: int, length: int, flags: int) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            return 1
        self.registered[address] = length
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        del self.registered[address]
        return 0


def test_pinning_in_pieces_registers_each_and_copies_never_span_two(
    directory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _Runtime()
    monkeypatch.setattr(transfer, "_cuda_runtime", lambda: runtime)
    monkeypatch.setenv(transfer.PIN_PIECE_ENV, "1")
    segment = transfer.Segment(os.path.join(directory, "pieces"), (3 << 20) + 4096, pin=True)
    base = segment.host.data_ptr()
    assert segment.pinned and segment.piece == 1 << 20
    mib = 1 << 20
    assert runtime.registered == {base: mib, base + mib: mib, base + 2 * mib: mib, base + 3 * mib: 4096}
    spans = transfer._spans((1 << 20) - 10, (2 << 20) + 20, 1 << 20)
    assert spans == [((1 << 20) - 10, 1 << 20), (1 << 20, 2 << 20), (2 << 20, 3 << 20), (3 << 20, (3 << 20) + 10)]
    assert transfer._spans(5, 7, None) == [(5, 12)]
    source = torch.randint(0, 256, ((2 << 20) + 20,), dtype=torch.uint8)
    segment.copy_in((1 << 20) - 10, source, non_blocking=False)
    assert torch.equal(segment.host[(1 << 20) - 10 : (3 << 20) + 10], source)
    segment.close()
    assert runtime.registered == {}


def test_pinning_that_fails_on_a_piece_leaves_none_registered(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _Runtime(fail_at=3)
    monkeypatch.setattr(transfer, "_cuda_runtime", lambda: runtime)
    monkeypatch.setenv(transfer.PIN_PIECE_ENV, "1")
    segment = transfer.Segment(os.path.join(directory, "pieces"), 4 << 20, pin=True)
    assert not segment.pinned and runtime.registered == {}
    segment.close()
    monkeypatch.setenv(transfer.PIN_PIECE_ENV, "0")  # not a size: one registration
    assert transfer.pin_piece_bytes() is None
