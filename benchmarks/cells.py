"""One benchmark measurement, run by ``benchmarks/run.py`` in a fresh interpreter.

Usage: python benchmarks/cells.py CELL SPEC_JSON OUT_JSON

Timers start at the first line of this file (``T0``), before vLLM, speculators or spec_compat
are imported; the parent also times the whole process. Cells that start vLLM workers guard on
``__name__ == "__main__"`` (workers are spawned) and kill their own children on the way out.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import contextlib  # noqa: E402 - the timer above must start first
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

Spec = dict[str, Any]
Record = dict[str, Any]

KEEP_ONLY_IMPORT_FIX = "transformers-torch-annotation"


def since_start() -> float:
    return time.perf_counter() - T0


def break_vllm() -> None:
    """Simulate an incompatible vLLM: its executor lost sample_tokens() (speculators 0.4 calls it)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    for klass in MultiprocExecutor.__mro__:
        if "sample_tokens" in vars(klass):
            delattr(klass, "sample_tokens")


def transformers_fix() -> None:
    """What spec_compat's transformers-torch-annotation adapter does, for baselines without it."""
    import torch
    import transformers.configuration_utils as configuration_utils

    if "torch" not in vars(configuration_utils):
        configuration_utils.torch = torch  # type: ignore[attr-defined]


def first_lines(text: str, limit: int = 600) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def kill_children() -> None:
    """End the worker processes this process started (vLLM normally does; a failed init may not)."""
    try:
        import psutil
    except ImportError:
        return
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


# ---- 1. time to the first error on an incompatible vLLM -----------------------------------------------


def cell_fail_strict(spec: Spec) -> Record:
    """apply(strict=True) from a cold interpreter: imports included."""
    break_vllm()
    import spec_compat

    try:
        spec_compat.apply(strict=True)
    except spec_compat.IncompatibleError as exc:
        seconds = since_start()
        text = str(exc)
        return {"seconds": seconds, "raised": type(exc).__name__, "names_sample_tokens": "sample_tokens" in text}
    return {"seconds": since_start(), "raised": None}


def cell_fail_preflight(spec: Spec) -> Record:
    """apply(strict=True) alone, with vLLM and speculators already imported.

    ``spec["preimport_worker_modules"]``: also import vLLM's GPU/CPU worker modules first (the
    preflight imports them to list the worker RPC names), to show what that import costs."""
    break_vllm()
    transformers_fix()
    import speculators.data_generation.custom_worker
    import speculators.data_generation.vllm_hidden_states_generator  # noqa: F401

    if spec.get("preimport_worker_modules"):
        import vllm.v1.worker.cpu_worker
        import vllm.v1.worker.gpu_worker  # noqa: F401

    import spec_compat

    imports_s = since_start()
    start = time.perf_counter()
    try:
        spec_compat.apply(strict=True)
    except spec_compat.IncompatibleError as exc:
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "imports_s": imports_s,
            "raised": type(exc).__name__,
            "names_sample_tokens": "sample_tokens" in str(exc),
        }
    return {"seconds": time.perf_counter() - start, "imports_s": imports_s, "raised": None}


def cell_fail_unshimmed(spec: Spec) -> Record:
    """Only the import fix; build the generator and generate until the first exception."""
    break_vllm()
    import psutil

    import spec_compat
    from spec_compat.registry import ADAPTERS

    spec_compat.apply(disable=[a.id for a in ADAPTERS if a.id != KEEP_ONLY_IMPORT_FIX])
    from speculators.data_generation import VllmHiddenStatesGenerator

    stage = "init"
    generator: Any = None
    record: Record = {}
    try:
        generator = VllmHiddenStatesGenerator(
            spec["model"], layer_ids=spec["layer_ids"], max_model_len=spec["max_model_len"], tensor_parallel_size=1
        )
        stage = "generate"
        for _ in range(3):
            generator.generate(spec["prompts"])
        record = {"seconds": since_start(), "raised": None, "stage": stage}
    except Exception as exc:  # noqa: BLE001 - the failure is the measurement
        seconds = since_start()
        record = {
            "seconds": seconds,
            "raised": type(exc).__name__,
            "stage": stage,
            "message": first_lines(f"{type(exc).__name__}: {exc}", 300),
            "where": traceback.extract_tb(exc.__traceback__)[-1].name if exc.__traceback__ else None,
            "worker_processes_at_failure": len(psutil.Process().children(recursive=True)),
        }
    finally:
        if generator is not None:
            with contextlib.suppress(Exception):
                generator.executor.shutdown()
        kill_children()
    return record


# ---- 2. apply() overhead on top of the imports -------------------------------------------------------


def cell_import_baseline(spec: Spec) -> Record:
    import vllm  # noqa: F401

    vllm_s = since_start()
    transformers_fix()
    import speculators.data_generation.vllm_hidden_states_generator  # noqa: F401

    return {"seconds": since_start(), "vllm_import_s": vllm_s}


def cell_import_apply(spec: Spec) -> Record:
    """The baseline's imports, then ``import spec_compat; spec_compat.apply()`` on top, timed apart."""
    import vllm  # noqa: F401

    vllm_s = since_start()
    transformers_fix()
    import speculators.data_generation.vllm_hidden_states_generator  # noqa: F401

    imports_s = since_start()
    start = time.perf_counter()
    import spec_compat

    spec_compat.apply()
    apply_s = time.perf_counter() - start
    return {"seconds": since_start(), "vllm_import_s": vllm_s, "imports_s": imports_s, "apply_s": apply_s}


# ---- 5. memory: RSS of the driver and every worker during generate() ---------------------------------


class RssMonitor:
    """Samples the RSS of this process and all its descendants every ``interval`` seconds."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self.interval = interval
        self.me = psutil.Process()
        self.baseline: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.timeline: list[tuple[float, int, int]] = []  # (t, driver rss, sum of children rss)
        self.marks: list[tuple[float, str, int]] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def processes(self) -> list[Any]:
        return [self.me, *self.me.children(recursive=True)]

    def _rss(self) -> dict[int, int]:
        import psutil

        values: dict[int, int] = {}
        for proc in self.processes():
            try:
                values[proc.pid] = int(proc.memory_info().rss)
                if proc.pid not in self.names:
                    self.names[proc.pid] = " ".join(proc.cmdline()[:3])[-120:] or proc.name()
            except psutil.Error:
                continue
        return values

    def start(self) -> None:
        for pid in self._rss():
            _reset_peak(pid)
        self.baseline = self._rss()
        self.peak = dict(self.baseline)
        self._t0 = time.perf_counter()
        self._thread.start()

    def mark(self, name: str) -> None:
        self.marks.append((time.perf_counter() - self._t0, name, int(self.me.memory_info().rss)))

    def _run(self) -> None:
        while not self._stop.is_set():
            values = self._rss()
            self.samples += 1
            for pid, rss in values.items():
                self.peak[pid] = max(self.peak.get(pid, 0), rss)
            me = values.get(self.me.pid, 0)
            self.timeline.append((time.perf_counter() - self._t0, me, sum(values.values()) - me))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _reset_peak(pid: int) -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) of a process: 5 > /proc/PID/clear_refs."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _status_bytes(pid: int, field: str) -> int | None:
    """A size field of /proc/PID/status (``VmHWM``: the kernel's peak RSS; ``RssShmem``: resident
    shared-memory pages, e.g. spec_compat's transfer segment mapped by a worker and the driver)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _vm_hwm(pid: int) -> int | None:
    return _status_bytes(pid, "VmHWM")


def _rss_shmem(pid: int) -> int:
    return _status_bytes(pid, "RssShmem") or 0


def measure_memory(generator: Any, prompts: list[list[int]]) -> Record:
    gc.collect()
    monitor = RssMonitor(0.05)
    executor = generator.executor
    original_rpc = executor.collective_rpc

    def traced_rpc(method: Any, *args: Any, **kwargs: Any) -> Any:
        if method == "_get_captured_states":
            monitor.mark("rpc _get_captured_states sent")
            result = original_rpc(method, *args, **kwargs)
            monitor.mark("rpc _get_captured_states received")
            return result
        return original_rpc(method, *args, **kwargs)

    executor.collective_rpc = traced_rpc
    from spec_compat.adapters.driver import results_contract

    original_check = results_contract.check_results

    def traced_check(*args: Any, **kwargs: Any) -> Any:
        # Called by spec_compat's results-contract wrapper after speculators' generate() returned.
        monitor.mark("spec_compat check_results start")
        try:
            return original_check(*args, **kwargs)
        finally:
            monitor.mark("spec_compat check_results end")

    results_contract.check_results = traced_check
    monitor.start()
    shmem_before = {pid: _rss_shmem(pid) for pid in monitor.baseline}
    time.sleep(0.2)
    start = time.perf_counter()
    try:
        results = generator.generate(prompts)
    finally:
        del executor.collective_rpc
        results_contract.check_results = original_check
    seconds = time.perf_counter() - start
    monitor.mark("generate returned")
    time.sleep(0.2)
    monitor.stop()
    returned = sum(int(h.numel()) * h.element_size() for r in results for h in r["hidden_states"])
    ids_bytes = sum(int(r["input_ids"].numel()) * r["input_ids"].element_size() for r in results)
    after = monitor._rss()
    hwm = {pid: _vm_hwm(pid) for pid in monitor.baseline}
    processes = []
    for pid, base in monitor.baseline.items():
        name = "driver" if pid == monitor.me.pid else monitor.names.get(pid, str(pid))
        peak = monitor.peak.get(pid, base)
        kernel_peak = hwm.get(pid)
        processes.append(
            {
                "pid": pid,
                "process": name,
                "rss_before_mb": base / 2**20,
                "rss_peak_mb": peak / 2**20,
                "rss_after_mb": after.get(pid, 0) / 2**20,
                "growth_mb": (peak - base) / 2**20,
                "growth_over_returned": (peak - base) / returned,
                "kernel_peak_mb": kernel_peak / 2**20 if kernel_peak else None,
                "kernel_growth_over_returned": (kernel_peak - base) / returned if kernel_peak else None,
                # the part of the growth that is the transfer segment's shared pages (still mapped after
                # the call), and the rest: the process's own memory
                "shmem_growth_mb": (_rss_shmem(pid) - shmem_before.get(pid, 0)) / 2**20,
                "kernel_growth_private_over_returned": (
                    (kernel_peak - base - (_rss_shmem(pid) - shmem_before.get(pid, 0))) / returned
                    if kernel_peak
                    else None
                ),
            }
        )
    driver = next(p for p in processes if p["process"] == "driver")
    workers = [p for p in processes if "Worker" in p["process"] or "spawn_main" in p["process"]]
    base_driver = monitor.baseline[monitor.me.pid]
    marks = [
        {"t": round(t, 3), "mark": name, "driver_growth_mb": (rss - base_driver) / 2**20}
        for t, name, rss in monitor.marks
    ]
    step = max(1, len(monitor.timeline) // 60)
    timeline = [
        [round(t, 2), round((me - base_driver) / 2**20, 1), round(rest / 2**20, 1)]
        for t, me, rest in monitor.timeline[::step]
    ]
    del results
    gc.collect()
    return {
        "prompts": len(prompts),
        "tokens": sum(len(p) for p in prompts),
        "layers": len(generator.layer_ids),
        "generate_s": seconds,
        "returned_bytes": returned,
        "returned_mb": returned / 2**20,
        "input_ids_mb": ids_bytes / 2**20,
        "samples": monitor.samples,
        "driver_growth_over_returned": driver["growth_over_returned"],
        "driver_kernel_growth_over_returned": driver["kernel_growth_over_returned"],
        "driver_kernel_growth_private_over_returned": driver["kernel_growth_private_over_returned"],
        "driver_shmem_growth_mb": driver["shmem_growth_mb"],
        "processes": processes,
        "worker_pids": [w["pid"] for w in workers],
        "marks": marks,
        "timeline_t_driverGrowthMB_childrenMB": timeline,
    }


# ---- 3 / 4. throughput: shimmed generator vs vLLM's LLM vs HF transformers ---------------------------


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_seconds() -> float:
    """user + system CPU seconds of this process and all its descendants (workers, engine core)."""
    import psutil

    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def _process_roles() -> dict[str, list[int]]:
    """pids by role: the generator's workers (children of this process), vLLM's engine core and its workers."""
    import psutil

    roles: dict[str, list[int]] = {"driver": [os.getpid()], "shim_workers": [], "engine_core": [], "vllm_workers": []}
    for child in psutil.Process().children():
        try:
            name = child.name()
            if "EngineCore" in name:
                roles["engine_core"].append(child.pid)
                roles["vllm_workers"].extend(c.pid for c in child.children(recursive=True) if "Worker" in c.name())
            elif "Worker" in name:
                roles["shim_workers"].append(child.pid)
        except psutil.Error:
            continue
    return roles


def _role_cpu(roles: dict[str, list[int]]) -> dict[str, float]:
    """Per role: CPU seconds (user + system), system seconds and minor page faults, summed over its pids."""
    import psutil

    out: dict[str, float] = {}
    for role, pids in roles.items():
        total = system = faults = 0.0
        for pid in pids:
            try:
                times = psutil.Process(pid).cpu_times()
                with open(f"/proc/{pid}/stat") as handle:
                    faults += int(handle.read().rpartition(")")[2].split()[7])
            except (psutil.Error, OSError):
                continue
            total += times.user + times.system
            system += times.system
        out[role] = total
        out[f"{role}_sys"] = system
        out[f"{role}_minflt"] = faults
    return out


class Breakdown:
    """Wall seconds spent in named calls during the shim's generate(); nested calls are kept
    apart (``top``: calls made directly by generate() and its wrappers, ``nested``: inside those)."""

    def __init__(self) -> None:
        self.top: dict[str, float] = {}
        self.nested: dict[str, float] = {}
        self.depth = 0
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, attr: str, key: Callable[[tuple[Any, ...]], str]) -> None:
        had_own = attr in vars(owner)
        original = getattr(owner, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            name = key(args)
            target = self.top if self.depth == 0 else self.nested
            self.depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1
                target[name] = target.get(name, 0.0) + time.perf_counter() - start

        setattr(owner, attr, wrapper)
        self._undo.append((owner, attr, original, had_own))

    def take(self) -> dict[str, dict[str, float]]:
        out = {"top": dict(self.top), "nested": dict(self.nested)}
        self.top.clear()
        self.nested.clear()
        return out


def instrument_shim(generator: Any) -> Breakdown:
    """Time the executor RPCs and spec_compat's own driver-side checks inside generate()."""
    from spec_compat.adapters.driver import input_order, input_validation, results_contract

    breakdown = Breakdown()
    executor = generator.executor
    breakdown.wrap(executor, "collective_rpc", lambda args: f"rpc {args[0] if isinstance(args[0], str) else 'fn'}")
    breakdown.wrap(executor, "execute_model", lambda args: "execute_model")
    breakdown.wrap(executor, "sample_tokens", lambda args: "sample_tokens")
    breakdown.wrap(generator.scheduler, "schedule", lambda args: "scheduler.schedule")
    # each where the generate() wrapper that calls it looks it up
    for module, name in (
        (results_contract, "check_results"),
        (input_validation, "validated_rows"),
        (input_order, "reorder_to_inputs"),
    ):
        breakdown.wrap(module, name, lambda args, name=name: f"spec_compat {name}")  # type: ignore[misc]
    return breakdown


def cell_throughput(spec: Spec) -> Record:
    import torch

    import spec_compat

    record: Record = {"timings": {}}
    report = spec_compat.apply(dtype="float32", strict=True)
    record["applied"] = report.applied
    from speculators.data_generation import VllmHiddenStatesGenerator

    model, tp, layer_ids = spec["model"], int(spec["tp"]), list(spec["layer_ids"])
    prompts: list[list[int]] = spec["prompts"]
    tokens = sum(len(p) for p in prompts)
    record.update({"model": os.path.basename(model), "tp": tp, "prompts": len(prompts), "tokens": tokens})
    generator: Any = None
    llm: Any = None
    try:
        start = time.perf_counter()
        generator = VllmHiddenStatesGenerator(
            model, layer_ids=layer_ids, max_model_len=spec["max_model_len"], tensor_parallel_size=tp
        )
        record["timings"]["generator_init_s"] = time.perf_counter() - start
        record["generator_compilation_mode"] = str(generator.vllm_config.compilation_config.mode)
        record["timings"]["generator_warmup_s"] = _timed(lambda: generator.generate(prompts[:4]))
        if spec.get("memory_prompts"):
            record["memory"] = measure_memory(generator, spec["memory_prompts"])

        runners: dict[str, Callable[[], Any]] = {"shim": lambda: generator.generate(prompts)}
        if spec.get("vllm", True):
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt

            start = time.perf_counter()
            llm = LLM(
                model=model,
                dtype="float32",
                enforce_eager=True,
                tensor_parallel_size=tp,
                max_model_len=spec["max_model_len"],
                max_num_seqs=32,  # the generator's MAX_NUM_SEQS
                max_num_batched_tokens=max(8192, spec["max_model_len"]),  # the generator's budget
                enable_prefix_caching=False,  # repeated prompts must not hit a cache
                seed=0,
            )
            record["timings"]["llm_init_s"] = time.perf_counter() - start
            record["llm_compilation_mode"] = str(llm.llm_engine.vllm_config.compilation_config.mode)
            params = SamplingParams(max_tokens=1, temperature=0.0)
            token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            runners["vllm"] = lambda: llm.generate(token_prompts, params, use_tqdm=False)
            record["timings"]["llm_warmup_s"] = _timed(lambda: llm.generate(token_prompts[:4], params, use_tqdm=False))
        if spec.get("hf", False):
            from transformers import AutoModelForCausalLM

            hf_threads = int(spec.get("hf_threads", tp))
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            hf.eval()  # type: ignore[no-untyped-call]
            record["hf_threads"] = hf_threads
            record["hf_attn_implementation"] = str(hf.config._attn_implementation)
            hidden_ids = [layer + 1 for layer in layer_ids]  # hidden_states[0] is the embedding output

            def run_hf(batch: list[list[int]]) -> list[list[Any]]:
                saved = torch.get_num_threads()
                torch.set_num_threads(hf_threads)
                out = []
                try:
                    with torch.inference_mode():
                        for ids in batch:
                            hs = hf(
                                input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False
                            ).hidden_states
                            out.append([hs[i][0] for i in hidden_ids])
                finally:
                    torch.set_num_threads(saved)
                return out

            runners["hf"] = lambda: run_hf(prompts)
            record["timings"]["hf_warmup_s"] = _timed(lambda: run_hf(prompts[:2]))
            # Sanity: same states as HF (its last hidden state is after the final norm: not compared).
            shim_first = generator.generate(prompts[:1])[0]["hidden_states"]
            hf_first = run_hf(prompts[:1])[0]
            last = len(hf.model.layers) - 1
            record["shim_vs_hf_max_abs_diff"] = {
                str(layer): float((a.float() - b.float()).abs().max())
                for layer, a, b in zip(layer_ids, shim_first, hf_first, strict=True)
                if layer != last
            }
            record["hf_max_abs_value"] = max(float(b.abs().max()) for b in hf_first)

        names = list(runners)
        roles = _process_roles()
        record["process_roles"] = {k: len(v) for k, v in roles.items()}
        breakdown = instrument_shim(generator)
        reps: list[dict[str, Any]] = []
        for rep in range(int(spec["reps"])):
            order = names if rep % 2 == 0 else names[::-1]
            seconds: dict[str, float] = {}
            cpu: dict[str, float] = {}
            by_role: dict[str, dict[str, float]] = {}
            for name in order:
                gc.collect()
                time.sleep(float(spec.get("settle_s", 1.5)))  # idle vLLM readers spin ~1 s before sleeping
                cpu_before = _cpu_seconds()
                roles_before = _role_cpu(roles)
                seconds[name] = _timed(runners[name])
                cpu[name] = _cpu_seconds() - cpu_before
                roles_after = _role_cpu(roles)
                by_role[name] = {k: round(roles_after[k] - roles_before[k], 3) for k in roles_after}
            row: dict[str, Any] = {f"{name}_tok_s": tokens / seconds[name] for name in names}
            row.update({f"{name}_cpu_s": cpu[name] for name in names})
            row["cpu_by_role_s"] = by_role
            row["shim_breakdown_s"] = breakdown.take()
            row["shim_s"] = seconds["shim"]
            row["loadavg_1m"] = os.getloadavg()[0]
            reps.append(row)
            print(
                f"[throughput tp={tp}] rep {rep}: "
                + ", ".join(f"{n}={tokens / seconds[n]:.0f} tok/s ({cpu[n]:.1f} cpu-s)" for n in names),
                flush=True,
            )
        record["reps"] = reps
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        if generator is not None:
            with contextlib.suppress(Exception):
                generator.executor.shutdown()
        kill_children()
    return record


CELLS: dict[str, Callable[[Spec], Record]] = {
    "fail_strict": cell_fail_strict,
    "fail_preflight": cell_fail_preflight,
    "fail_unshimmed": cell_fail_unshimmed,
    "import_baseline": cell_import_baseline,
    "import_apply": cell_import_apply,
    "throughput": cell_throughput,
}


def main() -> int:
    cell, spec_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(spec_path) as handle:
        spec = json.load(handle)
    record = CELLS[cell](spec)
    record["cell_wall_s"] = since_start()
    with open(out_path, "w") as handle:
        json.dump(record, handle)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - report anything, exit non-zero
        traceback.print_exc()
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: vLLM's atexit hooks are not part of any figure
