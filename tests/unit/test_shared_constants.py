"""tools/shared_constants.py is the one definition of the values tests/ and tools/ share: the modules
that once carried literal copies now derive them from it, and a literal copy written back (one that
could drift and make two parts of the suite test different things) fails here."""

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
# (file, its module-level name, the shared name it must be derived from)
DERIVED = [
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


@pytest.mark.parametrize(("where", "name", "shared"), DERIVED, ids=[f"{w}:{n}" for w, n, _ in DERIVED])
def test_shared_values_are_imported_not_copied(where: str, name: str, shared: str) -> None:
    source = (ROOT / where).read_text()
    assert _literal(ROOT / where, name) is None, f"{where}: {name} is a literal copy of shared_constants.{shared}"
    assert re.search(rf"^from shared_constants import .*\b{shared}\b", source, re.MULTILINE), where


def test_provision_installs_the_tested_speculators() -> None:
    script = (ROOT / "tools/provision.sh").read_text()
    default = re.search(r'SPECULATORS_VERSIONS="\$\{SPEC_COMPAT_SPECULATORS_VERSIONS:-([^}]*)\}"', script)
    assert default is not None
    assert tuple(default.group(1).split()) == shared_constants.TESTED_SPECULATORS


def test_the_matrix_tools_use_the_shared_columns() -> None:
    assert tuple(matrix.SPECULATORS_VERSIONS) == tuple(matrix_table.SPECULATORS) == shared_constants.MATRIX_SPECULATORS
    assert set(shared_constants.TESTED_SPECULATORS) <= set(shared_constants.MATRIX_SPECULATORS)
