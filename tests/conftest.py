"""Fixtures shared by the test modules (pytest loads this file; test modules import only its type
aliases, for annotations)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from engine_harness import require_speculators

EngineEnv = Callable[[str, str], dict[str, str]]


@pytest.fixture(scope="session")
def engine_env() -> EngineEnv:
    """``engine_env(speculators, threads_bind)``: the environment of a subprocess that starts a
    real CPU engine: this process's, that speculators install on PYTHONPATH (skipped, or failed
    under CI, when it is not provided), the KV cache at 1 GiB unless set, and vLLM's OpenMP threads
    bound to ``threads_bind`` ("0", "0|1": one core per TP rank)."""

    def make(speculators: str, threads_bind: str) -> dict[str, str]:
        return dict(
            os.environ,
            PYTHONPATH=str(require_speculators(speculators)),
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_CPU_OMP_THREADS_BIND=threads_bind,
        )

    return make
