"""apply() / revert() / plan() against the real vLLM and both speculators versions (no model run)."""

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
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
# Declared targets an applied adapter patches on one speculators line only (0.3.0: the torch proxy;
# 0.4.x: the two names it imports); every other declared target of an applied adapter is patched.
ONE_LINE_TARGETS = {f"device-memory-query: {GENERATOR}.{name}" for name in ("torch", "mem_get_info", "empty_cache")}
# Not an engine, but a fresh interpreter importing vLLM per speculators version: slow, kept out of -m "not engine".
pytestmark = pytest.mark.engine


@dataclass(frozen=True)
class ApplyChecks:
    """apply_checks.py in a fresh interpreter with one speculators install (a pool job: one core)."""

    speculators: str
    cores = 1

    @property
    def name(self) -> str:
        return f"apply-checks-spec{self.speculators}"

    def run(self, work: Path, core: str | None) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, PYTHONPATH=str(require_speculators(self.speculators)))
        command = [sys.executable, str(CELLS / "apply_checks.py")]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("job", [ApplyChecks(s) for s in TESTED_SPECULATORS], ids=TESTED_SPECULATORS)
def test_apply_revert_plan(job: ApplyChecks, engine_cells: CellPool) -> None:
    speculators = job.speculators
    proc = engine_cells.result(job)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plan_left_torch_alias"] is False
    assert out["planned"] == out["applied"]
    assert out["idempotent"] and out["preflight_ok"] and out["request_is_adapter"]
    assert out["revert_restores_identity"], "revert() must put back the original objects"
    assert out["patch_ids_not_in_registry"] == [], "every recorded patch must carry its adapter's registry id"
    assert out["applied_without_a_patch"] == [], "an applied adapter records what it patched under its own id"
    assert out["revert_removes_alias"]
    # each record's patch targets resolve, and name exactly what its apply() patched
    assert out["targets_unresolved"] == [], "every declared patch target names an object"
    assert out["patches_undeclared"] == [], "every patch apply() made is one its record declares"
    assert set(out["targets_not_patched"]) <= ONE_LINE_TARGETS, "an applied adapter patches what it declares"
    assert out["reverted_ids_not_in_registry"] == [], "revert() names only registry adapters"
    assert out["speculators_installed"].startswith(speculators)
    assert out["applied_outside_range"] == [], "an adapter applies only inside its record's speculators range"
    assert out["excluded_by_range"] == out["range_excluded_expected"] != [], "exclusions by range are reported"
    assert out["reapply_same_adapters"] and out["reapply_same_structure"]
    assert out["reverted_count"] >= 15
