"""``spec-compat extract --replicas N`` on a local Ray with real vLLM: the files of a single-process
run (same bytes), HF's hidden states in --format speculators-hs, replicas whose vLLM worker is killed,
an interrupted job."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_constants import LAYER_IDS, MAX_MODEL_LEN

from engine_harness import CellPool, model_dir, process_group_gone, require_speculators
from tiny_models import hf_layer_outputs

pytest.importorskip("ray")
pytestmark = pytest.mark.engine
LAYERS = list(LAYER_IDS)
SAMPLES = 240  # batches of 4: a few seconds of work for one replica, so a kill lands mid-run
READY = re.compile(r"replica (\d) ready on \S+ \(pid \d+, vLLM workers ([\d ]+),")


def _dataset(path: Path) -> Path:
    rng = random.Random(7)
    with path.open("w") as handle:
        for _ in range(SAMPLES):
            handle.write(json.dumps({"input_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(1, 90))]}) + "\n")
    return path


def _command(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "spec_compat", "extract", "--model", str(model_dir("dense")), "--input", str(data),
        "--output", str(out), "--layer-ids", ",".join(map(str, LAYERS)), "--max-model-len", str(MAX_MODEL_LEN),
        "--dtype", "float32", "--save-dtype", "float32", "--batch-size", "4", *extra,
    ]  # fmt: skip


def _env(one_core: str | None = None) -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(require_speculators("0.4.0.1")), os.environ.get("PYTHONPATH")])),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        RAY_USAGE_STATS_ENABLED="0",
    )
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # replicas: one core each (the driver binds them)
    if one_core:  # the one thread each of 2 replicas gets here: same threads, same sums, same bytes
        env["VLLM_CPU_OMP_THREADS_BIND"] = one_core
    return env


def _run(cmd: list[str], one_core: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=_env(one_core), capture_output=True, text=True, timeout=600)


def _listed(out: Path) -> dict[str, dict[str, object]]:
    """The manifest's samples, each file checked against its sha256; no replica's file left over."""
    samples: dict[str, dict[str, object]] = json.loads((out / "manifest.json").read_text())["samples"]
    for key, entry in samples.items():
        digest = hashlib.sha256((out / str(entry["file"])).read_bytes()).hexdigest()
        assert digest == entry["sha256"], f"sample {key} is listed but its file is not complete"
    assert not (out / ".spec-compat-replicas").exists() and not list(out.glob("*.tmp"))
    return samples


def _exactly_once(out: Path, reference: Path) -> None:
    """Every sample once, each file the single-process run's file byte for byte."""
    listed, expected = _listed(out), _listed(reference)
    assert sorted(map(int, listed)) == list(range(SAMPLES))
    assert sorted(p.name for p in out.glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(SAMPLES))
    different = [k for k in expected if listed[k]["sha256"] != expected[k]["sha256"]]
    assert not different, f"files differ from the single-process run's: {different[:10]}"


@dataclass(frozen=True)
class SingleProcess:
    """The dataset and a single-process extract of it (no Ray), in the job's directory (a pool job:
    one core); (data, output, process)."""

    name = "ray-extract-single-process-reference"
    cores = 1

    def run(self, work: Path, core: str | None) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
        data = _dataset(work / "data.jsonl")
        out = work / "single"
        return data, out, _run(_command(data, out), one_core=core or "0")


SINGLE = SingleProcess()


@pytest.fixture(scope="module")
def reference(engine_cells: CellPool) -> tuple[Path, Path]:
    """The dataset and a single-process extract of it (no Ray)."""
    data, out, proc = engine_cells.result(SINGLE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return data, out


def _speculators_hs_run(work: Path, data: Path) -> dict[str, Any]:
    out = work / "replicas"
    return {"out": out, "proc": _run(_command(data, out, "--replicas", "2", "--format", "speculators-hs"))}


def _killed_workers_run(work: Path, data: Path) -> dict[str, Any]:
    """Each replica's vLLM worker is SIGKILLed as soon as the replica is ready (the first of each slot:
    on a loaded machine the other may still be loading when the work is done)."""
    out, log = work / "faults", work / "faults.log"
    with log.open("w") as handle:
        proc = subprocess.Popen(_command(data, out, "--replicas", "2"), env=_env(), stdout=handle, stderr=handle,
                                text=True, start_new_session=True)  # fmt: skip
    killed: dict[str, int] = {}
    try:
        until = time.monotonic() + 500
        while proc.poll() is None and time.monotonic() < until:
            for replica, pids in READY.findall(log.read_text()):
                if replica not in killed:
                    killed[replica] = int(pids.split()[0])
                    with contextlib.suppress(ProcessLookupError):  # the job ended meanwhile
                        os.kill(killed[replica], signal.SIGKILL)
            time.sleep(0.05)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return {
        "out": out, "returncode": proc.returncode, "stderr": log.read_text(), "killed": killed,
        "group_gone": process_group_gone(proc.pid),
    }  # fmt: skip


def _interrupted_run(work: Path, data: Path) -> dict[str, Any]:
    """SIGINT once manifest.json lists >= 8 samples; then the samples kept (with their files' times)
    and a rerun with one replica into the same folder."""
    out, log = work / "interrupted", work / "interrupted.log"
    with log.open("w") as handle:
        proc = subprocess.Popen(_command(data, out, "--replicas", "2"), env=_env(), stdout=handle, stderr=handle,
                                text=True, start_new_session=True)  # fmt: skip
    try:
        until = time.monotonic() + 400
        manifest = out / "manifest.json"
        while not (manifest.exists() and len(json.loads(manifest.read_text())["samples"]) >= 8):
            _watch(proc, log, until)
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        to_exit = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    record: dict[str, Any] = {
        "out": out, "returncode": proc.returncode, "stderr": log.read_text(), "to_exit": to_exit,
        "group_gone": process_group_gone(proc.pid),
    }  # fmt: skip
    if proc.returncode == 128 + signal.SIGINT:
        kept = record["kept"] = _listed(out)
        record["mtimes"] = {k: (out / str(v["file"])).stat().st_mtime_ns for k, v in kept.items()}
        record["rerun"] = _run(_command(data, out, "--replicas", "1"), one_core="0")  # a user's binding is kept
    return record


RUNS = {"speculators-hs": _speculators_hs_run, "killed-workers": _killed_workers_run, "interrupted": _interrupted_run}


@dataclass(frozen=True)
class RayRuns:
    """The runs with ``--replicas`` (``RUNS``) one after another, so that one Ray runs at a time on the
    machine, on the reference's dataset (written again here: it is seeded); each run's record, or the
    error that stopped it, as a Future. A two-core pool job: its replicas take a core each, and what the
    tests check is files, exits and messages."""

    name = "ray-runs"
    cores = 2
    seconds_alone = 135  # three extracts of two replicas, each with its own Ray (2-core machine)

    def run(self, work: Path, core: str | None) -> dict[str, Future[dict[str, Any]]]:
        data = _dataset(work / "data.jsonl")
        records: dict[str, Future[dict[str, Any]]] = {}
        for label, fn in RUNS.items():
            records[label] = Future()
            (work / label).mkdir()
            try:
                records[label].set_result(fn(work / label, data))
            except Exception as exc:  # noqa: BLE001 - raised again in the test that reads this run
                records[label].set_exception(exc)
        return records


RAY = RayRuns()


def _ray_run(pool: CellPool, label: str) -> dict[str, Any]:
    return pool.result(RAY)[label].result()


@pytest.mark.reads(SINGLE, RAY)
def test_two_replicas_write_speculators_hs_with_the_single_process_states_and_hf_states(
    reference: tuple[Path, Path], engine_cells: CellPool
) -> None:
    """--format speculators-hs through two replicas: the dataset lists every line, each hs file holds the
    single-process speculators-v1 run's tokens and states (the same threads and batches: bitwise), and
    those are HF's. The other tests here check the replicas' speculators-v1 files byte for byte."""
    import datasets
    from safetensors.torch import load_file

    data, single = reference
    record = _ray_run(engine_cells, "speculators-hs")
    out, proc = record["out"], record["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"0 done, {SAMPLES} to do" in proc.stderr and "Traceback" not in proc.stderr
    listed = _listed(out)
    assert sorted(map(int, listed)) == list(range(SAMPLES))
    rows = {int(k): int(Path(str(v["file"])).stem.removeprefix("hs_")) for k, v in listed.items()}
    assert rows == {idx: idx for idx in range(SAMPLES)}  # no blank line: row = line number
    assert sorted(p.name for p in (out / "hidden_states").glob("hs_*.safetensors")) == sorted(
        f"hs_{i}.safetensors" for i in range(SAMPLES)
    )
    assert not list(out.glob("data_*.pt"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["provenance"]["format"] == "speculators-hs"
    assert "request-kwargs" in manifest["provenance"]["adapters_applied"]  # applied in the replicas
    assert manifest["runs"][-1]["replicas"] == 2
    stats = json.loads((out / "extract_stats.json").read_text())
    assert [r["replica"] for r in stats["replicas"]] == [0, 1]
    assert sum(r["samples"] for r in stats["replicas"]) == SAMPLES and stats["batches"] == SAMPLES // 4
    assert re.search(r"replica 0 \(\S+\): \d+ batches, \d+ samples", proc.stderr) or "replica 0: ran no batch" in (
        proc.stderr
    )
    lines = [json.loads(line)["input_ids"] for line in data.read_text().splitlines()]
    index = datasets.load_from_disk(str(out)).with_format(None)  # saved in torch format; compare as lists
    assert index["input_ids"] == lines and index["seq_len"] == [len(ids) for ids in lines]
    order = sorted(range(len(LAYERS)), key=LAYERS.__getitem__)  # an hs file's layers: ascending ids
    want = hf_layer_outputs(model_dir("dense"), lines, LAYERS)
    for idx in range(SAMPLES):
        saved = load_file(str(out / "hidden_states" / f"hs_{idx}.safetensors"))
        v1 = torch.load(single / f"data_{idx}.pt", weights_only=True)
        assert saved["token_ids"].tolist() == lines[idx] == v1["input_ids"].tolist()
        assert saved["hidden_states"].shape == (len(lines[idx]), len(LAYERS), v1["hidden_states"][0].shape[-1])
        for position, k in enumerate(order):
            got = saved["hidden_states"][:, position]
            assert torch.equal(got, v1["hidden_states"][k]), (idx, LAYERS[k])
            assert torch.allclose(got, want[idx][k], atol=2e-3, rtol=1e-3), (
                idx,
                float((got - want[idx][k]).abs().max()),
            )


def _watch(proc: subprocess.Popen[str], log: Path, until: float) -> str:
    text = log.read_text() if log.exists() else ""
    if proc.poll() is not None or time.monotonic() > until:
        raise AssertionError(f"exited ({proc.returncode}) or timed out before the event:\n{text[-4000:]}")
    return text


@pytest.mark.reads(SINGLE, RAY)
def test_killed_vllm_workers_replicas_restart_and_every_sample_is_written_once(
    reference: tuple[Path, Path], engine_cells: CellPool
) -> None:
    """Each replica's vLLM worker is SIGKILLed as soon as the replica is ready (``_killed_workers_run``):
    the batches it held go back to the queue, a new replica takes over."""
    _, single = reference
    record = _ray_run(engine_cells, "killed-workers")
    out, killed, stderr = record["out"], record["killed"], record["stderr"]
    assert record["returncode"] == 0, stderr[-4000:]
    assert killed, stderr[-4000:]
    # the first replica ready had batches for certain; a later one may have found the queue empty
    first = next(iter(killed))
    for replica, pid in killed.items():
        if replica != first and f"replica {replica} lost" not in stderr:
            continue
        assert re.search(
            rf"replica {replica} lost \(WorkerError: WorkerProcessDied: worker process rank 0 \(pid {pid}\) "
            r"killed by signal 9 \(SIGKILL\).*starting a new replica",
            stderr,
        ), stderr[-4000:]
    _exactly_once(out, single)
    stats = json.loads((out / "extract_stats.json").read_text())
    assert stats["replicas"][int(first)]["restarts"] == 1
    assert sum(r["samples"] for r in stats["replicas"]) == SAMPLES
    assert record["group_gone"], "a process of the job outlived it"
    print(f"killed workers {killed}; per replica: {[(r['batches'], r['engine_start_s']) for r in stats['replicas']]}")


@pytest.mark.reads(SINGLE, RAY)
def test_interrupted_job_stops_cleanly_and_a_rerun_finishes_the_rest(
    reference: tuple[Path, Path], engine_cells: CellPool
) -> None:
    _, single = reference
    record = _ray_run(engine_cells, "interrupted")
    out, stderr = record["out"], record["stderr"]
    assert record["returncode"] == 128 + signal.SIGINT, stderr[-4000:]
    assert "interrupted by SIGINT" in stderr and "Traceback" not in stderr, stderr[-4000:]
    assert record["group_gone"], "a replica or vLLM worker outlived the interrupted job"
    kept, mtimes = record["kept"], record["mtimes"]
    assert 8 <= len(kept) < SAMPLES
    print(f"SIGINT: exited {record['to_exit']:.1f} s after the signal, {len(kept)} complete samples kept")
    rerun = record["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert f"{len(kept)} done, {SAMPLES - len(kept)} to do" in rerun.stderr
    _exactly_once(out, single)
    assert all((out / f"data_{k}.pt").stat().st_mtime_ns == m for k, m in mtimes.items())


@pytest.mark.reads(SINGLE)
def test_without_ray_installed_the_error_is_one_line(reference: tuple[Path, Path], tmp_path: Path) -> None:
    data, _ = reference
    shadow = tmp_path / "no_ray"
    (shadow / "ray").mkdir(parents=True)
    (shadow / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    proc = subprocess.run(_command(data, tmp_path / "out", "--replicas", "2"), env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "spec-compat extract: error: --replicas needs Ray, which is not installed: "
        "pip install 'spec-compat[ray]' (or: pip install ray)"
    ]
    assert not (tmp_path / "out").exists()
