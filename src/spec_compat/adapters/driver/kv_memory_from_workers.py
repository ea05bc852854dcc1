"""Adapter ``kv-memory-from-workers``: KV memory where the device reports none."""

from __future__ import annotations

from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..support import override_keyword
from ..unit import Adapter
from .executor.hooks import executor_for

# speculators sizes the KV cache as free_device_memory * utilisation * 0.2. On CPU (and any device
# whose mem_get_info gives (0, 0)) that is 0 bytes -> 0 blocks. Ask the workers, as vLLM's engine
# core does (determine_available_memory: on CPU, VLLM_CPU_KVCACHE_SPACE).


def _available_memory(kwargs: dict[str, Any]) -> int:
    given = int(kwargs.get("available_memory") or 0)
    if given > 0:
        return given
    executor = executor_for(kwargs["vllm_config"])
    if executor is None:
        raise RuntimeError(
            "spec_compat: the device reported no free memory for the KV cache and no spec_compat "
            "executor is known for this config to ask the workers"
        )
    return int(min(executor.determine_available_memory()))


def probe_kv_memory(ctx: Context) -> Probe:
    return Probe(
        ctx.env.platform != "cuda",
        f"platform {ctx.env.platform!r}: the device memory query speculators uses gives 0 or raises"
        if ctx.env.platform != "cuda"
        else "CUDA reports free memory",
    )


def apply_kv_memory(ctx: Context, patcher: AdapterPatcher) -> None:
    override_keyword(ctx, patcher, "get_kv_cache_config_from_groups", "available_memory", _available_memory)


KV_MEMORY_FROM_WORKERS = Adapter(
    id="kv-memory-from-workers",
    patches=("speculators.data_generation.vllm_hidden_states_generator.get_kv_cache_config_from_groups",),
    how="keyword available_memory",
    why="speculators sizes the KV cache from device free memory: 0 on CPU -> no KV blocks",
    vllm_change="none: CPU / non-CUDA platforms (vllm-cpu) report no device memory",
    detect="platform is not CUDA (and at run time: available_memory <= 0)",
    delete_when="speculators asks the executor for available memory",
    side="driver",
    probe=probe_kv_memory,
    apply=apply_kv_memory,
)
