"""Preflight: bind every vLLM call the installed generator makes, after the adapters, before any
weights load. The calls are read from the installed speculators source with ``ast``, so a new
keyword in a future speculators release is checked too."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

from .adapters.speculators_code import INSTANCE_TYPES, call_sites
from .calls import bind_problem, names_reaching_target
from .options import PLUGIN_NAME

PLUGIN_GROUP = "vllm.general_plugins"


@dataclass(frozen=True)
class Finding:
    ok: bool
    what: str
    detail: str


def _is_vllm_object(value: Any) -> bool:
    from .calls import innermost

    return str(getattr(innermost(value), "__module__", "") or "").startswith("vllm")


def _vllm_method(cls: type, name: str) -> Any:
    """The method as vLLM defines it (skipping spec_compat's subclass)."""
    for klass in cls.__mro__:
        if name in vars(klass) and str(klass.__module__).startswith("vllm"):
            return vars(klass)[name]
    return getattr(cls, name, None)


def check_generator(generator: ModuleType, worker: ModuleType | None, worker_rpc_names: set[str]) -> list[Finding]:
    findings: list[Finding] = []
    for site in call_sites(generator):
        where = f"{generator.__name__}:{site.line}"
        if "." not in site.callee:
            value = getattr(generator, site.callee, None)
            if value is None or not _is_vllm_object(value):
                continue
            target, names = names_reaching_target(value, site.keywords)
            problem = bind_problem(target, site.n_positional, names)
            label = f"{site.callee}({', '.join(sorted(site.keywords))})"
        else:
            owner, method = site.callee.split(".")
            cls = getattr(generator, INSTANCE_TYPES[owner], None)
            cls = getattr(cls, "__wrapped__", cls)
            label = f"{site.callee}({', '.join(sorted(site.keywords))})"
            if not isinstance(cls, type) or not hasattr(cls, method):
                findings.append(Finding(False, label, f"{where}: {INSTANCE_TYPES[owner]} has no method {method}"))
                continue
            target = _vllm_method(cls, method)
            problem = bind_problem(target, site.n_positional + 1, site.keywords)
            if problem is None and site.rpc_method is not None and site.rpc_method not in worker_rpc_names:
                problem = f"no worker method {site.rpc_method!r} on vLLM's Worker or speculators' extension"
        findings.append(Finding(problem is None, label, f"{where}: {problem or 'binds'}"))
    return findings


def worker_rpc_names(worker: ModuleType | None) -> set[str]:
    names: set[str] = set()
    if worker is not None:
        names.update(vars(worker.HiddenStatesWorkerExtension))
    try:
        from .adapters.vllm_worker import worker_method_names

        names.update(worker_method_names())
    except ImportError:
        pass
    return names


def check_plugin_registered() -> Finding:
    entry_points = [ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if entry_points:
        return Finding(True, "vllm.general_plugins entry point", f"{entry_points[0].value}")
    return Finding(
        False,
        "vllm.general_plugins entry point",
        "spec_compat is importable but not installed as a distribution (pip install spec-compat): "
        "TP worker processes would run without the worker-side adapters",
    )
