"""speculators' ``.clone()`` of a captured tensor takes the shared-memory bytes it views instead of
copying them (adapter ``driver-states-handover``, adapters/driver/executor/driver_states_handover.py).

speculators copies every tensor of the captured-states reply on the driver (0.4.x
``h.clone().cpu()``, 0.3.0 ``h[a:b].clone().cpu()``): 0.7-1 GB per call for 1.5-8k-token prompts.
Into freshly mapped memory that ran at page-fault speed (H200, 5B MoE, 24 prompts of 1.5-2k
tokens: 0.24 s of a 0.46 s call); into reused, faulted-in memory still 0.10 s, half the forward.

The reply's tensors are views of a transfer segment (transfer.py) that the worker will not touch
again while any tensor keeps the segment's lease. Here they are ``CloneSource`` views whose
``clone()`` returns a plain ``torch.Tensor`` over the same bytes, with a storage of exactly its own
bytes (``torch.save`` of one writes only it) that keeps the lease: the copy is gone, the values are
the ones the copy would have had, and the worker writes its next reply into another segment (it
keeps a few, transfer.SegmentPool). A second clone of bytes already taken, or of a non-contiguous
view, is an ordinary copy. Everything else done to a source runs as on a plain tensor: views of the
segment stay sources (0.3.0 slices before it clones), anything else comes back plain.

No vLLM import here: torch only.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import timing


class HandoverTarget:
    """The segment bytes of one reply: ``leased`` the buffer over them that holds the segment's lease
    (transfer._leased_bytes), ``low`` the address of its first byte."""

    def __init__(self, leased: Any, low: int, on_first: Callable[[], None]) -> None:
        self.leased = leased
        self.low = low
        self.high = low + len(memoryview(leased))
        self.on_first = on_first  # the first tensor taken: the segment is now kept by a result
        self.taken = 0
        self._starts: list[int] = []  # byte ranges taken, sorted by start
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
            self.taken += 1
            return True

    def take(self, source: torch.Tensor) -> torch.Tensor | None:
        """A tensor over ``source``'s bytes with its own storage, or None where a copy must be made."""
        nbytes = source.numel() * source.element_size()
        start = source.data_ptr() - self.low
        if nbytes == 0 or not source.is_contiguous() or start < 0 or self.low + start + nbytes > self.high:
            return None
        if not self._claim(start, start + nbytes):
            return None
        if self.taken == 1:
            self.on_first()
        # A storage of exactly these bytes that keeps the leased buffer (and so the lease) alive: the
        # worker leaves the segment alone while this tensor's storage lives.
        taken = torch.frombuffer(self.leased, dtype=source.dtype, count=source.numel(), offset=start)
        return taken.view(source.shape)


class CloneSource(torch.Tensor):
    """A view of the transfer segment whose ``clone()`` takes its bytes (module docstring)."""

    _sc_target: HandoverTarget

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = _target_of(args)
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.clone and target is not None and _plain_clone_kwargs(kwargs):
                with timing.timed("transfer:driver-handover"):
                    taken = target.take(args[0])
                if taken is not None:
                    return taken
            result = func(*args, **kwargs)
            return _as_sources(result, target) if target is not None else result

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled as the plain tensor it views
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)  # type: ignore[no-untyped-call]


def _plain_clone_kwargs(kwargs: dict[str, Any]) -> bool:
    return all(
        key == "memory_format" and value in (torch.preserve_format, torch.contiguous_format)
        for key, value in kwargs.items()
    )


def _target_of(args: Any) -> HandoverTarget | None:
    for arg in args:
        if isinstance(arg, CloneSource):
            return arg._sc_target
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, CloneSource):
                    return item._sc_target
    return None


def _as_source(tensor: torch.Tensor, target: HandoverTarget) -> torch.Tensor:
    source = tensor.as_subclass(CloneSource)
    source._sc_target = target
    return source


def _as_sources(result: Any, target: HandoverTarget) -> Any:
    """Tensors in ``result`` that view the segment become sources again; all else as it is."""
    if isinstance(result, torch.Tensor):
        if type(result) is torch.Tensor and target.contains(result):
            return _as_source(result, target)
        return result
    if type(result) in (list, tuple) and any(isinstance(r, torch.Tensor) for r in result):
        return type(result)(_as_sources(r, target) for r in result)
    return result


def as_clone_sources(leased: Any, low: int, on_first: Callable[[], None]) -> Callable[[torch.Tensor], torch.Tensor]:
    """For one reply rebuilt over a segment by transfer.DriverMappings.open: the function that makes
    each of its tensors a ``CloneSource`` view of one target spanning the reply's bytes."""
    target = HandoverTarget(leased, low, on_first)
    return lambda tensor: _as_source(tensor, target)
