"""tools/routing_report.py on a real tiny Qwen3-MoE (HF, CPU): a planted expert flip is found at
its layer with the set that reproduces it, the tokens it reaches through attention are explained
as inherited, and a planted non-routing difference stays unexplained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import routing_report
import torch
from routing_report import Analysis, Limits, one_swap_sets, outlier_report, run_layer
from shared_constants import ALL_LAYER_IDS

import tiny_models

LAYER_IDS = list(ALL_LAYER_IDS)
PROMPT = [1, *range(40, 70)]
FLIP_LAYER, FLIP_TOKEN = 1, 5
LIMITS = Limits(max_rel_l2=5e-3, min_cosine=None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_model("qwen3_moe", tmp_path_factory.mktemp("models") / "qwen3_moe")


def chained_run(model_dir: Path, forced: dict[int, dict[int, list[int]]]) -> tuple[list[torch.Tensor], Any]:
    """Every layer's output, layer by layer (each fed the previous output), with ``forced[layer]``."""
    model = tiny_models.load_hf_model(model_dir)
    analysis = Analysis(model, tiny_models.decoder_layers(model), "cpu", LIMITS)
    outputs: list[torch.Tensor] = []
    for layer in range(len(analysis.layers)):
        stream = outputs[-1] if outputs else None
        outputs.append(run_layer(analysis, PROMPT, layer, stream, forced.get(layer)).output)
    own = run_layer(analysis, PROMPT, FLIP_LAYER)
    return outputs, own


def report_for(model_dir: Path, got_by_layer: list[torch.Tensor], want_by_layer: list[torch.Tensor]) -> dict[str, Any]:
    got = [[got_by_layer[i] for i in LAYER_IDS]]
    want = [[want_by_layer[i] for i in LAYER_IDS]]
    return outlier_report(
        tiny_models.load_hf_model, tiny_models.decoder_layers, model_dir, [PROMPT], LAYER_IDS, got, want, LIMITS, "cpu"
    )


def test_chained_layers_match_a_full_forward(model_dir: Path) -> None:
    outputs, _ = chained_run(model_dir, {})
    full = tiny_models.hf_layer_outputs(model_dir, [PROMPT], LAYER_IDS)[0]
    for k, layer in enumerate(LAYER_IDS):
        assert torch.allclose(outputs[layer], full[k], atol=1e-5)


def test_planted_flip_is_found_with_its_expert_set(model_dir: Path) -> None:
    want, own = chained_run(model_dir, {})
    assert own.indices is not None
    hf_set = sorted(own.indices[FLIP_TOKEN].tolist())
    planted = one_swap_sets(hf_set, 8)[3]
    got, _ = chained_run(model_dir, {FLIP_LAYER: {FLIP_TOKEN: planted}})
    report = report_for(model_dir, got, want)
    assert report["outlier_tokens"] >= 1 and report["unexplained"] == 0, report
    assert report["weight_rule_error"] < 1e-5  # the router's weight rule is reproduced
    row = next(r for r in report["per_token"] if r["token"] == FLIP_TOKEN)
    assert row["kind"] == "expert_flip" and row["explained"] and row["first_flip_layer"] == FLIP_LAYER
    assert row["first_over_limit_layer"] == FLIP_LAYER
    entry = row["layers"][FLIP_LAYER]
    assert entry["hf_experts"] == hf_set and entry["vllm_experts"] == planted
    assert entry["best_forced_rel_l2"] < 1e-5
    for other in report["per_token"]:
        assert other["token"] >= FLIP_TOKEN  # attention is causal: nothing before the flip differs
        if other["kind"] == "flip_through_attention":
            assert FLIP_TOKEN in other["inherited_from_tokens"]
    assert set(report["kinds"]) <= {"expert_flip", "flip_through_attention"}


def test_planted_non_routing_difference_is_unexplained(model_dir: Path) -> None:
    want, _ = chained_run(model_dir, {})
    got = [t.clone() for t in want]
    noise = torch.randn(got[2].shape[-1], generator=torch.Generator().manual_seed(0))
    got[2][3] += 0.05 * got[2][3].norm() * noise / noise.norm()
    report = report_for(model_dir, got, want)
    assert report["outlier_tokens"] == 1 and report["unexplained"] == 1
    row = report["per_token"][0]
    assert row["token"] == 3 and row["first_over_limit_layer"] == 2 and row["explained"] is False
    assert row["kind"] == "layer_mismatch" and report["kinds"] == {"layer_mismatch": 1}
    assert "layer 2" in row["why"]


def test_no_outliers_no_model_load(model_dir: Path) -> None:
    want, _ = chained_run(model_dir, {})
    assert report_for(model_dir, want, want) == {"outlier_tokens": 0, "tokens": len(PROMPT)}
    assert routing_report.OUTLIER_TOKEN_CAP > 0
