"""Captured hidden states from a vLLM worker to the driver through shared memory.

Without this, a reply of speculators' ``_get_captured_states`` (~500 MB for 32k tokens x 4 layers of
a 2048-wide bf16 model) is pickled tensor by tensor through vLLM's message queue and unpickled in
the driver: on an H200 that was 1.66 s of a 2.74 s call whose forward took 0.13 s.

Worker (``pack``): the reply's tensors are laid out in one *segment*, a file in the executor's
transfer directory (``/dev/shm``), mapped in the worker and, on CUDA, registered as pinned memory.
They are copied there in a few large device-to-host copies (consecutive tensors of one dtype are
concatenated on the device into chunks of up to ``CHUNK_BYTES``) and checked for NaN/Inf where they
are (one ``aminmax`` per chunk, before the copy). Only a ``SharedStates`` descriptor (offsets,
dtypes, shapes, the finiteness verdict) goes through vLLM's RPC.

Driver (``DriverMappings.open``): maps the segment once (populated, reused across calls) and
rebuilds the reply with tensors that are views of that mapping: no copy.

Lifetime: the tensors of one reply keep a *lease* alive, a file descriptor holding a shared
``flock`` on the segment. The worker reuses or frees a segment only when it can take that lock
exclusively, i.e. once the driver has dropped every tensor of the reply (speculators clones them
at once). Locks die with their process. The driver's executor creates the directory, hands it to
its workers (``TRANSFER_DIR_ENV``) and removes it at shutdown; directories of drivers that are no
longer alive are removed when a new one is made.

No vLLM import here: this is torch, mmap and flock only.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import functools
import itertools
import logging
import math
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("spec_compat.transfer")

TRANSFER_DIR_ENV = "SPEC_COMPAT_TRANSFER_DIR"
DIR_PREFIX = "spec_compat-transfer-"
ALIGN = 256  # bytes; every chunk starts aligned (DMA and any dtype view)
CHUNK_BYTES = 256 << 20  # largest device-side concatenation (bounds the extra device memory)
SIZE_STEP = 4 << 20  # segment sizes are multiples of this
SPARE_SEGMENTS = 3  # free segments a worker keeps besides the one it uses (at least; SegmentPool)
USE_WINDOW = 32  # replies over which the most segments in use at once is remembered
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the whole mapping in one call
PREFETCH_ENV = "SPEC_COMPAT_SEGMENT_PREFETCH"  # "0": a worker makes a segment only when a reply needs one
# N: a segment is pinned in pieces of N MiB (one cudaHostRegister each) instead of one call, and every copy into it
# is split at the pieces' edges, so none spans two registrations. Off by default: for the GPU A/B of whether one
# long cudaHostRegister on the background thread is what stalls the steps beside it (docs/benchmarks.md, run AA;
# benchmarks/segment_contention.py measures it without the engine).
PIN_PIECE_ENV = "SPEC_COMPAT_PIN_PIECE_MIB"


# ---- the descriptor ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor of the reply lies in the segment."""

    offset: int
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SharedStates:
    """What goes through vLLM's RPC instead of the tensors.

    ``template``: the reply with every tensor replaced by its ``TensorRef``. ``all_finite``: every
    floating-point value was finite on the worker. ``non_finite``: (tensor position, count) when not.
    ``live_segments``: the worker's segments that still exist (the driver unmaps the others).
    ``timings``: the worker's share of ``spec_compat.timings()``.
    """

    path: str
    nbytes: int
    segment_size: int
    template: Any
    all_finite: bool
    non_finite: tuple[tuple[int, int], ...]
    live_segments: tuple[str, ...]
    timings: tuple[tuple[str, float], ...]
    streamed: bool = False  # written step by step during the forwards (adapter captured-states-streamed)


@dataclass(frozen=True)
class SegmentSlice:
    """One tensor's bytes in a segment file (``DriverMappings.locate``): enough for another process
    to map them (``inode`` tells it the file at ``path`` is still the same one)."""

    path: str
    inode: int
    offset: int
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]


@dataclass(frozen=True)
class InlineStates:
    """The reply itself, when no segment could be made (``reason`` says why); already checked."""

    value: Any
    all_finite: bool
    reason: str
    timings: tuple[tuple[str, float], ...]


def flatten(value: Any) -> tuple[Any, list[Any]]:
    """``value`` with its tensors (in lists, tuples and dicts) replaced by their position, and the tensors."""
    import torch

    tensors: list[Any] = []
    return _walk(value, tensors, torch.Tensor), tensors


def _walk(item: Any, tensors: list[Any], tensor_type: type) -> Any:
    # A module-level function, not a recursive closure: a closure that refers to itself is a reference
    # cycle, which kept ``tensors`` (and the segment's lease they hold) alive until the garbage collector ran.
    if isinstance(item, tensor_type):
        tensors.append(item)
        return _Position(len(tensors) - 1)
    if isinstance(item, list):
        return [_walk(x, tensors, tensor_type) for x in item]
    if isinstance(item, tuple):
        return tuple(_walk(x, tensors, tensor_type) for x in item)
    if isinstance(item, dict):
        return {key: _walk(x, tensors, tensor_type) for key, x in item.items()}
    return item


@dataclass(frozen=True)
class _Position:
    index: int


def _substitute(template: Any, leaf: Any) -> Any:
    if isinstance(template, (_Position, TensorRef)):
        return leaf(template)
    if isinstance(template, list):
        return [_substitute(x, leaf) for x in template]
    if isinstance(template, tuple):
        return tuple(_substitute(x, leaf) for x in template)
    if isinstance(template, dict):
        return {key: _substitute(x, leaf) for key, x in template.items()}
    return template


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@dataclass(frozen=True)
class _Chunk:
    offset: int
    nbytes: int
    indices: tuple[int, ...]


def layout(tensors: list[Any]) -> tuple[list[_Chunk], list[int], int]:
    """Chunks of consecutive tensors with one dtype and device (each <= CHUNK_BYTES unless one tensor
    is larger), every tensor's byte offset, and the total size."""
    chunks: list[_Chunk] = []
    offsets: list[int] = []
    end = 0
    current: list[int] = []
    start = size = 0

    def close() -> None:
        if current:
            chunks.append(_Chunk(start, size, tuple(current)))

    for index, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        previous = tensors[current[-1]] if current else None
        same_kind = previous is not None and previous.dtype == tensor.dtype and previous.device == tensor.device
        if not current or not same_kind or size + nbytes > CHUNK_BYTES:
            close()
            start = _round_up(end, ALIGN)
            current, size = [], 0
        offsets.append(start + size)
        current.append(index)
        size += nbytes
        end = start + size
    close()
    return chunks, offsets, end


# ---- worker side -------------------------------------------------------------------------------------


def _cuda_runtime() -> Any:
    import torch

    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister leaves its error as the runtime's last error, which torch's next
    kernel-launch check would raise; read it once to clear it (libcudart is already loaded)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


def pin_piece_bytes() -> int | None:
    """``PIN_PIECE_ENV`` in bytes (a whole number of MiB above 0), or None: one registration per segment."""
    value = os.environ.get(PIN_PIECE_ENV, "").strip()
    return int(value) << 20 if value.isdigit() and int(value) > 0 else None


def _pieces(size: int, piece: int | None) -> list[tuple[int, int]]:
    """(start, length) of each registration of a segment of ``size`` bytes."""
    step = piece or size
    return [(start, min(step, size - start)) for start in range(0, size, step)]


def _spans(offset: int, nbytes: int, piece: int | None) -> list[tuple[int, int]]:
    """[offset, offset + nbytes) cut at every multiple of ``piece`` (None: not cut), as (start, stop)."""
    end = offset + nbytes
    spans = []
    while offset < end:
        stop = end if piece is None else min(end, (offset // piece + 1) * piece)
        spans.append((offset, stop))
        offset = stop
    return spans


def _pin(host: Any, piece: int | None = None) -> bool:
    done: list[int] = []
    try:
        runtime = _cuda_runtime()
        for start, length in _pieces(host.numel(), piece):
            code = runtime.cudaHostRegister(host.data_ptr() + start, length, 0)
            if int(code) != 0:
                break
            done.append(start)
        else:
            return True
    except Exception:  # noqa: BLE001 - no CUDA runtime: copy without pinning
        for start in done:
            _unpin(host, start)
        return False
    _clear_cuda_error()
    for start in done:
        _unpin(host, start)
    logger.warning("spec_compat: cudaHostRegister failed (%s); copies to shared memory are not pinned", code)
    return False


def _unpin(host: Any, start: int = 0) -> None:
    try:
        _cuda_runtime().cudaHostUnregister(host.data_ptr() + start)
    except Exception:  # noqa: BLE001
        _clear_cuda_error()


def create_file(path: str) -> int:
    """A new, empty segment file (never an existing one), open for reading and writing."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)


class Segment:
    """One segment file, mapped in the worker (and pinned for CUDA copies when ``pin``); ``fd``: the
    file already created by ``create_file`` (a segment made in the background), else created here."""

    def __init__(self, path: str, size: int, pin: bool, fd: int | None = None) -> None:
        import torch

        fd = create_file(path) if fd is None else fd
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here (ENOSPC), not as SIGBUS later
            else:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | MAP_POPULATE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.path = path
        self.size = size
        self.fd = fd
        self.host = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pin_requested = pin
        piece = pin_piece_bytes() if pin else None
        self.pinned = _pin(self.host, piece) if pin else False
        self.piece = piece if self.pinned else None  # pinned in pieces of this many bytes (None: whole or not)

    def copy_in(self, offset: int, source: Any, non_blocking: bool) -> None:
        """Copy the bytes of ``source`` (a contiguous uint8 tensor, on any device) to ``offset``; split at
        the edges of the pieces the segment was pinned in, so that no copy spans two registrations."""
        for start, stop in _spans(offset, source.numel(), self.piece):
            self.host[start:stop].copy_(source[start - offset : stop - offset], non_blocking=non_blocking)

    def leased(self) -> bool:
        """Does the driver still hold tensors of the last reply written here?"""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        if self.pinned:
            for start, _ in _pieces(self.size, self.piece):
                _unpin(self.host, start)
        del self.host
        self.map.close()
        os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class SegmentPool:
    """The worker's segments: reuse the smallest free one that fits, keep the most recently used other
    free ones, free the rest, make a new one when none fits.

    How many free ones are kept: ``SPARE_SEGMENTS``, or as many as were in use at once within the last
    ``USE_WINDOW`` replies if more (a call run in parts, or results the driver holds while the next
    call runs, needs that many in turn: fewer would free and re-make segments every call).

    How large a new one is: its own reply plus an eighth. Sizing it for the largest of the recent replies
    instead (so a segment made for a call's short last step fits its next full one) was measured on an
    H200 (docs/benchmarks.md, run O) and made both generate() and extract slower: it is not done.

    ``prefetch``: when an acquire leaves no other free segment that would fit a reply as large as the
    largest of the recent ones, the next segment is made on a background thread while the worker
    computes the next forward (fallocate, populate and cudaHostRegister all release the GIL), so the
    reply that needs it does not wait 0.2-0.4 s for it (H200, spec-compat extract: 2-6 such waits per
    run, 0.8-1.3 s of a 5-8 s run, run Q). At most one is made at a time; one that is never used is
    a spare like any other. Off: ``SPEC_COMPAT_SEGMENT_PREFETCH=0``."""

    def __init__(self, directory: str, name: str, prefetch: bool = False) -> None:
        self.directory = directory
        self.name = name
        self.prefetch = prefetch
        self._prefetching: Future[Segment] | None = None  # the segment being made in the background
        self._prefetcher: ThreadPoolExecutor | None = None
        self._recent_sizes: collections.deque[int] = collections.deque(maxlen=USE_WINDOW)  # replies' bytes
        self.prefetched = 0  # segments made in the background
        self.prefetch_wait_s = 0.0  # of the last acquire: seconds waiting for the one being made
        self.segments: list[Segment] = []
        self._numbers = itertools.count()
        self._uses = itertools.count()
        self.last_used: dict[str, int] = {}
        self.pinning_failed = False  # once cudaHostRegister has failed, copy unpinned instead of retrying
        self.made = 0
        self.freed = 0
        self.new_segment_s = 0.0  # of the last acquire: seconds making a segment
        self.free_segment_s = 0.0  # ... and freeing spares
        self._in_use: collections.deque[int] = collections.deque(maxlen=USE_WINDOW)  # leased + 1, per acquire

    def _close(self, segment: Segment) -> None:
        started = time.perf_counter()
        self.segments.remove(segment)
        self.last_used.pop(segment.path, None)
        segment.close()
        self.freed += 1
        self.free_segment_s += time.perf_counter() - started

    def acquire(self, nbytes: int, pin: bool) -> Segment:
        chosen = self._acquire(nbytes, pin, wait=True)
        assert chosen is not None  # made if none fits
        self.prefetch_after(chosen, pin)
        return chosen

    def acquire_without_waiting(self, nbytes: int, pin: bool) -> Segment | None:
        """``acquire`` for a reply streamed while the engine's steps run: None where ``acquire`` would wait
        for the segment being made in the background, and no segment started in the background here
        (``prefetch_after``, once the reply is done, starts it where ``acquire`` at a reply's end would).
        One H100, run AA: the streamer's wait for that segment took 0.33 s of a step, and the next one,
        started beside the rest of the steps, slowed them by 0.2 s (batch 1: 0.95 s against 0.42 s)."""
        return self._acquire(nbytes, pin, wait=False)

    def prefetch_after(self, chosen: Segment, pin: bool) -> None:
        """Start making the next segment in the background if ``chosen`` is the only free one that fits."""
        if self.prefetch:
            self._prefetch_if_short(chosen, pin and not self.pinning_failed)

    def _acquire(self, nbytes: int, pin: bool, wait: bool) -> Segment | None:
        self.new_segment_s = self.free_segment_s = self.prefetch_wait_s = 0.0
        pin = pin and not self.pinning_failed
        self._recent_sizes.append(nbytes)
        self._adopt_prefetched(wait=False)
        free = [s for s in self.segments if not s.leased()]
        fitting = [s for s in free if s.size >= nbytes and (s.pinned or not pin)]
        if not fitting and self._prefetching is not None and not wait:
            return None
        if not fitting and self._prefetching is not None:  # waiting for it is shorter than making one
            waited = time.perf_counter()
            if (made := self._adopt_prefetched(wait=True)) is not None:
                free.append(made)
                fitting += [made] if made.size >= nbytes and (made.pinned or not pin) else []
            self.prefetch_wait_s = time.perf_counter() - waited
        chosen = min(fitting, key=lambda s: s.size) if fitting else None
        self._in_use.append(len(self.segments) - len(free) + 1)
        keep = max(SPARE_SEGMENTS, max(self._in_use) - 1)
        spares = sorted((s for s in free if s is not chosen), key=lambda s: -self.last_used.get(s.path, -1))
        for segment in spares[keep:]:
            self._close(segment)
        if chosen is None:
            started = time.perf_counter()
            size = _round_up(nbytes + nbytes // 8, SIZE_STEP)  # headroom for the next, slightly larger call
            path = os.path.join(self.directory, f"{self.name}-{next(self._numbers)}")
            try:
                chosen = Segment(path, size, pin)
            except OSError:  # a full /dev/shm: make room from the spares, then try once more
                for segment in spares[:keep]:
                    self._close(segment)
                chosen = Segment(path, size, pin)
            self.made += 1
            self.pinning_failed = pin and not chosen.pinned
            self.segments.append(chosen)
            self.new_segment_s = time.perf_counter() - started
        self.last_used[chosen.path] = next(self._uses)
        return chosen

    def _prefetch_if_short(self, chosen: Segment, pin: bool) -> None:
        """Start making a segment for the largest recent reply if no free one but ``chosen`` fits it."""
        if self._prefetching is not None:
            return
        largest = max(self._recent_sizes)
        if any(s is not chosen and s.size >= largest and not s.leased() for s in self.segments):
            return
        size = _round_up(largest + largest // 8, SIZE_STEP)
        path = os.path.join(self.directory, f"{self.name}-{next(self._numbers)}")
        try:
            # the file now, the rest (fallocate, populate, pin) in the background: the transfer directory
            # shows every segment the pool has decided to make from the moment it decides
            fd = create_file(path)
        except OSError:
            return  # the reply that needs it makes its own (and says why if it cannot)
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spec-compat-segment")
        self._prefetching = self._prefetcher.submit(Segment, path, size, pin, fd)

    def _adopt_prefetched(self, wait: bool) -> Segment | None:
        """The background segment, once made (``wait``: until then), added to the pool; None if none
        was made (still running, or it failed: a full /dev/shm leaves the reply to make its own)."""
        future = self._prefetching
        if future is None or not (wait or future.done()):
            return None
        self._prefetching = None
        try:
            made = future.result()
        except OSError:
            return None
        self.made += 1
        self.prefetched += 1
        self.pinning_failed = self.pinning_failed or (made.pin_requested and not made.pinned)
        self.segments.append(made)
        self.last_used[made.path] = next(self._uses)  # ranked as recent: not the first spare to be freed
        return made

    def close(self) -> None:
        if self._prefetching is not None:
            self._adopt_prefetched(wait=True)
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None
        for segment in self.segments:
            segment.close()
        self.segments.clear()


def worker_pool(owner: Any, rank: int | None) -> SegmentPool | None:
    """The segment pool of one worker (kept on ``owner``, speculators' worker extension), or None when
    the driver did not start a transfer (no spec_compat executor, or its transfer is off)."""
    directory = os.environ.get(TRANSFER_DIR_ENV)
    if not directory:
        return None
    pool: SegmentPool | None = owner.__dict__.get("_spec_compat_segments")
    if pool is None or pool.directory != directory:
        prefetch = os.environ.get(PREFETCH_ENV, "1") != "0"
        pool = SegmentPool(directory, f"rank{rank}-pid{os.getpid()}", prefetch=prefetch)
        owner._spec_compat_segments = pool
    return pool


def _finite_probe(flat: Any) -> Any:
    """A device-side pair (min, max): both finite iff every value is (NaN and Inf propagate)."""
    import torch

    if not flat.is_floating_point() or flat.numel() == 0:
        return None
    low, high = torch.aminmax(flat)
    return torch.stack([low.float(), high.float()])


def non_finite_counts(tensors: list[Any]) -> tuple[tuple[int, int], ...]:
    import torch

    counts = []
    for index, tensor in enumerate(tensors):
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                counts.append((index, bad))
    return tuple(counts)


def pack(value: Any, pool: SegmentPool) -> SharedStates | InlineStates | Any:
    """Copy ``value``'s tensors into a segment of ``pool``; the descriptor that replaces them."""
    import torch

    template, tensors = flatten(value)
    if not tensors:
        return value
    started = time.perf_counter()
    chunks, offsets, nbytes = layout(tensors)
    cuda_devices = {t.device for t in tensors if t.device.type == "cuda"}
    try:
        segment = pool.acquire(max(nbytes, 1), pin=bool(cuda_devices))
    except OSError as exc:
        return _inline(value, tensors, f"{type(exc).__name__}: {exc}", started)
    acquire_s = time.perf_counter() - started
    host = segment.host
    probes: list[Any] = []
    check_s = 0.0
    for chunk in chunks:
        parts = [tensors[i].reshape(-1) for i in chunk.indices]
        dest = host[chunk.offset : chunk.offset + chunk.nbytes]
        if parts[0].device.type == "cpu":
            typed = dest.view(parts[0].dtype)
            if len(parts) == 1:
                typed.copy_(parts[0])
            else:
                torch.cat(parts, out=typed)
            checked = time.perf_counter()
            probes.append(_finite_probe(typed))
            check_s += time.perf_counter() - checked
        else:
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            probes.append(_finite_probe(flat))  # queued on the device before the copy
            segment.copy_in(chunk.offset, flat.reshape(-1).view(torch.uint8), non_blocking=segment.pinned)
    for device in cuda_devices:  # the copies were queued on each device's current stream
        torch.cuda.current_stream(device).synchronize()
    checked = time.perf_counter()
    present = [p for p in probes if p is not None]
    all_finite = not present or bool(torch.isfinite(torch.cat(present).cpu()).all())
    non_finite = () if all_finite else non_finite_counts(tensors)
    check_s += time.perf_counter() - checked
    refs = [TensorRef(offset, _dtype_name(t.dtype), tuple(t.shape)) for offset, t in zip(offsets, tensors, strict=True)]
    total_s = time.perf_counter() - started
    return SharedStates(
        path=segment.path,
        nbytes=nbytes,
        segment_size=segment.size,
        template=_substitute(template, lambda position: refs[position.index]),
        all_finite=all_finite,
        non_finite=non_finite,
        live_segments=tuple(s.path for s in pool.segments),
        timings=(
            ("own:worker-finite-check", check_s),
            ("transfer:worker-copy", total_s - check_s),  # the segment's acquire (a new one: made) included
            ("transfer:worker-acquire", acquire_s),  # of which making a segment, freeing spares:
            ("transfer:worker-new-segment", pool.new_segment_s),
            ("transfer:worker-free-segment", pool.free_segment_s),
            ("transfer:worker-prefetch-wait", pool.prefetch_wait_s),  # for a segment made in the background
        ),
    )


def _inline(value: Any, tensors: list[Any], reason: str, started: float) -> InlineStates:
    import torch

    probes = [p for p in (_finite_probe(t.reshape(-1)) for t in tensors) if p is not None]
    all_finite = not probes or bool(torch.isfinite(torch.cat(probes).cpu()).all())
    return InlineStates(value, all_finite, reason, (("own:worker-finite-check", time.perf_counter() - started),))


# ---- driver side -------------------------------------------------------------------------------------


class _Lease:
    """A file descriptor with a shared flock on a segment; closed (lock released) when collected.
    ``on_release``: called then (from whichever thread drops the last reference)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        self.on_release: Any = None

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)
        if self.on_release is not None:
            self.on_release()


def _leased_bytes(mapping: mmap.mmap, nbytes: int, lease: _Lease) -> Any:
    """A buffer over the first ``nbytes`` of ``mapping`` that owns ``lease``: tensors made from it keep
    both alive (and the mapping cannot be closed under them: the buffer is an export)."""
    buffer_type: Any = type("LeasedBytes", (ctypes.c_ubyte * nbytes,), {})
    buffer = buffer_type.from_buffer(mapping)
    buffer.lease = lease
    return buffer


class DriverMappings:
    """The driver's mappings of one executor's segments, kept across calls (mapped and faulted once).

    ``open(states, handover=...)``: with a ``handover(leased_bytes, low, on_first)`` function, each of the
    reply's non-empty tensors is passed through the function it returns (adapter driver-states-handover:
    their clones may keep the segment),
    unless the segments already kept by results would pass ``held_limit`` bytes or ``held_segments_limit``
    segments with this one (results kept for long, e.g. of many small calls, then copy: each kept segment
    is a file in /dev/shm and a descriptor in the worker).
    """

    def __init__(self, directory: str, held_limit: int | None = None, held_segments_limit: int | None = None) -> None:
        self.directory = directory
        self.maps: dict[str, mmap.mmap] = {}
        self.held_limit = _default_held_limit(directory) if held_limit is None else held_limit
        self.held_segments_limit = (
            int(os.environ.get(HELD_SEGMENTS_ENV) or HELD_SEGMENTS)
            if held_segments_limit is None
            else held_segments_limit
        )
        self.held_segments = 0  # segments whose lease a handed-over result keeps
        self.held_bytes = 0  # their bytes
        self.refused = 0  # replies not handed over (held_limit, held_segments_limit)
        self.segments_seen: set[str] = set()  # every segment a reply came in: how many the worker made
        self.segments_live_max = 0  # the most segments the worker had at once, used by a reply or not
        self.held_count = 0  # segments a result kept at least once
        self._held_lock = threading.RLock()  # RLock: a release can run in the GC inside the lock
        self.spans: dict[str, tuple[int, int, int]] = {}  # path -> (first address, size, inode) of its mapping

    def hold(self, lease: _Lease, size: int) -> None:
        """A result now keeps ``lease`` (once per lease): count its segment until it is released."""
        with self._held_lock:
            if lease.on_release is not None:
                return
            self.held_bytes += size
            self.held_segments += 1
            self.held_count += 1

            def release() -> None:
                with self._held_lock:
                    self.held_bytes -= size
                    self.held_segments -= 1

            lease.on_release = release

    def _mapping(self, path: str, size: int) -> mmap.mmap:
        mapping = self.maps.get(path)
        if mapping is None or len(mapping) != size:
            fd = os.open(path, os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | MAP_POPULATE)
                inode = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            self.maps[path] = mapping
            self.spans[path] = (ctypes.addressof(ctypes.c_char.from_buffer(mapping)), size, inode)
        return mapping

    def locate(self, tensor: Any) -> SegmentSlice | None:
        """Where in a segment file ``tensor``'s bytes lie, when they are exactly its storage (a
        handed-over clone's): another process can then map the same bytes (extract's writer process).
        None for anything else. While ``tensor`` lives its reply's lease keeps the file as it is."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.storage_offset() != 0:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or tensor.untyped_storage().nbytes() != nbytes:
            return None
        address = tensor.data_ptr()
        for path, (low, size, inode) in self.spans.items():
            if low <= address and address + nbytes <= low + size:
                return SegmentSlice(path, inode, address - low, _dtype_name(tensor.dtype), tuple(tensor.shape))
        return None

    def open(self, states: SharedStates, handover: Any = None) -> Any:
        """The reply ``states`` describes, with tensors backed by the segment."""
        import torch

        if os.path.dirname(states.path) != self.directory:
            raise ValueError(f"spec_compat: captured states at {states.path!r}, outside {self.directory!r}")
        for path in [p for p in self.maps if p not in states.live_segments]:
            del self.maps[path]  # freed by the worker; the mapping closes once no tensor uses it
            del self.spans[path]
        self.segments_seen.add(states.path)
        self.segments_live_max = max(self.segments_live_max, len(states.live_segments))
        if states.nbytes == 0:
            return _substitute(states.template, lambda ref: torch.empty(ref.shape, dtype=getattr(torch, ref.dtype)))
        lease = _Lease(states.path)
        mapping = self._mapping(states.path, states.segment_size)
        leased = _leased_bytes(mapping, states.nbytes, lease)
        base = torch.frombuffer(leased, dtype=torch.uint8)

        wrap: Any = None  # each view as handover's source, when the reply is handed over
        if handover is not None:
            with self._held_lock:
                full = self.held_segments >= self.held_segments_limit
                if full or self.held_bytes + states.segment_size > self.held_limit:
                    self.refused += 1
                else:
                    wrap = handover(leased, base.data_ptr(), functools.partial(self.hold, lease, len(mapping)))

        def view(ref: TensorRef) -> Any:
            dtype = getattr(torch, ref.dtype)
            size = math.prod(ref.shape) * dtype.itemsize
            tensor = base[ref.offset : ref.offset + size].view(dtype).view(ref.shape)
            return wrap(tensor) if wrap is not None and size else tensor

        return _substitute(states.template, view)

    def close(self) -> None:
        self.maps.clear()
        self.spans.clear()


HELD_LIMIT_ENV = "SPEC_COMPAT_HANDOVER_MAX_BYTES"
HELD_SEGMENTS_ENV = "SPEC_COMPAT_HANDOVER_MAX_SEGMENTS"
# Segments results may keep at once (default of SPEC_COMPAT_HANDOVER_MAX_SEGMENTS). 32 was measured on an
# H200 with ``spec-compat extract`` (docs/benchmarks.md, run O) and was slower than 8.
HELD_SEGMENTS = 8


def _default_held_limit(directory: str) -> int:
    """Bytes of segments results may keep: a quarter of the file system the segments live on, or
    ``$SPEC_COMPAT_HANDOVER_MAX_BYTES``."""
    if os.environ.get(HELD_LIMIT_ENV):
        return int(os.environ[HELD_LIMIT_ENV])
    try:
        return shutil.disk_usage(directory).total // 4
    except OSError:
        return 0


# ---- the directory -----------------------------------------------------------------------------------

_DIR_PATTERN = re.compile(rf"^{re.escape(DIR_PREFIX)}(\d+)-")


def _base_directory() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_directories(base: str) -> list[str]:
    """Remove transfer directories whose driver process is gone (a driver killed before its shutdown)."""
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        match = _DIR_PATTERN.match(name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
    return removed


def make_directory() -> str:
    base = _base_directory()
    sweep_stale_directories(base)
    return tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=base)


def remove_directory(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
