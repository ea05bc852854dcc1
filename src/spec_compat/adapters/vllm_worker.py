"""Names vLLM's GPU/CPU worker classes answer to over collective_rpc.

Read from the worker modules' source with ``ast`` (importing them costs about a second, most of
apply()'s own time): the class's methods and those of its bases within the same modules.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from . import source_parsing

WORKER_MODULES = ("vllm.v1.worker.worker_base", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker")


def _class_members(module: str) -> dict[str, tuple[set[str], list[str]]]:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return {}
    tree = source_parsing.parse(Path(spec.origin).read_text())
    classes: dict[str, tuple[set[str], list[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = {
                item.name if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else "" for item in node.body
            } - {""}
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            classes[node.name] = (names, bases)
    return classes


def worker_method_names() -> set[str]:
    classes: dict[str, tuple[set[str], list[str]]] = {}
    for module in WORKER_MODULES:
        classes.update(_class_members(module))
    names: set[str] = set()
    pending: list[str] = [name for name in ("Worker", "CPUWorker", "WorkerBase") if name in classes]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in classes:
            continue
        seen.add(name)
        methods, bases = classes[name]
        names |= methods
        pending.extend(bases)
    return names
