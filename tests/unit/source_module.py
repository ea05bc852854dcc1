"""Load Python source as a real module file (the adapters' AST probes read it with inspect)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_source(tmp: Path, stem: str, source: str) -> ModuleType:
    name = f"{stem}_{len(list(tmp.iterdir()))}"
    path = tmp / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
