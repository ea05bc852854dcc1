"""Adapter ``transformers-removed-modules``: transformers 5.24 removed modules speculators imports at
module level."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..unit import Adapter

# speculators' EAGLE-1 model does `from transformers.modeling_attn_mask_utils import ...` at import
# time, so `import speculators` (the generator's package, in the driver and in every worker) fails.
# vLLM releases whose transformers pin has no upper bound (0.24.0-0.30.0) resolve to 5.24 today.
# The data-generation path never calls those names: a placeholder module lets the import finish,
# and any use of a placeholder raises ImportError naming what was removed.


def _speculators_root() -> Path | None:
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _module_exists(name: str) -> bool:
    # Looked up on disk under the top-level package: importlib.util.find_spec() of a submodule
    # imports every parent package first (~0.3 s for speculators' transformers imports).
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    for base in spec.submodule_search_locations or []:
        path = Path(base, *rest.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
        if path.parent.is_dir() and any(path.parent.glob(f"{path.name}.*.so")):
            return True
    if spec.submodule_search_locations and all(Path(b).is_dir() for b in spec.submodule_search_locations):
        return False
    try:  # not a plain directory package (zip, custom loader): ask the import system
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# Only statements at column 0 run at import time unguarded (anything indented sits in a def, an if
# or a try). Matching them first and parsing just those statements with ast is ~100x cheaper than
# parsing every file of the package.
MODULE_LEVEL_TRANSFORMERS_IMPORT = re.compile(
    r"^from[ \t]+transformers\.[\w.]+[ \t]+import[ \t]+(?:\([^)]*\)|.*)$", re.M
)


@functools.lru_cache(maxsize=4)
def _module_level_transformers_imports(root: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if "from transformers." not in text:
            continue
        for match in MODULE_LEVEL_TRANSFORMERS_IMPORT.finditer(text):
            try:
                node = ast.parse(match.group(0)).body[0]
            except (SyntaxError, IndexError):
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                found.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return tuple((module, tuple(sorted(names))) for module, names in sorted(found.items()))


def removed_transformers_modules() -> dict[str, tuple[str, ...]]:
    root = _speculators_root()
    if root is None:
        return {}
    return {
        module: names
        for module, names in _module_level_transformers_imports(root)
        if module not in sys.modules and not _module_exists(module)
    }


def probe_transformers_removed_modules(ctx: Context) -> Probe:
    if _speculators_root() is None:
        return Probe(False, "speculators is not importable")
    missing = removed_transformers_modules()
    if not missing:
        return Probe(False, "every transformers module speculators imports at module level exists")
    listed = "; ".join(f"{module} ({', '.join(names)})" for module, names in missing.items())
    return Probe(True, f"speculators imports modules this transformers no longer has: {listed}")


def _placeholder(module: str, name: str, transformers_version: str) -> type:
    message = (
        f"{module}.{name} does not exist in transformers {transformers_version}; spec_compat put a "
        "placeholder there so that `import speculators` works (hidden-state extraction never uses it)"
    )

    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(message)

    return type(name, (), {"__new__": refuse, "__doc__": message, "__module__": module})


def apply_transformers_removed_modules(ctx: Context, patcher: AdapterPatcher) -> None:
    version = ctx.env.transformers.raw or "(unknown version)"
    for module, names in removed_transformers_modules().items():
        placeholder = types.ModuleType(module, f"spec_compat placeholder: {module} was removed from transformers")
        for name in names:
            setattr(placeholder, name, _placeholder(module, name, version))
        patcher.add_item(sys.modules, "sys.modules", module, placeholder)


TRANSFORMERS_REMOVED_MODULES = Adapter(
    id="transformers-removed-modules",
    patches=("sys.modules[transformers.*]",),
    how=(
        "placeholder modules added for the removed ones speculators imports, e.g. transformers.modeling_attn_mask_utils"
    ),
    why=(
        "`import speculators` raises ModuleNotFoundError: No module named 'transformers.modeling_attn_mask_utils' "
        "(its EAGLE-1 model imports _prepare_4d_causal_attention_mask)"
    ),
    vllm_change=(
        "transformers 5.24.0 removed modeling_attn_mask_utils; vLLM 0.24.0-0.30.0 pin transformers >=5.5.3 / "
        ">=5.10.4 with no upper bound, so a fresh install resolves to it (found by the version matrix)"
    ),
    detect=(
        "a module-level `from transformers.X import ...` in speculators' sources names a module that importlib "
        "cannot find"
    ),
    delete_when=(
        "speculators stops importing transformers internals at module level, or vLLM caps transformers below 5.24"
    ),
    side="import",
    probe=probe_transformers_removed_modules,
    apply=apply_transformers_removed_modules,
)
