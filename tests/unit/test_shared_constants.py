"""tools/shared_constants.py is the one definition of the values tests/ and tools/ share. Files that
still carry a literal copy (being switched to it) must hold the same value: a copy that drifts
fails here instead of making two parts of the suite test different things."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import matrix
import matrix_table
import pytest
import shared_constants

ROOT = Path(__file__).resolve().parents[2]
# (file, its module-level name, the shared name): literal copies still to be replaced by an import
COPIES = [
    ("tests/engine_harness.py", "LAYER_IDS", "LAYER_IDS"),
    ("tests/engine_harness.py", "MAX_MODEL_LEN", "MAX_MODEL_LEN"),
    ("tools/gpu_cells.py", "LAYER_IDS", "ALL_LAYER_IDS"),
    ("tools/gpu_cells.py", "MAX_MODEL_LEN", "MAX_MODEL_LEN"),
    ("tools/gpu_cells.py", "SPECULATORS", "TESTED_SPECULATORS"),
    ("tools/gpu_bundle.py", "SPECULATORS", "TESTED_SPECULATORS"),
]


def _literal(path: Path, name: str) -> Any:
    """The module-level literal bound to ``name`` (None when the name is imported or computed)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


@pytest.mark.parametrize(("where", "name", "shared"), COPIES, ids=[f"{w}:{n}" for w, n, _ in COPIES])
def test_a_remaining_copy_equals_the_shared_value(where: str, name: str, shared: str) -> None:
    copy = _literal(ROOT / where, name)
    if copy is None:
        return  # imported from shared_constants (or computed from it): nothing to drift
    assert (tuple(copy) if isinstance(copy, (list, tuple)) else copy) == getattr(shared_constants, shared)


def test_provision_installs_the_tested_speculators() -> None:
    script = (ROOT / "tools/provision.sh").read_text()
    default = re.search(r'SPECULATORS_VERSIONS="\$\{SPEC_COMPAT_SPECULATORS_VERSIONS:-([^}]*)\}"', script)
    assert default is not None
    assert tuple(default.group(1).split()) == shared_constants.TESTED_SPECULATORS


def test_the_matrix_tools_use_the_shared_columns() -> None:
    assert tuple(matrix.SPECULATORS_VERSIONS) == tuple(matrix_table.SPECULATORS) == shared_constants.MATRIX_SPECULATORS
    assert set(shared_constants.TESTED_SPECULATORS) <= set(shared_constants.MATRIX_SPECULATORS)
