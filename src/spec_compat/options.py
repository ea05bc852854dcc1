"""User options, passed from the driver to vLLM worker processes through the environment."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from types import ModuleType

from .detect import Environment

DTYPE_ENV = "SPEC_COMPAT_DTYPE"
# A vLLM attention backend name (AttentionBackendEnum), e.g. CPU_MLA: vLLM's reference MLA backend on CPU,
# which takes float32 (on an AMX host vLLM picks AMX_MLA, bfloat16 only).
ATTENTION_BACKEND_ENV = "SPEC_COMPAT_ATTENTION_BACKEND"
DISABLE_ENV = "SPEC_COMPAT_DISABLE"  # comma-separated adapter ids to leave out (for diagnosis)
WORKER_LOG_ENV = "SPEC_COMPAT_WORKER_LOG_LEVEL"  # e.g. INFO: show speculators' worker log lines
RPC_TIMEOUT_ENV = "SPEC_COMPAT_RPC_TIMEOUT"  # seconds: deadline of every worker RPC / model step of generate()
# 30 minutes. A healthy call is far shorter: one step of a 1T-parameter MoE (32B active, Kimi-K2 class)
# at TP=8 on H200s over a 32k-token batch is ~2e15 FLOPs, about a second; its captured states (4 layers
# x 7168 x 32k x bf16, 1.9 GB) copy in about a second more. But speculators' generator never warms the
# engine up, so its first step also pays what vLLM's engine does at start-up: Triton / DeepGEMM /
# FlashInfer JIT compilation and autotuning of the MoE and attention kernels for new shapes, reported at
# 5-20 minutes on large MoE models. 30 minutes leaves room for that and is still an answer where today
# there is none (the user's story: a 25-minute load, then no output at all). The engine load itself
# (worker start, weights, KV cache, capture set-up) has no deadline.
DEFAULT_RPC_TIMEOUT_S = 1800.0
# Set only while spec_compat's executor starts its workers, so that the worker-side adapters
# run in those workers and nowhere else (other vLLM engines in the process are untouched).
WORKER_ENV = "SPEC_COMPAT_WORKER_OPTIONS"
PLUGIN_NAME = "spec_compat"  # the vllm.general_plugins entry point (plugin.py)

VALID_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
VALID_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Options:
    """``dtype``: the model dtype the generator loads with (speculators hard-codes "auto", which
    vLLM on CPU turns into bfloat16 even for a float32 checkpoint). ``check_results``: verify
    every ``generate()`` result against the output contract. ``disable``: adapter ids to leave
    out, to see what a break looks like without its adapter. ``worker_log_level``: show log lines
    of speculators' worker code (and spec_compat's) from every TP worker at this level, prefixed
    with the rank (vLLM only configures its own loggers there, so INFO lines are lost).
    ``rpc_timeout_s``: the deadline of every worker RPC and model step generate() drives
    (``DEFAULT_RPC_TIMEOUT_S``; the engine load has none). ``attention_backend``: the vLLM attention
    backend the engine uses (an ``AttentionBackendEnum`` name such as "CPU_MLA"; speculators' config leaves
    vLLM to choose)."""

    dtype: str | None = None
    check_results: bool = True
    disable: tuple[str, ...] = ()
    worker_log_level: str | None = None
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.attention_backend is not None and (
            not isinstance(self.attention_backend, str) or not self.attention_backend.strip()
        ):
            raise ValueError(f"attention_backend must be a vLLM attention backend name, got {self.attention_backend!r}")
        if self.dtype is not None and self.dtype not in VALID_DTYPES:
            raise ValueError(f"dtype must be one of {VALID_DTYPES} or None, got {self.dtype!r}")
        if self.worker_log_level is not None and self.worker_log_level.upper() not in VALID_LOG_LEVELS:
            raise ValueError(f"worker_log_level must be one of {VALID_LOG_LEVELS}, got {self.worker_log_level!r}")
        object.__setattr__(self, "rpc_timeout_s", check_rpc_timeout(self.rpc_timeout_s, "rpc_timeout_s"))

    @classmethod
    def from_env(
        cls,
        dtype: str | None = None,
        check_results: bool = True,
        disable: tuple[str, ...] = (),
        worker_log_level: str | None = None,
        rpc_timeout_s: float | None = None,
        attention_backend: str | None = None,
    ) -> Options:
        from_env = tuple(x.strip() for x in os.environ.get(DISABLE_ENV, "").split(",") if x.strip())
        if rpc_timeout_s is None:
            raw = os.environ.get(RPC_TIMEOUT_ENV, "").strip()
            rpc_timeout_s = check_rpc_timeout(raw, RPC_TIMEOUT_ENV) if raw else DEFAULT_RPC_TIMEOUT_S
        return cls(
            dtype=dtype if dtype is not None else os.environ.get(DTYPE_ENV) or None,
            check_results=check_results,
            disable=tuple(sorted(set(disable) | set(from_env))),
            worker_log_level=worker_log_level or os.environ.get(WORKER_LOG_ENV) or None,
            rpc_timeout_s=rpc_timeout_s,
            attention_backend=attention_backend or os.environ.get(ATTENTION_BACKEND_ENV, "").strip() or None,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Options:
        values = json.loads(text)
        values["disable"] = tuple(values.get("disable", ()))
        return cls(**values)


def check_rpc_timeout(value: object, name: str) -> float:
    """``value`` (a number; text only from the environment) as a positive, finite number of seconds."""
    accepted = (int, float, str) if name == RPC_TIMEOUT_ENV else (int, float)
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{name} must be a positive, finite number of seconds, got {value!r} (to run without a deadline, "
            "disable the adapter: apply(disable=['executor-rpc-deadline']))"
        )
    return seconds


@dataclass
class Context:
    env: Environment
    options: Options
    generator: ModuleType | None = None  # speculators.data_generation.vllm_hidden_states_generator
    worker: ModuleType | None = None  # speculators.data_generation.custom_worker
