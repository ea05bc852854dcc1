"""Adapter ``model-dtype``: ModelConfig(dtype="auto")."""

from __future__ import annotations

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..support import override_keyword
from ..unit import Adapter


def probe_model_dtype(ctx: Context) -> Probe:
    if ctx.options.dtype is None:
        return Probe(False, "no dtype requested (apply(dtype=...) or SPEC_COMPAT_DTYPE)")
    return Probe(True, f"user asked for dtype={ctx.options.dtype!r}; speculators hard-codes 'auto'")


def apply_model_dtype(ctx: Context, patcher: AdapterPatcher) -> None:
    dtype = ctx.options.dtype
    override_keyword(ctx, patcher, "ModelConfig", "dtype", lambda kw: dtype)


MODEL_DTYPE = Adapter(
    id="model-dtype",
    patches=("speculators.data_generation.vllm_hidden_states_generator.ModelConfig",),
    how="keyword dtype",
    why="speculators hard-codes dtype='auto'; vLLM on CPU turns a float32 checkpoint into bfloat16",
    vllm_change="none (a missing knob)",
    detect="apply(dtype=...) or SPEC_COMPAT_DTYPE is set",
    delete_when="speculators exposes dtype",
    side="driver",
    probe=probe_model_dtype,
    apply=apply_model_dtype,
)
