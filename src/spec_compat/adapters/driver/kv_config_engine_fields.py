"""Adapter ``kv-config-engine-fields``: KVCacheConfig fields the engine core fills in."""

from __future__ import annotations

from typing import Any

from ...calls import KeywordPlan
from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..support import install_call_adapter
from ..unit import Adapter

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
    patches=("speculators.data_generation.vllm_hidden_states_generator.get_kv_cache_config_from_groups",),
    how="its result",
    why=(
        "workers need KVCacheConfig.kv_cache_layout / hash_block_size / cache_hit_alignment_tokens, and "
        "cache_config.block_size must match the KV groups"
    ),
    vllm_change="0.29.0 kv_cache_layout, 0.32.0 hash_block_size and cache_hit_alignment_tokens",
    detect="KVCacheConfig dataclass fields",
    delete_when="get_kv_cache_config_from_groups fills them itself",
    side="driver",
    probe=probe_kv_config_fields,
    apply=apply_kv_config_fields,
    changes_seen_in_nightly=("0.29.0 kv_cache_layout: 0.27.2.dev202608220641 (2026-08-22)",),
)
