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
    assert any(_vllm_imports(p) for p in (PACKAGE / "adapters").rglob("*.py"))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _package_imports(path: Path, modules: set[str]) -> set[str]:
    """The spec_compat modules ``path`` imports (relative imports resolved; function-level ones too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:  # `from . import transfer` imports the module spec_compat.adapters.transfer
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "spec_compat")
    return found


def _module_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _package_imports(path, set(paths)) & set(paths) - {name} for name, path in paths.items()}


def test_adapters_import_nothing_above_them() -> None:
    """adapters/ uses the library modules beside it, never the package's API, preflight or registry."""
    above = {"spec_compat", "spec_compat.engine", "spec_compat.preflight", "spec_compat.registry"}
    above |= {"spec_compat.doctor", "spec_compat.cli"}
    graph = _module_graph()
    assert {n: sorted(e & above) for n, e in graph.items() if n.startswith("spec_compat.adapters") and e & above} == {}


def test_no_import_cycles_through_the_adapters() -> None:
    graph = _module_graph()
    cycles = []
    for start in (n for n in graph if n.startswith("spec_compat.adapters") or n == "spec_compat.preflight"):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join(path))
                elif nxt not in path and len(path) < 8:
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []
