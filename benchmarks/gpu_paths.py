"""The measured paths of ``benchmarks/gpu.py``, each run in a fresh interpreter.

``python3 benchmarks/gpu.py --path NAME SPEC_JSON OUT_JSON`` calls ``run(NAME, spec)`` and writes
the record it returns. Every path: build the engine (timed: ``engine_start_s``), one warm-up call,
then ``spec["reps"]`` timed calls (``torch.cuda.synchronize()`` around each where CUDA is present).

shim         speculators' untouched ``VllmHiddenStatesGenerator.generate()`` through ``spec_compat.apply()``,
             with ``spec_compat.timings()`` per call (where spec_compat has it) and one extra call under cProfile.
llm_eager    ``vllm.LLM(..., enforce_eager=True).generate(max_tokens=1)``.
llm_default  the same with CUDA graphs and torch.compile (vLLM's defaults).
native       vLLM's own ``extract_hidden_states`` speculative method with ``ExampleHiddenStatesConnector``
             writing the same layers as safetensors files; a call ends when every file is written (the
             connector's per-file ``.lock`` is released), ``return_s`` is when ``generate()`` returned.
native_disk  (gpu.py) the same with its files on extract's disk, each fsync'd before the call ends.

The ``extract`` path is the ``spec-compat extract`` CLI itself, started by ``gpu.py`` directly.
Only imports from the standard library at module level: vLLM's spawned workers import ``__main__``.
"""

from __future__ import annotations

import contextlib
import cProfile
import fcntl
import gc
import hashlib
import json
import os
import pstats
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

Spec = dict[str, Any]
Record = dict[str, Any]


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def throughput(tokens: int, seconds: list[float]) -> dict[str, Any]:
    rates = [tokens / s for s in seconds]
    return {
        "timings_s": seconds,
        "tokens_per_s": rates,
        "tokens_per_s_best": max(rates),
        "tokens_per_s_median": statistics.median(rates),
    }


# ---- shim -------------------------------------------------------------------------------------------------


def split_timings(timings: dict[str, float]) -> dict[str, float]:
    """Sum spec_compat's accumulated seconds by kind: "own:" (its own work) and "transfer:" (moving the data)."""
    own = sum(v for k, v in timings.items() if k.startswith("own:"))
    transfer = sum(v for k, v in timings.items() if k.startswith("transfer:"))
    return {"own_s": own, "transfer_s": transfer}


def profile_call(call: Any, package_dirs: tuple[str, ...], top: int = 25) -> dict[str, Any]:
    """One call under cProfile (driver process only): the top functions by cumulative time, and the
    total own time (tottime) of functions in spec_compat's package."""
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    call()
    profiler.disable()
    wall = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    rows = []
    own = 0.0
    for (file, line, name), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if file.startswith(package_dirs):
            own += tottime
        short = "/".join(Path(file).parts[-3:]) if file.startswith("/") else file
        rows.append({"function": f"{short}:{line}({name})", "ncalls": ncalls, "tottime": tottime, "cumtime": cumtime})
    rows.sort(key=lambda r: -float(r["cumtime"]))
    return {
        "wall_s": wall,
        "spec_compat_tottime_s": own,
        "spec_compat_tottime_fraction": own / wall,
        "top_cumulative": rows[:top],
    }


def save_reference(results: list[dict[str, Any]], path: str) -> None:
    """The first prompt's hidden states, [tokens, layers, hidden] float32, for the native path's check."""
    import torch

    torch.save(torch.stack([h.float() for h in results[0]["hidden_states"]], dim=1), path)


def memory_status() -> dict[str, int]:
    """This process's resident and peak resident bytes (VmRSS, VmHWM), and locked (pinned) bytes."""
    values: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmLck", "VmPin"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def reset_peak_rss() -> bool:
    """Start a new VmHWM window (Linux: writing 5 to clear_refs resets the peak resident size)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def digest(results: list[dict[str, Any]]) -> str:
    """sha256 over every returned tensor's bytes, dtype and shape, in result order (bitwise equality
    across processes without shipping the tensors)."""
    import torch

    hasher = hashlib.sha256()
    for result in results:
        for tensor in [result["input_ids"], *result["hidden_states"]]:
            hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            hasher.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def shim_set(generator: Any, spec: Spec, entry: Spec, spec_compat: Any, package_dirs: tuple[str, ...]) -> Record:
    """One prompt set on a running shim engine: a warm-up call, ``reps`` timed calls (each with its
    spec_compat timings, peak RSS and digest), one call under cProfile."""
    prompts = json.loads(Path(entry["prompts_file"]).read_text())
    tokens = sum(min(len(p), spec["max_model_len"] - 1) for p in prompts)
    timings_fn = getattr(spec_compat, "timings", None)
    reset_fn = getattr(spec_compat, "reset_timings", None)
    sync()
    started = time.perf_counter()
    results = generator.generate(prompts)
    sync()
    warmup_s = time.perf_counter() - started
    shape_ok = len(results) == len(prompts) and all(len(r["hidden_states"]) == len(spec["layer_ids"]) for r in results)
    digests = [digest(results)] if spec.get("digest") else []
    if entry.get("reference"):
        save_reference(results, entry["reference"])
    returned_bytes = sum(h.numel() * h.element_size() for r in results for h in r["hidden_states"])
    seconds: list[float] = []
    breakdowns: list[dict[str, float] | None] = []
    memory: list[dict[str, int]] = []
    for rep in range(spec["reps"]):
        results = []  # drop the previous call's tensors before the next call
        gc.collect()
        if reset_fn is not None:
            reset_fn()
        peak_reset = reset_peak_rss()
        sync()
        started = time.perf_counter()
        results = generator.generate(prompts)
        sync()
        seconds.append(time.perf_counter() - started)
        memory.append({**memory_status(), "peak_reset": int(peak_reset)})
        breakdowns.append({k: float(v) for k, v in timings_fn().items()} if timings_fn is not None else None)
        if spec.get("digest") and rep == spec["reps"] - 1:  # the warm-up's and the last call's (~1 s per GB)
            digests.append(digest(results))
    results = []
    gc.collect()
    package_profile = profile_call(lambda: generator.generate(prompts), package_dirs)
    overhead: dict[str, Any] = {"timings_available": timings_fn is not None, "per_call": breakdowns}
    if timings_fn is not None:
        parts = [split_timings(b or {}) for b in breakdowns]
        fractions = [p["own_s"] / s for p, s in zip(parts, seconds, strict=True)]
        overhead.update(
            own_s=[p["own_s"] for p in parts],
            transfer_s=[p["transfer_s"] for p in parts],
            overhead_fractions=fractions,
            overhead_fraction=statistics.median(fractions),
            transfer_fraction=statistics.median(p["transfer_s"] / s for p, s in zip(parts, seconds, strict=True)),
        )
    else:
        overhead["overhead_fraction"] = None
    return {
        "prompts": len(prompts),
        "tokens": tokens,
        "returned_bytes": returned_bytes,
        "warmup_s": warmup_s,
        **throughput(tokens, seconds),
        "results_shape_ok": shape_ok,
        "digests": digests,
        "memory_per_call": memory,
        "overhead": overhead,
        "profile": package_profile,
    }


def run_shim(spec: Spec) -> Record:
    import spec_compat

    report = spec_compat.apply(strict=True, dtype=spec["dtype"])
    from speculators.data_generation import VllmHiddenStatesGenerator

    package = Path(spec_compat.__file__).parent
    package_dirs = (str(package) + os.sep, str(package.resolve()) + os.sep)
    started = time.perf_counter()
    generator = VllmHiddenStatesGenerator(
        spec["model"], layer_ids=spec["layer_ids"], max_model_len=spec["max_model_len"], tensor_parallel_size=1
    )
    engine_start_s = time.perf_counter() - started
    sets = {entry["name"]: shim_set(generator, spec, entry, spec_compat, package_dirs) for entry in spec["sets"]}
    rss_calls = []
    if spec.get("rss_calls"):  # driver memory over many calls of the first set: no growth
        prompts = json.loads(Path(spec["sets"][0]["prompts_file"]).read_text())
        for _ in range(spec["rss_calls"]):
            results = generator.generate(prompts)
            del results
            rss_calls.append(memory_status().get("VmRSS", 0))
    executor = generator.executor
    mapped = getattr(getattr(executor, "transfer_mappings", None), "maps", {})
    mappings = getattr(executor, "transfer_mappings", None)
    transfer_info = {
        "segments_mapped_bytes": sum(len(m) for m in mapped.values()),  # pinned by the worker (cudaHostRegister)
        "segments_handed_over": getattr(mappings, "held_count", None),
        "handover_refused": getattr(mappings, "refused", None),
        "segments_made": len(getattr(mappings, "segments_seen", ())),
    }
    executor.shutdown()
    return {
        "engine_start_s": engine_start_s,
        "engine": {
            "max_num_batched_tokens": getattr(generator.vllm_config.scheduler_config, "max_num_batched_tokens", None),
            "max_num_seqs": getattr(generator.vllm_config.scheduler_config, "max_num_seqs", None),
        },
        "sets": sets,
        "rss_after_each_call": rss_calls,
        "transfer": transfer_info,
        "applied": list(report.applied),
        "disabled": os.environ.get("SPEC_COMPAT_DISABLE", ""),
        "device": device_name(),
    }


# ---- vLLM's LLM.generate and native extraction ---------------------------------------------------------------


def wait_written(outputs: list[Any]) -> list[str]:
    """The connector writes each request's file in a thread after generate() returns, holding an
    exclusive flock on ``<file>.lock`` until it is written: take a shared lock on each, as a reader would."""
    files = []
    for out in outputs:
        path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"request {out.request_id}: no hidden_states_path in kv_transfer_params")
        lock = path + ".lock"
        if os.path.exists(lock):
            with open(lock) as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)
        files.append(path)
    return files


def fsync_all(files: list[str], threads: int = 8) -> None:
    """Every file and its folder on the disk, on ``threads`` threads as extract's 8 writers fsync
    theirs: the ``native_disk`` path ends when its files are as durable as extract's."""
    from concurrent.futures import ThreadPoolExecutor

    def one(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))
        list(pool.map(one, sorted({os.path.dirname(f) for f in files})))


def written_and_durable(outputs: list[Any], spec: Spec) -> list[str]:
    files = wait_written(outputs)
    if spec.get("native_fsync"):
        fsync_all(files)
    return files


def wipe(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)


def compare_with_shim(file: str, reference: str, layers: int) -> dict[str, Any]:
    """The native file of prompt 0 against the shim's hidden states of prompt 0: same layers captured?"""
    import torch
    from safetensors.torch import load_file

    native = load_file(file)["hidden_states"].float()
    shim = torch.load(reference)
    if native.shape != shim.shape:
        return {"native_shape": list(native.shape), "shim_shape": list(shim.shape), "same_shape": False}
    rel = [
        float(((native[:, k] - shim[:, k]).norm(dim=-1) / shim[:, k].norm(dim=-1).clamp_min(1e-12)).max())
        for k in range(layers)
    ]
    cos = [float(torch.nn.functional.cosine_similarity(native[:, k], shim[:, k], dim=-1).min()) for k in range(layers)]
    return {"same_shape": True, "shape": list(native.shape), "rel_l2_max_per_layer": rel, "cosine_min_per_layer": cos}


def llm_kwargs(spec: Spec, eager: bool, native: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec["dtype"],
        "max_model_len": spec["max_model_len"],
        "enforce_eager": eager,
        "enable_prefix_caching": False,
        "gpu_memory_utilization": spec["gpu_memory_utilization"],
    }
    if native:
        kwargs["enable_chunked_prefill"] = False  # the connector refuses chunked prefill
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": spec["native_layer_ids"]}},
        }
        kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": spec["native_storage"]},
        }
    return kwargs


def shutdown_llm(llm: Any) -> None:
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


def run_llm(spec: Spec, eager: bool) -> Record:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0)
    started = time.perf_counter()
    llm = LLM(**llm_kwargs(spec, eager=eager, native=False))
    engine_start_s = time.perf_counter() - started
    sets: dict[str, Record] = {}
    for entry in spec["sets"]:
        prompts = json.loads(Path(entry["prompts_file"]).read_text())
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        sync()
        started = time.perf_counter()
        llm.generate(requests, params, use_tqdm=False)
        sync()
        warmup_s = time.perf_counter() - started
        seconds = []
        for _ in range(spec["reps"]):
            sync()
            started = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            sync()
            seconds.append(time.perf_counter() - started)
            assert len(outputs) == len(prompts)
        tokens = sum(len(p) for p in prompts)
        sets[entry["name"]] = {
            "prompts": len(prompts),
            "tokens": tokens,
            "warmup_s": warmup_s,
            **throughput(tokens, seconds),
        }
    shutdown_llm(llm)
    return {"engine_start_s": engine_start_s, "sets": sets, "device": device_name()}


def native_set(llm: Any, spec: Spec, entry: Spec) -> Record:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(entry["prompts_file"]).read_text())
    tokens = sum(len(p) for p in prompts)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = SamplingParams(max_tokens=1, temperature=0)
    storage = spec["native_storage"]
    wipe(storage)
    sync()
    started = time.perf_counter()
    files = written_and_durable(llm.generate(requests, params, use_tqdm=False), spec)
    sync()
    warmup_s = time.perf_counter() - started
    reference = entry.get("reference")
    vs_shim = (
        compare_with_shim(files[0], reference, len(spec["layer_ids"]))
        if reference and os.path.exists(reference)
        else None
    )
    seconds, returned, written, counts = [], [], [], []
    for _ in range(spec["reps"]):
        wipe(storage)  # outside the timed region
        sync()
        started = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        returned.append(time.perf_counter() - started)
        files = written_and_durable(outputs, spec)
        sync()
        seconds.append(time.perf_counter() - started)
        written.append(sum(os.path.getsize(f) for f in files))
        counts.append(len(files))
    wipe(storage)
    return {
        "prompts": len(prompts),
        "tokens": tokens,
        "warmup_s": warmup_s,
        **throughput(tokens, seconds),
        "return_s": returned,
        "tokens_per_s_return_median": statistics.median(tokens / s for s in returned),
        "bytes_written": written,
        "files_written": counts,
        "vs_shim_prompt0": vs_shim,
    }


def run_native(spec: Spec) -> Record:
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**llm_kwargs(spec, eager=True, native=True))
    engine_start_s = time.perf_counter() - started
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    sets = {entry["name"]: native_set(llm, spec, entry) for entry in spec["sets"]}
    shutdown_llm(llm)
    return {
        "engine_start_s": engine_start_s,
        "engine": {
            "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
            "max_num_seqs": getattr(scheduler, "max_num_seqs", None),
        },
        "sets": sets,
        "storage": spec["native_storage"],
        "fsync": bool(spec.get("native_fsync")),
        "native_layer_ids": spec["native_layer_ids"],
        "device": device_name(),
    }


def run(name: str, spec: Spec) -> Record:
    if name == "shim":
        return run_shim(spec)
    if name == "native":
        return run_native(spec)
    if name == "llm_eager":
        return run_llm(spec, eager=True)
    if name == "llm_default":
        return run_llm(spec, eager=False)
    raise ValueError(f"unknown path {name}")
