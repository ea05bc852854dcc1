"""Adapter ``captured-states-shared-memory``: captured states through shared memory (the worker's
half of executor-shared-memory-replies)."""

from __future__ import annotations

import functools
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from .. import transfer
from ..probe import Probe
from ..speculators_code import extension_method, worker_module
from ..support import tp_rank
from ..unit import Adapter


def probe_shared_memory_states(ctx: Context) -> Probe:
    extension = worker_module(ctx).HiddenStatesWorkerExtension
    if "_get_captured_states" not in vars(extension):
        return Probe(False, "speculators' worker has no _get_captured_states")
    return Probe(True, "captured states leave the worker in shared memory (NaN/Inf checked on the device), not pickled")


def apply_shared_memory_states(ctx: Context, patcher: AdapterPatcher) -> None:
    extension_cls, original = extension_method(ctx, "_get_captured_states")

    @functools.wraps(original)
    def _get_captured_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        pool = transfer.worker_pool(self, tp_rank())
        if result is None or pool is None:
            return result  # not started by spec_compat's executor (or its transfer is off): as speculators does
        return transfer.pack(result, pool)

    patcher.replace(extension_cls, "_get_captured_states", _get_captured_states)


CAPTURED_STATES_SHARED_MEMORY = Adapter(
    id="captured-states-shared-memory",
    patches=("speculators.data_generation.custom_worker.HiddenStatesWorkerExtension._get_captured_states",),
    how=(
        "reply through a shared-memory segment; the next segment made in the background when no spare would fit "
        "(SPEC_COMPAT_SEGMENT_PREFETCH=0: only on demand; SPEC_COMPAT_PIN_PIECE_MIB=N: pinned in N MiB pieces, "
        "for a GPU A/B)"
    ),
    why=(
        "the reply (~500 MB for 32k tokens x 4 layers) was pickled tensor by tensor through vLLM's message queue and "
        "the driver checked NaN/Inf on the CPU: 12k tok/s where vLLM extracts 153k on one H200 (GPU_NOTES 'Turn-2 "
        "measurements')"
    ),
    vllm_change="none: all releases send RPC replies by pickling them",
    detect=(
        "the worker defines _get_captured_states; active only in workers whose driver set the transfer directory "
        "(executor-shared-memory-replies)"
    ),
    delete_when="vLLM offers a zero-copy tensor channel from workers to the driver",
    side="worker",
    probe=probe_shared_memory_states,
    apply=apply_shared_memory_states,
)
