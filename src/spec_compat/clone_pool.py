"""Faulted-in, reused memory for speculators' ``.clone()`` of the captured states (adapter
``driver-clone-pool``, adapters/executor_clones.py).

speculators copies every captured tensor the driver receives (0.4.x ``h.clone().cpu()``, 0.3.0
``h[a:b].clone().cpu()``) into memory the allocator has just mapped: for tensors of a few MB glibc
maps fresh pages per tensor, so the copy runs at page-fault speed. On an H200, 24 prompts of 1.5-2k
tokens (~700 MB of states): the clones took 0.41 s of a 0.73 s call, the forward 0.25 s.

Here the tensors handed to speculators (views of the transfer segment, transfer.py) are a tensor
subclass, ``CloneSource``, whose ``clone()`` copies into a *region*: an anonymous mapping faulted
in once (huge pages where the kernel gives them) and reused once every tensor cloned into it is
gone. A clone lands at the same offset in the region as its source in the segment, and each clone
is a plain ``torch.Tensor`` with a storage of exactly its own bytes (``torch.save`` of one writes
only it). The bytes are the source's: a copy, as ``clone()``.

Everything else done to a source runs as on a plain tensor: views of the segment stay sources
(0.3.0 slices before it clones), anything else comes back plain. A second clone of bytes already
cloned (or a non-contiguous source) is an ordinary ``clone()``.

Lifetime: a region is in use while its ``CloneTarget`` (referenced by the sources) or any clone
made into it is alive (``_RegionUse``, released by the garbage collector, from any thread). Free
regions are reused (the smallest that fits); one spare is kept, the rest unmapped.

No vLLM import here: torch, mmap and ctypes only.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import mmap
import threading
from typing import Any

import torch

from . import timing
from .transfer import _substitute, flatten

REGION_STEP = 2 << 20  # region sizes are multiples of a huge page
SPARE_REGIONS = 1  # free regions kept besides the one chosen


class Region:
    """An anonymous private mapping of ``size`` bytes, faulted in when made."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        hugepage = getattr(mmap, "MADV_HUGEPAGE", None)
        if hugepage is not None:
            with contextlib.suppress(OSError):
                self.map.madvise(hugepage)
        # Fault every page in now, on all of torch's threads (with huge pages asked for, this was the
        # fastest way measured: 656 MB in 0.06 s; MADV_POPULATE_WRITE took 0.15 s, 1.4 s with huge pages).
        torch.frombuffer(self.map, dtype=torch.uint8).zero_()

    def close(self) -> None:
        self.map.close()


class _RegionUse:
    """Held by a region's ``CloneTarget`` and by every clone's buffer: when the last goes, the
    region is free again."""

    def __init__(self, pool: ClonePool, region: Region) -> None:
        self.pool = pool
        self.region = region

    def __del__(self) -> None:
        self.pool.released.append(self.region)  # deque.append: atomic, safe from any thread or GC


class ClonePool:
    """The driver's regions: one per reply in flight, reused across calls."""

    def __init__(self) -> None:
        self.free: list[Region] = []
        self.regions = 0  # regions mapped now
        self.released: collections.deque[Region] = collections.deque()
        self._lock = threading.Lock()
        self.made = 0  # regions ever mapped (a reused region is not counted again)

    def _drain(self) -> None:
        while self.released:
            self.free.append(self.released.popleft())

    def acquire(self, nbytes: int) -> Region:
        with self._lock:
            self._drain()
            fitting = sorted((r for r in self.free if r.size >= nbytes), key=lambda r: r.size)
            chosen = fitting[0] if fitting else None
            keep = set(map(id, fitting[1 : 1 + SPARE_REGIONS]))
            for region in list(self.free):
                if region is chosen:
                    self.free.remove(region)
                elif id(region) not in keep:
                    self.free.remove(region)
                    region.close()
                    self.regions -= 1
            if chosen is not None:
                return chosen
        with timing.timed("transfer:driver-clone-region"):
            region = Region(-(-(nbytes + nbytes // 8) // REGION_STEP) * REGION_STEP)
        with self._lock:
            self.regions += 1
            self.made += 1
        return region

    def mapped_bytes(self) -> int:
        with self._lock:
            self._drain()
        return sum(r.size for r in self.free)  # free ones only; the rest are counted by their users

    def close(self) -> None:
        with self._lock:
            self._drain()
            for region in self.free:
                region.close()
            self.regions -= len(self.free)
            self.free.clear()

    def target(self, low: int, nbytes: int) -> CloneTarget:
        return CloneTarget(_RegionUse(self, self.acquire(nbytes)), low, nbytes)


class CloneTarget:
    """Where the clones of one reply go: source bytes at ``low + k`` are copied to region byte ``k``."""

    def __init__(self, use: _RegionUse, low: int, nbytes: int) -> None:
        self.use = use
        self.low = low
        self.high = low + nbytes
        self._starts: list[int] = []  # claimed byte ranges, sorted by start
        self._ends: list[int] = []
        self._lock = threading.Lock()

    def contains(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and self.low <= tensor.data_ptr() < self.high

    def _claim(self, start: int, end: int) -> bool:
        with self._lock:
            index = bisect.bisect_left(self._starts, start)
            if index > 0 and self._ends[index - 1] > start:
                return False
            if index < len(self._starts) and self._starts[index] < end:
                return False
            self._starts.insert(index, start)
            self._ends.insert(index, end)
            return True

    def clone_of(self, source: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``source`` in the region, or None where an ordinary clone must do."""
        nbytes = source.numel() * source.element_size()
        start = source.data_ptr() - self.low
        if nbytes == 0 or not source.is_contiguous() or start < 0 or start + nbytes > self.high - self.low:
            return None
        if not self._claim(start, start + nbytes):
            return None
        buffer_type: Any = type("ClonedBytes", (ctypes.c_ubyte * nbytes,), {})  # a subclass: it takes attributes
        buffer = buffer_type.from_buffer(self.use.region.map, start)
        buffer.use = self.use  # the region stays in use while this clone's storage lives
        clone = torch.frombuffer(buffer, dtype=source.dtype).view(source.shape)
        clone.copy_(source)
        return clone


class CloneSource(torch.Tensor):
    """A view of the transfer segment whose ``clone()`` goes to the pool (module docstring)."""

    _sc_target: CloneTarget

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = _target_of(args)
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.clone and target is not None and _plain_clone_kwargs(kwargs):
                with timing.timed("transfer:driver-clone"):
                    copied = target.clone_of(args[0])
                if copied is not None:
                    return copied
            result = func(*args, **kwargs)
            return _as_sources(result, target) if target is not None else result

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled as the plain tensor it views
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)  # type: ignore[no-untyped-call]


def _plain_clone_kwargs(kwargs: dict[str, Any]) -> bool:
    return all(
        k == "memory_format" and v in (torch.preserve_format, torch.contiguous_format) for k, v in kwargs.items()
    )


def _target_of(args: Any) -> CloneTarget | None:
    for arg in args:
        if isinstance(arg, CloneSource):
            return arg._sc_target
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, CloneSource):
                    return item._sc_target
    return None


def _as_source(tensor: torch.Tensor, target: CloneTarget) -> torch.Tensor:
    source = tensor.as_subclass(CloneSource)
    source._sc_target = target
    return source


def _as_sources(result: Any, target: CloneTarget) -> Any:
    """Tensors in ``result`` that view the segment become sources again; all else as it is."""
    if isinstance(result, torch.Tensor):
        if type(result) is torch.Tensor and target.contains(result):
            return _as_source(result, target)
        return result
    if isinstance(result, (list, tuple)) and any(isinstance(r, torch.Tensor) for r in result):
        items = [_as_sources(r, target) for r in result]
        return type(result)(items) if type(result) in (list, tuple) else result
    return result


def as_clone_sources(value: Any, pool: ClonePool) -> Any:
    """``value`` (a reply rebuilt over one transfer segment) with its CPU tensors as ``CloneSource``s
    of one target spanning them."""
    template, tensors = flatten(value)
    cpu = [t for t in tensors if t.device.type == "cpu" and t.numel() > 0]
    if not cpu:
        return value
    low = min(t.data_ptr() for t in cpu)
    high = max(t.data_ptr() + t.numel() * t.element_size() for t in cpu)
    target = pool.target(low, high - low)
    wrapped = [_as_source(t, target) if t.device.type == "cpu" and t.numel() > 0 else t for t in tensors]
    return _substitute(template, lambda position: wrapped[position.index])
