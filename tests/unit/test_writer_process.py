"""extract's ``--writer process`` without an engine: states handed over through the real transfer (one
process playing worker and driver), files written by the writer process, compared byte for byte with
the writer threads' files; samples outside segments on the driver's threads; a dead process fails
loudly; a killed driver's process stops."""

from __future__ import annotations

import gc
import hashlib
import io
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from spec_compat import extract
from spec_compat.adapters import handover, transfer
from spec_compat.extract.formats.hs import SpeculatorsHs
from spec_compat.extract.formats.v1 import SpeculatorsV1
from spec_compat.extract.writer import BackgroundWriter
from spec_compat.extract.writer_process import RawTensor, WriterProcess, raw_tensors, rebuilt

ROWS = (7, 33, 1, 20)
LAYERS = 3


@pytest.fixture
def directory(tmp_path: Path) -> str:
    path = tmp_path / f"{transfer.DIR_PREFIX}{os.getpid()}-test"
    path.mkdir()
    return str(path)


def handed_over(pool: transfer.SegmentPool, mappings: transfer.DriverMappings, dtype: torch.dtype) -> list[Any]:
    """One reply through the transfer, cloned as speculators 0.4.x does: per request, its layers' states."""
    generator = torch.Generator().manual_seed(3)
    sent = {
        f"req_{i}": [torch.randn(rows, 16, generator=generator).to(dtype) for _ in range(LAYERS)]
        for i, rows in enumerate(ROWS)
    }
    packed = transfer.pack(sent, pool)
    assert isinstance(packed, transfer.SharedStates)
    reply = mappings.open(packed, handover.as_clone_sources)
    return [[h.clone().cpu() for h in reply[key]] for key in sorted(reply)]


def payloads(states: list[list[torch.Tensor]]) -> list[tuple[int, dict[str, Any]]]:
    return [
        (idx, {
            "input_ids": torch.arange(len(layers[0]), dtype=torch.long),
            "hidden_states": layers,
            "loss_mask": torch.ones(len(layers[0]), dtype=torch.long),
        })
        for idx, layers in enumerate(states)
    ]  # fmt: skip


def manifest_of(out: Path) -> extract.Manifest:
    return extract.Manifest(out, {"model": "m", "layer_ids": [1], "format": extract.FORMAT, "run": {}})


def write(out: Path, fmt: Any, samples: list[tuple[int, dict[str, Any]]], locate: Any, process: bool) -> dict[str, str]:
    """Every file the writer leaves in ``out`` (by name) with its sha256, and the manifest's record of each."""
    (out / "hidden_states").mkdir(parents=True)  # speculators-hs's folder (its ``prepare``)
    manifest = manifest_of(out)
    writer_process = WriterProcess(out, fmt, 2, True, None, False, 0) if process else None
    writer = BackgroundWriter(out, manifest, 2, 2, fmt=fmt, process=writer_process)
    writer.locate = locate
    for start in range(0, len(samples), 2):
        writer.submit(samples[start : start + 2])
    writer.close()
    if writer_process is not None:
        assert writer_process.samples == len(samples), "every sample in a segment goes to the process"
        writer_process.close()  # again, as extract does after an interruption: nothing happens
    files = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    listed = {entry["file"]: entry["sha256"] for entry in manifest.data["samples"].values()}
    assert listed and all(files[name] == digest for name, digest in listed.items())
    return {name: digest for name, digest in files.items() if name in listed}


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [(SpeculatorsV1(), torch.bfloat16), (SpeculatorsV1(), torch.float32), (SpeculatorsV1(fp8=True), torch.bfloat16),
     (SpeculatorsHs(layer_ids=[4, 1, 2]), torch.bfloat16)],
    ids=["v1-bf16", "v1-f32", "v1-fp8", "hs-bf16"],
)  # fmt: skip
def test_the_process_writes_the_threads_files_byte_for_byte(
    directory: str, tmp_path: Path, fmt: Any, dtype: torch.dtype
) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    samples = payloads(handed_over(pool, mappings, dtype))
    assert all(mappings.locate(h) is not None for _, p in samples for h in p["hidden_states"])
    by_threads = write(tmp_path / "threads", fmt, samples, mappings.locate, process=False)
    by_process = write(tmp_path / "process", fmt, samples, mappings.locate, process=True)
    assert by_process == by_threads and len(by_process) == len(ROWS)
    # once the caller drops them, nothing keeps the segment from the worker: the process released it too
    del samples
    gc.collect()
    assert mappings.held_bytes == 0 and not any(s.leased() for s in pool.segments)
    pool.close()


def test_tensors_that_are_not_exactly_a_segments_bytes_are_not_located(directory: str) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    states = handed_over(pool, mappings, torch.float32)
    located = mappings.locate(states[1][0])
    assert located is not None and located.path == pool.segments[0].path and located.shape == (33, 16)
    assert mappings.locate(states[1][0][2:5]) is None  # a view: its storage is more than its bytes
    assert mappings.locate(states[1][0].to(torch.bfloat16)) is None  # a cast: not in the segment
    assert mappings.locate(torch.zeros(4)) is None
    pool.close()


def test_samples_outside_segments_are_written_on_the_drivers_threads(directory: str, tmp_path: Path) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    samples = payloads(handed_over(pool, mappings, torch.float32))
    copied = [(idx + 10, {**p, "hidden_states": [h.clone() for h in p["hidden_states"]]}) for idx, p in samples[:2]]
    out = tmp_path / "mixed"
    out.mkdir()
    process = WriterProcess(out, SpeculatorsV1(), 2, False, None, False, 0)
    writer = BackgroundWriter(out, manifest_of(out), 2, 2, sync=False, process=process)
    writer.locate = mappings.locate
    writer.submit(samples + copied)
    writer.close()
    assert process.samples == len(samples) and writer.written_samples == len(samples) + 2
    for idx, payload in copied:
        loaded = torch.load(out / f"data_{idx}.pt")
        assert all(torch.equal(a, b) for a, b in zip(loaded["hidden_states"], payload["hidden_states"], strict=True))
    pool.close()


def test_a_dead_writer_process_fails_the_files_loudly_and_keeps_the_written_ones(
    directory: str, tmp_path: Path
) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    samples = payloads(handed_over(pool, mappings, torch.float32))
    out = tmp_path / "out"
    out.mkdir()
    manifest = manifest_of(out)
    process = WriterProcess(out, SpeculatorsV1(), 2, False, None, False, 0)
    writer = BackgroundWriter(out, manifest, 2, 2, sync=False, process=process)
    writer.locate = mappings.locate
    writer.submit(samples[:2])
    writer.drain()
    process.process.kill()
    assert process.ended.wait(30)
    writer.submit(samples[2:])
    with pytest.raises(extract.WriteFailed, match=r"writer process ended \(exit code -9\)"):
        writer.close()
    assert sorted(manifest.data["samples"]) == ["0", "1"]
    pool.close()


def test_a_write_failing_in_the_process_names_the_file(directory: str, tmp_path: Path) -> None:
    pool, mappings = transfer.SegmentPool(directory, "w"), transfer.DriverMappings(directory)
    samples = payloads(handed_over(pool, mappings, torch.float32))
    out = tmp_path / "gone"
    out.mkdir()
    process = WriterProcess(out, SpeculatorsV1(), 1, False, None, False, 0)
    writer = BackgroundWriter(out, manifest_of(out), 1, 2, sync=False, process=process)
    writer.locate = mappings.locate
    os.rmdir(out)
    writer.submit(samples[:1])
    with pytest.raises(extract.WriteFailed, match=r"cannot write .*gone/data_0\.pt"):
        writer.drain()
    writer.pool.shutdown()
    process.close()
    pool.close()


def test_the_writer_process_stops_when_its_driver_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from spec_compat.extract.formats.v1 import SpeculatorsV1
        from spec_compat.extract.writer_process import WriterProcess
        process = WriterProcess(Path({str(tmp_path)!r}), SpeculatorsV1(), 2, False, None, False, 0)
        print(process.process.pid, flush=True)
        time.sleep(600)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None
    child = int(driver.stdout.readline())
    # a Ctrl-C reaches the terminal's foreground process group: the driver's, not the writer's (the driver
    # decides when its writer ends, after the batches in flight)
    assert os.getpgid(child) != os.getpgid(driver.pid)
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the writer process outlived its driver"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _saved(payload: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(2000, dtype=torch.long),
        torch.arange(40, dtype=torch.long)[5:25:2],  # a strided view into a larger storage
        torch.ones(6, 4, dtype=torch.bool).t(),
        torch.zeros(0, dtype=torch.long),
    ],
    ids=["ids", "strided-view", "bool-transposed", "empty"],
)
def test_small_tensors_cross_the_pipe_as_bytes_and_save_the_same_file(tensor: torch.Tensor) -> None:
    payload = {"input_ids": tensor, "hidden_states": [torch.randn(3, 2)], "loss_mask": torch.ones(5, dtype=torch.long)}
    sent = raw_tensors({k: v for k, v in payload.items() if k != "hidden_states"}, payload["hidden_states"])
    assert isinstance(sent["input_ids"], RawTensor) and isinstance(sent["loss_mask"], RawTensor)
    back = {**{k: rebuilt(v) for k, v in pickle.loads(pickle.dumps(sent)).items()}}
    assert _saved({**payload, **back}) == _saved(payload)


def test_tensors_sharing_a_storage_or_not_plain_stay_tensors() -> None:
    base = torch.arange(10, dtype=torch.long)
    shared = {"input_ids": base[:5], "loss_mask": base[5:]}
    assert raw_tensors(shared, []) is shared
    with_grad = {"input_ids": torch.ones(3, requires_grad=True)}
    assert raw_tensors(with_grad, []) is with_grad
    state = torch.arange(6, dtype=torch.long)
    view = {"input_ids": state[:3]}
    assert raw_tensors(view, [state]) is view  # it shares a state's storage
