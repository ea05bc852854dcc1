"""Adapter ``kv-cache-planning-aliases``: vLLM 0.33: KV-cache planning helpers moved."""

from __future__ import annotations

import importlib
import importlib.util

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..unit import Adapter

KV_PLANNING_NAMES = (
    "_get_kv_cache_groups_uniform_spec",
    "get_kv_cache_config_from_groups",
    "unify_hybrid_kv_cache_specs",
)


def probe_kv_cache_planning_aliases(ctx: Context) -> Probe:
    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    missing = [name for name in KV_PLANNING_NAMES if not hasattr(kv_cache_utils, name)]
    if not missing:
        return Probe(False, "kv_cache_utils still defines the helpers speculators imports")
    try:
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ImportError:
        return Probe(False, f"kv_cache_utils lacks {missing} and there is no kv_cache_planning module", blocking=True)
    absent = [name for name in missing if not hasattr(planning, name)]
    if absent:
        return Probe(False, f"neither kv_cache_utils nor kv_cache_planning defines {absent}", blocking=True)
    return Probe(True, f"kv_cache_utils lacks {missing}; kv_cache_planning defines them")


def apply_kv_cache_planning_aliases(ctx: Context, patcher: AdapterPatcher) -> None:
    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    for name in KV_PLANNING_NAMES:
        if not hasattr(kv_cache_utils, name):
            patcher.add(kv_cache_utils, name, getattr(planning, name))


KV_CACHE_PLANNING_ALIASES = Adapter(
    id="kv-cache-planning-aliases",
    patches=(
        "vllm.v1.core.kv_cache_utils._get_kv_cache_groups_uniform_spec",
        "vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
        "vllm.v1.core.kv_cache_utils.unify_hybrid_kv_cache_specs",
    ),
    how="added aliases of the helpers in vllm.v1.core.kv_cache_planning",
    why="speculators imports them from kv_cache_utils: ImportError at import",
    vllm_change="0.33.0 moved them to vllm.v1.core.kv_cache_planning",
    detect="the names are missing from kv_cache_utils and present in kv_cache_planning",
    delete_when="speculators' generator is no longer used with vLLM >= 0.33",
    side="import",
    probe=probe_kv_cache_planning_aliases,
    apply=apply_kv_cache_planning_aliases,
)
