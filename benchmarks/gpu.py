"""Hidden-state extraction on one GPU: the shimmed generator against vLLM-native extraction (issue 12).

On the lent H200 machine, after ``tools/gpu_install.sh`` (tools/GPU.md), one model per device call
(each call is limited to 600 s; ``--budget-s`` keeps one invocation inside it):

    . /tmp/sc/env.sh && python3 benchmarks/gpu.py --out "$OUT" --models dense
    . /tmp/sc/env.sh && python3 benchmarks/gpu.py --out "$OUT" --models moe

then here, on the two files that came back:

    python3 benchmarks/gpu.py --merge A/gpu_dense.json B/gpu_moe.json --write benchmarks/results/gpu_latest.json

and on a CPU machine, to check the plumbing end to end (tests/tiny_models.py's dense model, float32,
6 prompts of 16-63 tokens, one round; ``native`` is recorded ``unsupported``: vLLM's example connector
copies into pinned memory, which needs CUDA; about 2.5 minutes on 2 cores):

    source ~/.cache/spec_compat/env.sh
    $SPEC_COMPAT_VENV/bin/python benchmarks/gpu.py --cpu-smoke --out /tmp/gpu_smoke

``--speculators 0.3.0`` measures the other speculators release; ``--paths`` picks and orders the paths;
``--extract-args "..."`` passes extra flags to ``spec-compat extract`` (after ours: ``"--batch-size 64"``;
by default extract plans its own batches, as for a user). Outside a git checkout (the device
copy) the spec_compat commit recorded is ``$SPEC_COMPAT_COMMIT``.

Models (bf16, random weights, built on the GPU under ``--work-dir`` and reused): ``dense`` a Qwen3 with
Qwen3-1.7B's decoder stack (1.4B parameters with the test tokenizer's 512-token vocabulary), ``moe`` the
5.0B-parameter Qwen3-MoE of tools/gpu_large_moe.py. Prompts as in gpu_large_moe.py: 48 prompts of random
ids in [3, 500), lengths in [256, 1024), ``random.Random(0)`` (31,997 tokens).

Paths, each engine in its own fresh process (its process group killed on timeout), in this order per
round (``--rounds``; a path that would not fit the budget is recorded ``not-run``):
``shim`` (speculators' generator through spec_compat), ``native`` (vLLM's extract_hidden_states +
ExampleHiddenStatesConnector writing the same layers to /dev/shm; its layer ids are ours + 1),
``llm_eager`` / ``llm_default`` (``LLM.generate(max_tokens=1)``, eager / CUDA graphs + compile) and
``extract`` (``spec-compat extract`` of the prompts x24 to local disk; its figure is ``extract_stats.json``'s
dataset-to-files time, engine start excluded; without that file the process wall time, engine start
included, marked ``stats_missing``). Per path: 1 warm-up and 3 timed calls; details in
benchmarks/gpu_paths.py.

Keys (per model under ``per_model.<model>.ratios``, from the medians of the timed calls; at the top
level the worst over the models: the smallest ratio, the largest overhead):
shim_vs_native       shim tokens/s / native tokens/s (native: until every file is written)
extract_vs_native    spec-compat extract tokens/s (dataset to files) / native tokens/s
extract_shm_vs_native  the same with extract's output in /dev/shm, where native writes (path ``extract_shm``)
extract_vs_disk_bound  extract / what its disk takes with fsync on (benchmarks/disk_write.py, measured in the
                     run, divided by the bytes extract wrote per token)
shim_vs_llm_eager    shim / LLM.generate(max_tokens=1) with enforce_eager (no extraction at all)
shim_vs_llm_default  shim / LLM.generate with vLLM's defaults (per model only)
native_vs_llm_eager  what the native extraction itself costs (per model only)
overhead_fraction    spec_compat's own seconds ("own:" labels of spec_compat.timings()) / generate() seconds,
                     median over the shim's timed calls; null when spec_compat has no timings()
shim_vs_native_return  as shim_vs_native, native timed until generate() returns (files may still be written)
Also at the top level: ``worst_model`` (which model gave each key), ``complete`` (every key of every model
measured), ``targets`` (issue 12's), ``per_model`` (params, tokens, layer ids, every run of every path with
its timings, engine start, spec_compat timings per call, cProfile top 25), ``versions``, ``gpu``,
``prompts``, ``settings``, ``timestamp``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import importlib.metadata as metadata
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATHS = ("shim", "native", "llm_eager", "extract", "llm_default", "shim_without", "extract_shm", "native_disk")
EXTRACT_PATHS = ("extract", "extract_shm")  # extract_shm: the same, its output in /dev/shm (native's storage)
DEFAULT_PATHS = PATHS[:5]  # shim_without (the shim with --shim-disable's adapters left out) only when asked
# native_disk: native writing to extract's disk (the work folder), every file fsync'd before the call ends,
# as extract's are: the same durability on the same disk (native alone writes to /dev/shm, never fsync'd)
NATIVE_PATHS = ("native", "native_disk")
REQUIRED_KEYS = ("shim_vs_native", "extract_vs_native", "shim_vs_llm_eager", "overhead_fraction")
TARGETS = {
    "shim_vs_native": (">=", 0.8),
    "extract_vs_native": (">=", 0.8),
    "overhead_fraction": ("<=", 0.05),
}  # issue 27
# Seconds a path is assumed to take (engine start + calls) until it has been measured in this run.
PRIOR_S = {
    "shim": 70.0, "native": 60.0, "llm_eager": 50.0, "extract": 80.0, "llm_default": 90.0, "shim_without": 70.0,
    "extract_shm": 80.0, "native_disk": 60.0,
}  # fmt: skip
SMOKE_PRIOR_S = {
    "shim": 30.0, "native": 30.0, "llm_eager": 30.0, "extract": 40.0, "llm_default": 50.0, "shim_without": 30.0,
    "extract_shm": 40.0, "native_disk": 30.0,
}  # fmt: skip
MARKER = "gpu_bench_model.json"

DENSE_CONFIG: dict[str, Any] = {  # Qwen3-1.7B's decoder stack
    "hidden_size": 2048,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 6144,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
LAYER_IDS = {"dense": [2, 10, 18, 26], "moe": [2, 8, 13, 15], "tiny": [1, 2, 3]}


@dataclass(frozen=True)
class PromptSet:
    """Random ids in [3, 500), ``count`` prompts, lengths uniform in [low, high) or, for ``chat``, a
    log-normal with median ``median`` and log-spread ``sigma`` clipped to [low, high): many short
    conversations and a long tail, the shape of ShareGPT / UltraChat length histograms."""

    count: int
    seed: int
    low: int
    high: int
    max_model_len: int  # the per-set engine length (one engine runs every set: see engine_len)
    extract_repeat: int  # the extract dataset is the set this many times (~0.5-0.8M tokens)
    median: float | None = None
    sigma: float | None = None

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        if self.median is None:
            lengths = [rng.randrange(self.low, self.high) for _ in range(self.count)]
        else:
            sigma = self.sigma or 1.0
            draws = (int(rng.lognormvariate(math.log(self.median), sigma)) for _ in range(10**6))
            lengths = [n for n in draws if self.low <= n < self.high][: self.count]
        return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


PROMPT_SETS = {
    "256-1024": PromptSet(count=48, seed=0, low=256, high=1024, max_model_len=2048, extract_repeat=24),
    "1.5k-2k": PromptSet(count=24, seed=1, low=1536, high=2048, max_model_len=4096, extract_repeat=16),
    "4k-8k": PromptSet(count=8, seed=2, low=4096, high=8000, max_model_len=8192, extract_repeat=14),
    "chat": PromptSet(
        count=64, seed=3, low=32, high=4000, max_model_len=4096, extract_repeat=12, median=600, sigma=0.9
    ),
    "smoke": PromptSet(count=6, seed=0, low=16, high=64, max_model_len=512, extract_repeat=24),
}


# ---- small helpers --------------------------------------------------------------------------------------------


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def safetensors_params(model_dir: Path) -> int:
    """Parameter count from the safetensors headers (no torch needed)."""
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def speculators_dir(version: str) -> Path:
    for item in os.environ.get("SPEC_COMPAT_SPECULATORS", "").split(","):
        name, _, path = item.strip().partition("=")
        if name == version and path:
            return Path(path)
    raise SystemExit(
        f"speculators {version} not in SPEC_COMPAT_SPECULATORS={os.environ.get('SPEC_COMPAT_SPECULATORS')!r}"
    )


def child_env(spec_dir: Path, smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(spec_dir), env.get("PYTHONPATH", "")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    for key in ("SPEC_COMPAT_DTYPE", "SPEC_COMPAT_DISABLE"):
        env.pop(key, None)
    if smoke:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def distribution_version(name: str, path: str | None = None) -> str | None:
    try:
        if path is None:
            return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    for dist in metadata.distributions(path=[path]):
        if (dist.metadata["Name"] or "").lower() == name:
            return dist.version
    return None


def git_commit() -> str | None:
    """``$SPEC_COMPAT_COMMIT`` when set (the device copy's .git is the landed base, not the tree sent),
    else the checkout's HEAD."""
    if os.environ.get("SPEC_COMPAT_COMMIT"):
        return os.environ["SPEC_COMPAT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SPEC_COMPAT_COMMIT")
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def versions(spec_dir: Path) -> dict[str, Any]:
    vllm = distribution_version("vllm")
    return {
        "vllm": vllm or distribution_version("vllm-cpu"),
        "vllm_distribution": "vllm" if vllm else "vllm-cpu",
        "torch": distribution_version("torch"),
        "transformers": distribution_version("transformers"),
        "safetensors": distribution_version("safetensors"),  # < 0.8 holds the GIL in the native path's writers
        "speculators": distribution_version("speculators", str(spec_dir)),
        "spec_compat": git_commit(),
        "python": sys.version.split()[0],
    }


def last_error_line(log: Path) -> str | None:
    """The first and the last line naming an exception (vLLM's workers log the cause first)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if "Error: " in line]
    if not lines:
        return None
    return lines[0][-400:] if lines[0] == lines[-1] else f"{lines[0][-400:]} ... {lines[-1][-300:]}"


# ---- processes --------------------------------------------------------------------------------------------------


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def end_group(pgid: int, grace_s: float) -> None:
    """Let the group's other processes (vLLM's engine core, multiprocessing's resource tracker, which
    unlinks shared memory) end by themselves for ``grace_s``, then SIGTERM, then SIGKILL."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
        deadline = time.perf_counter() + wait_s
        while group_alive(pgid) and time.perf_counter() < deadline:
            time.sleep(0.1)
        if not group_alive(pgid):
            return


def run_process(command: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int | None, float]:
    """Run in its own process group, stdout+stderr to ``log``; (exit code or None on timeout, wall seconds).
    Returns when no process of the group is left (so the next engine finds the GPU memory free)."""
    started = time.perf_counter()
    with log.open("w") as handle:
        proc = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            code = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    end_group(proc.pid, grace_s=0.0 if code is None else 10.0)
    return code, time.perf_counter() - started


# ---- model build (``--build KIND DIR``, in its own process) ---------------------------------------------------------


def extract_layer_ids(spec: dict[str, Any], extract_args: str) -> list[int]:
    """The path's layer ids; with ``--format speculators-hs`` the last is the model's last layer (its files'
    last layer is the verifier's, docs/extract.md), the count unchanged so both formats write as many bytes."""
    layer_ids = list(spec["layer_ids"])
    if "speculators-hs" not in shlex.split(extract_args):
        return layer_ids
    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    last = int(config.get("text_config", config)["num_hidden_layers"]) - 1
    return layer_ids if last in layer_ids else [*layer_ids[:-1], last]


def listed_samples(output: Path) -> int:
    manifest = output / "manifest.json"
    return len(json.loads(manifest.read_text())["samples"]) if manifest.exists() else 0


def build_config(kind: str) -> dict[str, Any]:
    if kind == "dense":
        return {"family": "qwen3", **DENSE_CONFIG}
    if kind == "moe":
        sys.path.insert(0, str(ROOT / "tools"))
        from gpu_large_moe import CONFIG

        return {"family": "qwen3_moe", **CONFIG}
    return {"family": "tiny_dense (tests/tiny_models.py)"}


def build_model(kind: str, model_dir: Path) -> None:
    """Write the checkpoint (bf16, on the GPU; the tiny one as the tests build it) unless it is there."""
    config = build_config(kind)
    marker = model_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("config") == config:
        return
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    if kind == "tiny":
        tiny_models.build_model("dense", model_dir)
        marker.write_text(json.dumps({"config": config}))
        return
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_large_moe

    if kind == "moe":
        gpu_large_moe.build(tmp)
    else:
        gpu_large_moe.build_random_checkpoint(tmp, "qwen3", DENSE_CONFIG)
    (tmp / MARKER).write_text(json.dumps({"config": config}))
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)


# ---- one model: every path, alternated -----------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke: bool = args.cpu_smoke
        self.started = time.perf_counter()
        self.spec_dir = speculators_dir(args.speculators)
        self.env = child_env(self.spec_dir, self.smoke)
        self.logs = args.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.work: Path = args.work_dir
        self.work.mkdir(parents=True, exist_ok=True)
        self.priors = SMOKE_PRIOR_S if self.smoke else PRIOR_S
        self.commit = git_commit()
        self.disk: dict[str, Any] | None = None  # the extract output's disk, measured once (disk_write.py)
        self.variants: dict[str, str] = args.variants  # label -> the path it runs (--variant)

    def remaining(self) -> float:
        return float(self.args.budget_s) - (time.perf_counter() - self.started)

    def build(self, kind: str) -> dict[str, Any]:
        model_dir = self.work / "models" / kind
        reused = (model_dir / MARKER).exists()
        log = self.logs / f"build_{kind}.log"
        command = [sys.executable, str(Path(__file__).resolve()), "--build", kind, str(model_dir)]
        code, wall = run_process(command, self.env, self.remaining(), log)
        info: dict[str, Any] = {"path": str(model_dir), "build_s": wall, "reused": reused, "exit": code}
        if code != 0:
            info["error"] = last_error_line(log) or f"exit {code}"
            return info
        info["params"] = safetensors_params(model_dir)
        info["bytes"] = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        info["config"] = build_config(kind)
        return info

    def native_storage(self) -> str:
        """/dev/shm as in the Turn-2 measurement, unless it cannot hold a few calls' files."""
        shm = Path("/dev/shm")
        if shm.is_dir() and shutil.disk_usage(shm).free > 4 * 2**30:
            return str(shm / "sc_native_hs")
        return str(self.work / "sc_native_hs")

    def engine_len(self) -> int:
        """One engine per path runs every set, at the largest set's max_model_len (or --max-model-len).
        That changes no step: speculators schedules max(8192, max_model_len) tokens per step and every set
        fits below 8192; vLLM's own paths get max(max_model_len, its default) with chunked prefill off (each
        path records the value it ran with under ``engine``)."""
        return self.args.max_model_len or max(PROMPT_SETS[name].max_model_len for name in self.args.prompt_sets)

    def spec(self, kind: str, model_dir: str, sets: list[dict[str, Any]]) -> dict[str, Any]:
        layer_ids = LAYER_IDS[kind]
        return {
            "model": model_dir,
            "layer_ids": layer_ids,
            "native_layer_ids": [layer + 1 for layer in layer_ids],  # vLLM counts from the layer's input
            "max_model_len": self.engine_len(),
            "dtype": self.args.dtype,
            "gpu_memory_utilization": 0.8,
            "reps": self.args.reps,
            "sets": sets,
            "native_storage": self.native_storage(),
            "digest": self.args.digest,
            "rss_calls": 0,
        }

    def run_path(self, kind: str, name: str, spec: dict[str, Any], round_: int, timeout: float) -> dict[str, Any]:
        stem = f"{kind}_r{round_}_{name}"
        log = self.logs / f"{stem}.log"
        base = self.variants.get(name, name)  # a --variant runs its base path with its own env / extract args
        env = {**self.env, **self.args.variant_env.get(name, {})}
        if base in EXTRACT_PATHS:
            return {"base": base, **self.run_extracts(kind, name, base, spec, round_, timeout, env)}
        spec_file = self.work / f"{stem}.spec.json"
        out_file = self.work / f"{stem}.out.json"
        if base in ("shim", "shim_without") and round_ == 0:
            spec = {**spec, "rss_calls": self.args.rss_calls}
        if base == "shim_without":  # the same shim process with some adapters left out: an A/B in one run
            env = {**env, "SPEC_COMPAT_DISABLE": self.args.shim_disable}
        if base == "native_disk":  # extract's disk and durability: the work folder, every file fsync'd
            spec = {**spec, "native_storage": str(self.work / "sc_native_hs_disk"), "native_fsync": True}
        name = {"shim_without": "shim", "native_disk": "native"}.get(base, base)
        spec_file.write_text(json.dumps(spec))
        out_file.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--path", name, str(spec_file), str(out_file)]
        code, wall = run_process(command, env, timeout, log)
        record: dict[str, Any] = {"wall_s": wall, "log": str(log.relative_to(self.args.out))}
        if code is None:
            return {**record, "status": "timeout", "timeout_s": timeout, "error": last_error_line(log)}
        if code != 0 or not out_file.exists():
            return {**record, "status": "failed", "exit": code, "error": last_error_line(log)}
        return {**record, "base": base, "status": "ok", **json.loads(out_file.read_text())}

    def extract_root(self, name: str) -> Path:
        if name == "extract_shm":
            return Path("/dev/shm")
        return self.args.extract_output or self.work

    def measure_disk(self, root: Path) -> dict[str, Any]:
        """What the extract output's disk takes (benchmarks/disk_write.py, 2 GiB per way), once per run:
        the bound on ``extract`` with fsync on, whatever the writer does."""
        if self.disk is None:
            import disk_write

            folder = root / "sc_disk_write"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            try:
                self.disk = {"dir": str(root), "gb_per_s": disk_write.measure(folder, 2 << 30)}
            except OSError as exc:
                self.disk = {"dir": str(root), "error": str(exc)}
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            print(f"   disk under {root}: {self.disk}", flush=True)
        return self.disk

    def run_extracts(
        self, kind: str, name: str, base: str, spec: dict[str, Any], round_: int, timeout: float, env: dict[str, str]
    ) -> dict[str, Any]:
        """``spec-compat extract`` once per set (each its own process and engine)."""
        started = time.perf_counter()
        sets: dict[str, Any] = {}
        for entry in spec["sets"]:
            left = timeout - (time.perf_counter() - started)
            sets[entry["name"]] = self.run_extract_set(kind, name, base, spec, entry, round_, left, env)
        statuses = {r["status"] for r in sets.values()}
        status = "ok" if statuses == {"ok"} else ("failed" if "ok" not in statuses else "partial")
        return {"status": status, "wall_s": time.perf_counter() - started, "sets": sets}

    def run_extract_group(
        self, kind: str, names: list[str], spec: dict[str, Any], round_: int
    ) -> dict[str, dict[str, Any]]:
        """Several extract paths (variants of one another) set by set: the first set for each path, then
        the next set for each, so that a budget running out leaves whole A/Bs of the sets done, not all
        sets of one path and none of the other (run X lost its A/B that way). A set is not run when the
        budget left is less than the longest set any of them took so far (before any: the path's prior)."""
        records = {
            name: {"round": round_, "base": self.variants.get(name, name), "wall_s": 0.0, "sets": {}} for name in names
        }
        walls: list[float] = []
        for entry in spec["sets"]:
            for name in names:
                record = records[name]
                base = record["base"]
                estimate = max(walls) if walls else self.priors[base]
                left = self.remaining()
                if left < estimate:
                    reason = f"{left:.0f} s of budget left, {'measured' if walls else 'assumed'} {estimate:.0f} s"
                    record["sets"][entry["name"]] = {"status": "not-run", "reason": reason}
                    continue
                env = {**self.env, **self.args.variant_env.get(name, {})}
                timeout = min(left, self.args.path_timeout_s)
                done = self.run_extract_set(kind, name, base, spec, entry, round_, timeout, env)
                record["sets"][entry["name"]] = done
                record["wall_s"] += float(done.get("wall_s") or 0.0)
                walls.append(float(done.get("wall_s") or 0.0))
        for record in records.values():
            statuses = {r["status"] for r in record["sets"].values()}
            record["status"] = "ok" if statuses == {"ok"} else ("partial" if "ok" in statuses else "not-run")
            if statuses - {"ok", "not-run"} and "ok" not in statuses:
                record["status"] = "failed"
        return records

    def run_extract_set(
        self,
        kind: str,
        name: str,
        base: str,
        spec: dict[str, Any],
        entry: dict[str, Any],
        round_: int,
        timeout: float,
        env: dict[str, str],
    ) -> dict[str, Any]:
        """One set of path ``name`` (an extract path or a variant of one), with the disk it wrote to."""
        root = self.extract_root(base)
        disk = self.measure_disk(root) if base == "extract" else None
        extract_args = self.args.variant_args.get(name, self.args.extract_args)
        log = self.logs / f"{kind}_r{round_}_{name}_{entry['name']}.log"
        return {**self.run_extract(spec, entry, log, timeout, root, extract_args, env), "disk": disk}

    def run_extract(
        self,
        spec: dict[str, Any],
        entry: dict[str, Any],
        log: Path,
        timeout: float,
        root: Path,
        extract_args: str,
        env: dict[str, str],
    ) -> dict[str, Any]:
        prompts = json.loads(Path(entry["prompts_file"]).read_text())
        data = self.work / "extract_input.jsonl"
        repeat = entry["extract_repeat"] if self.args.extract_repeat is None else self.args.extract_repeat
        data.write_text("".join(json.dumps({"input_ids": p}) + "\n" for _ in range(repeat) for p in prompts))
        output = root / "sc_extract_out"
        shutil.rmtree(output, ignore_errors=True)
        command = [sys.executable, "-m", "spec_compat.cli", "extract", "--model", spec["model"], "--input", str(data)]
        layer_ids = extract_layer_ids(spec, extract_args)
        command += ["--output", str(output), "--layer-ids", ",".join(str(x) for x in layer_ids)]
        # extract's own batch plan, as a user runs it (--batch-size N in --extract-args to choose)
        command += ["--max-model-len", str(spec["max_model_len"])]
        command += ["--dtype", spec["dtype"], "--gpu-memory-utilization", str(spec["gpu_memory_utilization"])]
        command += shlex.split(extract_args)
        if timeout < 5:
            return {"status": "not-run", "reason": "no time left in the path's timeout"}
        code, wall = run_process(command, env, timeout, log)
        tokens = repeat * sum(min(len(p), spec["max_model_len"] - 1) for p in prompts)
        record: dict[str, Any] = {
            "wall_s": wall,
            "log": str(log.relative_to(self.args.out)),
            "command": shlex.join(command),
            "env": {k: v for k, v in env.items() if k not in self.env or self.env[k] != v},
            "samples": repeat * len(prompts),
            "output_bytes": sum(f.stat().st_size for f in output.rglob("*") if f.is_file()) if output.is_dir() else 0,
            "output_files": listed_samples(output),  # either --format: the samples its manifest lists
        }
        stats_file = output / "extract_stats.json"
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else None
        shutil.rmtree(output, ignore_errors=True)
        if code is None:
            return {**record, "status": "timeout", "timeout_s": timeout, "error": last_error_line(log)}
        if code != 0:
            return {**record, "status": "failed", "exit": code, "error": last_error_line(log)}
        if record["output_files"] != record["samples"]:
            return {**record, "status": "failed", "error": f"{record['output_files']} data files written"}
        if stats is None:  # an extract without extract_stats.json: the process wall time, engine start included
            seconds = wall
            record.update(stats_missing=True, engine_start_s=None, tokens=tokens, extract_s=seconds)
        else:
            seconds = float(stats["extract_s"])
            record.update(stats_missing=False, engine_start_s=stats.get("engine_start_s"), stats=stats)
            record.update(tokens=int(stats.get("tokens", tokens)), extract_s=seconds)
        if seconds <= 0:
            return {**record, "status": "failed", "error": f"extract_s {seconds}"}
        rate = record["tokens"] / seconds
        steady = (stats or {}).get("steady_tokens_per_s")
        if steady:  # like the other paths, which time calls after a warm-up call: the batches after the first
            record["tokens_per_s_including_first_batch"] = rate
            rate = float(steady)
        timeline = (stats or {}).get("timeline") or []
        if len(timeline) > 1 and timeline[-1][1] > timeline[0][1]:
            # diagnostic, not the target's rate: the loop's pace from the first batch's hand-over to the last
            # one's (the writer at most --pending-batches behind), the end's drain (a fixed cost per run) left out
            record["loop_tokens_per_s"] = sum(t for _, _, t in timeline[1:]) / (timeline[-1][1] - timeline[0][1])
        return {
            **record,
            "status": "ok",
            "tokens_per_s": [rate],
            "tokens_per_s_best": rate,
            "tokens_per_s_median": rate,
        }

    def model(self, kind: str, section: dict[str, Any], save: Any) -> None:
        """Fill ``section`` (already in the result, which ``save()`` writes after every path)."""
        section.update(model=kind, layer_ids=LAYER_IDS[kind])
        print(f"== {kind}: building the model ({self.remaining():.0f} s of budget left)", flush=True)
        section["build"] = build = self.build(kind)
        section["params"] = build.get("params")
        if build.get("exit") != 0:
            section["paths"] = {
                name: {"runs": [], "status": "not-run", "reason": "model build failed"}
                for name in (*PATHS, *self.variants)
            }
            return
        print(f"   {build['params'] / 1e9:.3f}B parameters, {build['build_s']:.0f} s (reused: {build['reused']})")
        sets = []
        section["prompt_set_inputs"] = {}
        for name in self.args.prompt_sets:
            prompts = PROMPT_SETS[name].prompts()
            prompts_file = self.work / f"prompts_{name}.json"
            prompts_file.write_text(json.dumps(prompts))
            reference = self.work / f"{kind}_shim_{name}_prompt0.pt"
            reference.unlink(missing_ok=True)
            sets.append({"name": name, "prompts_file": str(prompts_file), "reference": str(reference),
                         "extract_repeat": PROMPT_SETS[name].extract_repeat})  # fmt: skip
            lengths = [len(p) for p in prompts]
            section["prompt_set_inputs"][name] = {
                **dataclasses.asdict(PROMPT_SETS[name]),
                "tokens": sum(lengths),
                "length_min": min(lengths),
                "length_median": statistics.median(lengths),
                "length_max": max(lengths),
            }
        spec = self.spec(kind, build["path"], sets)
        section["engine_max_model_len"] = spec["max_model_len"]
        section["native_layer_ids"] = spec["native_layer_ids"]
        section["native_storage"] = spec["native_storage"]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in (*PATHS, *self.variants)}
        extracts = [n for n in self.args.paths if self.variants.get(n, n) in EXTRACT_PATHS]
        for round_ in range(self.args.rounds):
            for name in self.args.paths:
                if len(extracts) > 1 and name in extracts:
                    if name == extracts[0]:  # all extract paths here, set by set: each set's A/B side by side
                        for label, record in self.run_extract_group(kind, extracts, spec, round_).items():
                            runs[label].append(record)
                            print(f"   round {round_} {label:12s} {describe(record)}", flush=True)
                        section["paths"] = summarize_paths(runs)
                        section["prompt_sets"] = prompt_set_ratios(section["paths"], self.args.prompt_sets, self.commit)
                        save()
                    continue
                measured = [r["wall_s"] for r in runs[name] if r.get("status") == "ok"]
                prior = self.priors[self.variants.get(name, name)]
                estimate = max(measured) if measured else prior * (1 + 0.25 * (len(sets) - 1))
                left = self.remaining()
                if left < estimate:
                    reason = f"{left:.0f} s of budget left, {'measured' if measured else 'assumed'} {estimate:.0f} s"
                    runs[name].append({"status": "not-run", "round": round_, "reason": reason})
                    print(f"   round {round_} {name:12s} not-run ({reason})", flush=True)
                    continue
                timeout = min(left, self.args.path_timeout_s)
                record = {"round": round_, **self.run_path(kind, name, spec, round_, timeout)}
                if self.smoke and name == "native" and "pin_memory=True requires" in str(record.get("error")):
                    record["status"] = "unsupported"  # the connector's pinned-memory copies need CUDA
                runs[name].append(record)
                print(f"   round {round_} {name:12s} {describe(record)}", flush=True)
                section["paths"] = summarize_paths(runs)
                section["prompt_sets"] = prompt_set_ratios(section["paths"], self.args.prompt_sets, self.commit)
                save()
        section["paths"] = summarize_paths(runs)
        section["prompt_sets"] = prompt_set_ratios(section["paths"], self.args.prompt_sets, self.commit)


def extract_phases(stats: dict[str, Any]) -> dict[str, float] | None:
    """An extract run's seconds in three phases, from its ``timeline`` (diagnostic, not the target's rate).

    - fill: the first ``--pending-batches`` batches, while the pipeline fills (the worker's segments are
      made and mapped, the writer starts its first files); the first of them is the warm-up the target's
      rate already leaves out;
    - middle: the full-size batches after them, the writer at most ``--pending-batches`` behind: the
      pace a run keeps for as long as it lasts (``middle_tokens_per_s``);
    - end: the smaller batches of the tapered tail and the drain, until the last file is on the disk.

    ``fixed_s``: the run's seconds after its first batch less what its tokens take at the middle's pace,
    what a run of any length pays once (run Y: 0.40-0.75 s of 5-7 s runs of 0.7M tokens). None when the
    run has no full-size batch after its fill."""
    timeline = stats.get("timeline") or []
    fill = max(1, int(stats.get("pending_batches") or 1))
    extract_s, first_s = stats.get("extract_s"), stats.get("first_batch_s")
    if len(timeline) <= fill or extract_s is None or first_s is None:
        return None
    largest = max(tokens for _, _, tokens in timeline)
    last_full = max(i for i, (_, _, tokens) in enumerate(timeline) if tokens > largest / 2)
    middle_s = timeline[last_full][1] - timeline[fill - 1][1]
    if last_full < fill or middle_s <= 0:
        return None
    middle_rate = sum(tokens for _, _, tokens in timeline[fill : last_full + 1]) / middle_s
    after_first = sum(tokens for _, _, tokens in timeline[1:])
    return {
        "fill_s": timeline[fill - 1][1],
        "fill_tokens": sum(tokens for _, _, tokens in timeline[:fill]),
        "middle_s": middle_s,
        "middle_batches": last_full + 1 - fill,
        "middle_tokens_per_s": middle_rate,
        "end_s": extract_s - timeline[last_full][1],
        "end_tokens": sum(tokens for _, _, tokens in timeline[last_full + 1 :]),
        "fixed_s": (extract_s - first_s) - after_first / middle_rate,
    }


def extract_breakdown(stats: dict[str, Any]) -> str:
    """Where an extract loop's time went (its extract_stats.json), or "" for another path."""
    if "drain_s" not in stats:
        return ""
    s = {key: f"{stats[key]:.2f}" for key in ("extract_s", "generate_s", "handoff_s", "writer_wait_s", "drain_s")}
    return (
        f" ({s['extract_s']} s: generate {s['generate_s']} s, handing over {s['handoff_s']} s,"
        f" waited {s['writer_wait_s']} s, drain {s['drain_s']} s of it{writer_threads_busy(stats)}{phases_text(stats)})"
    )


def phases_text(stats: dict[str, Any]) -> str:
    phases = extract_phases(stats)
    if phases is None:
        return ""
    return (
        f"; fill {phases['fill_s']:.2f} s, middle {phases['middle_tokens_per_s']:,.0f} tok/s over"
        f" {phases['middle_s']:.2f} s, end {phases['end_s']:.2f} s, fixed {phases['fixed_s']:.2f} s"
        f"{second_batch_text(stats)}{slowest_later_batch_text(stats, phases['middle_tokens_per_s'])}"
        f"{segments_text(stats)}"
    )


def slowest_later_batch_text(stats: dict[str, Any], middle_rate: float) -> str:
    """The batch after the second that took longest beyond its tokens at the middle's pace, with its largest
    timings: run AA found one tail batch 0.2-0.3 s slow in every path."""
    timeline, per_batch = stats.get("timeline") or [], stats.get("batch_timings") or []
    if len(timeline) < 3 or len(per_batch) != len(timeline) or middle_rate <= 0:
        return ""
    excess = {i: timeline[i][0] - timeline[i - 1][1] - timeline[i][2] / middle_rate for i in range(2, len(timeline))}
    index = max(excess, key=lambda i: excess[i])
    return f"; slowest later batch {index} (+{excess[index]:.3f} s): " + largest_timings_text(per_batch[index], 3)


def segments_text(stats: dict[str, Any]) -> str:
    """Segments replies came in, and the most the worker had at once (more: one made that no reply used)."""
    transfer = stats.get("transfer") or {}
    if "segments_made" not in transfer:
        return ""
    return f"; segments {transfer['segments_made']} used, {transfer.get('segments_live_max', '?')} at most"


def second_batch_text(stats: dict[str, Any]) -> str:
    """The second batch's largest rpc: / transfer: seconds (extract_stats.json's ``batch_timings``, from
    2816299): run Z found its forward slowed by the segment made beside it in the background."""
    per_batch = stats.get("batch_timings") or []
    if len(per_batch) < 2:
        return ""
    return "; second batch: " + largest_timings_text(per_batch[1], 4)


def largest_timings_text(timings: dict[str, float], count: int) -> str:
    """A batch's ``count`` largest timings, largest first, as "label 0.123 s, ..."."""
    largest = sorted(timings.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{label} {seconds:.3f} s" for label, seconds in largest)


def writer_threads_busy(stats: dict[str, Any]) -> str:
    """How many of the writer's threads were, on average over the run, in each step (the step's seconds
    summed over the threads / the run's): a writer short of its disk's bound with few threads in fsync
    keeps the disk's queue short (run X: 3.7 of 8 in fsync)."""
    timings, seconds = stats.get("timings") or {}, stats.get("extract_s") or 0.0
    steps = {"fsync": "extract:fsync", "sha256": "extract:sha256", "save": "extract:torch-save"}
    if seconds <= 0 or not any(label in timings for label in steps.values()):
        return ""
    busy = ", ".join(f"{name} {timings.get(label, 0.0) / seconds:.1f}" for name, label in steps.items())
    return f"; of {stats.get('writer_threads')} writer threads on average: {busy}"


def describe(record: dict[str, Any]) -> str:
    if record.get("status") not in ("ok", "partial"):
        why = record.get("error") or record.get("reason")
        return f"{record.get('status')} after {record.get('wall_s', 0):.0f} s: {why}"
    parts = []
    for name, entry in record.get("sets", {}).items():
        if entry.get("status", "ok") != "ok":
            parts.append(f"{name} {entry.get('status')}: {entry.get('error') or entry.get('reason')}")
            continue
        text = f"{name} {entry['tokens_per_s_median']:,.0f} tok/s"
        overhead = entry.get("overhead", {}).get("overhead_fraction")
        if overhead is not None:
            text += f" (own {overhead:.3f})"
        text += extract_breakdown(entry.get("stats") or {})
        parts.append(text)
    start = record.get("engine_start_s")
    started = f"engine start {start:.1f} s; " if start is not None else ""
    return f"{started}process {record['wall_s']:.0f} s; " + "; ".join(parts)


# ---- summaries -------------------------------------------------------------------------------------------------------


def summarize_paths(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per path: every run, and per prompt set the tokens/s of all timed calls of its ok runs pooled."""
    out: dict[str, dict[str, Any]] = {}
    for name, records in runs.items():
        ok = [r for r in records if r.get("status") in ("ok", "partial")]
        base = next((r["base"] for r in records if r.get("base")), name)  # a --variant's path
        entry: dict[str, Any] = {
            "base": base,
            "status": "ok" if ok else (records[-1].get("status", "not-run") if records else "not-run"),
            "runs": records,
            "engine_start_s": median_or_none([r["engine_start_s"] for r in ok if r.get("engine_start_s") is not None]),
            "sets": {},
        }
        for set_name in {n for r in ok for n in r.get("sets", {})}:
            with_set = [r["sets"][set_name] for r in ok if set_name in r["sets"]]  # a merged run may lack it
            done = [d for d in with_set if d.get("status", "ok") == "ok"]
            rates = [float(x) for d in done for x in d["tokens_per_s"]]
            summary: dict[str, Any] = {
                "tokens_per_s_best": max(rates) if rates else None,
                "tokens_per_s_median": median_or_none(rates),
                "calls": len(rates),
            }
            if base in ("shim", "shim_without"):
                fractions = [float(x) for d in done for x in d["overhead"].get("overhead_fractions", [])]
                summary["overhead_fraction"] = median_or_none(fractions)
                summary["digests"] = sorted({x for d in done for x in d.get("digests", [])})
                summary["where_time_goes"] = where_time_goes(done)
                summary["memory_per_call"] = [m for d in done for m in d.get("memory_per_call", [])]
            if base in EXTRACT_PATHS and done:  # one process per set and round: the first ok one's details
                for key in ("tokens", "output_bytes", "disk", "stats"):
                    summary[key] = done[0].get(key)
            if base in NATIVE_PATHS:
                summary["tokens_per_s_return_median"] = median_or_none([d["tokens_per_s_return_median"] for d in done])
                summary["vs_shim_prompt0"] = next(
                    (d["vs_shim_prompt0"] for d in done if d.get("vs_shim_prompt0")), None
                )
            entry["sets"][set_name] = summary
        out[name] = entry
    return out


# Labels of spec_compat.timings() measured inside an RPC (already in its "rpc:<method>" time).
INSIDE_RPC = (
    "own:executor-rpc",
    "own:worker-finite-check",
    "transfer:worker-copy",
    "transfer:worker-acquire",
    "transfer:driver-map",
)


def where_time_goes(done: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median seconds per call: the call, each spec_compat.timings() label, and the rest (speculators'
    own driver code and vLLM's scheduler: the call less every RPC, the clones and spec_compat's own work
    outside RPCs)."""
    calls = [s for d in done for s in d.get("timings_s", [])]
    per_call = [b for d in done for b in d.get("overhead", {}).get("per_call", []) if b is not None]
    labels = sorted({k for b in per_call for k in b})
    out: dict[str, float | None] = {"call_s": median_or_none(calls)}
    for label in labels:
        out[label] = median_or_none([b.get(label, 0.0) for b in per_call])
    if per_call and len(per_call) == len(calls):
        outside = [
            sum(
                v
                for k, v in b.items()
                if k.startswith(("rpc:", "own:", "transfer:driver-handover")) and k not in INSIDE_RPC
            )
            for b in per_call
        ]
        out["rest_s"] = median_or_none([c - o for c, o in zip(calls, outside, strict=True)])
    return out


def prompt_set_ratios(paths: dict[str, dict[str, Any]], set_names: list[str], commit: str | None) -> dict[str, Any]:
    def med(path: str, set_name: str, key: str = "tokens_per_s_median") -> float | None:
        value: float | None = paths.get(path, {}).get("sets", {}).get(set_name, {}).get(key)
        return value

    out: dict[str, Any] = {}
    for name in set_names:
        shim = paths.get("shim", {}).get("sets", {}).get(name, {})
        without = paths.get("shim_without", {}).get("sets", {}).get(name, {})
        digests, digests_without = shim.get("digests") or [], without.get("digests") or []
        out[name] = {
            "shim_vs_native": ratio(med("shim", name), med("native", name)),
            "extract_vs_native": ratio(med("extract", name), med("native", name)),
            # both on the same disk, both fsync'd before the call ends (native_disk: native's files fsync'd)
            "extract_vs_native_disk": ratio(med("extract", name), med("native_disk", name)),
            "native_disk_vs_native": ratio(med("native_disk", name), med("native", name)),
            # the same extract writing to /dev/shm, where native writes: the storage taken out
            "extract_shm_vs_native": ratio(med("extract_shm", name), med("native", name)),
            # what the disk allows: its fsync'd write speed (8 threads) / the bytes extract wrote per token
            "extract_disk_bound_tokens_per_s": disk_bound(paths, name),
            "extract_vs_disk_bound": ratio(med("extract", name), disk_bound(paths, name)),
            # diagnostic: extract's pace between its pipeline's fill and its end (extract_phases), the rate a
            # long run approaches, and the seconds a run of any length pays once on top
            "extract_middle_vs_native": ratio(extract_phase(paths, name, "middle_tokens_per_s"), med("native", name)),
            "extract_fixed_s": extract_phase(paths, name, "fixed_s"),
            # the most any writer of extract's bytes could reach against native in RAM on this disk, fsync'd
            "disk_bound_vs_native": ratio(disk_bound(paths, name), med("native", name)),
            "overhead_fraction": shim.get("overhead_fraction"),
            # every call of the shim and of the shim with the speed-ups off returned the same bytes
            "bitwise_equal": (len(set(digests) | set(digests_without)) == 1) if digests and digests_without else None,
            "shim_deterministic": (len(digests) == 1) if digests else None,
            "shim_vs_shim_without": ratio(med("shim", name), med("shim_without", name)),
            "shim_vs_llm_eager": ratio(med("shim", name), med("llm_eager", name)),
            "shim_vs_native_return": ratio(med("shim", name), med("native", name, "tokens_per_s_return_median")),
            "tokens_per_s": {path: med(path, name) for path in paths if med(path, name) is not None},
            # each --variant against native and against the path it varies (same invocation)
            "variants": {
                label: {
                    "base": entry["base"],
                    "vs_native": ratio(med(label, name), med("native", name)),
                    "vs_native_disk": ratio(med(label, name), med("native_disk", name)),
                    "vs_base": ratio(med(label, name), med(entry["base"], name)),
                }
                for label, entry in paths.items()
                if entry.get("base", label) != label and med(label, name) is not None
            },
            "where_time_goes": shim.get("where_time_goes"),
            "commit": commit,
        }
    return out


def extract_phase(paths: dict[str, dict[str, Any]], set_name: str, key: str) -> float | None:
    """``key`` of the extract path's phases for ``set_name`` (its first ok run's stats; older records too)."""
    stats = paths.get("extract", {}).get("sets", {}).get(set_name, {}).get("stats") or {}
    value: float | None = (extract_phases(stats) or {}).get(key)
    return value


def disk_bound(paths: dict[str, dict[str, Any]], set_name: str) -> float | None:
    """Tokens/s the extract output's disk could take with fsync on (``buffered_fsync_8`` of
    disk_write.py, the larger of it and ``direct_4`` when extract wrote with O_DIRECT)."""
    record = paths.get("extract", {}).get("sets", {}).get(set_name, {})
    speeds = (record.get("disk") or {}).get("gb_per_s") or {}
    direct = bool((record.get("stats") or {}).get("direct_io"))
    gb_per_s = max(speeds.get("buffered_fsync_8") or 0.0, (speeds.get("direct_4") or 0.0) if direct else 0.0)
    tokens, nbytes = record.get("tokens"), record.get("output_bytes")
    if not gb_per_s or not tokens or not nbytes:
        return None
    return float(gb_per_s * 1e9 / (nbytes / tokens))


def top_level(per_model: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The required keys, worst over the models and prompt sets (smallest ratio, largest overhead), and
    which model / set gave each."""
    out: dict[str, Any] = {}
    worst: dict[str, str | None] = {}
    for key in REQUIRED_KEYS:
        values = {
            f"{m}/{n}": v.get(key)
            for m, section in per_model.items()
            for n, v in section.get("prompt_sets", {}).items()
            if v.get(key) is not None
        }
        if not values:
            out[key], worst[key] = None, None
            continue
        pick = max if key == "overhead_fraction" else min
        where = pick(values, key=lambda k: values[k])
        out[key], worst[key] = values[where], where
    out["worst"] = worst
    out["complete"] = all(
        v.get(k) is not None
        for s in per_model.values()
        for v in s.get("prompt_sets", {}).values()
        for k in REQUIRED_KEYS
    )
    # extract against native on the same disk with the same durability (native_disk), and the disk's own
    # bound against native in RAM: where that is < 0.8, extract_vs_native >= 0.8 is beyond this disk
    for key in ("extract_vs_native_disk", "disk_bound_vs_native"):
        values = [v.get(key) for s in per_model.values() for v in s.get("prompt_sets", {}).values()]
        present = [v for v in values if v is not None]
        out[key] = min(present) if present else None
    out["targets"] = {
        key: {"target": f"{op} {bound}", "value": out[key], "met": None if out[key] is None else
              (out[key] >= bound if op == ">=" else out[key] <= bound)}
        for key, (op, bound) in TARGETS.items()
    }  # fmt: skip
    return out


def device_of(per_model: dict[str, dict[str, Any]]) -> str | None:
    for section in per_model.values():
        for entry in section.get("paths", {}).values():
            for run in entry.get("runs", []):
                if run.get("device"):
                    return str(run["device"])
    return None


def print_table(result: dict[str, Any]) -> None:
    print(f"\nGPU benchmark: {result.get('gpu')}; versions {result.get('versions')}")
    shown = sorted(
        {p for s in result["per_model"].values() for e in s.get("prompt_sets", {}).values() for p in e["tokens_per_s"]},
        key=lambda p: (PATHS.index(p) if p in PATHS else len(PATHS), p),
    )
    head = f"{'model':6s} {'set':9s} " + " ".join(f"{p:>12s}" for p in shown)
    print(head + f" {'shim/nat':>9s} {'extr/nat':>9s} {'shm/nat':>8s} {'ex/disk':>8s} {'own':>6s} {'bitwise':>8s}")
    footnote = False
    for kind, section in result["per_model"].items():
        for name, entry in section.get("prompt_sets", {}).items():
            rates = entry.get("tokens_per_s", {})
            # extract's tokens/s from the invocation its ratios come from (merged files: one_run_ratios)
            extract_rates = entry.get("extract_tokens_per_s") or {}
            rates = {**rates, **{p: v for p, v in extract_rates.items() if p not in SHIM_SIDE}}
            cells = " ".join(f"{rates[p]:>12,.0f}" if p in rates else f"{'-':>12s}" for p in shown)
            equal = entry.get("bitwise_equal")
            apart = entry.get("extract_ratios_from", entry.get("ratios_from")) != entry.get("ratios_from")
            footnote = footnote or apart
            print(
                f"{kind:6s} {name:9s} {cells} {fmt(entry.get('shim_vs_native')):>9s} "
                f"{fmt(entry.get('extract_vs_native')) + ('*' if apart else ''):>9s} "
                f"{fmt(entry.get('extract_shm_vs_native')):>8s} "
                f"{fmt(entry.get('extract_vs_disk_bound')):>8s} {fmt(entry.get('overhead_fraction')):>6s} "
                f"{'n/a' if equal is None else str(equal):>8s}"
            )
    if footnote:
        print("* extract's ratios (and tokens/s) from a later invocation than the shim's, against that one's native")
    keys = (*REQUIRED_KEYS, "extract_vs_native_disk", "disk_bound_vs_native")
    print("worst over models and sets: " + ", ".join(f"{k} {fmt(result.get(k))}" for k in keys))
    for key, target in result.get("targets", {}).items():
        met = target["met"]
        verdict = "n/a" if met is None else ("MET" if met else "MISSED")
        print(f"  {key:18s} {fmt(target['value']):>8s}  target {target['target']:8s} {verdict}")


def fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"


POOLED_KEYS = ("bitwise_equal", "shim_deterministic")
SHIM_SIDE = ("shim", "shim_without", "native")  # paths whose tokens/s the shim's group of ratios shows


# Which paths each group of a set's ratios is taken from (one_run_ratios): the shim's ratios need shim and
# native side by side, extract's need native and extract; an invocation may measure one group only (a lever A/B).
RATIO_GROUPS = {"shim": frozenset({"shim", "native"}), "extract": frozenset({"native", "extract"})}
EXTRACT_GROUP_PREFIXES = ("extract", "disk_bound", "native_disk", "variants")


def one_run_ratios(kind: str, section: dict[str, Any], files: list[Path], parts: list[dict[str, Any]]) -> None:
    """Per prompt set, each group of ratios (``RATIO_GROUPS``) from ONE invocation, never from runs pooled
    across invocations: the latest (files are merged oldest first) that measured that group's paths, so a
    newer data path's figures replace an older one's, also from an invocation that ran one group only
    (run Y's extract A/B had no shim); where none did, the one that measured the most paths for that set,
    the later on a tie. Only ``bitwise_equal`` and ``shim_deterministic`` come from the pooled digests
    (every invocation's shim and shim_without returned the same bytes). ``ratios_from`` and ``commit``
    name the shim group's file and commit, ``extract_ratios_from`` and ``extract_commit`` the extract
    group's; ``extract_tokens_per_s`` the extract group's tokens/s per path."""
    for name, entry in section.get("prompt_sets", {}).items():
        for group, needed in RATIO_GROUPS.items():
            chosen = _latest_with(kind, name, files, parts, needed)
            if chosen is None:
                continue
            file, paths, commit = chosen
            fresh = prompt_set_ratios(paths, [name], commit or entry.get("commit"))[name]
            if group == "extract":
                entry.update({k: v for k, v in fresh.items() if k.startswith(EXTRACT_GROUP_PREFIXES)})
                entry.update(extract_ratios_from=str(file), extract_commit=fresh["commit"])
                entry["extract_tokens_per_s"] = fresh["tokens_per_s"]
            else:
                shim_side = {k: v for k, v in fresh.items() if not k.startswith(EXTRACT_GROUP_PREFIXES)}
                entry.update({k: v for k, v in shim_side.items() if k not in POOLED_KEYS})
                entry["ratios_from"] = str(file)


def _latest_with(
    kind: str, set_name: str, files: list[Path], parts: list[dict[str, Any]], needed: frozenset[str]
) -> tuple[Path, dict[str, Any], str | None] | None:
    """The latest invocation that measured ``needed`` for the set, else the one with the most paths for it."""
    best: tuple[bool, int, int] | None = None
    chosen: tuple[Path, dict[str, Any], str | None] | None = None
    for index, (file, part) in enumerate(zip(files, parts, strict=True)):
        paths = part["per_model"].get(kind, {}).get("paths", {})
        done = {
            label for label, path in paths.items() if path.get("sets", {}).get(set_name, {}).get("tokens_per_s_median")
        }
        complete = done.issuperset(needed)
        rank = (complete, 0 if complete else len(done), index)
        if done and (best is None or rank >= best):
            best, chosen = rank, (file, paths, part.get("versions", {}).get("spec_compat"))
    return chosen


def model_key(kind: str, part: dict[str, Any], first: dict[str, Any]) -> str:
    """Runs of another speculators release than the first file's stay apart (``moe@speculators-0.3.0``):
    pooling them would mix two libraries' digests and timings in one entry."""
    version = part.get("versions", {}).get("speculators")
    if version == first.get("versions", {}).get("speculators"):
        return kind
    return f"{kind}@speculators-{version}"


def merge(files: list[Path], write: Path) -> int:
    parts = [json.loads(f.read_text()) for f in files]
    per_model: dict[str, Any] = {}
    for part in parts:
        for kind, section in part["per_model"].items():
            kind = model_key(kind, part, parts[0])
            if kind not in per_model:
                per_model[kind] = copy.deepcopy(section)  # parts stay as read: one_run_ratios reads them
                continue
            # The same model from another invocation (e.g. one path run later): pool the runs of every
            # path and summarize again, so the bitwise check spans both invocations (the ratios are then
            # taken from one invocation per set: one_run_ratios).
            merged = per_model[kind]
            runs = {name: list(entry.get("runs", [])) for name, entry in merged.get("paths", {}).items()}
            for name, entry in section.get("paths", {}).items():
                runs.setdefault(name, []).extend(r for r in entry.get("runs", []) if r.get("status") != "not-run")
            merged["paths"] = summarize_paths(runs)
            first_set: dict[str, Any] = next(iter(merged.get("prompt_sets", {}).values()), {})
            commit = first_set.get("commit")
            names = list(dict.fromkeys([*merged.get("prompt_sets", {}), *section.get("prompt_sets", {})]))
            merged["prompt_sets"] = prompt_set_ratios(merged["paths"], names, commit)
            merged.setdefault("merged_from", []).append(section.get("model", kind))
    for key, section in per_model.items():
        kind, _, _ = key.partition("@")
        mine = [(f, p) for f, p in zip(files, parts, strict=True) if kind in p["per_model"]
                and model_key(kind, p, parts[0]) == key]  # fmt: skip
        one_run_ratios(kind, section, [f for f, _ in mine], [p for _, p in mine])
    result: dict[str, Any] = {**top_level(per_model), "per_model": per_model}
    result["versions"] = parts[0]["versions"]
    if any(p["versions"] != parts[0]["versions"] for p in parts):
        result["versions_by_source"] = {str(f): p["versions"] for f, p in zip(files, parts, strict=True)}
    result["gpu"] = next((p.get("gpu") for p in parts if p.get("gpu")), None)
    result["prompt_sets"] = {k: v for p in parts for k, v in p.get("prompt_sets", {}).items()}
    result["sources"] = [{"file": str(f), "timestamp": p.get("timestamp"), "command": p.get("command")}
                         for f, p in zip(files, parts, strict=True)]  # fmt: skip
    result["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write.parent.mkdir(parents=True, exist_ok=True)
    write.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"\nwritten {write}")
    return 0


# ---- main ------------------------------------------------------------------------------------------------------------


def parse_variants(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, dict[str, str]], dict[str, str]]:
    """--variant LABEL=PATH, --variant-env LABEL:KEY=VALUE, --variant-args LABEL:ARGS, checked."""
    variants: dict[str, str] = {}
    for item in args.variant:
        label, _, base = item.partition("=")
        if not re.fullmatch(r"[a-z0-9_]+", label) or label in PATHS or base not in PATHS:
            raise ValueError(f"--variant {item!r}: want LABEL=PATH, LABEL new ([a-z0-9_]), PATH one of {PATHS}")
        variants[label] = base
    env: dict[str, dict[str, str]] = {}
    for item in args.variant_env:
        label, _, pair = item.partition(":")
        key, sep, value = pair.partition("=")
        if label not in variants or not sep or not key:
            raise ValueError(f"--variant-env {item!r}: want LABEL:KEY=VALUE for a --variant LABEL")
        env.setdefault(label, {})[key] = value
    extract_args: dict[str, str] = {}
    for item in args.variant_args:
        label, _, value = item.partition(":")
        if variants.get(label) not in EXTRACT_PATHS:
            raise ValueError(f"--variant-args {item!r}: LABEL must be a --variant of {EXTRACT_PATHS}")
        extract_args[label] = value
    return variants, env, extract_args


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for gpu_<models>.json and the logs ($OUT on the device)")
    parser.add_argument("--models", default="dense", help="comma-separated: dense, moe")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"subset of {PATHS}, in this order")
    parser.add_argument(
        "--shim-disable",
        default="driver-states-handover",
        help="adapter ids the shim_without path leaves out (SPEC_COMPAT_DISABLE): the speed-ups measured on and off",
    )
    parser.add_argument(
        "--prompt-sets", default="256-1024", help=f"comma-separated, in this order, of {sorted(PROMPT_SETS)}"
    )
    parser.add_argument("--digest", action="store_true", help="sha256 of every shim call's results (bitwise_equal)")
    parser.add_argument(
        "--rss-calls", type=int, default=0, help="shim: this many more calls of the first set, RSS after each"
    )
    parser.add_argument("--rounds", type=int, default=2, help="repeat the paths, budget allowing")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per engine (after 1 warm-up)")
    parser.add_argument("--budget-s", type=float, default=520.0, help="wall budget of this invocation, build included")
    parser.add_argument("--path-timeout-s", type=float, default=300.0, help="kill one path's process after this")
    parser.add_argument("--speculators", default="0.4.0.1", help="version key of SPEC_COMPAT_SPECULATORS (or 0.3.0)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/sc_gpu_bench"), help="models, extract output")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the largest set's")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--extract-repeat", type=int, default=None, help="extract dataset: each set N times (default: the set's)"
    )
    parser.add_argument("--extract-args", default="", help="extra flags for spec-compat extract (one string)")
    parser.add_argument(
        "--extract-output", type=Path, default=None, help="where spec-compat extract writes (default: the work folder)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="one more path: PATH run again under LABEL, with --variant-env / --variant-args (an A/B in one run)",
    )
    parser.add_argument(
        "--variant-env", action="append", default=[], metavar="LABEL:KEY=VALUE", help="environment of one variant"
    )
    parser.add_argument(
        "--variant-args", action="append", default=[], metavar="LABEL:ARGS", help="an extract variant's --extract-args"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model, a few prompts, on CPU: plumbing only")
    parser.add_argument("--merge", nargs="+", type=Path, help="combine gpu_<models>.json files ...")
    parser.add_argument("--write", type=Path, default=HERE / "results" / "gpu_latest.json", help="... into this file")
    parser.add_argument("--path", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--build", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.models = "tiny"
        args.work_dir = Path("/tmp/sc_gpu_smoke_work") if args.work_dir == Path("/tmp/sc_gpu_bench") else args.work_dir
        args.prompt_sets = args.prompt_sets if args.prompt_sets != "256-1024" else "smoke"
        args.dtype, args.rounds, args.budget_s = "float32", 1, min(args.budget_s, 400.0)
    args.prompt_sets = [p.strip() for p in args.prompt_sets.split(",") if p.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    try:
        args.variants, args.variant_env, args.variant_args = parse_variants(args)
    except ValueError as exc:
        parser.error(str(exc))
    unknown = sorted(set(args.paths) - set(PATHS) - set(args.variants)) + sorted(set(args.models) - set(LAYER_IDS))
    unknown += sorted(set(args.prompt_sets) - set(PROMPT_SETS))
    if unknown:
        parser.error(f"unknown paths or models {unknown}")
    if not (args.merge or args.path or args.build or args.out):
        parser.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.path:
        from gpu_paths import run

        spec = json.loads(Path(args.path[1]).read_text())
        Path(args.path[2]).write_text(json.dumps(run(args.path[0], spec)))
        return 0
    if args.build:
        build_model(args.build[0], Path(args.build[1]))
        return 0
    if args.merge:
        return merge(args.merge, args.write)

    bench = Bench(args)
    name = "_".join(args.models)
    out_file = args.out / f"gpu_{name}.json"
    result: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "versions": versions(bench.spec_dir),
        "prompt_sets": {name: dataclasses.asdict(PROMPT_SETS[name]) for name in args.prompt_sets},
        "settings": {k: getattr(args, k) for k in ("rounds", "reps", "budget_s", "path_timeout_s", "max_model_len",
                                                    "dtype", "paths", "extract_repeat", "extract_args", "speculators",
                                                    "shim_disable", "digest", "rss_calls", "variants",
                                                    "variant_env", "variant_args")},
        "extract_output": str(args.extract_output) if args.extract_output else None,
        "per_model": {},
    }  # fmt: skip

    def save() -> None:
        result.update(top_level(result["per_model"]))
        result["gpu"] = device_of(result["per_model"])
        result["elapsed_s"] = time.perf_counter() - bench.started
        result["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        out_file.write_text(json.dumps(result, indent=1) + "\n")

    for kind in args.models:
        result["per_model"][kind] = {}
        bench.model(kind, result["per_model"][kind], save)
        save()
    print_table(result)
    print(f"\n{time.perf_counter() - bench.started:.0f} s; written {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
