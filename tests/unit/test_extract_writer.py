"""extract's batching and background writer, without an engine."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.serialization

from spec_compat import extract


def test_plan_batches_by_samples_and_tokens() -> None:
    assert extract.plan_batches([10] * 7, max_samples=3, max_tokens=1000) == [(0, 3), (3, 6), (6, 7)]
    assert extract.plan_batches([400, 400, 400, 50], max_samples=32, max_tokens=1000) == [(0, 2), (2, 4)]
    assert extract.plan_batches([5000, 10, 10], max_samples=32, max_tokens=1000) == [(0, 1), (1, 3)]
    assert extract.plan_batches([], max_samples=4, max_tokens=10) == []


def _payload(n: int, value: float) -> dict[str, Any]:
    return {
        "input_ids": torch.arange(n),
        "hidden_states": [torch.full((n, 8), value)],
        "loss_mask": torch.ones(n, dtype=torch.long),
    }


def _manifest(out: Path) -> extract.Manifest:
    return extract.Manifest(out, {"model": "m", "layer_ids": [1], "format": extract.FORMAT, "run": {}})


def test_writer_records_batches_in_order_once_written(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path)
    writer = extract.BackgroundWriter(tmp_path, manifest, threads=3, pending=2)
    for batch in range(5):
        writer.submit([(batch * 2 + k, _payload(3 + k, float(batch))) for k in range(2)])
        assert len(writer.in_flight) <= 2
    writer.close()
    saved = json.loads((tmp_path / "manifest.json").read_text())["samples"]
    assert sorted(map(int, saved)) == list(range(10))
    for key, entry in saved.items():
        blob = (tmp_path / entry["file"]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == entry["sha256"]
        loaded = torch.load(tmp_path / entry["file"], weights_only=True)
        assert float(loaded["hidden_states"][0][0, 0]) == int(key) // 2 and entry["num_tokens"] == 3 + int(key) % 2
    assert not list(tmp_path.glob("*.tmp"))


def test_a_failed_write_names_the_file_and_keeps_every_complete_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = _manifest(tmp_path)
    writer = extract.BackgroundWriter(tmp_path, manifest, threads=2, pending=1)
    writer.submit([(0, _payload(2, 0.0)), (1, _payload(2, 0.0))])
    writer.drain()

    real_save = torch.save

    def full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if float(obj["hidden_states"][0][0, 0]) == 9.0:
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    writer.submit([(2, _payload(2, 1.0)), (3, _payload(2, 9.0))])
    with pytest.raises(extract.WriteFailed, match=r"cannot write .*data_3\.pt: No space left on device"):
        writer.close()
    saved = json.loads((tmp_path / "manifest.json").read_text())["samples"]
    assert sorted(map(int, saved)) == [0, 1, 2], "sample 2's file is complete: kept; sample 3 is not listed"
    assert not (tmp_path / "data_3.pt").exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_torch_writer_errors_are_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save's C++ writer fails a full disk with 'unexpected pos 576 vs 534' (no errno)."""

    def torch_writer_failure(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        Path(f).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", torch_writer_failure)
    free = 10_000
    monkeypatch.setattr(
        extract.os, "statvfs", lambda path: type("S", (), {"f_bavail": free, "f_frsize": 1, "f_flag": 0})()
    )
    with pytest.raises(extract.WriteFailed, match=r"data_7\.pt: No space left on device \(10,000 bytes free"):
        extract.write_sample(tmp_path, 7, _payload(4, 0.0))
    assert not list(tmp_path.iterdir()), "the partial temporary file is removed"


def test_files_without_zip_crc_load_equal_and_the_sha256_still_catches_a_flipped_byte(tmp_path: Path) -> None:
    import zipfile

    payload = _payload(64, 1.5)
    before = torch.utils.serialization.config.save.compute_crc32
    try:
        assert extract.disable_zip_crc32()
        name, _, digest = extract.write_sample(tmp_path, 0, payload)
    finally:
        torch.serialization.set_crc32_options(before)
    path = tmp_path / name
    assert {info.CRC for info in zipfile.ZipFile(path).infolist()} == {0}  # the pass really was skipped
    loaded = torch.load(path)
    assert torch.equal(loaded["hidden_states"][0], payload["hidden_states"][0])
    assert extract.sha256_of(path) == digest
    data = bytearray(path.read_bytes())
    data[data.find(payload["hidden_states"][0].numpy().tobytes()) + 5] ^= 0x01
    path.write_bytes(data)
    assert extract.sha256_of(path) != digest  # what a rerun checks (torch.load itself would not notice)
