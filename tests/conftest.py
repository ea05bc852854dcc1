"""Fixtures shared by the test modules (pytest loads this file)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_harness import CellPool, jobs_read_by

POOL = pytest.StashKey[CellPool]()


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
    engine runs in the background of the processes a later test starts itself."""
    yield
    pool = request.config.stash.get(POOL, None)
    if pool is not None:
        pool.wait()
