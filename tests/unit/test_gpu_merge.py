"""benchmarks/gpu.py --merge: records of another speculators release stay apart from the first file's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu import merge

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "benchmarks" / "results" / "gpu" / "c863c88_moe_chat_h100.json"


def test_a_second_speculators_release_gets_its_own_entry(tmp_path: Path) -> None:
    other = json.loads(RECORD.read_text())
    other["versions"]["speculators"] = "0.3.0"
    other["versions"]["spec_compat"] = "abc1234"
    other_file = tmp_path / "other.json"
    other_file.write_text(json.dumps(other))
    written = tmp_path / "merged.json"

    assert merge([RECORD, other_file], written) == 0

    per_model = json.loads(written.read_text())["per_model"]
    assert sorted(per_model) == ["moe", "moe@speculators-0.3.0"]
    assert per_model["moe"]["prompt_sets"]["chat"]["ratios_from"] == str(RECORD)
    assert per_model["moe@speculators-0.3.0"]["prompt_sets"]["chat"]["ratios_from"] == str(other_file)
    assert per_model["moe@speculators-0.3.0"]["prompt_sets"]["chat"]["commit"] == "abc1234"  # the chosen file's
    assert per_model["moe"]["prompt_sets"]["chat"]["commit"] == "c863c88"
    first = per_model["moe"]["paths"]["shim"]["runs"]
    assert len(first) == len(json.loads(RECORD.read_text())["per_model"]["moe"]["paths"]["shim"]["runs"])


def _copy(tmp_path: Path, name: str, commit: str, drop: tuple[str, ...]) -> Path:
    record = json.loads(RECORD.read_text())
    record["versions"]["spec_compat"] = commit
    for path in drop:
        del record["per_model"]["moe"]["paths"][path]
    file = tmp_path / name
    file.write_text(json.dumps(record))
    return file


def _merged_chat(tmp_path: Path, newer: Path) -> dict[str, Any]:
    """RECORD then ``newer`` merged: the chat set's entry."""
    written = tmp_path / "merged.json"
    assert merge([RECORD, newer], written) == 0
    chat: dict[str, Any] = json.loads(written.read_text())["per_model"]["moe"]["prompt_sets"]["chat"]
    return chat


def test_a_later_invocation_with_the_target_paths_replaces_one_with_more_paths(tmp_path: Path) -> None:
    assert {"shim", "native", "extract", "shim_without"} <= set(
        json.loads(RECORD.read_text())["per_model"]["moe"]["paths"]
    )
    newer = _copy(tmp_path, "newer.json", "def5678", ("shim_without",))
    chat = _merged_chat(tmp_path, newer)
    assert chat["ratios_from"] == str(newer)
    assert chat["commit"] == "def5678"


def test_a_later_invocation_without_extract_does_not_replace_one_with_it(tmp_path: Path) -> None:
    newer = _copy(tmp_path, "newer.json", "def5678", ("extract",))
    chat = _merged_chat(tmp_path, newer)
    assert chat["ratios_from"] == str(RECORD)
    assert chat["commit"] == "c863c88"


def test_extract_variants_run_set_by_set_and_a_short_budget_keeps_whole_pairs(tmp_path: Path) -> None:
    """Several extract paths run the first set for each, then the next set for each: when the budget
    runs out, the sets done have both sides of the A/B (run X lost its A/B by running one path's sets
    first). A set is skipped once the budget left is under the longest set run so far."""
    import argparse

    from gpu import Bench

    bench = object.__new__(Bench)
    ran: list[tuple[str, str]] = []
    budget = {"left": 100.0}
    bench.args = argparse.Namespace(variant_env={"b": {"K": "1"}}, variant_args={}, extract_args="", path_timeout_s=50)
    bench.variants, bench.env, bench.logs, bench.priors = {"b": "extract"}, {}, tmp_path, {"extract": 10.0}
    bench.remaining = lambda: budget["left"]  # type: ignore[method-assign]
    bench.extract_root = lambda base: tmp_path  # type: ignore[method-assign]
    bench.measure_disk = lambda root: {"gb_per_s": {}}  # type: ignore[method-assign]

    def run_extract(spec: Any, entry: Any, log: Path, timeout: float, root: Path, args: str, env: Any) -> Any:
        ran.append((log.stem.split("_")[-2], entry["name"]))
        budget["left"] -= 30.0
        return {"status": "ok", "wall_s": 30.0, "env": env, "tokens_per_s": [1.0], "tokens_per_s_median": 1.0}

    bench.run_extract = run_extract  # type: ignore[method-assign]
    spec = {"sets": [{"name": "s1"}, {"name": "s2"}, {"name": "s3"}]}
    records = bench.run_extract_group("m", ["extract", "b"], spec, 0)

    # 100 s: 70 left after extract s1, 40 after b s1, 10 after extract s2: under the 30 s a set took, so b s2 waits
    assert ran == [("extract", "s1"), ("b", "s1"), ("extract", "s2")]
    assert records["b"]["sets"]["s1"]["env"] == {"K": "1"} and records["extract"]["sets"]["s1"]["env"] == {}
    assert records["b"]["sets"]["s2"]["status"] == "not-run" and records["b"]["status"] == "partial"
    assert records["extract"]["sets"]["s3"]["status"] == "not-run" and records["extract"]["wall_s"] == 60.0
