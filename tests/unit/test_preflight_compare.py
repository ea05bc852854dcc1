"""tools/preflight_compare.py: the issue-30 check that a refactor left every preflight as it was."""

from __future__ import annotations

import json
from pathlib import Path

import preflight_compare

REPO = Path(__file__).resolve().parents[2]


def _record(
    folder: Path, label: str, active: list[str], verdict: str = "compatible", transformers: str = "5.25.0"
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    preflight = {"verdict": verdict, "active_adapters": active, "failed_checks": []}
    versions = {"transformers": transformers, "spec-compat": "0.1.0"}
    record = {"label": label, "versions": versions, "preflight": {"0.4.0.1": preflight}}
    (folder / f"{label}.json").write_text(json.dumps(record))


def test_a_changed_adapter_set_or_verdict_is_a_difference(tmp_path: Path) -> None:
    _record(tmp_path / "a", "vllm-0.32.0", ["x", "y"])
    _record(tmp_path / "b", "vllm-0.32.0", ["y", "x"])
    same, compared = preflight_compare.compare(
        preflight_compare.preflights(tmp_path / "a"), preflight_compare.preflights(tmp_path / "b")
    )
    assert same == [] and compared == 1
    _record(tmp_path / "c", "vllm-0.32.0", ["y", "z"], verdict="incompatible")
    differences, _ = preflight_compare.compare(
        preflight_compare.preflights(tmp_path / "a"), preflight_compare.preflights(tmp_path / "c")
    )
    assert any("gone ['x'], new ['z']" in d for d in differences)
    assert any("verdict compatible -> incompatible" in d for d in differences)


def test_preflights_in_different_environments_are_a_difference_not_a_comparison(tmp_path: Path) -> None:
    _record(tmp_path / "a", "vllm-0.32.0", ["x"])
    _record(tmp_path / "b", "vllm-0.32.0", ["x"], transformers="5.26.0")
    differences, compared = preflight_compare.compare(
        preflight_compare.preflights(tmp_path / "a"), preflight_compare.preflights(tmp_path / "b")
    )
    assert compared == 0 and len(differences) == 1 and "environments differ" in differences[0]


def test_the_recorded_issue_30_comparison_has_no_difference() -> None:
    folder = REPO / "docs" / "matrix" / "issue30_preflight"
    before, after = preflight_compare.preflights(folder / "before"), preflight_compare.preflights(folder / "after")
    differences, compared = preflight_compare.compare(before, after)
    assert compared >= 69 and differences == []
    assert {r["spec_compat_commit"] for r in before.values()} != {r["spec_compat_commit"] for r in after.values()}
