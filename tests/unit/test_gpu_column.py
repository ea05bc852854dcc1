"""The GPU column of the support table (tools/matrix_table.py) from docs/gpu/ records."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from matrix_table import gpu_summary, load_gpu


def cell(family: str, ok: bool, dtype: str = "bfloat16", speculators: str = "0.4.0.1") -> dict[str, Any]:
    return {
        "vllm": "0.23.0",
        "speculators": speculators,
        "family": family,
        "tp": 1,
        "dtype": dtype,
        "status": "pass" if ok else "mismatch",
        "verdict": {"pass": ok},
    }


def test_newest_run_wins_and_float32_mla_is_not_counted(tmp_path: Path) -> None:
    old = [cell("dense", False), cell("kimi_k25", True), cell("deepseek_v3", False, dtype="float32")]
    (tmp_path / "run9_a.json").write_text(json.dumps({"cells": old}))
    (tmp_path / "run10_b.json").write_text(json.dumps({"cells": [cell("dense", True), cell("dense", True, "float32")]}))
    (tmp_path / "large_moe.json").write_text(json.dumps({"model": "no cells"}))
    got = load_gpu(tmp_path)["0.23.0"]
    assert got[("0.4.0.1", "dense", 1, "bfloat16")]["file"] == "run10_b.json"  # run10 after run9
    assert ("0.4.0.1", "deepseek_v3", 1, "float32") not in got
    assert gpu_summary(got) == "2/2 families pass (3 cells)"


def test_one_failing_cell_fails_its_family() -> None:
    cells = {
        ("0.4.0.1", "qwen3_moe", 1, "bfloat16"): cell("qwen3_moe", True),
        ("0.3.0", "qwen3_moe", 1, "bfloat16"): cell("qwen3_moe", False, speculators="0.3.0"),
    }
    assert gpu_summary(cells) == "0/1 families pass (2 cells); not: qwen3_moe"
    assert gpu_summary(None) == "not run" and gpu_summary(cells, tp=2) == "not run"
