"""Every adapter spec_compat has, in the order they are applied.

Each adapter is one unit (``adapters.unit.Adapter``) defined in its adapters module beside the probe
and apply it names: what it patches, why, which vLLM change made it necessary, how it is detected,
when it can be deleted (vllm-ascend's patch notes are the model), the speculators releases it is for.
This module only lists them, grouped by side, and puts them in an order that satisfies each unit's
``after`` / ``before`` ids (``ordered``): the constraints, not list position, decide which wrapper
of a method wraps which; where no constraint speaks, the written order is kept.
"""

from __future__ import annotations

from collections.abc import Iterable

from .adapters import (
    cpu_kernels,
    driver_calls,
    executor,
    executor_all_ranks_reply,
    executor_handover,
    executor_malloc,
    executor_protocol,
    executor_replies,
    executor_transfer,
    executor_zmq,
    generate,
    imports,
    kv_cache,
    lifecycle,
    watchdog,
    worker,
    worker_process,
)
from .adapters.unit import SUPPORTED_SPECULATORS, Adapter, Side

__all__ = ["ADAPTERS", "BY_ID", "SUPPORTED_SPECULATORS", "Adapter", "AdapterOrderError", "Side", "ordered"]


class AdapterOrderError(ValueError):
    """The units' ``after`` / ``before`` ids cannot be satisfied (unknown id, other side, a cycle)."""


def ordered(units: Iterable[Adapter]) -> tuple[Adapter, ...]:
    """``units`` in an order where every ``after`` id comes earlier and every ``before`` id later;
    among the units free to go next, the first written goes first (so a list already in order is
    returned unchanged). Raises AdapterOrderError naming what cannot be satisfied."""
    written = list(units)
    by_id = {unit.id: unit for unit in written}
    if len(by_id) != len(written):
        raise AdapterOrderError("adapter ids must be unique")
    earlier: dict[str, set[str]] = {unit.id: set() for unit in written}  # id -> ids that must precede it
    for unit in written:
        for other, edge in [(o, (o, unit.id)) for o in unit.after] + [(o, (unit.id, o)) for o in unit.before]:
            if other not in by_id:
                raise AdapterOrderError(f"{unit.id}: orders itself against unknown adapter {other!r}")
            if by_id[other].side != unit.side:
                raise AdapterOrderError(
                    f"{unit.id} ({unit.side}) orders itself against {other} ({by_id[other].side}): "
                    "sides are applied at different times, their order is fixed by the side"
                )
            first, second = edge
            earlier[second].add(first)
    placed: list[Adapter] = []
    done: set[str] = set()
    waiting = written
    while waiting:
        ready = next((unit for unit in waiting if earlier[unit.id] <= done), None)
        if ready is None:
            cycle = ", ".join(f"{u.id} after {sorted(earlier[u.id] - done)}" for u in waiting)
            raise AdapterOrderError(f"the adapters' order constraints form a cycle: {cycle}")
        placed.append(ready)
        done.add(ready.id)
        waiting = [unit for unit in waiting if unit is not ready]
    return tuple(placed)


ADAPTERS: tuple[Adapter, ...] = ordered(
    (
        # ---- before `import speculators` -------------------------------------------------------------
        imports.TRANSFORMERS_TORCH_ANNOTATION,
        imports.TRANSFORMERS_REMOVED_MODULES,
        imports.KV_CACHE_PLANNING_ALIASES,
        # ---- worker side (speculators.data_generation.custom_worker) ------------------------------------
        worker.CAPTURE_GATE,
        worker.WRAPPER_BASE_MODEL,
        worker.CAPTURE_SETUP,
        worker.LAYER_KWARGS,
        worker.BATCH_ORDER_LOG,
        worker.CAPTURED_STATES_SHARED_MEMORY,
        worker.LOUD_WORKER_ERRORS,
        worker_process.WORKER_EXCEPTION_TRANSPORT,
        watchdog.WORKER_STACK_DUMP,
        # ---- driver side: names in speculators.data_generation.vllm_hidden_states_generator -------------
        driver_calls.MODEL_DTYPE,
        driver_calls.ATTENTION_BACKEND,
        driver_calls.BLOCK_SIZE_FROM_PLATFORM,
        driver_calls.PREFIX_CACHING_OFF,
        driver_calls.SCHEDULER_CONFIG_ENCODER_DECODER,
        driver_calls.REQUEST_KWARGS,
        cpu_kernels.CPU_RMS_NORM_STRIDED,
        executor.EXECUTOR,
        executor_all_ranks_reply.EXECUTOR_ALL_RANKS_REPLY,
        executor_protocol.EXECUTOR_REPLY_SHAPE,
        executor_protocol.EXECUTOR_SAMPLE_TOKENS,
        executor_protocol.EXECUTOR_KV_LAYOUT,
        executor_protocol.EXECUTOR_MODEL_RUNNER_V1,
        executor_zmq.EXECUTOR_CLOSE_QUEUES,
        executor_transfer.EXECUTOR_SHARED_MEMORY_REPLIES,
        executor_handover.DRIVER_STATES_HANDOVER,
        watchdog.EXECUTOR_RPC_DEADLINE,
        executor_replies.RPC_REPLY_READ_ONCE,
        executor_malloc.WORKER_MALLOC_RETAIN,
        kv_cache.KV_CONFIG_SIGNATURE,
        kv_cache.KV_MEMORY_FROM_WORKERS,
        kv_cache.KV_CONFIG_ENGINE_FIELDS,
        kv_cache.DEVICE_MEMORY_QUERY,
        driver_calls.SCHEDULER_BLOCK_SIZE,
        generate.SINGLE_STEP_BATCHES,
        generate.SEQUENCE_LIMIT,
        generate.INPUT_ORDER,
        generate.LAYER_IDS,
        generate.RESULTS_CONTRACT,
        generate.INPUT_VALIDATION,
        lifecycle.SHUTDOWN_AT_EXIT,
        watchdog.GENERATE_SIGNAL_SHUTDOWN,
    )
)

# Adapters that register an executor hook (executor.install_hook) install the subclass first if the
# "executor" record has not (its apply installs it and its worker set-up hook).
BY_ID = {adapter.id: adapter for adapter in ADAPTERS}
