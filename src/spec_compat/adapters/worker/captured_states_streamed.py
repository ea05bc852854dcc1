"""Adapter ``captured-states-streamed``: each step's captured states copied to the reply's segment
as the step ends, beside the next forward (speculators 0.4.x; the mechanism: adapters/stream.py)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from .. import speculators_code, transfer
from ..probe import Probe
from ..speculators_code import extension_method, worker_module
from ..stream import StatesStreamer
from ..support import tp_rank
from ..unit import SPECULATORS_0_4_ONLY, Adapter

logger = logging.getLogger("spec_compat.stream")

# What speculators 0.4.x's worker does that the stream relies on: _store_captured_states appends
# each step's tensors to _captured_states and that step's sorted metadata to _request_metadata;
# _get_captured_states walks _request_metadata over the per-layer concatenation of _captured_states
# and clears both; _reset_capture clears both.
STORE_NAMES = {"_captured_states", "_request_metadata"}
GET_NAMES = {"_captured_states", "_request_metadata"}


def probe_streamed_states(ctx: Context) -> Probe:
    extension = worker_module(ctx).HiddenStatesWorkerExtension
    methods = vars(extension)
    if not all(name in methods for name in ("_store_captured_states", "_get_captured_states", "_reset_capture")):
        return Probe(False, "speculators' worker has no _store/_get_captured_states and _reset_capture")
    store = speculators_code.attribute_names_used(methods["_store_captured_states"])
    get = speculators_code.attribute_names_used(methods["_get_captured_states"])
    if not (store >= STORE_NAMES and get >= GET_NAMES):
        return Probe(False, "speculators' worker does not keep per-step captures with per-step request metadata")
    return Probe(True, "each step's captured states go to the reply's segment as the step ends (a side stream)")


def prompt_rows(worker: Any, req_id: str) -> int | None:
    """The prompt length of a request the worker's model runner holds (its CachedRequestState)."""
    state = (getattr(getattr(worker, "model_runner", None), "requests", None) or {}).get(req_id)
    if state is None:
        return None
    rows = getattr(state, "num_prompt_tokens", None)
    if rows is None and getattr(state, "prompt_token_ids", None) is not None:
        rows = len(state.prompt_token_ids)
    return int(rows) if rows is not None else None


def apply_streamed_states(ctx: Context, patcher: AdapterPatcher) -> None:
    extension_cls, store = extension_method(ctx, "_store_captured_states")
    _, get = extension_method(ctx, "_get_captured_states")
    _, reset = extension_method(ctx, "_reset_capture")

    def streamer(self: Any) -> StatesStreamer | None:
        found: StatesStreamer | None = self.__dict__.get("_spec_compat_streamer")
        if found is not None and found.pool.directory == os.environ.get(transfer.TRANSFER_DIR_ENV):
            return found  # every step after the first: no pool or rank lookup
        pool = transfer.worker_pool(self, tp_rank())
        if pool is None:
            return None  # not started by spec_compat's executor (or its transfer is off)
        if found is None or found.pool is not pool:
            found = self._spec_compat_streamer = StatesStreamer(pool)
        return found

    @functools.wraps(store)
    def _store_captured_states(self: Any, aux_hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        first = getattr(self, "_captured_states", None) is None
        stored = len(getattr(self, "_request_metadata", None) or ())
        result = store(self, aux_hidden_states, *args, **kwargs)
        stream = streamer(self)
        if stream is not None:
            metadata = getattr(self, "_request_metadata", None) or []
            step = list(metadata[-1]) if len(metadata) == stored + 1 else None  # what speculators stored now
            try:
                stream.step(list(aux_hidden_states), first, step, functools.partial(prompt_rows, self))
            except Exception as exc:  # noqa: BLE001 - speculators' own reply is still whole: use it, say so once
                stream.fail(exc)
                if not self.__dict__.get("_spec_compat_stream_warned"):
                    self._spec_compat_stream_warned = True
                    logger.warning(
                        "spec_compat: captured-states-streamed failed (%s: %s); speculators builds the reply",
                        type(exc).__name__,
                        exc,
                    )
        return result

    @functools.wraps(get)
    def _get_captured_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        stream = self.__dict__.get("_spec_compat_streamer")
        if stream is None or getattr(self, "_captured_states", None) is None:
            return get(self, *args, **kwargs)
        states = stream.finish([list(step) for step in self._request_metadata])
        if states is None:
            return get(self, *args, **kwargs)  # speculators' own reply (then captured-states-shared-memory's)
        self._captured_states = None  # what speculators' own method clears after its reply
        self._request_metadata = []
        return states

    @functools.wraps(reset)
    def _reset_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        stream = self.__dict__.get("_spec_compat_streamer")
        if stream is not None:
            stream.drop()
        return reset(self, *args, **kwargs)

    patcher.replace(extension_cls, "_store_captured_states", _store_captured_states)
    patcher.replace(extension_cls, "_get_captured_states", _get_captured_states)
    patcher.replace(extension_cls, "_reset_capture", _reset_capture)


CAPTURED_STATES_STREAMED = Adapter(
    id="captured-states-streamed",
    patches=(
        "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension._store_captured_states",
        "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension._get_captured_states",
        "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension._reset_capture",
    ),
    how=(
        "each step's rows copied, as the step ends, to their request's place in the reply's segment (one region "
        "per layer; a side CUDA stream), placed by the metadata speculators stores per step; else speculators' reply. "
        "On CUDA only with SPEC_COMPAT_STREAM_ON_CUDA=1: not faster yet on an H100 (docs/benchmarks.md run AA)"
    ),
    why=(
        "speculators builds its reply on the device after the last step (a concatenation per layer, a clone per "
        "request chunk and layer, a concatenation per request) and the ~0.5 GB device-to-host copy follows while "
        "the GPU waits: 0.020 s of a 0.24 s batch of 29k tokens, 0.011 s of it the copy (one H100, run Z)"
    ),
    vllm_change="none: speculators' capture is its own code; the copy rides on the shared-memory reply",
    detect=(
        "AST: _store_captured_states keeps per-step captures and request metadata, _get_captured_states walks "
        "them; active only in workers whose driver set the transfer directory"
    ),
    delete_when="speculators copies captured states off the device step by step itself",
    side="worker",
    probe=probe_streamed_states,
    apply=apply_streamed_states,
    speculators=SPECULATORS_0_4_ONLY,
    after=("captured-states-shared-memory",),
)
