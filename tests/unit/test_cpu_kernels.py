"""cpu-rms-norm-strided against the installed vLLM's real RMSNorm and its real CPU kernel.

The release in the test venv has the PyTorch-native ``forward_cpu`` (so the probe says no); routing
``forward_cpu`` to ``forward_cuda`` reproduces what vLLM 0.12.0 / 0.13.0 do, on this build's own
``_C.rms_norm``. The engine-level proof is the matrix's 0.12.0 / 0.13.0 cells against HF.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from spec_compat.adapters.driver import cpu_rms_norm_strided
from spec_compat.detect import detect
from spec_compat.options import Context, Options
from spec_compat.patching import Patcher
from tests.unit.fake_modules import recording_generator_module

pytest.importorskip("vllm")
import torch
import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
from vllm.config import CompilationConfig
from vllm.model_executor.layers.layernorm import RMSNorm


def _ctx(generator: Any = None) -> Context:
    return Context(env=detect(), options=Options(), generator=generator)


def test_native_cpu_dispatch_is_left_alone() -> None:
    ctx = _ctx()
    assert ctx.env.platform == "cpu"
    assert cpu_rms_norm_strided.rms_norm_strided_error() <= 1e-5
    assert not cpu_rms_norm_strided.probe_cpu_rms_norm_strided(ctx).applies


def test_kernel_dispatch_on_a_strided_view_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM 0.12.0's CustomOp.forward_cpu ("we assume that CPU ops are compatible with CUDA ops") ends
    # in its rms_norm helper: an empty output and this build's own C++ kernel, strides unread.
    def kernel_path(self: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, self.weight.data, self.variance_epsilon)
        return out

    monkeypatch.setattr(RMSNorm, "forward_cpu", kernel_path)
    assert cpu_rms_norm_strided.rms_norm_strided_error() > 0.1
    probe = cpu_rms_norm_strided.probe_cpu_rms_norm_strided(_ctx())
    assert probe.applies and "strided view" in probe.reason


def test_other_platforms_are_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = Context(env=dataclasses.replace(detect(), platform="cuda"), options=Options())
    monkeypatch.setattr(cpu_rms_norm_strided, "rms_norm_strided_error", lambda: pytest.fail("probed on cuda"))
    assert not cpu_rms_norm_strided.probe_cpu_rms_norm_strided(ctx).applies


def test_compilation_config_gets_rms_norm_off_and_keeps_the_rest() -> None:
    fresh = cpu_rms_norm_strided.with_rms_norm_disabled({})
    assert isinstance(fresh, CompilationConfig) and fresh.custom_ops == ["-rms_norm"]
    given = CompilationConfig(custom_ops=["+silu_and_mul"])
    updated = cpu_rms_norm_strided.with_rms_norm_disabled({"compilation_config": given})
    assert updated.custom_ops == ["+silu_and_mul", "-rms_norm"] and given.custom_ops == ["+silu_and_mul"]
    as_dict = cpu_rms_norm_strided.with_rms_norm_disabled({"compilation_config": {"mode": 0}})
    assert as_dict == {"mode": 0, "custom_ops": ["-rms_norm"]}


def test_only_speculators_vllm_config_changes_and_revert_restores_it() -> None:
    module, received = recording_generator_module()
    vllm_config = module.VllmConfig  # type: ignore[attr-defined]
    patcher = Patcher()
    cpu_rms_norm_strided.CPU_RMS_NORM_STRIDED.install(_ctx(module), patcher)
    module.VllmConfig(model_config="m")  # type: ignore[attr-defined]
    assert received[-1]["model_config"] == "m"
    assert received[-1]["compilation_config"].custom_ops == ["-rms_norm"]
    patcher.revert()
    assert module.VllmConfig is vllm_config  # type: ignore[attr-defined]
