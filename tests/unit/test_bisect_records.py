"""Each adapter's ``first_seen_nightly`` is what tools/matrix.py bisect found and proved."""

from __future__ import annotations

import json
from pathlib import Path

from spec_compat.registry import ADAPTERS, BY_ID

BISECTS = Path(__file__).resolve().parents[2] / "docs" / "matrix" / "bisect"


def test_every_bisect_record_is_in_its_adapters_record_and_proven() -> None:
    records = {path.stem: json.loads(path.read_text()) for path in sorted(BISECTS.glob("*.json"))}
    for adapter_id, record in records.items():
        assert adapter_id in BY_ID, f"docs/matrix/bisect/{adapter_id}.json names no adapter"
        assert record["adapter"] == adapter_id
        if record["first_needed"] is None:  # not needed in the newest build: nothing to name
            assert record["probed"] == {record["series"][1]: False} and not BY_ID[adapter_id].first_seen_nightly
            continue
        first = record["first_needed"]["build"]
        assert record["probed"][first] is True, "the first build needing it was probed and needs it"
        if record.get("last_not_needed"):
            last = record["last_not_needed"]["build"]
            assert record["probed"][last] is False, "the build before it was probed and does not"
            assert record.get("proven") is True, f"{adapter_id}: the run without it did not fail at {first}"
            seen = f"{first} ({record['first_needed']['date']})"
            assert BY_ID[adapter_id].first_seen_nightly == seen, f"{adapter_id}: record it as first seen in {seen}"
    for unit in ADAPTERS:
        if unit.first_seen_nightly:
            assert unit.id in records, f"{unit.id}: first_seen_nightly without docs/matrix/bisect/{unit.id}.json"
