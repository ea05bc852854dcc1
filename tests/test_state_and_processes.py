"""Repeated use, worker logs, start methods and unknown vLLM versions, on a real engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine_harness import Cell, CellPool, big_batch, engine_process_env, model_dir, record_figure
from spec_compat.adapters import transfer

pytestmark = pytest.mark.engine
CELLS = Path(__file__).resolve().parent / "cells"
CALLS = int(os.environ.get("SPEC_COMPAT_STATE_CALLS", "200"))


@dataclass(frozen=True)
class CallsCell:
    """``script`` (state_cell.py: the generator; llm_rss_cell.py: vLLM's own LLM, the baseline) making
    CALLS calls on a TP=2 MoE engine; (record, output). A two-core pool job: what it records is
    results and memory, not time."""

    script: str
    cores = 2

    @property
    def name(self) -> str:
        return f"calls-{self.script.removesuffix('.py')}"

    def run(self, work: Path, core: str | None) -> tuple[dict[str, Any], str]:
        out = work / f"{self.script}.json"
        proc = subprocess.run(
            [sys.executable, str(CELLS / self.script), str(model_dir("qwen3_moe")), "2", str(CALLS), str(out)],
            env=engine_process_env("0.4.0.1", "0|1"), capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        return json.loads(out.read_text()), proc.stdout + proc.stderr


STATE, LLM_BASELINE = CallsCell("state_cell.py"), CallsCell("llm_rss_cell.py")


def _growth(record: dict[str, Any]) -> list[int]:
    return [end - mid for end, mid in zip(record["rss_end"], record["rss_after_10"], strict=True)]


@pytest.mark.reads(STATE, LLM_BASELINE)
def test_repeated_calls_match_single_calls_and_memory_is_flat(engine_cells: CellPool) -> None:
    record, output = engine_cells.result(STATE)
    baseline, _ = engine_cells.result(LLM_BASELINE)
    # speculators issue 279 was state leaking between calls: every result of the varied batches
    # must equal the fresh single-prompt call (float32; allow rounding if kernels reorder sums).
    assert record["max_rel_diff_vs_single"] <= 1e-5, record
    driver_growth, *worker_growth = _growth(record)
    vllm_worker_growth = _growth(baseline)
    record_figure(
        "state-calls",
        {**record, "calls": CALLS, "worker_growth": worker_growth, "vllm_llm_worker_growth": vllm_worker_growth},
    )
    assert driver_growth < 0.02 * record["rss_after_10"][0], record
    # The shared-memory transfer over the same calls: every reply through it and checked on the
    # worker, the segment reused (a batch larger than any before may need one more), no driver
    # descriptor left open per call, nothing left in /dev/shm after shutdown. The 24 single-prompt
    # results stay alive all along: they keep up to HELD_SEGMENTS segments (driver-states-handover),
    # the later ones are copies.
    replies = record["states_replies"]
    assert (replies["verified"], replies["unverified"]) == (CALLS + 24, 0), replies
    # written step by step (captured-states-streamed) unless larger than the recent ones plus an eighth
    # (a first call, batches growing): most of these calls of 1-13 prompts
    assert CALLS * 3 // 4 <= replies["streamed"] < CALLS + 24, replies
    held = transfer.HELD_SEGMENTS
    assert record["segments_max"] <= held + 2 and record["segments_made"] <= held + 4, record
    assert record["driver_fds_end"] == record["driver_fds_after_10"], record
    assert record["transfer_directory_left"] is False
    # vLLM's CPU workers grow on their own under varied batches (measured: ~+0.6 MB/call with
    # vllm.LLM alone); the shim must not add to that beyond noise.
    allowance = 1.5 * max(vllm_worker_growth) + (32 << 20)
    assert max(worker_growth) <= allowance, (worker_growth, vllm_worker_growth)
    # worker logs: speculators' INFO line from each TP worker, with the rank
    for rank in (0, 1):
        assert (
            f"[spec_compat TP{rank}] INFO speculators.data_generation.custom_worker: Hidden states capture setup"
            in output
        )


VERSION_ENV = "SPEC_COMPAT_VLLM_VERSION"
UNKNOWN_VERSIONS = [
    Cell("0.4.0.1", "dense", 1, method="fork", env=((VERSION_ENV, "0.34.0rc1.dev42+g1234abc.cu130"),)),
    Cell("0.4.0.1", "dense", 1, method="spawn", env=((VERSION_ENV, "not-a-version"),)),
]


@pytest.mark.parametrize("cell", UNKNOWN_VERSIONS, ids=["future-nightly-fork", "unparseable-spawn"])
def test_unknown_versions_decide_by_probes(cell: Cell, engine_cells: CellPool) -> None:
    record, output = engine_cells.result(cell)
    assert record is not None, output
    assert record["problems"] == [] and "request-kwargs" in record["applied"]
    if dict(cell.env)[VERSION_ENV] == "not-a-version":
        assert "is not a PEP 440 version" in output


@pytest.mark.parametrize("cell", [Cell("0.4.0.1", "dense", 1)], ids=lambda cell: cell.name)
def test_batch_larger_than_max_num_seqs(cell: Cell, engine_cells: CellPool) -> None:
    """speculators keeps prefilled requests running (it never reports outputs to the scheduler):
    a batch beyond max_num_seqs (32) would leave inputs unscheduled without spec_compat. The engine
    cell of test_engine.py's dense TP=1 case runs that batch too."""
    from engine_harness import LAYER_IDS
    from tiny_models import hf_layer_outputs

    record, output = engine_cells.result(cell)
    assert record is not None, output
    prompts = big_batch()
    assert len(prompts) > 32 and record["big_batch"]["input_ids"] == prompts
    reference = hf_layer_outputs(model_dir("dense"), prompts, LAYER_IDS)
    worst = max(
        float((g - w).abs().max()) / max(1.0, float(w.abs().max()))
        for got, want in zip(record["big_batch"]["results"], reference, strict=True)
        for g, w in zip(got, want, strict=True)
    )
    assert worst <= 1e-3, worst
