"""``spec_compat.extract.distributed.Job`` against a fake Ray (no engine): queue, retries, halves, exactly once."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from spec_compat.extract import ExtractConfig, Manifest, Sample
from spec_compat.extract.distributed import TMP_DIR, Job, cpu_binding


class Ref:
    counter = itertools.count()

    def __init__(self, call: Any) -> None:
        self.id = next(self.counter)
        self.call = call


class Method:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> Ref:
        return Ref(lambda: getattr(self.actor, self.name)(*args))


class FakeActor:
    """A replica: ``poison`` samples take its engine down; the others are written as 8-byte files."""

    def __init__(self, ray: FakeRay, config: ExtractConfig, slot: int, bind: str | None) -> None:
        self.ray, self.config, self.slot, self.lost = ray, config, slot, False
        self.info = Method(self, "_info")
        self.run_batch = Method(self, "_run_batch")
        self.shutdown = Method(self, "_shutdown")

    def _info(self) -> dict[str, Any]:
        return {"error": None, "host": "h", "pid": 1, "worker_pids": [2], "gpus": None, "cpu_bind": None,
                "max_num_seqs": 4, "engine_start_s": 0.0, "environment": {}, "applied": ["x"]}  # fmt: skip

    def _run_batch(self, batch: int, attempt: int, samples: list[Sample]) -> dict[str, Any]:
        if self.lost or any(s.idx in self.ray.poison for s in samples):
            ran, self.lost = not self.lost, True
            return {"lost": "WorkerError: WorkerProcessDied", "ran": ran}
        directory = self.config.output / TMP_DIR / f"{batch}-{attempt}"
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for s in samples:
            blob = bytes(8 * [s.idx % 256])
            (directory / f"data_{s.idx}.pt.tmp").write_bytes(blob)
            written.append((s.idx, f"{TMP_DIR}/{batch}-{attempt}/data_{s.idx}.pt.tmp", len(s.input_ids),
                            hashlib.sha256(blob).hexdigest(), len(blob)))  # fmt: skip
        self.ray.batches.append([s.idx for s in samples])
        return {"written": written, "failed": [], "generate_s": 0.0}

    def _shutdown(self) -> None:
        pass


class ActorClass:
    def __init__(self, ray: FakeRay) -> None:
        self.ray = ray

    def options(self, **kwargs: Any) -> ActorClass:
        return self

    def remote(self, config: ExtractConfig, slot: int, bind: str | None) -> FakeActor:
        self.ray.started.append(slot)
        return FakeActor(self.ray, config, slot, bind)


class FakeRay:
    def __init__(self, poison: set[int]) -> None:
        self.poison = poison
        self.started: list[int] = []
        self.killed = 0
        self.batches: list[list[int]] = []

    def remote(self, cls: Any) -> ActorClass:
        return ActorClass(self)

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 8.0}

    def wait(self, refs: list[Ref], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Ref], list[Ref]]:
        first = min(refs, key=lambda r: r.id)
        return [first], [r for r in refs if r is not first]

    def get(self, ref: Ref) -> Any:
        return ref.call()

    def kill(self, actor: FakeActor, no_restart: bool = True) -> None:
        self.killed += 1


def _job(tmp_path: Path, poison: set[int], samples: int = 12, on_error: str = "skip") -> tuple[Job, FakeRay]:
    config = ExtractConfig(model="m", input=tmp_path / "in.jsonl", output=tmp_path / "out", layer_ids=[0],
                           batch_size=4, on_error=on_error, fsync=False)  # fmt: skip
    config.output.mkdir()
    todo = [Sample(i, [1] * (i + 1)) for i in range(samples)]
    manifest = Manifest(config.output, {"format": "f", "model": "m", "layer_ids": [0], "run": {}})
    ray = FakeRay(poison)
    return Job(ray, config, manifest, todo, 2, 2, local=False, new_manifest=True), ray


def test_every_sample_is_recorded_once_and_files_get_their_final_names(tmp_path: Path) -> None:
    job, ray = _job(tmp_path, poison=set())
    job.run()
    job.manifest.close()  # as run_distributed does at the end: manifest.json and sample_lengths.json complete
    assert not (job.config.output / "manifest.json.journal").exists()
    listed = job.manifest.data["samples"]
    assert sorted(map(int, listed)) == list(range(12)) and job.failures == 0
    assert sorted(i for batch in ray.batches for i in batch) == list(range(12))  # each sample ran once
    assert sorted(p.name for p in job.config.output.glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(12))
    assert not any((job.config.output / TMP_DIR).rglob("*.tmp"))
    assert job.manifest.data["provenance"]["adapters_applied"] == ["x"]  # from the replicas
    lengths = json.loads((job.config.output / "sample_lengths.json").read_text())
    assert lengths == {str(i): i + 1 for i in range(12)}


def test_a_sample_that_kills_engines_is_retried_a_bounded_number_of_times_then_failed(tmp_path: Path) -> None:
    job, ray = _job(tmp_path, poison={5})
    job.run()
    assert sorted(map(int, job.manifest.data["samples"])) == [i for i in range(12) if i != 5]
    assert list(job.manifest.data["failed"]) == ["5"] and job.failures == 1
    assert "an engine died while running it, 3 times" in job.manifest.data["failed"]["5"]
    # batch [4..7]: 3 deaths (the first run, 2 retries), then halves [4, 5] (1 death), then [5] (1 death)
    assert sum(s.restarts for s in job.slots) == 5
    assert [4] in ray.batches and [6, 7] in ray.batches


def test_on_error_stop_stops_after_the_failed_sample(tmp_path: Path) -> None:
    job, _ = _job(tmp_path, poison={0}, samples=40, on_error="stop")
    job.run()
    assert job.stopping and list(job.manifest.data["failed"]) == ["0"]
    assert len(job.manifest.data["samples"]) < 39


@pytest.mark.parametrize(
    ("slot", "tp", "replicas", "cpus", "expected"),
    [(0, 1, 2, 2, "0"), (1, 1, 2, 2, "1"), (0, 1, 1, 2, "0-1"), (1, 2, 2, 16, "8-11|12-15"), (1, 1, 4, 2, "1")],
)
def test_cpu_binding_splits_the_cores(slot: int, tp: int, replicas: int, cpus: int, expected: str) -> None:
    assert cpu_binding(slot, tp, replicas, cpus) == expected


def test_speculators_hs_files_get_their_row_names_from_the_driver(tmp_path: Path) -> None:
    """The driver names each replica's file as the single-process run does: hidden_states/hs_{row}, by the
    sample's row (here idx 2k: every other line of the input), and fsyncs that folder before the manifest."""
    config = ExtractConfig(model="m", input=tmp_path / "in.jsonl", output=tmp_path / "out", layer_ids=[0, 1],
                           batch_size=4, fsync=True, format="speculators-hs")  # fmt: skip
    (config.output / "hidden_states").mkdir(parents=True)
    todo = [Sample(2 * row, [1] * (row + 1), row=row) for row in range(6)]
    manifest = Manifest(config.output, {"format": "speculators-hs", "model": "m", "layer_ids": [0, 1], "run": {}})
    job = Job(FakeRay(set()), config, manifest, todo, 2, 2, local=False, new_manifest=True)
    job.run()
    listed = job.manifest.data["samples"]
    assert {k: v["file"] for k, v in listed.items()} == {
        str(2 * row): f"hidden_states/hs_{row}.safetensors" for row in range(6)
    }
    assert sorted(p.name for p in (config.output / "hidden_states").iterdir()) == sorted(
        f"hs_{row}.safetensors" for row in range(6)
    )
    assert job.bytes == 6 * 8
