"""Never a silent wait (issue 14) on a real TP=2 engine: a rank blocked forever inside
_get_captured_states (rank 1, then the reply rank 0) surfaces as WorkerTimeout naming the silent
rank, with its Python stack, within the deadline plus the shutdown, and no worker is left; a later
call fails at once. A driver interrupted by SIGINT / SIGTERM in the middle of generate() exits
within seconds with its workers gone; a second SIGINT forces the exit.

Each run is a two-core pool job (beside another two-core job): its own driver process with its own
engine, every limit checked on that process's own events, far above what it takes on a loaded machine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cells.outcomes import alive
from engine_harness import CellPool, engine_process_env, model_dir, record_figure

pytestmark = pytest.mark.engine
CELLS = Path(__file__).resolve().parent / "cells"
RPC_TIMEOUT_S = 8.0
SLACK_S = 60.0  # a shared 2-core machine: generous on top of the deadline
SIGNAL_EXIT_LIMIT_S = 45.0
# name: (the signals sent, the exit status expected)
SIGNAL_CASES = {
    "sigterm": ([signal.SIGTERM], 128 + signal.SIGTERM),
    "sigint": ([signal.SIGINT], -signal.SIGINT),  # an uncaught KeyboardInterrupt exits by SIGINT
    "sigint-twice": ([signal.SIGINT, signal.SIGINT], 128 + signal.SIGINT),
}


@dataclass(frozen=True)
class BlockedRank:
    """hang_cell.py's record: rank 1, then rank 0, blocked forever (one engine each). A two-core pool
    job."""

    name = "hang-blocked-rank"
    cores = 2
    seconds_alone = 65  # two engines, each with a blocked call and its 8 s deadline

    def run(self, work: Path, core: str | None) -> dict[str, Any]:
        out = work / "hang.json"
        proc = subprocess.run(
            [sys.executable, str(CELLS / "hang_cell.py"), str(model_dir("qwen3_moe")), str(RPC_TIMEOUT_S), str(out)],
            env=engine_process_env("0.4.0.1", "0|1"), capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        record: dict[str, Any] = json.loads(out.read_text())
        return record


BLOCKED = BlockedRank()


@dataclass(frozen=True)
class Interrupted:
    """signal_client.py interrupted in generate() by its case's signals (``SIGNAL_CASES``). A two-core
    pool job."""

    case: str
    cores = 2

    @property
    def name(self) -> str:
        return f"signal-{self.case}"

    def run(self, work: Path, core: str | None) -> dict[str, Any]:
        return _interrupt(work, SIGNAL_CASES[self.case][0], engine_process_env("0.4.0.1", "0|1"))


def _interrupt(work: Path, signals: list[int], env: dict[str, str]) -> dict[str, Any]:
    """Start the client, wait until generate() is in flight, send ``signals`` (the next one once the
    shutdown message appeared); returns exit code, seconds from the first signal to exit, leftovers."""
    out, marker, log = work / "pids.json", work / "in_generate", work / "client.log"
    with log.open("w") as sink:
        client = subprocess.Popen(
            [sys.executable, str(CELLS / "signal_client.py"), str(model_dir("qwen3_moe")), str(out), str(marker)],
            env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while not marker.exists():
                assert client.poll() is None, log.read_text()[-5000:]
                assert time.monotonic() < deadline, "generate() never reached the slow call"
                time.sleep(0.2)
            time.sleep(0.5)  # the driver is now waiting for rank 0's reply
            sent = time.monotonic()
            client.send_signal(signals[0])
            for signum in signals[1:]:
                while "shutting the engine down" not in log.read_text() and client.poll() is None:
                    time.sleep(0.05)
                client.send_signal(signum)
            code = client.wait(timeout=SIGNAL_EXIT_LIMIT_S + 60)
            seconds = time.monotonic() - sent
        finally:
            if client.poll() is None:
                client.kill()
    pids = json.loads(out.read_text())
    time.sleep(0.5)
    return {
        "code": code,
        "seconds": seconds,
        "left": [p for p in pids["workers"] if alive(p)],
        "log": log.read_text(),
    }


@pytest.mark.reads(BLOCKED)
def test_blocked_rank_is_reported_and_the_engine_shut_down(engine_cells: CellPool, tmp_path: Path) -> None:
    record = engine_cells.result(BLOCKED)
    (tmp_path / "hang_report.txt").write_text(record["rank1"]["blocked"]["text"])
    cases = ("rank1", "rank0")
    figures = {f"{c}_{step}_s": record[c][step]["seconds"] for c in cases for step in ("blocked", "later")}
    record_figure("hang-blocked-rank", figures | {"rpc_timeout_s": RPC_TIMEOUT_S})
    for case, stuck, answered in (("rank1", 1, 0), ("rank0", 0, 1)):
        result = record[case]
        assert result["healthy"]["raised"] is None, result["healthy"]
        blocked = result["blocked"]
        assert blocked["raised"] == "WorkerTimeout" and blocked["is_worker_error"], blocked
        assert blocked["stuck"] == [stuck] and blocked["answered"] == [answered] and blocked["rank"] == stuck, blocked
        text = blocked["text"]
        assert f"answered: TP rank {answered}; no reply: TP rank {stuck}" in text, text
        assert f"TP rank {stuck}: Python stack at the deadline (all threads)" in text, text
        assert "in blocked_forever_in_get_captured_states" in text and "in worker_busy_loop" in text, text
        assert f"TP rank {stuck} (pid {result['pids'][stuck]}): alive" in text and "NO REPLY" in text, text
        assert "no worker process left" in text, text
        assert RPC_TIMEOUT_S <= blocked["seconds"] < RPC_TIMEOUT_S + SLACK_S, blocked["seconds"]
        later = result["later"]
        assert later["raised"] == "EngineStopped" and later["seconds"] < 1.0, later
        assert "create a new VllmHiddenStatesGenerator" in later["text"], later
        assert result["orphans"] == [] and result["watchdog_directory_left"] is False, result


@pytest.mark.parametrize("job", [Interrupted(case) for case in SIGNAL_CASES], ids=list(SIGNAL_CASES))
def test_signal_during_generate_stops_and_leaves_no_worker(job: Interrupted, engine_cells: CellPool) -> None:
    signals, code = SIGNAL_CASES[job.case]
    outcome = engine_cells.result(job)
    record_figure(job.name, {"exit_s": outcome["seconds"], "code": outcome["code"]})
    assert outcome["code"] == code, outcome
    assert outcome["seconds"] < SIGNAL_EXIT_LIMIT_S, outcome
    assert outcome["left"] == [], outcome
    assert "shutting the engine down" in outcome["log"], outcome["log"][-3000:]
    assert "generate() returned" not in outcome["log"], outcome["log"][-3000:]
    if len(signals) == 1:
        assert "no worker process left" in outcome["log"], outcome["log"][-3000:]
    else:
        assert "second signal: killing the vLLM workers" in outcome["log"], outcome["log"][-3000:]
