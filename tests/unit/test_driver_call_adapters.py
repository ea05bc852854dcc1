"""Each driver-side keyword adapter against the old and the new vLLM signature shape, for the keyword
sets speculators 0.3.0 and 0.4.x pass. Fakes stand in for vLLM here; the real-engine suite is the
proof that the adapters work on a real vLLM."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spec_compat.calls import bind_problem, innermost, names_reaching_target
from spec_compat.detect import detect
from spec_compat.options import Context, Options
from spec_compat.patching import Patcher
from tests.unit.apply_adapters import apply_adapters
from tests.unit.fake_modules import NEW, OLD, SPEC_CALLS, fake_generator

CALL_ADAPTERS = [
    "request-kwargs",
    "scheduler-config-encoder-decoder",
    "prefix-caching-off",
    "block-size-from-platform",
    "kv-config-signature",
    "scheduler-block-size",
]


def _args() -> dict[str, Any]:
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=128))
    group = SimpleNamespace(kv_cache_spec="spec", layer_names=["layer.0"])
    return {"cfg": cfg, "kv": None, "groups": [group], "specs": {"layer.0": "spec"}}


def _apply(module: Any) -> tuple[Patcher, list[str]]:
    return apply_adapters(Context(env=detect(), options=Options(), generator=module), CALL_ADAPTERS)


def _keywords(call_args: str) -> set[str]:
    return {part.split("=")[0].strip() for part in call_args.split(", ")}


@pytest.mark.parametrize("speculators", ["0.3", "0.4"])
@pytest.mark.parametrize("shape_name", ["old", "new"])
def test_every_call_binds_after_adapters(tmp_path: Path, speculators: str, shape_name: str) -> None:
    shapes = OLD if shape_name == "old" else NEW
    module = fake_generator(tmp_path, speculators, shapes)
    broken_before = {
        name
        for name, call in SPEC_CALLS[speculators].items()
        if bind_problem(getattr(module, name), 0, _keywords(call))
    }
    patcher, _ = _apply(module)
    try:
        for name, call in SPEC_CALLS[speculators].items():
            target, names = names_reaching_target(getattr(module, name), _keywords(call))
            assert bind_problem(target, 0, names) is None, (name, names)
        module.make_calls(**_args())  # and the calls really go through
        received = {name: innermost(getattr(module, name)).calls[-1] for name in SPEC_CALLS[speculators]}
    finally:
        patcher.revert()

    assert received["CacheConfig"]["enable_prefix_caching"] is False
    assert received["CacheConfig"]["block_size"] is None  # left to the platform
    if "block_size" in shapes["Scheduler"]:
        assert received["Scheduler"]["block_size"] == 128  # the resolved size, not speculators' 16
    if "is_encoder_decoder" in shapes["SchedulerConfig"]:
        assert received["SchedulerConfig"]["is_encoder_decoder"] is False
    if "eos_token_id" not in shapes["Request"]:
        assert "eos_token_id" not in received["Request"]
    if "kv_cache_specs" in shapes["get_kv_cache_config_from_groups"]:
        assert received["get_kv_cache_config_from_groups"]["kv_cache_specs"] == {"layer.0": "spec"}
    # The fakes reproduce real breaks (the matrix): without adapters these calls fail.
    expected_breaks = {
        ("0.3", "new"): {"Request", "Scheduler", "SchedulerConfig", "get_kv_cache_config_from_groups"},
        ("0.4", "new"): {"Request"},
        ("0.4", "old"): {"Scheduler", "SchedulerConfig", "get_kv_cache_config_from_groups"},
        ("0.3", "old"): set(),
    }[(speculators, shape_name)]
    assert broken_before == expected_breaks


def test_revert_restores_original_objects(tmp_path: Path) -> None:
    module = fake_generator(tmp_path, "0.3", NEW)
    originals = {name: getattr(module, name) for name in SPEC_CALLS["0.3"]}
    patcher, applied = _apply(module)
    assert applied
    assert any(getattr(module, name) is not originals[name] for name in originals)
    patcher.revert()
    assert all(getattr(module, name) is originals[name] for name in originals)
