"""Each adapter's ``first_seen_nightly`` is what tools/matrix.py bisect found and proved, and each entry
of its ``changes_seen_in_nightly`` what tools/matrix.py bisect-source found in the builds' own source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matrix

from spec_compat.registry import ADAPTERS, BY_ID

BISECTS = Path(__file__).resolve().parents[2] / "docs" / "matrix" / "bisect"


def _records(source: bool) -> dict[str, Any]:
    """``<adapter>.json`` (bisect) or ``<adapter>--<change>.json`` (bisect-source), by file stem."""
    paths = sorted(BISECTS.glob("*.json"))
    return {path.stem: json.loads(path.read_text()) for path in paths if ("--" in path.stem) == source}


def test_every_bisect_record_is_in_its_adapters_record_and_proven() -> None:
    records = _records(source=False)
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


def test_every_source_bisect_is_in_its_adapters_record_and_changes_there() -> None:
    records = _records(source=True)
    assert records, "no docs/matrix/bisect/<adapter>--<change>.json"
    found: dict[str, set[str]] = {}
    for stem, record in records.items():
        adapter_id, change_id = stem.split("--")
        assert record["adapter"] == adapter_id and record["change_id"] == change_id and record["method"] == "source"
        probe = matrix.SOURCE_CHANGES[change_id]  # the table that found it still says the same
        assert (probe.adapter, probe.change, probe.path) == (record["adapter"], record["change"], record["file"])
        first, last = record["first_has"]["build"], record["last_without"]["build"]
        assert record["probed"][first] is True, f"{stem}: {first} was probed and has the change"
        assert record["probed"][last] is False, f"{stem}: {last}, the build before, was probed and has not"
        assert record["monotone"] is True, f"{stem}: the builds around the boundary disagree with it"
        seen = f"{record['change']}: {first} ({record['first_has']['date']})"
        assert seen in BY_ID[adapter_id].changes_seen_in_nightly, f"{adapter_id}: record {seen!r}"
        found.setdefault(adapter_id, set()).add(seen)
    for unit in ADAPTERS:
        assert set(unit.changes_seen_in_nightly) == found.get(unit.id, set()), (
            f"{unit.id}: changes_seen_in_nightly without its docs/matrix/bisect/{unit.id}--<change>.json"
        )
