"""Every adapter spec_compat has, in the order they are applied.

Each adapter is one unit (``adapters.unit.Adapter``) defined in its own file,
``adapters/<side folder>/<id>.py`` (``adapter_file``), beside the probe and apply it names; its
typed fields say what it patches (dotted paths a test resolves), why, which vLLM change made it
necessary, how it is detected, when it can be deleted (vllm-ascend's patch notes are the model),
the speculators releases it is for. Adding one is its file and one line below (docs/architecture.md).
This module only lists them, grouped by side, and puts them in an order that satisfies each unit's
``after`` / ``before`` ids (``ordered``): the constraints, not list position, decide which wrapper
of a method wraps which; where no constraint speaks, the written order is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .adapters.driver import (
    attention_backend,
    block_hashes_off,
    block_size_from_platform,
    cpu_rms_norm_strided,
    device_memory_query,
    generate_signal_shutdown,
    input_order,
    input_validation,
    kv_config_engine_fields,
    kv_config_signature,
    kv_memory_from_workers,
    layer_ids,
    model_dtype,
    prefix_caching_off,
    request_kwargs,
    results_contract,
    scheduler_block_size,
    scheduler_config_encoder_decoder,
    sequence_limit,
    shutdown_at_exit,
    single_step_batches,
)
from .adapters.driver.executor import (
    driver_states_handover,
    executor,
    executor_all_ranks_reply,
    executor_close_queues,
    executor_kv_layout,
    executor_model_runner_v1,
    executor_reply_shape,
    executor_rpc_deadline,
    executor_sample_tokens,
    executor_shared_memory_replies,
    rpc_reply_read_once,
    worker_malloc_retain,
)
from .adapters.import_time import (
    cpu_nightly_target_device,
    kv_cache_planning_aliases,
    transformers_removed_modules,
    transformers_torch_annotation,
)
from .adapters.unit import SUPPORTED_SPECULATORS, Adapter, Side
from .adapters.worker import (
    batch_order_log,
    capture_gate,
    capture_setup,
    captured_states_shared_memory,
    captured_states_streamed,
    layer_kwargs,
    loud_worker_errors,
    wrapper_base_model,
)
from .adapters.worker_process import (
    worker_exception_transport,
    worker_stack_dump,
)

__all__ = [
    "ADAPTERS",
    "BY_ID",
    "SIDE_FOLDERS",
    "SUPPORTED_SPECULATORS",
    "Adapter",
    "AdapterOrderError",
    "Side",
    "adapter_file",
    "ordered",
]


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
        cpu_nightly_target_device.CPU_NIGHTLY_TARGET_DEVICE,  # first: the others' probes import vLLM
        transformers_torch_annotation.TRANSFORMERS_TORCH_ANNOTATION,
        transformers_removed_modules.TRANSFORMERS_REMOVED_MODULES,
        kv_cache_planning_aliases.KV_CACHE_PLANNING_ALIASES,
        # ---- worker side (speculators.data_generation.custom_worker) ------------------------------------
        capture_gate.CAPTURE_GATE,
        wrapper_base_model.WRAPPER_BASE_MODEL,
        capture_setup.CAPTURE_SETUP,
        layer_kwargs.LAYER_KWARGS,
        batch_order_log.BATCH_ORDER_LOG,
        captured_states_shared_memory.CAPTURED_STATES_SHARED_MEMORY,
        captured_states_streamed.CAPTURED_STATES_STREAMED,
        loud_worker_errors.LOUD_WORKER_ERRORS,
        worker_exception_transport.WORKER_EXCEPTION_TRANSPORT,
        worker_stack_dump.WORKER_STACK_DUMP,
        # ---- driver side: names in speculators.data_generation.vllm_hidden_states_generator -------------
        model_dtype.MODEL_DTYPE,
        attention_backend.ATTENTION_BACKEND,
        block_size_from_platform.BLOCK_SIZE_FROM_PLATFORM,
        prefix_caching_off.PREFIX_CACHING_OFF,
        scheduler_config_encoder_decoder.SCHEDULER_CONFIG_ENCODER_DECODER,
        request_kwargs.REQUEST_KWARGS,
        block_hashes_off.BLOCK_HASHES_OFF,
        cpu_rms_norm_strided.CPU_RMS_NORM_STRIDED,
        executor.EXECUTOR,
        executor_all_ranks_reply.EXECUTOR_ALL_RANKS_REPLY,
        executor_reply_shape.EXECUTOR_REPLY_SHAPE,
        executor_sample_tokens.EXECUTOR_SAMPLE_TOKENS,
        executor_kv_layout.EXECUTOR_KV_LAYOUT,
        executor_model_runner_v1.EXECUTOR_MODEL_RUNNER_V1,
        executor_close_queues.EXECUTOR_CLOSE_QUEUES,
        executor_shared_memory_replies.EXECUTOR_SHARED_MEMORY_REPLIES,
        driver_states_handover.DRIVER_STATES_HANDOVER,
        executor_rpc_deadline.EXECUTOR_RPC_DEADLINE,
        rpc_reply_read_once.RPC_REPLY_READ_ONCE,
        worker_malloc_retain.WORKER_MALLOC_RETAIN,
        kv_config_signature.KV_CONFIG_SIGNATURE,
        kv_memory_from_workers.KV_MEMORY_FROM_WORKERS,
        kv_config_engine_fields.KV_CONFIG_ENGINE_FIELDS,
        device_memory_query.DEVICE_MEMORY_QUERY,
        scheduler_block_size.SCHEDULER_BLOCK_SIZE,
        single_step_batches.SINGLE_STEP_BATCHES,
        sequence_limit.SEQUENCE_LIMIT,
        input_order.INPUT_ORDER,
        layer_ids.LAYER_IDS,
        results_contract.RESULTS_CONTRACT,
        input_validation.INPUT_VALIDATION,
        shutdown_at_exit.SHUTDOWN_AT_EXIT,
        generate_signal_shutdown.GENERATE_SIGNAL_SHUTDOWN,
    )
)

# Adapters that register an executor hook (executor.install_hook) install the subclass first if the
# "executor" record has not (its apply installs it and its worker set-up hook); then the first of
# them also makes the patches the "executor" record declares.
BY_ID = {adapter.id: adapter for adapter in ADAPTERS}


# Where each side's adapters live under adapters/, one file per adapter named after its id ("-" as
# "_"); a driver adapter that is a behaviour of spec_compat's executor is in driver/executor/.
SIDE_FOLDERS: dict[str, tuple[str, ...]] = {
    "import": ("import_time",),
    "worker": ("worker",),
    "worker-process": ("worker_process",),
    "driver": ("driver", "driver/executor"),
}
_PACKAGE = Path(__file__).resolve().parent


def adapter_file(adapter_id: str) -> str:
    """The file that defines adapter ``adapter_id``, relative to the package (``adapters/<side
    folder>/<id>.py``); tests/unit/test_registry.py checks it for every id. KeyError: no such id."""
    name = adapter_id.replace("-", "_") + ".py"
    folders = SIDE_FOLDERS[BY_ID[adapter_id].side]
    found = [f"adapters/{folder}/{name}" for folder in folders if (_PACKAGE / "adapters" / folder / name).is_file()]
    return found[0] if found else f"adapters/{folders[0]}/{name}"
