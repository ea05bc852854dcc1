"""The pool's grouping of engine cells (engine_harness.grouped): which cells share a driver process; and
which jobs run at once (engine_harness.CellPool)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engine_harness import Cell, CellGroup, CellPool, family_uses_mla, grouped, jobs_read_by, longest_first


class Other:
    """A job that is not an engine cell: never grouped."""

    name = "other"
    cores = 1

    def run(self, work: Path, core: str | None) -> str:
        return "ran"


def test_cells_of_one_driver_kind_are_grouped_at_the_first_ones_place() -> None:
    dense, moe = Cell("0.4.0.1", "dense", 1), Cell("0.4.0.1", "qwen3_moe", 1)
    mla, kimi = Cell("0.4.0.1", "deepseek_v3", 1), Cell("0.4.0.1", "kimi_k25", 1)
    other = Other()
    jobs, group_of = grouped([dense, other, mla, moe, kimi])
    assert [job.name for job in jobs] == [
        CellGroup((dense, moe)).name,
        "other",
        CellGroup((mla, kimi)).name,
    ]
    assert group_of[moe] is group_of[dense] and group_of[kimi] is group_of[mla]


@pytest.mark.parametrize(
    "second",
    [
        Cell("0.3.0", "qwen3_moe", 1),  # another speculators install
        Cell("0.4.0.1", "qwen3_moe", 2),  # another TP size (and cores)
        Cell("0.4.0.1", "qwen3_moe", 1, apply=False),
        Cell("0.4.0.1", "qwen3_moe", 1, disable=("request-kwargs",)),
        Cell("0.4.0.1", "qwen3_moe", 1, env=(("SPEC_COMPAT_VLLM_VERSION", "not-a-version"),)),
        Cell("0.4.0.1", "deepseek_v3", 1),  # MLA: the attention backend option is read at apply()
    ],
    ids=lambda cell: cell.name,
)
def test_cells_of_another_driver_kind_stay_apart(second: Cell) -> None:
    first = Cell("0.4.0.1", "dense", 1)
    jobs, group_of = grouped([first, second])
    assert jobs == [first, second] and group_of == {}


def test_mla_is_read_from_the_family_description() -> None:
    assert family_uses_mla("deepseek_v3") and family_uses_mla("kimi_k25")
    assert not family_uses_mla("dense") and not family_uses_mla("qwen3_moe")


def test_a_grouped_cell_reads_its_own_part_of_the_groups_result(tmp_path: Path, monkeypatch: Any) -> None:
    a, b = Cell("0.4.0.1", "dense", 1), Cell("0.4.0.1", "qwen3_moe", 1)
    ran: list[tuple[Cell, ...]] = []

    def fake_run_cells(cells: tuple[Cell, ...], work: Path, core: str | None = None) -> dict[Cell, Any]:
        ran.append(cells)
        return {cell: ({"family": cell.family}, "") for cell in cells}

    monkeypatch.setattr("engine_harness.run_cells", fake_run_cells)
    pool = CellPool([a, b], tmp_path)
    assert pool.result(b) == ({"family": "qwen3_moe"}, "")
    assert pool.result(a) == ({"family": "dense"}, "")
    pool.wait()
    assert ran == [(a, b)]  # one process for both


class TwoCores:
    """A two-core job that records when it started and ended."""

    cores = 2

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log = name, log

    def run(self, work: Path, core: str | None) -> None:
        self.log.append(("start", self.name))
        time.sleep(0.3)
        self.log.append(("end", self.name))


def test_two_core_jobs_run_two_at_a_time_after_the_one_core_jobs(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    first, other, second = TwoCores("first", log), Other(), TwoCores("second", log)
    pool = CellPool([first, other, second], tmp_path)
    assert pool.result(other) == "ran"
    pool.wait()
    assert sorted(log[:2]) == [("start", "first"), ("start", "second")]  # both started before either ended
    assert sorted(log[2:]) == [("end", "first"), ("end", "second")]


def test_jobs_that_say_they_are_long_start_first_the_others_keep_their_order() -> None:
    log: list[tuple[str, str]] = []
    a, b, long_one = TwoCores("a", log), TwoCores("b", log), TwoCores("long", log)
    long_one.seconds_alone = 100  # type: ignore[attr-defined]
    assert longest_first([a, b, long_one]) == [long_one, a, b]


class CollectedTest:
    """What jobs_read_by reads of a collected test: its parameters, fixtures and ``reads`` marks."""

    def __init__(self, params: dict[str, Any], fixturenames: list[str], reads: tuple[Any, ...] = ()) -> None:
        self.callspec = type("CallSpec", (), {"params": params})()
        self.fixturenames, self.reads = fixturenames, reads

    def iter_markers(self, name: str) -> list[pytest.Mark]:
        return [pytest.mark.reads(*self.reads).mark] if name == "reads" and self.reads else []


def test_only_the_tests_that_use_the_pool_give_it_jobs() -> None:
    read, built, marked = Cell("0.4.0.1", "dense", 1), Cell("0.4.0.1", "qwen3_moe", 1), Other()
    items = [
        CollectedTest({"cell": built}, ["cell"]),  # a unit test that only builds a cell
        CollectedTest({"cell": read}, ["cell", "engine_cells"]),
        CollectedTest({}, ["fixture_reading_the_pool", "engine_cells"], reads=(marked,)),
    ]
    assert jobs_read_by(items) == [read, marked]  # type: ignore[arg-type]
