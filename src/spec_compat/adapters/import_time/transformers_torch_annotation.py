"""Adapter ``transformers-torch-annotation``: transformers 5: `import speculators` fails."""

from __future__ import annotations

import importlib
import importlib.util

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..unit import Adapter

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


def apply_transformers_torch_annotation(ctx: Context, patcher: AdapterPatcher) -> None:
    import torch

    configuration_utils = importlib.import_module("transformers.configuration_utils")
    patcher.add(configuration_utils, "torch", torch)


TRANSFORMERS_TORCH_ANNOTATION = Adapter(
    id="transformers-torch-annotation",
    patches=("transformers.configuration_utils.torch",),
    how="an added alias of torch",
    why="`import speculators` raises PydanticUndefinedAnnotation: name 'torch' is not defined",
    vllm_change=(
        "transformers 5 (pulled in by vLLM >= 0.24.0) annotates PretrainedConfig.dtype with torch.dtype, importing "
        "torch only under TYPE_CHECKING"
    ),
    detect="PretrainedConfig annotations mention torch and the module has no `torch` name",
    delete_when=(
        "speculators stops rebuilding pydantic models over PretrainedConfig, or transformers binds torch at module "
        "level"
    ),
    side="import",
    probe=probe_transformers_torch_annotation,
    apply=apply_transformers_torch_annotation,
)
