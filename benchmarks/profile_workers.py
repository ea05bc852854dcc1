"""Profile the model worker of the shimmed generator and of vLLM's own LLM on the same prompts.

    python benchmarks/profile_workers.py [--family qwen3_moe] [--tp 1] [--prompts 12] [--seconds-out FILE]

Needs py-spy (``pip install py-spy``). Starts both engines in this process (as benchmarks/cells.py
does), warms both up, then records each worker process with ``py-spy record --format raw`` during
one timed call of each, and prints the hottest frames side by side, plus the differences between
the two engines' VllmConfig (the generator builds its own; LLM goes through EngineArgs).

Environment as for benchmarks/run.py (PYTHONPATH with speculators, VLLM_CPU_KVCACHE_SPACE,
VLLM_CPU_OMP_THREADS_BIND="0" or "0|1", VLLM_WORKER_MULTIPROC_METHOD=spawn). docs/benchmarks.md
(section 3) used it at --tp 2, once as is and once with MALLOC_MMAP_THRESHOLD_=1073741824
MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=536870912 (glibc keeps freed memory: no page-fault churn).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_models  # noqa: E402
import cells  # noqa: E402
import run  # noqa: E402


def config_items(vllm_config: Any) -> dict[str, str]:
    """Flat ``section.field -> repr`` of the config sections that can change how the model runs."""
    items: dict[str, str] = {}
    for section in (
        "model_config",
        "cache_config",
        "parallel_config",
        "scheduler_config",
        "compilation_config",
        "kernel_config",
        "load_config",
        "device_config",
    ):
        obj = getattr(vllm_config, section, None)
        fields = getattr(obj, "__dataclass_fields__", None)
        if obj is None or fields is None:
            continue
        for name in fields:
            try:
                items[f"{section}.{name}"] = repr(getattr(obj, name))[:160]
            except Exception as exc:  # noqa: BLE001 - a property that cannot be read here
                items[f"{section}.{name}"] = f"<{type(exc).__name__}>"
    return items


def worker_pid(parent_pid: int, under_engine_core: bool) -> int:
    import psutil

    for proc in psutil.Process(parent_pid).children(recursive=True):
        name = proc.name()
        if "Worker" not in name:
            continue
        parent = proc.parent()
        is_under_core = parent is not None and "EngineCore" in parent.name()
        if is_under_core == under_engine_core:
            return int(proc.pid)
    raise RuntimeError(f"no worker process found (under EngineCore: {under_engine_core})")


def record(pid: int, fn: Any, out: Path) -> float:
    spy = subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)
    return seconds


def hottest(raw: Path, top: int) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """(samples, leaf frames by samples, every frame by inclusive samples) of a py-spy raw file."""
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [
            f.split(" (")[0] + " (" + f.split("(")[-1].split(":")[0].split("/")[-1] + ")" for f in stack.split(";")
        ]
        if any("dequeue" in f or "acquire_read" in f or "wait" in f.split(" (")[0] for f in frames[-3:]):
            continue  # idle: waiting for the next RPC
        total += count
        leaf[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return total, leaf.most_common(top), inclusive.most_common(top * 2)


def cpu_reps(runs: dict[str, tuple[int, Any]], tokens: int, reps: int) -> list[dict[str, Any]]:
    """Alternating timed calls; CPU seconds of every process (driver, workers, engine core) per call."""
    import psutil

    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    label = {p.pid: ("driver" if p.pid == os.getpid() else p.name()) for p in procs}
    shim_worker = runs["shim"][0]
    label[shim_worker] = "shim worker"
    label[runs["vllm"][0]] = "vLLM worker"

    def cpu() -> dict[int, float]:
        values: dict[int, float] = {}
        for proc in procs:
            try:
                times = proc.cpu_times()
                values[proc.pid] = times.user + times.system
            except psutil.Error:
                continue
        return values

    def worker_detail() -> dict[str, tuple[float, float, int]]:
        """(user s, system s, minor page faults) of the two model workers."""
        detail: dict[str, tuple[float, float, int]] = {}
        for name, (pid, _) in runs.items():
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rpartition(")")[2].split()
            times = psutil.Process(pid).cpu_times()
            detail[name] = (times.user, times.system, int(fields[7]))
        return detail

    rows: list[dict[str, Any]] = []
    for rep in range(reps):
        for name in list(runs) if rep % 2 == 0 else list(runs)[::-1]:
            time.sleep(1.5)
            before = cpu()
            detail_before = worker_detail()
            start = time.perf_counter()
            runs[name][1]()
            seconds = time.perf_counter() - start
            after = cpu()
            detail_after = worker_detail()
            per = {label.get(pid, str(pid)): round(after[pid] - before.get(pid, 0.0), 2) for pid in after}
            per = {k: v for k, v in per.items() if v >= 0.02}
            b, a = detail_before[name], detail_after[name]
            worker = {"user_s": round(a[0] - b[0], 2), "sys_s": round(a[1] - b[1], 2), "minor_faults": a[2] - b[2]}
            rows.append(
                {"run": name, "wall_s": round(seconds, 2), "tok_s": round(tokens / seconds), "cpu_s": per, **worker}
            )
            print(
                f"  rep {rep} {name:5s} wall {seconds:5.2f} s ({tokens / seconds:5.0f} tok/s) cpu-s {per}; "
                f"its worker {worker}",
                flush=True,
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3_moe", choices=sorted(bench_models.FAMILIES))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--cpu-reps", type=int, default=4, help="alternating calls timed per process first")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()

    import spec_compat

    spec_compat.apply(dtype="float32", strict=True)
    from speculators.data_generation import VllmHiddenStatesGenerator
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(bench_models.build(args.family))
    n = bench_models.num_layers(args.family)
    layer_ids = [2, n // 2, n - 3, n - 1]
    prompts = run.prompts(args.prompts, seed=1000 + args.prompts)
    tokens = sum(len(p) for p in prompts)
    generator = VllmHiddenStatesGenerator(
        model, layer_ids=layer_ids, max_model_len=run.MAX_MODEL_LEN, tensor_parallel_size=args.tp
    )
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        tensor_parallel_size=args.tp,
        max_model_len=run.MAX_MODEL_LEN,
        max_num_seqs=32,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        seed=0,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    try:
        gen_cfg = config_items(generator.vllm_config)
        llm_cfg = config_items(llm.llm_engine.vllm_config)
        differences = {
            key: {"generator": gen_cfg.get(key), "llm": llm_cfg.get(key)}
            for key in sorted(set(gen_cfg) | set(llm_cfg))
            if gen_cfg.get(key) != llm_cfg.get(key)
        }
        print(f"VllmConfig differences (generator vs LLM), {len(differences)}:")
        for key, pair in differences.items():
            print(f"  {key}: {pair['generator']}  |  {pair['llm']}")
        generator.generate(prompts[:4])
        llm.generate(token_prompts[:4], params, use_tqdm=False)
        out: dict[str, Any] = {"config_differences": differences, "tokens": tokens}
        scratch = Path(tempfile.mkdtemp(prefix="spec_compat_profile_"))
        runs = {
            "shim": (worker_pid(os.getpid(), False), lambda: generator.generate(prompts)),
            "vllm": (worker_pid(os.getpid(), True), lambda: llm.generate(token_prompts, params, use_tqdm=False)),
        }
        out["cpu_reps"] = cpu_reps(runs, tokens, args.cpu_reps)
        for name, (pid, fn) in runs.items():
            time.sleep(1.5)
            seconds = record(pid, fn, scratch / f"{name}.txt")
            samples, leaves, inclusive = hottest(scratch / f"{name}.txt", args.top)
            out[name] = {"seconds": seconds, "tok_s": tokens / seconds, "samples": samples, "leaf": leaves}
            out[name]["inclusive"] = inclusive
            print(f"\n{name}: {tokens / seconds:.0f} tok/s ({seconds:.2f} s), {samples} busy samples in worker {pid}")
            print("  self (leaf frames):")
            for frame, count in leaves:
                print(f"    {100 * count / max(samples, 1):5.1f}%  {frame}")
            print("  inclusive:")
            for frame, count in inclusive:
                print(f"    {100 * count / max(samples, 1):5.1f}%  {frame}")
        if args.json_out:
            args.json_out.write_text(json.dumps(out, indent=1))
    finally:
        llm.llm_engine.engine_core.shutdown()
        generator.executor.shutdown()
        cells.kill_children()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
