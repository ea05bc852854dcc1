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
``--extract-args "..."`` passes extra flags to ``spec-compat extract`` (after ours: ``"--batch-size 96"``
overrides the default of one batch per 48 prompts). Outside a git checkout (the device
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
import datetime
import importlib.metadata as metadata
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATHS = ("shim", "native", "llm_eager", "extract", "llm_default", "shim_without")
DEFAULT_PATHS = PATHS[:5]  # shim_without (the shim with --shim-disable's adapters left out) only when asked
REQUIRED_KEYS = ("shim_vs_native", "extract_vs_native", "shim_vs_llm_eager", "overhead_fraction")
TARGETS = {"shim_vs_native": (">=", 0.5), "extract_vs_native": (">=", 0.5), "overhead_fraction": ("<=", 0.05)}
# Seconds a path is assumed to take (engine start + calls) until it has been measured in this run.
PRIOR_S = {"shim": 70.0, "native": 60.0, "llm_eager": 50.0, "extract": 80.0, "llm_default": 90.0, "shim_without": 70.0}
SMOKE_PRIOR_S = {
    "shim": 30.0, "native": 30.0, "llm_eager": 30.0, "extract": 40.0, "llm_default": 50.0, "shim_without": 30.0
}  # fmt: skip
MARKER = "gpu_bench_model.json"

DENSE_CONFIG: dict[str, Any] = {  # Qwen3-1.7B's decoder stack
    "hidden_size": 2048,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 6144,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
LAYER_IDS = {"dense": [2, 10, 18, 26], "moe": [2, 8, 13, 15], "tiny": [1, 2, 3]}


# ---- small helpers --------------------------------------------------------------------------------------------


def make_prompts(count: int, seed: int, low: int, high: int) -> list[list[int]]:
    """As tools/gpu_large_moe.py: ids in [3, 500), lengths in [low, high)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(low, high))] for _ in range(count)]


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

    def spec(self, kind: str, model_dir: str, prompts_file: Path) -> dict[str, Any]:
        layer_ids = LAYER_IDS[kind]
        return {
            "model": model_dir,
            "layer_ids": layer_ids,
            "native_layer_ids": [layer + 1 for layer in layer_ids],  # vLLM counts from the layer's input
            "max_model_len": self.args.max_model_len,
            "dtype": self.args.dtype,
            "gpu_memory_utilization": 0.8,
            "reps": self.args.reps,
            "prompts_file": str(prompts_file),
            "native_storage": self.native_storage(),
            "shim_reference": str(self.work / f"{kind}_shim_prompt0.pt"),
        }

    def run_path(self, kind: str, name: str, spec: dict[str, Any], round_: int, timeout: float) -> dict[str, Any]:
        stem = f"{kind}_r{round_}_{name}"
        log = self.logs / f"{stem}.log"
        if name == "extract":
            return self.run_extract(spec, log, timeout)
        spec_file = self.work / f"{stem}.spec.json"
        out_file = self.work / f"{stem}.out.json"
        spec_file.write_text(json.dumps(spec))
        out_file.unlink(missing_ok=True)
        env = self.env
        if name == "shim_without":  # the same shim process with some adapters left out: an A/B in one run
            env = {**self.env, "SPEC_COMPAT_DISABLE": self.args.shim_disable}
            name = "shim"
        command = [sys.executable, str(Path(__file__).resolve()), "--path", name, str(spec_file), str(out_file)]
        code, wall = run_process(command, env, timeout, log)
        record: dict[str, Any] = {"wall_s": wall, "log": str(log.relative_to(self.args.out))}
        if code is None:
            return {**record, "status": "timeout", "timeout_s": timeout, "error": last_error_line(log)}
        if code != 0 or not out_file.exists():
            return {**record, "status": "failed", "exit": code, "error": last_error_line(log)}
        return {**record, "status": "ok", **json.loads(out_file.read_text())}

    def run_extract(self, spec: dict[str, Any], log: Path, timeout: float) -> dict[str, Any]:
        prompts = json.loads(Path(spec["prompts_file"]).read_text())
        data = self.work / "extract_input.jsonl"
        repeat = self.args.extract_repeat
        data.write_text("".join(json.dumps({"input_ids": p}) + "\n" for _ in range(repeat) for p in prompts))
        output = self.work / "sc_extract_out"
        shutil.rmtree(output, ignore_errors=True)
        command = [sys.executable, "-m", "spec_compat.cli", "extract", "--model", spec["model"], "--input", str(data)]
        command += ["--output", str(output), "--layer-ids", ",".join(str(x) for x in spec["layer_ids"])]
        command += ["--max-model-len", str(spec["max_model_len"]), "--batch-size", str(len(prompts))]
        command += ["--dtype", spec["dtype"], "--gpu-memory-utilization", str(spec["gpu_memory_utilization"])]
        command += shlex.split(self.args.extract_args)
        code, wall = run_process(command, self.env, timeout, log)
        tokens = repeat * sum(min(len(p), spec["max_model_len"] - 1) for p in prompts)
        record: dict[str, Any] = {
            "wall_s": wall,
            "log": str(log.relative_to(self.args.out)),
            "command": shlex.join(command),
            "samples": repeat * len(prompts),
            "output_bytes": sum(f.stat().st_size for f in output.glob("*") if f.is_file()) if output.is_dir() else 0,
            "output_files": len(list(output.glob("data_*.pt"))) if output.is_dir() else 0,
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
                name: {"runs": [], "status": "not-run", "reason": "model build failed"} for name in PATHS
            }
            return
        print(f"   {build['params'] / 1e9:.3f}B parameters, {build['build_s']:.0f} s (reused: {build['reused']})")
        prompts = self.prompts()
        prompts_file = self.work / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        section["tokens"] = sum(len(p) for p in prompts)
        spec = self.spec(kind, build["path"], prompts_file)
        Path(spec["shim_reference"]).unlink(missing_ok=True)
        section["native_layer_ids"] = spec["native_layer_ids"]
        section["native_storage"] = spec["native_storage"]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PATHS}
        for round_ in range(self.args.rounds):
            for name in self.args.paths:
                measured = [r["wall_s"] for r in runs[name] if r.get("status") == "ok"]
                estimate = max(measured) if measured else self.priors[name]
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
                section["ratios"] = model_ratios(section["paths"])
                save()
        section["paths"] = summarize_paths(runs)
        section["ratios"] = model_ratios(section["paths"])

    def prompts(self) -> list[list[int]]:
        a = self.args
        return make_prompts(a.prompt_count, a.prompt_seed, a.prompt_min, a.prompt_max)


def describe(record: dict[str, Any]) -> str:
    if record.get("status") != "ok":
        why = record.get("error") or record.get("reason")
        return f"{record.get('status')} after {record.get('wall_s', 0):.0f} s: {why}"
    start = record.get("engine_start_s")
    text = f"{record['tokens_per_s_median']:>12,.0f} tok/s median, best {record['tokens_per_s_best']:,.0f}"
    text += f"; engine start {start:.1f} s" if start is not None else "; engine start n/a"
    text += f"; process {record['wall_s']:.0f} s"
    overhead = record.get("overhead", {}).get("overhead_fraction") if "overhead" in record else None
    if "overhead" in record:
        text += f"; overhead {'n/a' if overhead is None else f'{overhead:.3f}'}"
    return text


# ---- summaries -------------------------------------------------------------------------------------------------------


def summarize_paths(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per path: every run, and the tokens/s of all timed calls of its ok runs pooled (best, median)."""
    out: dict[str, dict[str, Any]] = {}
    for name, records in runs.items():
        ok = [r for r in records if r.get("status") == "ok"]
        rates = [float(x) for r in ok for x in r["tokens_per_s"]]
        entry: dict[str, Any] = {
            "status": "ok" if ok else (records[-1].get("status", "not-run") if records else "not-run"),
            "runs": records,
            "tokens_per_s_best": max(rates) if rates else None,
            "tokens_per_s_median": median_or_none(rates),
            "engine_start_s": median_or_none([r["engine_start_s"] for r in ok if r.get("engine_start_s") is not None]),
        }
        if name == "shim":
            fractions = [float(x) for r in ok for x in r["overhead"].get("overhead_fractions", [])]
            entry["overhead_fraction"] = median_or_none(fractions)
            entry["profile_spec_compat_tottime_fraction"] = median_or_none(
                [r["profile"]["spec_compat_tottime_fraction"] for r in ok]
            )
        if name == "native":
            entry["tokens_per_s_return_median"] = median_or_none([r["tokens_per_s_return_median"] for r in ok])
            entry["bytes_written_per_call"] = median_or_none([float(b) for r in ok for b in r["bytes_written"]])
        out[name] = entry
    return out


def model_ratios(paths: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def med(name: str) -> float | None:
        value: float | None = paths.get(name, {}).get("tokens_per_s_median")
        return value

    return {
        "shim_vs_native": ratio(med("shim"), med("native")),
        "extract_vs_native": ratio(med("extract"), med("native")),
        "shim_vs_llm_eager": ratio(med("shim"), med("llm_eager")),
        "shim_vs_llm_default": ratio(med("shim"), med("llm_default")),
        "native_vs_llm_eager": ratio(med("native"), med("llm_eager")),
        "shim_vs_native_return": ratio(med("shim"), paths.get("native", {}).get("tokens_per_s_return_median")),
        "overhead_fraction": paths.get("shim", {}).get("overhead_fraction"),
        "shim_vs_shim_without": ratio(med("shim"), med("shim_without")),
    }


def top_level(per_model: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The required keys, worst over the models (smallest ratio, largest overhead), and which model gave each."""
    out: dict[str, Any] = {}
    worst: dict[str, str | None] = {}
    for key in REQUIRED_KEYS:
        values = {m: s.get("ratios", {}).get(key) for m, s in per_model.items()}
        present = {m: v for m, v in values.items() if v is not None}
        if not present:
            out[key], worst[key] = None, None
            continue
        pick = max if key == "overhead_fraction" else min
        model = pick(present, key=lambda m: present[m])
        out[key], worst[key] = present[model], model
    out["worst_model"] = worst
    out["complete"] = all(s.get("ratios", {}).get(k) is not None for s in per_model.values() for k in REQUIRED_KEYS)
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
    print(f"{'model':6s} {'path':12s} {'status':11s} {'runs':>4s} {'tok/s median':>13s} {'best':>11s} {'start s':>8s}")
    for kind, section in result["per_model"].items():
        for name, entry in section.get("paths", {}).items():
            ok = [r for r in entry["runs"] if r.get("status") == "ok"]
            med, best, start = entry["tokens_per_s_median"], entry["tokens_per_s_best"], entry["engine_start_s"]
            print(
                f"{kind:6s} {name:12s} {entry['status']:11s} {len(ok):>4d} "
                f"{'-' if med is None else f'{med:,.0f}':>13s} {'-' if best is None else f'{best:,.0f}':>11s} "
                f"{'-' if start is None else f'{start:.1f}':>8s}"
            )
        ratios = section.get("ratios", {})
        print("       " + ", ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in ratios.items()))
    print("worst over models: " + ", ".join(f"{k} {fmt(result.get(k))}" for k in REQUIRED_KEYS))
    for key, target in result.get("targets", {}).items():
        met = target["met"]
        verdict = "n/a" if met is None else ("MET" if met else "MISSED")
        print(f"  {key:18s} {fmt(target['value']):>8s}  target {target['target']:8s} {verdict}")


def fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def merge(files: list[Path], write: Path) -> int:
    parts = [json.loads(f.read_text()) for f in files]
    per_model: dict[str, Any] = {}
    for part in parts:
        per_model.update(part["per_model"])
    result: dict[str, Any] = {**top_level(per_model), "per_model": per_model}
    result["versions"] = parts[0]["versions"]
    if any(p["versions"] != parts[0]["versions"] for p in parts):
        result["versions_by_source"] = {str(f): p["versions"] for f, p in zip(files, parts, strict=True)}
    result["gpu"] = next((p.get("gpu") for p in parts if p.get("gpu")), None)
    result["prompts"] = parts[0]["prompts"]
    result["sources"] = [{"file": str(f), "timestamp": p.get("timestamp"), "command": p.get("command")}
                         for f, p in zip(files, parts, strict=True)]  # fmt: skip
    result["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write.parent.mkdir(parents=True, exist_ok=True)
    write.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"\nwritten {write}")
    return 0


# ---- main ------------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for gpu_<models>.json and the logs ($OUT on the device)")
    parser.add_argument("--models", default="dense", help="comma-separated: dense, moe")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"subset of {PATHS}, in this order")
    parser.add_argument(
        "--shim-disable",
        default="executor-rpc-deadline,generate-signal-shutdown,shutdown-at-exit",
        help="adapter ids the shim_without path leaves out (SPEC_COMPAT_DISABLE)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="repeat the paths, budget allowing")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per engine (after 1 warm-up)")
    parser.add_argument("--budget-s", type=float, default=520.0, help="wall budget of this invocation, build included")
    parser.add_argument("--path-timeout-s", type=float, default=300.0, help="kill one path's process after this")
    parser.add_argument("--speculators", default="0.4.0.1", help="version key of SPEC_COMPAT_SPECULATORS (or 0.3.0)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/sc_gpu_bench"), help="models, extract output")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--extract-repeat", type=int, default=24, help="extract dataset: the prompts N times")
    parser.add_argument("--extract-args", default="", help="extra flags for spec-compat extract (one string)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model, a few prompts, on CPU: plumbing only")
    parser.add_argument("--merge", nargs="+", type=Path, help="combine gpu_<models>.json files ...")
    parser.add_argument("--write", type=Path, default=HERE / "results" / "gpu_latest.json", help="... into this file")
    parser.add_argument("--path", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--build", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.prompt_count, args.prompt_seed, args.prompt_min, args.prompt_max = 48, 0, 256, 1024
    if args.cpu_smoke:
        args.models = "tiny"
        args.work_dir = Path("/tmp/sc_gpu_smoke_work") if args.work_dir == Path("/tmp/sc_gpu_bench") else args.work_dir
        args.prompt_count, args.prompt_min, args.prompt_max = 6, 16, 64
        args.max_model_len, args.dtype, args.rounds, args.budget_s = 512, "float32", 1, min(args.budget_s, 400.0)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = sorted(set(args.paths) - set(PATHS)) + sorted(set(args.models) - set(LAYER_IDS))
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
        "prompts": {
            "count": args.prompt_count,
            "seed": args.prompt_seed,
            "length_range": [args.prompt_min, args.prompt_max],
            "id_range": [3, 500],
            "tokens": sum(len(p) for p in bench.prompts()),
        },
        "settings": {k: getattr(args, k) for k in ("rounds", "reps", "budget_s", "path_timeout_s", "max_model_len",
                                                    "dtype", "paths", "extract_repeat", "extract_args", "speculators")},
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
