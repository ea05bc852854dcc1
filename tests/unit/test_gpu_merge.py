"""benchmarks/gpu.py --merge: records of another speculators release stay apart from the first file's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

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


def _chat_ratio(record: Path, key: str) -> Any:
    return json.loads(record.read_text())["per_model"]["moe"]["prompt_sets"]["chat"][key]


def test_a_later_invocation_without_extract_replaces_the_shim_ratios_only(tmp_path: Path) -> None:
    newer = _copy(tmp_path, "newer.json", "def5678", ("extract",))
    chat = _merged_chat(tmp_path, newer)
    assert chat["ratios_from"] == str(newer) and chat["commit"] == "def5678"
    assert chat["extract_ratios_from"] == str(RECORD) and chat["extract_commit"] == "c863c88"
    assert chat["extract_vs_native"] == _chat_ratio(RECORD, "extract_vs_native") is not None


def test_a_later_extract_a_b_without_shim_replaces_the_extract_ratios_only(tmp_path: Path) -> None:
    """Run Y's lever A/B measured native and extract but no shim: its extract ratios are the newest,
    the shim's stay those of the invocation that measured shim and native side by side."""
    record = json.loads(RECORD.read_text())
    record["versions"]["spec_compat"] = "def5678"
    del record["per_model"]["moe"]["paths"]["shim"]
    for entry in record["per_model"]["moe"]["paths"]["extract"]["sets"].values():
        entry["tokens_per_s_median"] *= 2  # a faster extract, told apart
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(record))

    chat = _merged_chat(tmp_path, newer)

    assert chat["ratios_from"] == str(RECORD) and chat["commit"] == "c863c88"
    assert chat["shim_vs_native"] == _chat_ratio(RECORD, "shim_vs_native")
    assert chat["extract_ratios_from"] == str(newer) and chat["extract_commit"] == "def5678"
    assert chat["extract_vs_native"] == pytest.approx(2 * _chat_ratio(RECORD, "extract_vs_native"))
