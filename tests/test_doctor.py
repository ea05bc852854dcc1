"""``spec-compat doctor`` on the real vLLM: a compatible and an incompatible environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from shared_constants import TESTED_SPECULATORS

from engine_harness import CellPool, require_speculators

CELLS = Path(__file__).resolve().parent / "cells"
# Not an engine, but doctor in a fresh interpreter importing vLLM (and its AMX probe): slow, not in -m "not engine".
pytestmark = pytest.mark.engine


def _run_both(first: list[str], second: list[str], speculators: str) -> list[subprocess.CompletedProcess[str]]:
    """Both commands at once, each in its own fresh interpreter (one core each, nothing timed)."""
    env = dict(os.environ, PYTHONPATH=str(require_speculators(speculators)))
    procs = [
        subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in (first, second)
    ]
    done = []
    for args, proc in zip((first, second), procs, strict=True):
        stdout, stderr = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return done


@dataclass(frozen=True)
class BothAtOnce:
    """Two commands at once with that speculators (``_run_both``): a two-core pool job."""

    label: str
    first: tuple[str, ...]
    second: tuple[str, ...]
    speculators: str
    cores = 2

    @property
    def name(self) -> str:
        return f"doctor-{self.label}"

    def run(self, work: Path, core: str | None) -> list[subprocess.CompletedProcess[str]]:
        return _run_both(list(self.first), list(self.second), self.speculators)


DOCTOR = ("-m", "spec_compat", "doctor")
COMPATIBLE = [BothAtOnce(f"spec{s}", (*DOCTOR, "--json"), DOCTOR, s) for s in TESTED_SPECULATORS]
FIXTURE = str(CELLS / "doctor_fixture.py")
INCOMPATIBLE = BothAtOnce("incompatible", (FIXTURE, "doctor", "--json"), (FIXTURE, "strict"), "0.4.0.1")


@pytest.mark.parametrize("job", COMPATIBLE, ids=TESTED_SPECULATORS)
def test_doctor_compatible(job: BothAtOnce, engine_cells: CellPool) -> None:
    speculators = job.speculators
    proc, table = engine_cells.result(job)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["verdict"] == "compatible" and result["exit_code"] == 0
    assert result["environment"]["speculators"].startswith(speculators)
    assert any(a["id"] == "request-kwargs" and a["applies"] for a in result["adapters"])
    assert result["preflight"] and all(f["ok"] for f in result["preflight"])
    if result["environment"]["platform"] == "cpu":  # the AMX check: None on a CPU without AMX, never an error
        amx = result["cpu_amx"]
        assert amx is None or ("error" not in amx and amx["probe"]["bare"] in ("runs", "traps", "no kernel")), amx
    assert table.returncode == 0 and "verdict: compatible" in table.stdout


@pytest.mark.parametrize("job", [INCOMPATIBLE], ids=["0.4.0.1"])
def test_doctor_incompatible_matches_strict_apply(job: BothAtOnce, engine_cells: CellPool) -> None:
    proc, strict = engine_cells.result(job)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["verdict"] == "incompatible"
    failed = [f for f in result["preflight"] if not f["ok"]]
    assert any("sample_tokens" in f["what"] for f in failed), failed
    assert strict.returncode == 1 and "IncompatibleError" in strict.stdout and "sample_tokens" in strict.stdout
