"""Adapter ``executor-shared-memory-replies``: the driver's half of captured states through shared
memory (the worker's half is ``captured-states-shared-memory`` in worker.py).

The executor gives its workers a transfer directory; a worker's reply is a small descriptor of a
segment there, which the driver maps and hands speculators as tensors (and skips its CPU NaN/Inf
scan when the worker checked on the device).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .. import timing
from ..options import Context
from . import executor_handover, transfer
from .executor_switches import switch_on
from .probe import Probe
from .unit import Adapter

logger = logging.getLogger("spec_compat.executor")
STATE_REPLIES = (transfer.SharedStates, transfer.InlineStates)


def received_states(executor: Any, result: Any, own_time: timing.OwnTime) -> Any:
    """The hook on a reply of speculators' RPC: shared-memory descriptors replaced by the tensors
    they describe; replies checked finite on the worker (or not) counted."""
    if isinstance(result, list) and any(isinstance(r, STATE_REPLIES) for r in result):
        return [received_states(executor, r, own_time) for r in result]
    if isinstance(result, STATE_REPLIES):
        timing.add_all(result.timings)
        executor.states_replies["verified" if result.all_finite else "unverified"] += 1
        if isinstance(result, transfer.SharedStates):
            with own_time.excluded(), timing.timed("transfer:driver-map"):
                return executor.transfer_mappings.open(result, executor_handover.handover(executor))
        if executor.transfer_fallback_reason is None:
            executor.transfer_fallback_reason = result.reason
            logger.warning(
                "spec_compat: captured states came back through vLLM's RPC instead of shared memory (slower): %s",
                result.reason,
            )
        return result.value
    if result is not None and transfer.flatten(result)[1]:
        executor.states_replies["unverified"] += 1
    return result


def probe_shared_memory_replies(ctx: Context) -> Probe:
    if sys.platform == "win32":
        return Probe(False, "no POSIX shared memory and flock on this platform")
    return Probe(
        True,
        "captured states are pickled tensor by tensor through vLLM's message queue (H200: 1.66 s of a 2.74 s call); "
        "they come through a shared-memory segment instead, described by a small reply",
    )


EXECUTOR_SHARED_MEMORY_REPLIES = Adapter(
    id="executor-shared-memory-replies",
    notes="""
    why: see captured-states-shared-memory: the driver maps the segment instead of unpickling 192 tensors, and skips its
        CPU NaN/Inf scan when the worker checked on the device
    vllm change: none: all releases send RPC replies by pickling them
    detect: POSIX flock and mmap (Linux, macOS)
    delete when: vLLM offers a zero-copy tensor channel from workers to the driver
    patches: MultiprocExecutor.__init__ / collective_rpc / shutdown (a transfer directory for the workers; descriptors
        in speculators' replies become tensors over shared memory)
    """,
    side="driver",
    probe=probe_shared_memory_replies,
    apply=switch_on("shared_memory_replies"),
)
