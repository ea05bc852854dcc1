"""speculators' default layer ids on a small real model: refused before any weights load."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from shared_constants import TESTED_SPECULATORS

from engine_harness import CellPool, model_dir, require_speculators

pytestmark = pytest.mark.engine

# speculators' generator logs its steps ("Initializing hidden states generator ...", then
# "Initializing executor..." right before it starts the workers) at INFO, which Python drops unless
# a handler is configured: the script shows them on stderr, so that the missing executor line says
# the refusal came before the executor, not that nothing was logged.
SCRIPT = """
import logging, sys, spec_compat
logging.basicConfig()
logging.getLogger("speculators").setLevel(logging.INFO)
spec_compat.apply()
from speculators.data_generation import VllmHiddenStatesGenerator
try:
    VllmHiddenStatesGenerator(sys.argv[1], max_model_len=256)
except ValueError as exc:
    import multiprocessing
    print("REFUSED:", exc)
    print("CHILDREN:", len(multiprocessing.active_children()))
"""


@dataclass(frozen=True)
class DefaultLayerIds:
    """SCRIPT in a fresh interpreter with one speculators install (a pool job: one core); its
    (process, seconds from start to exit)."""

    speculators: str
    cores = 1

    @property
    def name(self) -> str:
        return f"default-layer-ids-spec{self.speculators}"

    def run(self, work: Path, core: str | None) -> tuple[subprocess.CompletedProcess[str], float]:
        env = dict(os.environ, PYTHONPATH=str(require_speculators(self.speculators)), VLLM_CPU_KVCACHE_SPACE="1")
        started = time.monotonic()
        command = [sys.executable, "-c", SCRIPT, str(model_dir("dense"))]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        return proc, time.monotonic() - started


@pytest.mark.parametrize("job", [DefaultLayerIds(s) for s in TESTED_SPECULATORS], ids=TESTED_SPECULATORS)
def test_default_layer_ids_with_repeats_are_refused_before_the_engine_starts(
    job: DefaultLayerIds, engine_cells: CellPool
) -> None:
    version = job.speculators
    proc, elapsed = engine_cells.result(job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED:"))
    # the tiny models have 4 decoder layers: speculators picks [2, 4 // 2, 4 - 3, 4 - 1]
    assert "speculators' default layer_ids for this model [2, 2, 1, 3] repeat [2]" in refused
    assert "--layer-ids" in refused and "layer_ids=[...]" in refused
    assert "CHILDREN: 0" in proc.stdout  # no worker was started
    assert "Initializing hidden states generator" in proc.stderr, proc.stderr[-3000:]  # its log lines are shown
    assert "Loading weights" not in proc.stderr and "Initializing executor" not in proc.stderr
    print(f"speculators {version}: refused {elapsed:.1f} s after start (imports included)")
