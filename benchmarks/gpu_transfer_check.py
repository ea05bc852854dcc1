"""On the GPU machine: the shimmed generator with and without the shared-memory transfer.

Each variant is a fresh interpreter on the same model and prompts (tools/gpu_large_moe.py's
5.0B Qwen3-MoE by default): tokens/s per call, ``spec_compat.timings()`` per call, a cProfile of
one call, and whether the two variants return bitwise-equal tensors. Run after
``tools/gpu_install.sh`` and ``. /tmp/sc/env.sh``:

    python3 benchmarks/gpu_transfer_check.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRANSFER_ADAPTERS = ["executor-shared-memory-replies", "captured-states-shared-memory"]


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(256, 1024))] for _ in range(48)]


def variant(model_dir: str, layers: list[int], transfer: bool, out: str, calls: int) -> None:
    import spec_compat

    spec_compat.apply(strict=True, dtype="bfloat16", disable=[] if transfer else TRANSFER_ADAPTERS)
    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    batch = prompts()
    started = time.perf_counter()
    generator = VllmHiddenStatesGenerator(model_dir, layer_ids=layers, max_model_len=2048, tensor_parallel_size=1)
    start_s = time.perf_counter() - started
    generator.generate(batch)  # warm-up
    seconds, per_call = [], []
    for _ in range(calls):
        spec_compat.reset_timings()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        results = generator.generate(batch)
        seconds.append(time.perf_counter() - started)
        per_call.append(spec_compat.timings())
    profile = cProfile.Profile()
    profile.enable()
    results = generator.generate(batch)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
    torch.save([[h for h in r["hidden_states"]] for r in results], out + ".pt")
    tokens = sum(len(p) for p in batch)
    record = {
        "transfer": transfer,
        "engine_start_s": start_s,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s_best": tokens / min(seconds),
        "tokens_per_s_median": tokens / sorted(seconds)[len(seconds) // 2],
        "timings": per_call,
        "own_fraction": [
            sum(v for k, v in t.items() if k.startswith("own:")) / s for t, s in zip(per_call, seconds, strict=True)
        ],
        "states_replies": getattr(generator.executor, "states_replies", None),
        "profile": text.getvalue()[-6000:],
    }
    generator.executor.shutdown()
    Path(out).write_text(json.dumps(record, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/sc_large_moe"))
    parser.add_argument("--layers", default="2,8,13,15")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--speculators", default="0.4.0.1")
    parser.add_argument("--variant", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    if args.variant:
        variant(str(args.model_dir), layers, args.variant[0] == "on", args.variant[1], args.calls)
        return 0
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_large_moe

    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"build": gpu_large_moe.build(args.model_dir)}
    installs = dict(item.split("=", 1) for item in os.environ["SPEC_COMPAT_SPECULATORS"].split(","))
    env = dict(os.environ, PYTHONPATH=f"{installs[args.speculators]}:{os.environ.get('PYTHONPATH', '')}")
    for name in ("on", "off"):
        out = str(args.out / f"transfer_{name}.json")
        command = [sys.executable, __file__, "--model-dir", str(args.model_dir), "--layers", args.layers,
                   "--calls", str(args.calls), "--out", str(args.out), "--variant", name, out]  # fmt: skip
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
        (args.out / f"transfer_{name}.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
        summary[name] = json.loads(Path(out).read_text()) if proc.returncode == 0 else {"failed": proc.returncode}
    if all("failed" not in summary[n] for n in ("on", "off")):
        import torch

        a, b = torch.load(str(args.out / "transfer_on.json.pt")), torch.load(str(args.out / "transfer_off.json.pt"))
        summary["bitwise_equal"] = all(
            torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)
        )
    (args.out / "transfer_check.json").write_text(json.dumps(summary, indent=1))
    for name in ("on", "off"):
        record = summary[name]
        print(name, {k: record.get(k) for k in ("tokens_per_s_best", "tokens_per_s_median", "seconds", "own_fraction")})
    print("bitwise_equal", summary.get("bitwise_equal"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
