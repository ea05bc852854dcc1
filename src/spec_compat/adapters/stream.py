"""Captured hidden states copied into the reply's segment step by step (adapter captured-states-streamed).

speculators 0.4.x keeps every engine step's captured states on the device (one tensor per layer and
step) and builds its reply after the last step, on the device: a concatenation per layer, a clone
per request chunk and layer, a concatenation per request and layer; ``transfer.pack`` then lays the
tensors out once more and copies ~0.5 GB to the host while the GPU waits (one H100, run Z: 0.020 s of
a 0.24 s batch of 29k tokens, 0.011 s of it the device-to-host copy).

Here each step's tensors are copied into the segment the reply will be read from as soon as the
step's forward has queued them: on a side CUDA stream, so the copy runs beside the next step's
forward. The segment holds one region per layer: that layer's rows of every step in step order, which
is speculators' own per-layer concatenation. After the last step, speculators' request metadata
(walked as its ``_get_captured_states`` walks it) says whose rows are where; where every request's
rows are one run of consecutive rows (vLLM continues a chunked prompt at the start of the next step),
a request's tensor for a layer is a slice of that layer's region, described by a ``TensorRef``.

Anything else leaves the reply to speculators' own code and ``pack`` (speculators keeps the device
tensors either way): a request whose rows are not consecutive, rows no request owns, more rows than
the segment has room for, tensors of another shape than the first step's, the first reply of an
engine (its size is not known yet: a segment has room for the largest of the recent replies and an
eighth, as ``SegmentPool`` sizes new ones), an unpinned segment on CUDA (its copy would block).

The bytes are speculators' reply either way: rows are copied, never computed.
No vLLM import here: torch only.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any

from .transfer import (
    ALIGN,
    USE_WINDOW,
    Segment,
    SegmentPool,
    SharedStates,
    TensorRef,
    _dtype_name,
    _finite_probe,
    _round_up,
    non_finite_counts,
)


@dataclass
class _Region:
    """One layer's rows in the segment."""

    offset: int
    row_shape: tuple[int, ...]
    row_bytes: int
    dtype: Any


@dataclass
class _Reply:
    """One reply being streamed (``segment`` None: declined, ``declined`` says why)."""

    rows: int = 0  # rows captured so far (every layer has as many)
    segment: Segment | None = None
    regions: list[_Region] = field(default_factory=list)
    capacity_rows: int = 0
    nbytes: int = 0
    device: Any = None
    probes: list[Any] = field(default_factory=list)  # device-side (min, max) per step and layer
    held: list[Any] = field(default_factory=list)  # the step tensors until their copies are done
    declined: str | None = None
    acquire_timings: tuple[tuple[str, float], ...] = ()
    enqueue_s: float = 0.0


class StatesStreamer:
    """One worker's streamed replies: the reply being streamed, the sizes of the recent ones, the
    side stream. ``declined`` counts replies left to speculators' code, ``last_declined`` says why."""

    def __init__(self, pool: SegmentPool) -> None:
        self.pool = pool
        self.recent_rows: collections.deque[int] = collections.deque(maxlen=USE_WINDOW)
        self.current: _Reply | None = None
        self.side_streams: dict[Any, Any] = {}  # CUDA device -> its copy stream
        self.streamed = 0
        self.declined = 0
        self.last_declined: str | None = None

    # ---- while the steps run ---------------------------------------------------------------------

    def step(self, tensors: list[Any], first: bool) -> None:
        """One engine step's captured states (speculators' list, one tensor per layer), just stored by
        speculators; ``first``: the first step since its last reply or reset."""
        if first or self.current is None:
            self.drop()
            self.current = self._begin(tensors)
        reply = self.current
        rows = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0
        if reply.declined is None:
            problem = self._misfit(reply, tensors, rows)
            if problem is None:
                self._copy(reply, tensors, rows)
            else:
                self._decline(reply, problem)
        reply.rows += rows

    def drop(self) -> None:
        """Forget the reply being streamed (speculators reset its capture), once its copies are done."""
        reply, self.current = self.current, None
        if reply is not None:
            self._wait(reply)

    def _begin(self, tensors: list[Any]) -> _Reply:
        reply = _Reply()
        if not self.recent_rows:
            reply.declined = "the engine's first reply: its size is not known yet"
            return reply
        if not tensors or any(t.dim() == 0 or not t.is_contiguous() for t in tensors):
            reply.declined = "captured tensors that are not contiguous rows"
            return reply
        device = tensors[0].device
        if device.type not in ("cuda", "cpu") or any(t.device != device for t in tensors):
            reply.declined = f"captured tensors on {sorted({str(t.device) for t in tensors})}"
            return reply
        largest = max(self.recent_rows)
        reply.capacity_rows = largest + largest // 8
        end = 0
        for tensor in tensors:
            row_shape = tuple(tensor.shape[1:])
            row_bytes = math.prod(row_shape) * tensor.element_size()
            offset = _round_up(end, ALIGN)
            reply.regions.append(_Region(offset, row_shape, row_bytes, tensor.dtype))
            end = offset + reply.capacity_rows * row_bytes
        reply.nbytes = end
        reply.device = device
        started = time.perf_counter()
        try:
            segment = self.pool.acquire(max(end, 1), pin=device.type == "cuda")
        except OSError as exc:
            reply.declined = f"no segment: {type(exc).__name__}: {exc}"
            return reply
        if device.type == "cuda" and not segment.pinned:
            reply.declined = "the segment is not pinned (a copy to it would wait for the forward)"
            return reply
        reply.segment = segment
        reply.acquire_timings = (
            ("transfer:worker-acquire", time.perf_counter() - started),
            ("transfer:worker-new-segment", self.pool.new_segment_s),
            ("transfer:worker-free-segment", self.pool.free_segment_s),
            ("transfer:worker-prefetch-wait", self.pool.prefetch_wait_s),
        )
        return reply

    @staticmethod
    def _misfit(reply: _Reply, tensors: list[Any], rows: int) -> str | None:
        if len(tensors) != len(reply.regions):
            return f"a step captured {len(tensors)} layers, the first {len(reply.regions)}"
        for tensor, region in zip(tensors, reply.regions, strict=True):
            same = tensor.dtype == region.dtype and tuple(tensor.shape[1:]) == region.row_shape
            if not same or tensor.device != reply.device or not tensor.is_contiguous() or tensor.shape[0] != rows:
                return "a step's tensors differ from the first step's (dtype, row shape, device or rows)"
        if reply.rows + rows > reply.capacity_rows:
            return f"more rows than the segment has room for ({reply.capacity_rows})"
        return None

    def _copy(self, reply: _Reply, tensors: list[Any], rows: int) -> None:
        import torch

        started = time.perf_counter()
        assert reply.segment is not None
        host = reply.segment.host
        destinations = []
        for tensor, region in zip(tensors, reply.regions, strict=True):
            start = region.offset + reply.rows * region.row_bytes
            destinations.append(host[start : start + rows * region.row_bytes].view(tensor.dtype).view(tensor.shape))
            reply.probes.append(_finite_probe(tensor.reshape(-1)))  # on the forward's stream, as pack does
        if reply.device.type == "cuda":
            side = self.side_streams.get(reply.device)
            if side is None:
                side = self.side_streams[reply.device] = torch.cuda.Stream(device=reply.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(reply.device))  # after the step's kernels made them
            with torch.cuda.stream(side):
                for destination, tensor in zip(destinations, tensors, strict=True):
                    destination.copy_(tensor, non_blocking=True)
            reply.held.extend(tensors)
        else:
            for destination, tensor in zip(destinations, tensors, strict=True):
                destination.copy_(tensor)
        reply.enqueue_s += time.perf_counter() - started

    def _decline(self, reply: _Reply, why: str) -> None:
        self._wait(reply)
        reply.declined = why
        reply.segment = None

    def _wait(self, reply: _Reply) -> None:
        if reply.held:
            side = self.side_streams.get(reply.device)
            if side is not None:
                side.synchronize()
            reply.held.clear()

    # ---- after the last step ---------------------------------------------------------------------

    def finish(self, request_metadata: list[list[tuple[str, int]]]) -> SharedStates | None:
        """The reply as ``SharedStates``, or None when it is left to speculators' code (``last_declined``).
        ``request_metadata``: speculators' per-step lists of (request id, prompt rows), in its order."""
        reply, self.current = self.current, None
        if reply is None:
            return None
        self.recent_rows.append(reply.rows)
        started = time.perf_counter()
        self._wait(reply)
        wait_s = time.perf_counter() - started
        spans = None if reply.declined else _request_spans(request_metadata, reply.rows)
        if reply.declined is None and spans is None:
            reply.declined = "a request's rows are not one run, or rows no request owns"
        if reply.declined is not None or reply.segment is None or spans is None:
            self.declined += 1
            self.last_declined = reply.declined
            return None
        self.streamed += 1
        return self._describe(reply, reply.segment, spans, wait_s)

    def _describe(
        self, reply: _Reply, segment: Segment, spans: dict[str, tuple[int, int]], wait_s: float
    ) -> SharedStates:
        import torch

        checked = time.perf_counter()
        present = [p for p in reply.probes if p is not None]
        all_finite = not present or bool(torch.isfinite(torch.cat(present).cpu()).all())
        template = {
            req_id: [
                TensorRef(r.offset + start * r.row_bytes, _dtype_name(r.dtype), (rows, *r.row_shape))
                for r in reply.regions
            ]
            for req_id, (start, rows) in spans.items()
        }
        non_finite: tuple[tuple[int, int], ...] = ()
        if not all_finite:  # which tensors, in the reply's order (as pack reports them)
            non_finite = non_finite_counts([_host_view(segment, ref) for refs in template.values() for ref in refs])
        check_s = time.perf_counter() - checked
        return SharedStates(
            path=segment.path,
            nbytes=reply.nbytes,
            segment_size=segment.size,
            template=template,
            all_finite=all_finite,
            non_finite=non_finite,
            live_segments=tuple(s.path for s in self.pool.segments),
            timings=(
                ("own:worker-finite-check", check_s),
                ("transfer:worker-stream-enqueue", reply.enqueue_s),  # inside the steps' forwards
                ("transfer:worker-stream-wait", wait_s),  # for the last step's copies
                *reply.acquire_timings,
            ),
            streamed=True,
        )


def _host_view(segment: Segment, ref: TensorRef) -> Any:
    import torch

    dtype = getattr(torch, ref.dtype)
    size = math.prod(ref.shape) * dtype.itemsize
    return segment.host[ref.offset : ref.offset + size].view(dtype).view(ref.shape)


def _request_spans(request_metadata: list[list[tuple[str, int]]], rows: int) -> dict[str, tuple[int, int]] | None:
    """(first row, rows) of each request, in the order speculators' reply lists them, walking the
    metadata as speculators does (each entry takes the next ``n`` rows); None unless every request's
    rows are one run and the entries take exactly the ``rows`` captured."""
    spans: dict[str, tuple[int, int]] = {}
    position = 0
    for step in request_metadata:
        for req_id, count in step:
            count = int(count)
            if count < 0:
                return None
            start, taken = spans.get(req_id, (position, 0))
            if count and taken and start + taken != position:
                return None  # not consecutive: speculators concatenates pieces from several places
            spans[req_id] = (start if taken else position, taken + count)
            position += count
    return spans if position == rows else None
