"""extract's batching and background writer, without an engine."""

from __future__ import annotations

import hashlib
import json
import os
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


def test_plan_batches_cut_to_whole_parts_of_the_running_slots() -> None:
    """A batch of more samples than the generator's running slots holds a whole number of slot-sized
    parts (each part is an engine run of its own): never a short tail part inside a batch."""
    # 35 fit the token limit: the batch takes 32 (one whole part), the rest start the next one
    assert extract.plan_batches([10] * 40, max_samples=64, max_tokens=350, slots=32) == [(0, 32), (32, 40)]
    # 64 asked for and fitting: two whole parts
    assert extract.plan_batches([1] * 70, max_samples=64, max_tokens=10**6, slots=32) == [(0, 64), (64, 70)]
    # at most the slots: the token limit decides as before
    assert extract.plan_batches([10] * 7, max_samples=3, max_tokens=1000, slots=32) == [(0, 3), (3, 6), (6, 7)]
    assert extract.plan_batches([400, 400, 400, 50], max_samples=32, max_tokens=1000, slots=32) == [(0, 2), (2, 4)]
    # every sample is planned exactly once, in order
    lengths = [(i * 37) % 900 + 1 for i in range(500)]
    batches = extract.plan_batches(lengths, max_samples=100, max_tokens=30000, slots=32)
    assert [b for a in batches for b in range(*a)] == list(range(500))
    assert all(end - begin <= 32 or (end - begin) % 32 == 0 for begin, end in batches)


def test_plan_batches_tapers_the_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last ``tail`` batches' samples are replanned at a quarter of the token limit, so the run's
    end waits for small batches to be written; every sample still planned once, in order."""
    lengths = [100] * 40  # 10 batches of 4 at 400 tokens
    whole = extract.plan_batches(lengths, max_samples=64, max_tokens=400)
    assert whole == [(i, i + 4) for i in range(0, 40, 4)]
    tapered = extract.plan_batches(lengths, max_samples=64, max_tokens=400, tail=2)
    assert tapered == whole[:-2] + [(i, i + 1) for i in range(32, 40)]
    # a sample longer than the tail's limit (250 here) is still a batch of its own
    assert extract.plan_batches([500, 500, 100, 100, 100, 100, 900], 64, 1000, tail=2) == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 7),
    ]
    # too few batches to taper, or nothing smaller to make: planned as without
    assert extract.plan_batches([100] * 8, max_samples=64, max_tokens=400, tail=2) == [(0, 4), (4, 8)]
    assert extract.plan_batches([400] * 4, max_samples=64, max_tokens=400, tail=2) == [(i, i + 1) for i in range(4)]
    lengths = [(i * 37) % 900 + 1 for i in range(500)]
    batches = extract.plan_batches(lengths, max_samples=100, max_tokens=30000, slots=32, tail=2)
    assert [b for a in batches for b in range(*a)] == list(range(500))
    # the switch: SPEC_COMPAT_EXTRACT_TAPER=0 (or 1) plans no tail, N batches of 1/N, default 4
    assert extract.tail_batches(3) == 3 and extract.taper_divisor() == 4
    for off in ("0", "1"):
        monkeypatch.setenv("SPEC_COMPAT_EXTRACT_TAPER", off)
        assert extract.tail_batches(3) == 0
    monkeypatch.setenv("SPEC_COMPAT_EXTRACT_TAPER", "2")
    assert extract.tail_batches(3) == 3 and extract.taper_divisor() == 2
    halves = extract.plan_batches([100] * 40, 64, 400, tail=2, divisor=extract.taper_divisor())
    assert halves == whole[:-2] + [(i, i + 2) for i in range(32, 40, 2)]
    monkeypatch.setenv("SPEC_COMPAT_EXTRACT_TAPER", "half")
    with pytest.raises(ValueError, match="SPEC_COMPAT_EXTRACT_TAPER='half': want a whole number"):
        extract.tail_batches(3)


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
        # either way: at most pending + 1 batches unrecorded, pending batches' bytes unwritten
        assert len(writer.in_flight) <= 3 and writer.unwritten <= 2 * writer.largest_batch
    writer.close()
    assert writer.unwritten == 0
    saved = json.loads((tmp_path / "manifest.json").read_text())["samples"]
    assert sorted(map(int, saved)) == list(range(10))
    for key, entry in saved.items():
        blob = (tmp_path / entry["file"]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == entry["sha256"]
        loaded = torch.load(tmp_path / entry["file"], weights_only=True)
        assert float(loaded["hidden_states"][0][0, 0]) == int(key) // 2 and entry["num_tokens"] == 3 + int(key) % 2
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("by_bytes", [True, False])
def test_the_next_batch_waits_for_bytes_not_for_the_oldest_batchs_last_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by_bytes: bool
) -> None:
    """Room by bytes (SPEC_COMPAT_WRITER_BYTE_WINDOW=1): with one file of the oldest batch still being
    written, the next batch is handed over as soon as the bytes allow, and the one after waits (pending
    + 1 batches unrecorded). By whole batches (the default) the loop waits for the oldest to be recorded."""
    import threading

    monkeypatch.setenv("SPEC_COMPAT_WRITER_BYTE_WINDOW", "1" if by_bytes else "0")
    slow_may_finish = threading.Event()
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if float(obj["hidden_states"][0][0, 0]) == 9.0:
            assert slow_may_finish.wait(60)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    writer = extract.BackgroundWriter(tmp_path, _manifest(tmp_path), threads=3, pending=2)
    writer.submit([(0, _payload(4, 9.0)), (1, _payload(4, 0.0))])  # sample 0's file waits for the event
    writer.submit([(2, _payload(4, 0.0)), (3, _payload(4, 0.0))])

    def handed_over(first: int, expected: bool) -> threading.Thread:
        thread = threading.Thread(
            target=writer.submit, args=([(first, _payload(4, 0.0)), (first + 1, _payload(4, 0.0))],)
        )
        thread.start()
        thread.join(timeout=30.0 if expected else 1.0)
        return thread

    third = handed_over(4, expected=by_bytes)
    if by_bytes:
        assert not third.is_alive(), "the third batch fits the bytes: handed over while sample 0 is written"
        fourth = handed_over(6, expected=False)
        assert fourth.is_alive(), "pending + 1 batches unrecorded: the fourth waits"
    else:
        assert third.is_alive(), "two batches unrecorded: the third waits for the oldest"
        fourth = third
    assert not slow_may_finish.is_set()
    slow_may_finish.set()
    fourth.join(timeout=60)
    assert not fourth.is_alive()
    writer.close()
    listed = json.loads((tmp_path / "manifest.json").read_text())["samples"]
    assert sorted(map(int, listed)) == list(range(8 if by_bytes else 6))
    assert writer.unwritten == 0


def test_batches_are_recorded_off_the_callers_thread_without_it_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine loop submits and goes on: the directory fsync and the manifest save of a batch
    happen on the recorder thread as soon as its files are written, not when the loop next waits."""
    import threading

    saved_on: list[str] = []
    real_save = extract.Manifest.save

    def save(self: extract.Manifest, sync: bool = False) -> None:
        saved_on.append(threading.current_thread().name)
        real_save(self, sync)

    monkeypatch.setattr(extract.Manifest, "save", save)
    writer = extract.BackgroundWriter(tmp_path, _manifest(tmp_path), threads=2, pending=2)
    writer.submit([(0, _payload(3, 0.0)), (1, _payload(3, 0.0))])
    writer.in_flight[0].result(timeout=60)  # the caller never waited on the writer for it
    assert writer.wait_s == 0.0
    listed = json.loads((tmp_path / "manifest.json").read_text())["samples"]
    assert sorted(map(int, listed)) == [0, 1]
    assert saved_on and all(name.startswith("spec-compat-recorder") for name in saved_on)
    writer.close()


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


def test_direct_io_files_equal_buffered_ones_and_leave_nothing_staged(tmp_path: Path) -> None:
    """O_DIRECT from /dev/shm (padded to a block, truncated back): the same bytes, sha256 and tensors as
    torch.save to the file itself; the staged copy is gone."""
    staging = extract.direct_io_staging(tmp_path)
    if staging is None:
        pytest.skip("no O_DIRECT on the test's file system")
    payload = _payload(1000, 0.25)  # 32 kB of states plus the zip: not a multiple of the block
    buffered, direct = tmp_path / "buffered", tmp_path / "direct"
    buffered.mkdir()
    direct.mkdir()
    name, tokens, digest = extract.write_sample(buffered, 3, payload)
    name_d, tokens_d, digest_d = extract.write_sample(direct, 3, payload, staging=staging)
    assert (name_d, tokens_d, digest_d) == (name, tokens, digest)
    blob = (direct / name).read_bytes()
    assert blob == (buffered / name).read_bytes() and len(blob) % extract.DIRECT_ALIGN
    assert hashlib.sha256(blob).hexdigest() == digest
    assert torch.equal(torch.load(direct / name)["hidden_states"][0], payload["hidden_states"][0])
    assert not list(staging.glob(f"spec-compat-{os.getpid()}-*"))
    assert sorted(p.name for p in direct.iterdir()) == [name]


def test_a_staging_area_that_cannot_take_the_file_falls_back_to_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    real_save = torch.save

    def full_staging(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if Path(f).parent == staging:
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_staging)
    name, _, digest = extract.write_sample(tmp_path, 0, _payload(8, 2.0), staging=staging)
    assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest
    assert not list(staging.iterdir())


def test_a_file_system_refusing_unaligned_direct_writes_gets_the_bytes_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL on an O_DIRECT write (the open took the flag): the rest is written without it."""
    import errno
    import fcntl

    staging = extract.direct_io_staging(tmp_path)
    if staging is None:
        pytest.skip("no O_DIRECT on the test's file system")
    real_write = os.write
    refused: list[int] = []

    def refuse_direct(fd: int, data: Any) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(extract.os, "write", refuse_direct)
    payload = _payload(300, 1.0)
    name, _, digest = extract.write_sample(tmp_path, 1, payload, staging=staging)
    assert refused, "the O_DIRECT write was tried"
    assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest
    assert torch.equal(torch.load(tmp_path / name)["hidden_states"][0], payload["hidden_states"][0])


@pytest.mark.skipif(not hasattr(os, "getpriority") or os.uname().sysname != "Linux", reason="per-thread nice: Linux")
@pytest.mark.parametrize("nice", ["0", "10"])
def test_writer_threads_run_nicer_than_the_engine_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nice: str
) -> None:
    """The files are written by threads SPEC_COMPAT_WRITER_NICE nicer than the caller (the engine
    loop), which keeps its own priority; the files are the same either way."""
    import threading

    monkeypatch.setenv("SPEC_COMPAT_WRITER_NICE", nice)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []
    real_save = torch.save

    def save_noting_priority(obj: Any, path: Any) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        real_save(obj, path)

    monkeypatch.setattr(torch, "save", save_noting_priority)
    writer = extract.BackgroundWriter(tmp_path, _manifest(tmp_path), threads=2, pending=1)
    writer.submit([(i, _payload(4, float(i))) for i in range(4)])
    writer.close()
    assert seen and set(seen) == {min(19, own + int(nice))}, seen
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    assert writer.nice == int(nice)
    loaded = torch.load(tmp_path / "data_3.pt")
    assert torch.equal(loaded["hidden_states"][0], torch.full((4, 8), 3.0))


@pytest.mark.parametrize(("early", "sync", "kicked"), [("1", True, True), ("0", True, False), ("1", False, False)])
def test_a_synced_file_is_handed_to_the_disk_before_it_is_read_back_for_its_sha256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, early: str, sync: bool, kicked: bool
) -> None:
    """With fsync on (and SPEC_COMPAT_EARLY_WRITEBACK not "0"), the whole written file is handed to
    sync_file_range(SYNC_FILE_RANGE_WRITE) before the read-back; the file and its sha256 are the same."""
    from spec_compat.extract import files

    monkeypatch.setenv("SPEC_COMPAT_EARLY_WRITEBACK", early)
    handed: list[tuple[int, int, int, int]] = []

    def recording_sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> int:
        handed.append((os.fstat(fd).st_size, offset, nbytes, flags))
        return 0

    monkeypatch.setattr(files, "_sync_file_range", recording_sync_file_range)
    reads: list[int] = []
    real_sha256 = hashlib.sha256

    class NotingSha256:
        """hashlib's sha256, noting at each update how many files had been handed to the disk."""

        def __init__(self) -> None:
            self.real = real_sha256()

        def update(self, data: Any) -> None:
            reads.append(len(handed))
            self.real.update(data)

        def hexdigest(self) -> str:
            return self.real.hexdigest()

    def sha256_noting_when() -> NotingSha256:
        return NotingSha256()

    monkeypatch.setattr(files.hashlib, "sha256", sha256_noting_when)
    payload = _payload(64, 2.0)
    name, _, digest = extract.write_sample(tmp_path, 5, payload, sync=sync)
    monkeypatch.undo()
    size = (tmp_path / name).stat().st_size
    assert handed == ([(size, 0, 0, 2)] if kicked else [])
    assert reads and set(reads) == {len(handed)}, "handed to the disk before the read-back began"
    assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest
    assert torch.equal(torch.load(tmp_path / name)["hidden_states"][0], payload["hidden_states"][0])


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="sync_file_range: Linux")
def test_libcs_sync_file_range_is_found_and_takes_a_written_file(tmp_path: Path) -> None:
    from spec_compat.extract import files

    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert files.start_writeback(fd)
    finally:
        os.close(fd)
