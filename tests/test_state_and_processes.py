"""Repeated use, worker logs, start methods and unknown vLLM versions, on a real engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_harness import Cell, model_dir, record_figure, require_speculators, run_cell

pytestmark = pytest.mark.engine
HERE = Path(__file__).resolve().parent
CALLS = int(os.environ.get("SPEC_COMPAT_STATE_CALLS", "200"))


def _state_run(tmp_path: Path, tp: int) -> tuple[dict[str, Any], str]:
    out = tmp_path / "state.json"
    env = dict(
        os.environ,
        PYTHONPATH=str(require_speculators("0.4.0.1")),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else "0",
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "state_cell.py"), str(model_dir("qwen3_moe")), str(tp), str(CALLS), str(out)],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


def test_repeated_calls_match_single_calls_and_memory_is_flat(tmp_path: Path) -> None:
    record, output = _state_run(tmp_path, tp=2)
    # speculators issue 279: state leaking between calls. Batch composition may change the
    # summation order of CPU kernels, so equality is to float32 rounding, not bitwise.
    assert record["max_rel_diff_vs_single"] <= 1e-5, record
    growth = [(end - mid) / mid for end, mid in zip(record["rss_end"], record["rss_after_10"], strict=True)]
    record_figure("state-200-calls", {**record, "rss_growth_after_10": growth})
    assert max(growth) < 0.05, f"RSS grew by {max(growth):.1%} between call 10 and call {CALLS}: {record}"
    # worker logs: speculators' INFO line from each TP worker, with the rank
    for rank in (0, 1):
        assert (
            f"[spec_compat TP{rank}] INFO speculators.data_generation.custom_worker: Hidden states capture setup"
            in output
        )


@pytest.mark.parametrize(
    ("override", "method"),
    [("0.34.0rc1.dev42+g1234abc.cu130", "fork"), ("not-a-version", "spawn")],
    ids=["future-nightly-fork", "unparseable-spawn"],
)
def test_unknown_versions_decide_by_probes(override: str, method: str) -> None:
    os.environ["SPEC_COMPAT_VLLM_VERSION"] = override
    try:
        record, output = run_cell(Cell("0.4.0.1", "dense", 1, method=method), {"chunk_budget": 0})
    finally:
        del os.environ["SPEC_COMPAT_VLLM_VERSION"]
    assert record is not None, output
    assert record["problems"] == [] and "request-kwargs" in record["applied"]
    if override == "not-a-version":
        assert "is not a PEP 440 version" in output
