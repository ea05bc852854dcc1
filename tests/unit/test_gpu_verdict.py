"""tools/gpu_cells.py's strict verdict for a cell over the per-token limit: it passes only when
the outlier report accounts for every outlier token, one by one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from gpu_cells import account_for_outliers, family_config, routing_is_continuous, settle_verdict  # noqa: E402

FLOOR = {"rel_l2_max": 0.07, "cosine_min": 0.9975, "routing_continuous": True}


def row(kind: str | None, rel: float = 0.06, cos: float = 0.998, token: int = 5) -> dict[str, Any]:
    return {"prompt": 1, "token": token, "kind": kind, "rel_l2_max": rel, "cosine_min": cos, "why": "w"}


def report(*rows: dict[str, Any], total: int | None = None, **extra: Any) -> dict[str, Any]:
    return {"outlier_tokens": len(rows) if total is None else total, "tokens": 754, "per_token": list(rows), **extra}


def test_expert_flips_of_any_size_are_accounted() -> None:
    got = account_for_outliers("bfloat16", None, report(row("expert_flip", 0.9, 0.5), row("flip_through_attention")))
    assert got["accounted"] and got["by_rule"] == {"expert_flip": 1, "flip_through_attention": 1}


def test_rounding_needs_bfloat16_and_the_measured_floor() -> None:
    inside = row("accumulated_rounding", 0.054, 0.9986)
    assert account_for_outliers("bfloat16", FLOOR, report(inside))["accounted"]
    assert not account_for_outliers("bfloat16", None, report(inside))["accounted"]  # no floor measured
    assert not account_for_outliers("float32", FLOOR, report(inside))["accounted"]  # float32: strict only
    top_k = {**FLOOR, "routing_continuous": False}  # HF's own bfloat16 run flips experts: no rounding floor
    assert not account_for_outliers("bfloat16", top_k, report(inside))["accounted"]
    over_rel = account_for_outliers("bfloat16", FLOOR, report(row("accumulated_rounding", 0.08, 0.999)))
    over_cos = account_for_outliers("bfloat16", FLOOR, report(row("accumulated_rounding", 0.05, 0.99)))
    assert not over_rel["accounted"] and not over_cos["accounted"]
    assert "over the floor" in over_rel["unaccounted"][0]["why"]


def test_a_layer_mismatch_fails_among_flips() -> None:
    got = account_for_outliers("bfloat16", FLOOR, report(row("expert_flip"), row("layer_mismatch", token=9)))
    assert not got["accounted"]
    assert got["unaccounted"] == [{"prompt": 1, "token": 9, "kind": "layer_mismatch", "why": "w"}]


def test_an_incomplete_report_never_passes() -> None:
    capped = account_for_outliers("bfloat16", FLOOR, report(row("expert_flip"), total=283))
    stopped = account_for_outliers("bfloat16", FLOOR, report(row("expert_flip"), stopped="time limit"))
    failed = account_for_outliers("bfloat16", FLOOR, {"error": "Traceback ..."})
    assert not any(x["accounted"] for x in (capped, stopped, failed))
    assert "1 of 283" in capped["why"] and not account_for_outliers("bfloat16", FLOOR, None)["accounted"]


def verdict(values_ok: bool, order_ok: bool = True) -> dict[str, Any]:
    return {"values_ok": values_ok, "input_order_ok": order_ok, "count_ok": True, "problems": False}


def test_settle_verdict() -> None:
    flips = report(row("expert_flip"))
    ok = verdict(False)
    settle_verdict(ok, "bfloat16", flips)
    assert ok["pass"] and ok["outliers"]["accounted"]
    wrong_order = verdict(False, order_ok=False)
    settle_verdict(wrong_order, "bfloat16", flips)  # accounted values cannot rescue a wrong order
    assert not wrong_order["pass"]
    unexplained = verdict(False)
    settle_verdict(unexplained, "bfloat16", report(row("layer_mismatch")))
    assert not unexplained["pass"]
    within = verdict(True)
    settle_verdict(within, "float32", None)
    assert within["pass"] and "outliers" not in within


def test_continuous_routing_is_read_from_the_config() -> None:
    assert routing_is_continuous({"hidden_size": 64})  # dense
    assert routing_is_continuous({"num_experts": 4, "num_experts_per_tok": 4})
    assert not routing_is_continuous({"n_routed_experts": 8, "num_experts_per_tok": 2})
    assert not routing_is_continuous({"text_config": {"n_routed_experts": 8, "num_experts_per_tok": 2}})
    continuous = {
        f
        for f in ("dense", "qwen3_moe_all_experts", "deepseek_v3_all_experts", "qwen3_moe_w4a16", "deepseek_v3_fp8")
        if routing_is_continuous(family_config(f))
    }
    assert len(continuous) == 5
    assert not any(routing_is_continuous(family_config(f)) for f in ("qwen3_moe", "deepseek_v3", "kimi_k25"))


def test_w8a8_limits_widen_to_the_measured_spread_only_in_bfloat16(tmp_path: Path) -> None:
    from gpu_cells import W8A8_LIMITS, cell_limits

    from tiny_models import ACTIVATION_QUANTIZATION_FILE

    spread = {"token_metric": {"rel_l2_max": 0.088, "cosine_min": 0.9961}}
    plain_twin, w8a8_twin = tmp_path / "w4a16.dequantized", tmp_path / "fp8.dequantized"
    plain_twin.mkdir()
    w8a8_twin.mkdir()
    (w8a8_twin / ACTIVATION_QUANTIZATION_FILE).write_text("{}")
    assert cell_limits("bfloat16", w8a8_twin, spread) == (0.088, 0.995, W8A8_LIMITS)
    assert cell_limits("bfloat16", plain_twin, spread) == (0.05, 0.995, "strict")  # W4A16: weights only
    assert cell_limits("float32", w8a8_twin, spread) == (5e-3, None, "strict")
    assert cell_limits("bfloat16", w8a8_twin, None) == (0.05, 0.995, "strict")  # nothing measured
    narrow = {"token_metric": {"rel_l2_max": 0.01, "cosine_min": 0.9999}}
    assert cell_limits("bfloat16", w8a8_twin, narrow) == (0.05, 0.995, W8A8_LIMITS)  # never below strict


def test_family_env_defaults_and_overrides() -> None:
    import argparse

    from gpu_cells import FAMILY_ENV, family_env

    args = argparse.Namespace(family_env_values={"deepseek_v3_fp8": {"VLLM_USE_DEEP_GEMM_E8M0": "1", "X": "y"}})
    assert family_env(args, "deepseek_v3_fp8") == {
        **FAMILY_ENV["deepseek_v3_fp8"],
        "VLLM_USE_DEEP_GEMM_E8M0": "1",
        "X": "y",
    }
    assert family_env(args, "dense") == {}
    marlin = family_env(args, "deepseek_v3_fp8_w8a16")
    assert (
        marlin["VLLM_TEST_FORCE_FP8_MARLIN"] == "1"
        and "DeepGemmFp8BlockScaledMMKernel" in marlin["VLLM_DISABLED_KERNELS"]
    )
