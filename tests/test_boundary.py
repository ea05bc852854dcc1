"""Only spec_compat/adapters/ may import vLLM (the design rule that keeps internals in one place)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "spec_compat"


def _vllm_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            found.append(node.module)
    return found


def test_only_adapters_import_vllm() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): imports
        for path in PACKAGE.rglob("*.py")
        if "adapters" not in path.relative_to(PACKAGE).parts and (imports := _vllm_imports(path))
    }
    assert offenders == {}


def test_the_check_sees_adapters_imports() -> None:
    # guard against a scanner that finds nothing: the adapters do import vLLM
    assert any(_vllm_imports(p) for p in (PACKAGE / "adapters").glob("*.py"))
