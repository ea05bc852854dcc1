"""Adapter ``worker-malloc-retain``: glibc malloc settings for the CPU workers spec_compat starts.

speculators' capture copies every captured state a few times per call; glibc returns that memory
to the kernel and vLLM's own temporaries fault it in again. The workers keep freed memory instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from ....environ import scoped_environ
from ....options import Context
from ....patching import AdapterPatcher
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import ExecutorHook

# Keep freed memory in the worker's heap instead of returning it to the kernel after every call.
WORKER_MALLOC_ENV = (
    ("MALLOC_MMAP_THRESHOLD_", str(1 << 30)),
    ("MALLOC_TRIM_THRESHOLD_", str(1 << 32)),
    ("MALLOC_TOP_PAD_", str(1 << 29)),
)


def malloc_env(settings: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The settings the workers start with, each only where the user left it unset."""
    return {key: value for key, value in settings if key not in os.environ}


class WorkerMalloc(ExecutorHook):
    def __init__(self, settings: tuple[tuple[str, str], ...] = WORKER_MALLOC_ENV) -> None:
        self.settings = settings

    def start(self, executor: Any) -> contextlib.AbstractContextManager[object] | None:
        return scoped_environ(malloc_env(self.settings))


def apply_worker_malloc(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, WorkerMalloc())


def probe_worker_malloc(ctx: Context) -> Probe:
    if ctx.env.platform != "cpu":
        return Probe(False, f"platform {ctx.env.platform!r}: captured states live in device memory")
    if sys.platform != "linux":
        return Probe(False, "not glibc/Linux")
    preset = [key for key, _ in WORKER_MALLOC_ENV if key in os.environ]
    if len(preset) == len(WORKER_MALLOC_ENV):
        return Probe(False, f"the user set {preset} already")
    return Probe(
        True,
        "CPU workers copy every captured state ~4 times per call (speculators' capture); glibc returns that "
        "memory to the kernel and vLLM's own temporaries fault in again (MoE TP=2: ~2x the page faults, 0.8x "
        "vLLM's throughput); the workers keep freed memory instead",
    )


WORKER_MALLOC_RETAIN = Adapter(
    id="worker-malloc-retain",
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how=(
        "hook WorkerMalloc: the environment of the worker processes spec_compat's executor starts "
        "(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_; each only if unset)"
    ),
    why=(
        "throughput on CPU MoE TP=2 was 0.8x vLLM's own LLM.generate: page faults after glibc returns the capture "
        "copies' memory to the kernel (benchmarks #5, docs/benchmarks.md section 3)"
    ),
    vllm_change="none: speculators' worker-side capture copies on the CPU platform",
    detect="platform is cpu (captures in host memory) and the variables are not all set by the user",
    delete_when="speculators captures without per-step copies, or vLLM's CPU workers preload tcmalloc",
    side="driver",
    probe=probe_worker_malloc,
    apply=apply_worker_malloc,
)
