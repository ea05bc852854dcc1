"""Adapters that must run before ``speculators`` is imported (driver and every worker)."""

from __future__ import annotations

import importlib

from ..options import Context
from ..patching import Patcher
from .probe import Probe

# ---- transformers 5: `import speculators` fails -------------------------------------------------
# speculators' pydantic models subclass transformers' PretrainedConfig; transformers 5 annotates
# `dtype: str | torch.dtype | None` with `torch` imported only under TYPE_CHECKING, so pydantic's
# model_rebuild() raises PydanticUndefinedAnnotation: name 'torch' is not defined.


def probe_transformers_torch_annotation(ctx: Context) -> Probe:
    try:
        configuration_utils = importlib.import_module("transformers.configuration_utils")
    except ImportError as exc:
        return Probe(False, f"transformers not importable: {exc}")
    if "torch" in vars(configuration_utils):
        return Probe(False, "transformers.configuration_utils already binds the name `torch`")
    annotations = getattr(configuration_utils.PretrainedConfig, "__annotations__", {})
    if not any("torch" in str(value) for value in annotations.values()):
        return Probe(False, "PretrainedConfig annotations do not mention torch")
    return Probe(True, "PretrainedConfig annotates with `torch.dtype` but the module has no `torch` name")


def apply_transformers_torch_annotation(ctx: Context, patcher: Patcher) -> None:
    import torch

    configuration_utils = importlib.import_module("transformers.configuration_utils")
    patcher.add("transformers-torch-annotation", configuration_utils, "torch", torch)


# ---- vLLM 0.33: KV-cache planning helpers moved ------------------------------------------------
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


def apply_kv_cache_planning_aliases(ctx: Context, patcher: Patcher) -> None:
    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    for name in KV_PLANNING_NAMES:
        if not hasattr(kv_cache_utils, name):
            patcher.add("kv-cache-planning-aliases", kv_cache_utils, name, getattr(planning, name))
