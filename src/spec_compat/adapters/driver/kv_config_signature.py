"""Adapter ``kv-config-signature``: get_kv_cache_config_from_groups(kv_cache_specs=...)."""

from __future__ import annotations

from typing import Any

from ..support import KeywordSignature
from ..unit import Adapter

# Three adapters wrap the generator's get_kv_cache_config_from_groups, each a CallAdapter around the
# one before: kv-config-signature (adds / drops kv_cache_specs), kv-memory-from-workers (fills
# available_memory), kv-config-engine-fields (completes the result). Each touches only its own
# keyword or the result and none reads what another changes, so their nesting order does not
# matter and the records state no after= / before= (the generate() wrappers, which do depend on
# each other, do).

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
    patches=("speculators.data_generation.vllm_hidden_states_generator.get_kv_cache_config_from_groups",),
    how="keyword kv_cache_specs",
    why="TypeError: unexpected keyword 'kv_cache_specs' (0.3.0) / missing 'kv_cache_specs' (0.4 on 0.11.x)",
    vllm_change="0.12.0 dropped kv_cache_specs",
    detect="signature vs AST: passed by speculators",
    delete_when="speculators 0.3.0 is no longer supported",
    side="driver",
    probe=KV_CONFIG_KEYWORD.probe,
    apply=KV_CONFIG_KEYWORD.apply,
)
