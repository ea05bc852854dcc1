"""Fixtures shared by the test modules (pytest loads this file; test modules import only its type
aliases, for annotations)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from engine_harness import CellPool, jobs_read_by, require_speculators

EngineEnv = Callable[[str, str], dict[str, str]]
POOL = pytest.StashKey[CellPool]()


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


@pytest.fixture(scope="session")
def engine_cells(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CellPool]:
    """The jobs every collected test reads (engine cells, tests/cells/engine_cell.py, and the other
    runs of ``Job`` parameters and ``reads`` marks), each run once, in the background from the first
    test that asks (CellPool)."""
    pool = CellPool(jobs_read_by(request.session.items), tmp_path_factory.mktemp("pool"))
    request.config.stash[POOL] = pool
    yield pool
    pool.stop()


@pytest.fixture(scope="module", autouse=True)
def no_cell_beyond_its_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """The module that started the pool waits at its end until all of its jobs have run, so no
    engine runs in the background of a later module's timing-sensitive tests (faults, hangs, signals)."""
    yield
    pool = request.config.stash.get(POOL, None)
    if pool is not None:
        pool.wait()
