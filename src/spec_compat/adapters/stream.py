"""Captured hidden states copied into the reply's segment step by step (adapter captured-states-streamed).

speculators 0.4.x keeps every engine step's captured states on the device (one tensor per layer and
step) and builds its reply after the last step, on the device: a concatenation per layer, a clone
per request chunk and layer, a concatenation per request and layer; ``transfer.pack`` then lays the
tensors out once more and copies ~0.5 GB to the host while the GPU waits (one H100, run Z: 0.020 s of
a 0.24 s batch of 29k tokens, 0.011 s of it the device-to-host copy).

Here each step's rows are copied into the segment the reply will be read from as soon as the step's
forward has queued them: on a side CUDA stream, so the copies run beside the next step's forward. The
segment holds one region per layer; in each, every request has a run of rows as long as its prompt,
reserved when the request first appears (the worker's model runner knows the prompt's length). The
step's request metadata, which speculators has just stored (request id, rows, in the order of the
step's rows), says which rows of the step go where; each request's rows then lie in the segment as
speculators' reply would hold them (its chunks concatenated), so after the last step a request's
tensor for a layer is a slice of that layer's region, described by a ``TensorRef``. The reply is
described only if speculators' metadata, read again after the last step, is the one the rows were
placed by.

Anything else leaves the reply to speculators' own code and ``pack`` (speculators keeps the device
tensors either way): a step whose rows are not exactly its metadata's, a request whose prompt length
the worker does not know or whose rows outgrow it, more rows than the segment has room for, tensors
of another shape than the first step's, the first reply of an engine (its size is not known yet: a
segment has room for the largest of the recent replies and an eighth, as ``SegmentPool`` sizes new
ones), an unpinned segment on CUDA (a copy to it would wait for the forward), no free segment while the
next one is still being made in the background (``SegmentPool.acquire_without_waiting``: on one H100 the
wait for it inside a step cost more than streaming saves; ``pack`` at the reply's end finds it made).

The bytes are speculators' reply either way: rows are copied, never computed.
No vLLM import here: torch only.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import time
from collections.abc import Callable
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
class _Run:
    """One request's rows in every region: reserved from ``start`` for ``reserved`` rows, ``received`` so far."""

    start: int
    reserved: int
    received: int = 0


@dataclass
class _Reply:
    """One reply being streamed (``segment`` None: declined, ``declined`` says why)."""

    rows: int = 0  # rows captured so far (every layer has as many)
    segment: Segment | None = None
    regions: list[_Region] = field(default_factory=list)
    capacity_rows: int = 0
    reserved_rows: int = 0
    nbytes: int = 0
    device: Any = None
    runs: dict[str, _Run] = field(default_factory=dict)  # in the order requests first appeared
    metadata: list[list[tuple[str, int]]] = field(default_factory=list)  # per step, as the rows were placed
    probes: list[Any] = field(default_factory=list)  # device-side (min, max) per step and layer
    held: list[Any] = field(default_factory=list)  # the step tensors until their copies are done
    declined: str | None = None
    acquire_timings: tuple[tuple[str, float], ...] = ()
    enqueue_s: float = 0.0


# On CUDA the stream runs only when this is "1": on one H100 (docs/benchmarks.md, run AA) it cut the reply's
# step from 0.017 to 0.0035 s a batch but made whole runs no faster; the next A/B has the wait fix
# (acquire_without_waiting). On CPU it always runs (tests/test_transfer_engine.py).
CUDA_ENV = "SPEC_COMPAT_STREAM_ON_CUDA"

PromptRows = Callable[[str], "int | None"]  # a request's prompt length, as the worker knows it


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

    def step(
        self, tensors: list[Any], first: bool, metadata: list[tuple[str, int]] | None, prompt_rows: PromptRows
    ) -> None:
        """One engine step's captured states (speculators' list, one tensor per layer), just stored by
        speculators; ``first``: the first step since its last reply or reset; ``metadata``: the
        (request id, rows) speculators stored for this step's rows, in their order (None: it stored none)."""
        if first or self.current is None:
            self.drop()
            self.current = self._begin(tensors)
        reply = self.current
        rows = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0
        if reply.declined is None:
            problem = self._misfit(reply, tensors, rows)
            moves = self._place(reply, metadata, rows, prompt_rows) if problem is None else problem
            if isinstance(moves, str):
                self._decline(reply, moves)
            else:
                self._copy(reply, tensors, moves)
        reply.rows += rows

    def fail(self, exc: BaseException) -> None:
        """A step raised inside the stream: the reply is left to speculators' code (its tensors are intact)."""
        reply = self.current
        if reply is not None and reply.declined is None:
            self._decline(reply, f"the stream failed: {type(exc).__name__}: {exc}")

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
        if device.type == "cuda" and os.environ.get(CUDA_ENV) != "1":
            reply.declined = f"on CUDA only with {CUDA_ENV}=1 (not faster yet on a GPU)"
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
            segment = self.pool.acquire_without_waiting(max(end, 1), pin=device.type == "cuda")
        except OSError as exc:
            reply.declined = f"no segment: {type(exc).__name__}: {exc}"
            return reply
        if segment is None:
            reply.declined = "the next segment is still being made in the background"
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
        return None

    @staticmethod
    def _place(
        reply: _Reply, metadata: list[tuple[str, int]] | None, rows: int, prompt_rows: PromptRows
    ) -> list[tuple[int, int, int]] | str:
        """Where this step's rows go: (first row in the step, first row in the regions, rows), rows that
        continue each other merged; a run reserved for each request new in this step. Or why they cannot
        be placed."""
        if metadata is None:
            return "no request metadata for a step"
        counts = [(req_id, int(count)) for req_id, count in metadata]
        if any(count < 0 for _, count in counts) or sum(count for _, count in counts) != rows:
            return f"a step's metadata names {sum(count for _, count in counts)} rows, the step has {rows}"
        moves: list[tuple[int, int, int]] = []
        source = 0
        for req_id, count in counts:
            run = reply.runs.get(req_id)
            if run is None:
                reserved = prompt_rows(req_id)
                if reserved is None:
                    return f"the worker does not know request {req_id!r}'s prompt length"
                if reply.reserved_rows + reserved > reply.capacity_rows:
                    return f"more rows than the segment has room for ({reply.capacity_rows})"
                run = reply.runs[req_id] = _Run(reply.reserved_rows, reserved)
                reply.reserved_rows += reserved
            if run.received + count > run.reserved:
                return f"request {req_id!r} has more rows than its prompt ({run.reserved})"
            target = run.start + run.received
            if moves and moves[-1][0] + moves[-1][2] == source and moves[-1][1] + moves[-1][2] == target:
                moves[-1] = (moves[-1][0], moves[-1][1], moves[-1][2] + count)
            elif count:
                moves.append((source, target, count))
            run.received += count
            source += count
        reply.metadata.append(counts)
        return moves

    def _copy(self, reply: _Reply, tensors: list[Any], moves: list[tuple[int, int, int]]) -> None:
        import torch

        started = time.perf_counter()
        assert reply.segment is not None
        segment = reply.segment
        destinations = []  # (layer, step row, rows, byte offset in the segment)
        for layer, (tensor, region) in enumerate(zip(tensors, reply.regions, strict=True)):
            for source, target, count in moves:
                destinations.append((layer, source, count, region.offset + target * region.row_bytes))
            reply.probes.append(_finite_probe(tensor.reshape(-1)))  # on the forward's stream, as pack does
        cuda = reply.device.type == "cuda"
        side = None
        if cuda:
            side = self.side_streams.get(reply.device)
            if side is None:
                side = self.side_streams[reply.device] = torch.cuda.Stream(device=reply.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(reply.device))  # after the step's kernels made them
            reply.held.extend(tensors)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for layer, source, count, start in destinations:
                rows = tensors[layer][source : source + count].reshape(-1).view(torch.uint8)
                segment.copy_in(start, rows, non_blocking=cuda)
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
        ``request_metadata``: speculators' per-step lists of (request id, rows), as its reply walks them."""
        reply, self.current = self.current, None
        if reply is None:
            return None
        self.recent_rows.append(reply.rows)
        started = time.perf_counter()
        self._wait(reply)
        wait_s = time.perf_counter() - started
        walked = [[(req_id, int(count)) for req_id, count in step] for step in request_metadata]
        if reply.declined is None and walked != reply.metadata:
            reply.declined = "speculators' request metadata is not the one the rows were placed by"
        if reply.declined is not None or reply.segment is None:
            self.declined += 1
            self.last_declined = reply.declined
            return None
        self.streamed += 1
        self.pool.prefetch_after(reply.segment, pin=reply.device.type == "cuda")  # where pack's acquire would
        return self._describe(reply, reply.segment, wait_s)

    def _describe(self, reply: _Reply, segment: Segment, wait_s: float) -> SharedStates:
        import torch

        checked = time.perf_counter()
        present = [p for p in reply.probes if p is not None]
        all_finite = not present or bool(torch.isfinite(torch.cat(present).cpu()).all())
        template = {
            req_id: [
                TensorRef(r.offset + run.start * r.row_bytes, _dtype_name(r.dtype), (run.received, *r.row_shape))
                for r in reply.regions
            ]
            for req_id, run in reply.runs.items()
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
