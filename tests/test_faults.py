"""Worker faults on a real TP=2 engine: each reaches the caller as an error naming the exception
type, the TP rank and the remote traceback, within 60 s, and no worker process is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine_harness import CellPool, engine_process_env, model_dir, record_figure

pytestmark = pytest.mark.engine
CELLS = Path(__file__).resolve().parent / "cells"
LIMIT_S = 60


SCENARIOS = ("errors", "transfer", "kill")


@dataclass(frozen=True)
class FaultScenarios:
    """Every scenario in ONE driver process (one engine each, started after the previous one is shut
    down): the driver's imports and apply() are paid once, not three times. A two-core pool job: the
    limits it checks are on its own processes' events."""

    name = "faults"
    cores = 2
    seconds_alone = 70  # three engines, one after another

    def run(self, work: Path, core: str | None) -> dict[str, Any]:
        out = work / "faults.json"
        proc = subprocess.run(
            [sys.executable, str(CELLS / "fault_cell.py"), str(model_dir("qwen3_moe")), ",".join(SCENARIOS), str(out)],
            env=engine_process_env("0.4.0.1", "0|1"), capture_output=True, text=True, timeout=600 * len(SCENARIOS),
        )  # fmt: skip
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        records: dict[str, Any] = json.loads(out.read_text())
        return records


FAULTS = FaultScenarios()


@pytest.fixture(scope="module")
def fault_records(engine_cells: CellPool) -> dict[str, Any]:
    records = engine_cells.result(FAULTS)
    for scenario, record in records.items():
        record_figure(f"faults-{scenario}", {k: v.get("seconds") for k, v in record.items() if isinstance(v, dict)})
    return records


def _assert_loud(outcome: dict[str, Any], exc_type: str, rank: int, in_traceback: str) -> None:
    assert outcome["raised"] == "WorkerError", outcome
    assert outcome["exc_type"] == exc_type and outcome["rank"] == rank, outcome
    assert f"TP rank {rank}" in outcome["text"] and "remote traceback" in outcome["text"], outcome["text"]
    assert in_traceback in outcome["text"], outcome["text"]
    assert outcome["seconds"] < LIMIT_S, outcome


@pytest.mark.reads(FAULTS)
def test_worker_exceptions_are_loud(fault_records: dict[str, Any]) -> None:
    record = fault_records["errors"]
    _assert_loud(record["rpc_empty_rank0"], "AssertionError", 0, "raise_on_rank_0")
    assert "AssertionError: (empty message)" in record["rpc_empty_rank0"]["text"]
    _assert_loud(record["speculators_rpc_empty_rank1"], "RuntimeError", 1, "broken")
    assert record["healthy_after"]["raised"] is None, record["healthy_after"]
    _assert_loud(record["forward_error"], "ValueError", 0, "injected failure in decoder layer 1")
    expected = {
        "empty_batch": "ValueError",
        "empty_sequence": "ValueError",
        "negative_id": "ValueError",
        "non_integer_id": "TypeError",
        "id_beyond_vocab": "ValueError",
        "float_tensor": "TypeError",
        "one_dim_tensor": "ValueError",
    }
    assert {name: outcome["raised"] for name, outcome in record["bad_input"].items()} == expected
    assert record["bad_input_reached_engine"] is False
    assert record["long_prompt"] == {"tokens": 127, "shape": [127, 128], "warned": True}
    assert record["orphans"] == []


@pytest.mark.reads(FAULTS)
def test_killed_worker_is_named(fault_records: dict[str, Any]) -> None:
    record = fault_records["kill"]
    killed = record["killed"]
    assert killed["raised"] == "WorkerError" and killed["exc_type"] == "WorkerProcessDied", killed
    assert killed["rank"] == 1 and "killed by signal 9 (SIGKILL)" in killed["text"], killed
    assert killed["seconds"] < LIMIT_S
    assert record["orphans"] == []


@pytest.mark.reads(FAULTS)
def test_transfer_faults_are_loud(fault_records: dict[str, Any]) -> None:
    """A NaN is found on the worker (before the copy) and named by request and layer, in a packed reply and in
    one written step by step; a worker killed half-way through writing its shared-memory segment surfaces as a
    named dead worker,
    and no segment outlives the executor."""
    record = fault_records["transfer"]
    nan = record["nan"]
    assert nan["raised"] == "ResultContractError", nan
    assert "(layer 2): " in nan["text"] and "non-finite values" in nan["text"], nan["text"]
    assert "(layer 0)" not in nan["text"], nan["text"]
    assert record["states_replies_after_nan"]["unverified"] == 1, record["states_replies_after_nan"]
    assert record["healthy_after"]["raised"] is None, record["healthy_after"]
    # the same NaN in a reply written step by step (captured-states-streamed): found and named the same way
    streamed = record["nan_streamed"]
    assert streamed["raised"] == "ResultContractError" and "(layer 2): " in streamed["text"], streamed
    assert "(layer 0)" not in streamed["text"], streamed["text"]
    after = record["states_replies_after_nan_streamed"]
    assert after["unverified"] == 2 and after["streamed"] >= 2, after  # healthy_after and this one
    killed = record["killed"]  # while a step's rows are written to the segment
    assert killed["raised"] == "WorkerError" and killed["exc_type"] == "WorkerProcessDied", killed
    assert killed["rank"] == 0 and "killed by signal 9 (SIGKILL)" in killed["text"], killed
    assert killed["seconds"] < LIMIT_S
    assert record["orphans"] == [] and record["transfer_directory"]
    assert record["transfer_directory_left"] is False
