"""``spec-compat extract --replicas``: 1 vs 2 replicas on this machine (a benchmark, not a test).

    source ~/.cache/spec_compat/env.sh
    $SPEC_COMPAT_VENV/bin/python benchmarks/ray_scaling.py             # ~110M dense, 240 samples
    $SPEC_COMPAT_VENV/bin/python benchmarks/ray_scaling.py --samples 80 --model tiny

Runs, one after the other, on the same dataset (token ids, lengths 64..320), each a fresh
``spec-compat extract`` process writing a fresh output directory:

single-1core  no Ray, VLLM_CPU_OMP_THREADS_BIND=0 (what one replica of the 2-replica run gets)
single-all    no Ray, every core (VLLM_CPU_OMP_THREADS_BIND=0-(n-1))
replicas-1    --replicas 1 (the driver binds it to every core)
replicas-2    --replicas 2 (one core each here: cores split evenly between the replicas)

Figures: the job's tokens/s from each run's ``extract_stats.json`` (single: dataset to files,
engine start excluded; replicas: from the first replica ready, so a replica that starts later
counts against it), the wall time of the whole command (engine starts, Ray start and shutdown
included), and per replica its samples and tokens/s. Results: printed and written as JSON
(``benchmarks/results/ray_scaling.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAYERS = "2,7,13"
TINY_LAYERS = "2,0,3"


def _model(name: str) -> tuple[Path, str]:
    sys.path.insert(0, str(HERE))
    from bench_models import build, tiny_dense

    if name == "tiny":
        return tiny_dense(), TINY_LAYERS
    return build("dense"), LAYERS


def _dataset(path: Path, samples: int, seed: int = 3) -> int:
    rng = random.Random(seed)
    tokens = 0
    with path.open("w") as handle:
        for _ in range(samples):
            ids = [rng.randrange(3, 500) for _ in range(rng.randrange(64, 321))]
            tokens += len(ids)
            handle.write(json.dumps({"input_ids": ids}) + "\n")
    return tokens


def _speculators() -> str:
    raw = os.environ.get("SPEC_COMPAT_SPECULATORS", "")
    for item in filter(None, raw.split(",")):
        version, _, path = item.partition("=")
        if version == "0.4.0.1":
            return path
    raise SystemExit("SPEC_COMPAT_SPECULATORS has no 0.4.0.1 (source ~/.cache/spec_compat/env.sh)")


def run_one(
    name: str, model: Path, layers: str, data: Path, out: Path, extra: list[str], bind: str | None
) -> dict[str, Any]:
    path = os.pathsep.join(filter(None, [_speculators(), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, RAY_USAGE_STATS_ENABLED="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    command = [
        sys.executable, "-m", "spec_compat", "extract", "--model", str(model), "--input", str(data),
        "--output", str(out), "--layer-ids", layers, "--max-model-len", "512", "--batch-size", "8",
        "--no-fsync", *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    wall_s = time.perf_counter() - started
    log = out.parent / f"{name}.log"
    log.write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}); log: {log}\n{proc.stderr[-3000:]}")
    stats = json.loads((out / "extract_stats.json").read_text())
    record = {
        "run": name,
        "wall_s": wall_s,
        "extract_s": stats["extract_s"],
        "tokens": stats["tokens"],
        "tokens_per_s": stats["tokens_per_s"],
        "replicas": [
            {k: r[k] for k in ("replica", "samples", "batches", "tokens_per_s", "engine_start_s", "cpu_bind")}
            for r in stats.get("replicas", [])
        ],
    }
    if "engine_start_s" in stats:
        record["engine_start_s"] = stats["engine_start_s"]
    per = "  ".join(
        f"r{r['replica']}: {r['samples']} samples {r['tokens_per_s'] or 0:,.0f} tok/s" for r in record["replicas"]
    )
    print(
        f"{name:13s} {stats['tokens_per_s']:8,.0f} tok/s  extract {stats['extract_s']:6.1f} s  wall {wall_s:6.1f} s  "
        + per,
        flush=True,
    )
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", choices=["dense", "tiny"], default="dense", help="~110M dense Qwen3, or the tests' tiny one"
    )
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--runs", default="single-1core,single-all,replicas-1,replicas-2")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ray_scaling.json")
    args = parser.parse_args()
    model, layers = _model(args.model)
    cpus = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="spec_compat_ray_scaling_"))
    data = work / "data.jsonl"
    tokens = _dataset(data, args.samples)
    print(f"{args.samples} samples, {tokens:,} tokens, model {model.name}, {cpus} cores; logs in {work}", flush=True)
    plans: dict[str, tuple[list[str], str | None]] = {
        "single-1core": ([], "0"),
        "single-all": ([], f"0-{cpus - 1}" if cpus > 1 else "0"),
        "replicas-1": (["--replicas", "1"], None),
        "replicas-2": (["--replicas", "2"], None),
    }
    records = []
    for name in args.runs.split(","):
        extra, bind = plans[name]
        records.append(run_one(name, model, layers, data, work / name, extra, bind))
        shutil.rmtree(work / name, ignore_errors=True)
    by = {r["run"]: r for r in records}
    ratios = {}
    if "replicas-2" in by and "replicas-1" in by:
        ratios["replicas2_over_replicas1"] = by["replicas-2"]["tokens_per_s"] / by["replicas-1"]["tokens_per_s"]
    if "replicas-2" in by and "single-1core" in by:
        ratios["replicas2_over_single_1core"] = by["replicas-2"]["tokens_per_s"] / by["single-1core"]["tokens_per_s"]
    if "replicas-1" in by and "single-all" in by:
        ratios["replicas1_over_single_all"] = by["replicas-1"]["tokens_per_s"] / by["single-all"]["tokens_per_s"]
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    result = {"samples": args.samples, "tokens": tokens, "model": args.model, "cores": cpus, "load_avg": load,
              "runs": records, "ratios": ratios}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
