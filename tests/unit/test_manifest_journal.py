"""manifest.json's journal: a batch's samples appended, the manifest rewritten rarely, replayed after a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spec_compat.extract import manifest as manifest_module
from spec_compat.extract.manifest import Manifest

PROVENANCE = {"model": "m", "layer_ids": [1], "format": "f", "run": {}}
JOURNAL = "manifest.json.journal"


def _open(out: Path) -> Manifest:
    return Manifest(out, PROVENANCE)


def _record_batches(manifest: Manifest, start: int, batches: int, size: int = 4) -> None:
    for batch in range(batches):
        for idx in range(start + batch * size, start + (batch + 1) * size):
            manifest.record(idx, f"data_{idx}.pt", 10 + idx, f"{idx:064x}")
        manifest.save(sync=True)


def _listed(out: Path) -> set[int]:
    return set(map(int, json.loads((out / "manifest.json").read_text())["samples"]))


@pytest.fixture
def no_timed_rewrites(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the journal's length makes a rewrite due (a slow machine cannot make one happen by time)."""
    monkeypatch.setattr(manifest_module, "REWRITE_MIN_INTERVAL_S", 1e9)


def test_new_samples_go_to_the_journal_and_close_completes_the_manifest(
    tmp_path: Path, no_timed_rewrites: None
) -> None:
    manifest = _open(tmp_path)
    manifest.save(sync=True)  # a new manifest: written at once
    _record_batches(manifest, 0, batches=7)  # 28 samples: rewritten at 16, then 12 in the journal
    on_disk = _listed(tmp_path)
    journal = [json.loads(line) for line in (tmp_path / JOURNAL).read_text().splitlines()]
    assert on_disk | {int(r["idx"]) for r in journal} == set(range(28))
    assert len(journal) == 12 and on_disk == set(range(16)), "the last batches are only in the journal"
    assert all(r["entry"] == manifest.data["samples"][r["idx"]] for r in journal)
    manifest.close(sync=True)
    assert _listed(tmp_path) == set(range(28)) and not (tmp_path / JOURNAL).exists()
    lengths = json.loads((tmp_path / "sample_lengths.json").read_text())
    assert lengths == {str(i): 10 + i for i in range(28)}


def test_rewrites_grow_geometrically_so_recording_is_linear_in_the_samples(
    tmp_path: Path, no_timed_rewrites: None
) -> None:
    manifest = _open(tmp_path)
    manifest.save()
    _record_batches(manifest, 0, batches=1000, size=8)  # 8000 samples
    # each rewrite comes once the journal holds half as many samples as the manifest: log_1.5(8000) + a few
    assert manifest.rewrites <= 30, manifest.rewrites
    assert len((tmp_path / JOURNAL).read_text().splitlines()) <= 8000 // 2


def test_a_rewrite_is_due_by_time_when_it_is_cheap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(manifest_module.time, "monotonic", lambda: clock[0])
    manifest = _open(tmp_path)
    _record_batches(manifest, 0, batches=20)  # 80 samples, no time passes: the journal's length decides
    listed_before = len(_listed(tmp_path))
    assert listed_before < 80
    clock[0] += manifest_module.REWRITE_MIN_INTERVAL_S  # a rewrite took ~0 s: due after the minimum interval
    _record_batches(manifest, 80, batches=1)
    assert _listed(tmp_path) == set(range(84)) and not (tmp_path / JOURNAL).exists()


def test_a_rerun_replays_the_journal_of_a_killed_run_and_ignores_a_cut_off_line(
    tmp_path: Path, no_timed_rewrites: None
) -> None:
    manifest = _open(tmp_path)
    manifest.save(sync=True)
    _record_batches(manifest, 0, batches=7)
    journaled = {int(json.loads(line)["idx"]) for line in (tmp_path / JOURNAL).read_text().splitlines()}
    with (tmp_path / JOURNAL).open("a") as handle:  # the process was killed in the middle of an append
        handle.write('{"idx":"99","entry":{"file":"data_99.pt","num_tok')
    del manifest
    again = _open(tmp_path)
    assert again.replayed == len(journaled)
    assert len(journaled) == 12 and set(map(int, again.data["samples"])) == set(range(28)), "99 was cut off"
    again.save(sync=True)  # a rerun's first save folds the journal into manifest.json
    assert _listed(tmp_path) == set(range(28)) and not (tmp_path / JOURNAL).exists()


def test_replay_stops_at_a_damaged_line_and_a_stale_journal_changes_nothing(tmp_path: Path) -> None:
    manifest = _open(tmp_path)
    _record_batches(manifest, 0, batches=2)
    manifest.close()
    entry = manifest.data["samples"]["3"]
    lines = [
        json.dumps({"idx": "3", "entry": entry}),  # already in manifest.json (a crash before the journal went)
        json.dumps({"idx": "50", "entry": {"file": "data_50.pt"}}),  # no sha256: not a complete record
        json.dumps({"idx": "51", "entry": {"file": "data_51.pt", "num_tokens": 1, "sha256": "0" * 64}}),
    ]
    (tmp_path / JOURNAL).write_text("\n".join(lines) + "\n")
    again = _open(tmp_path)
    assert again.replayed == 1 and again.data["samples"]["3"] == entry
    assert set(map(int, again.data["samples"])) == set(range(8)), "nothing after the damaged line is taken"


def test_failures_and_provenance_changes_rewrite_at_once(tmp_path: Path, no_timed_rewrites: None) -> None:
    manifest = _open(tmp_path)
    manifest.save()
    _record_batches(manifest, 0, batches=8)
    manifest.fail([40], "boom")
    manifest.save()
    saved = json.loads((tmp_path / "manifest.json").read_text())
    assert saved["failed"] == {"40": "boom"} and set(map(int, saved["samples"])) == set(range(32))
    manifest.record(40, "data_40.pt", 3, "f" * 64)  # the failed sample done on a rerun: no longer failed
    manifest.save()
    assert json.loads((tmp_path / "manifest.json").read_text())["failed"] == {}


def test_without_the_journal_every_save_rewrites_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(manifest_module.JOURNAL_ENV, "0")
    manifest = _open(tmp_path)
    for batch in range(6):
        _record_batches(manifest, batch * 4, batches=1)
        assert _listed(tmp_path) == set(range((batch + 1) * 4)) and not (tmp_path / JOURNAL).exists()
    assert manifest.rewrites == 6
