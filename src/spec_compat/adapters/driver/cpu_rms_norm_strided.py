"""Adapter ``cpu-rms-norm-strided``: a vLLM CPU kernel that computes wrong on the inputs speculators'
engine gives it.

vLLM 0.12.0 / 0.13.0 route an enabled ``RMSNorm`` on CPU through
``CustomOp.forward_cpu`` -> ``forward_cuda`` -> the C++ ``_C.rms_norm`` kernel, and that kernel reads
its input as if it were contiguous. Qwen3's per-head q/k norms hand it a strided view of the fused
qkv projection (``q.view(tokens, heads, head_dim)``), so every attention layer gets wrong queries and
keys: vLLM alone disagrees with HF (tiny Qwen3, prompt log-probs 3.93 off), no error anywhere.
0.14.1 made ``forward_cpu`` the PyTorch-native path. With ``rms_norm`` disabled as a custom op the
same engine matches HF (7.2e-6). The probe runs the layer both ways on a strided view, so it follows
the kernel and the dispatch, not a version number; the fix is one ``custom_ops`` entry in the
``VllmConfig`` speculators builds, so other engines in the process are untouched.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..support import override_keyword
from ..unit import Adapter

DISABLE_RMS_NORM = "-rms_norm"


def rms_norm_strided_error() -> float:
    """Max |forward_cpu - forward_native| of vLLM's RMSNorm on a strided [tokens, heads, dim] view."""
    import torch
    from vllm.model_executor.layers.layernorm import RMSNorm

    generator = torch.Generator().manual_seed(0)
    tokens, heads, head_dim = 5, 4, 32
    fused = torch.randn(tokens, 2 * heads * head_dim, generator=generator)
    strided = fused[:, : heads * head_dim].view(tokens, heads, head_dim)  # as Qwen3's q_norm sees q
    with _vllm_config_scope():  # newer releases build a CustomOp only inside one
        layer: Any = RMSNorm(head_dim, eps=1e-6)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(head_dim, generator=generator) + 0.5)
        return float((layer.forward_cpu(strided) - layer.forward_native(strided)).abs().max())


def _vllm_config_scope() -> contextlib.AbstractContextManager[Any]:
    import vllm.config as config

    if not hasattr(config, "set_current_vllm_config"):
        return contextlib.nullcontext()
    return config.set_current_vllm_config(config.VllmConfig())


def probe_cpu_rms_norm_strided(ctx: Context) -> Probe:
    if ctx.env.platform != "cpu":
        return Probe(False, f"platform {ctx.env.platform!r}: the device kernel honours strides")
    try:
        error = rms_norm_strided_error()
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run must not stop apply()
        return Probe(False, f"could not run vLLM's RMSNorm on CPU ({type(exc).__name__}: {exc})")
    if error <= 1e-4:
        return Probe(False, f"RMSNorm on CPU matches its native path on a strided view ({error:.1e})")
    return Probe(
        True, f"RMSNorm's CPU kernel is wrong on a strided view (max diff {error:.2f}); Qwen3's q/k norms get one"
    )


def with_rms_norm_disabled(kwargs: dict[str, Any]) -> Any:
    """The compilation config speculators passes (or vLLM's default), with rms_norm off as a custom op."""
    from vllm.config import CompilationConfig

    given = kwargs.get("compilation_config")
    if given is None:
        return CompilationConfig(custom_ops=[DISABLE_RMS_NORM])
    if isinstance(given, dict):
        return {**given, "custom_ops": [*given.get("custom_ops", []), DISABLE_RMS_NORM]}
    updated = copy.deepcopy(given)  # speculators' object stays as it was
    updated.custom_ops = [*given.custom_ops, DISABLE_RMS_NORM]
    return updated


def apply_cpu_rms_norm_strided(ctx: Context, patcher: AdapterPatcher) -> None:
    override_keyword(ctx, patcher, "VllmConfig", "compilation_config", with_rms_norm_disabled)


CPU_RMS_NORM_STRIDED = Adapter(
    id="cpu-rms-norm-strided",
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmConfig",),
    how="keyword compilation_config: custom op rms_norm off",
    why=(
        "vLLM alone computes Qwen3 wrong on CPU (prompt log-probs 3.93 off HF, hidden states 1.5 rel): its C++ "
        "rms_norm kernel reads the q/k norms' strided per-head views as if contiguous"
    ),
    vllm_change=(
        "0.12.0 / 0.13.0 on CPU: an enabled RMSNorm runs forward_cpu -> forward_cuda -> _C.rms_norm (0.14.1 made "
        "forward_cpu the native path)"
    ),
    detect=(
        "platform cpu and RMSNorm.forward_cpu differs from forward_native on a strided [tokens, heads, head_dim] view"
    ),
    delete_when="vLLM 0.13 is no longer supported",
    side="driver",
    probe=probe_cpu_rms_norm_strided,
    apply=apply_cpu_rms_norm_strided,
)
