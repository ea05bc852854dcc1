"""Feature probes on the installed speculators code (read with ``ast``, never executed)."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..options import Context
from . import source_parsing

GENERATOR_MODULE = "speculators.data_generation.vllm_hidden_states_generator"
WORKER_MODULE = "speculators.data_generation.custom_worker"


def generator_module(ctx: Context) -> Any:
    """speculators' generator module (driver adapters run only once it is imported)."""
    assert ctx.generator is not None, "driver adapters need the speculators generator module"
    return ctx.generator


def worker_module(ctx: Context) -> Any:
    """speculators' custom_worker module (worker adapters run only once it is imported)."""
    assert ctx.worker is not None, "worker adapters need speculators' custom_worker module"
    return ctx.worker


def extension_method(ctx: Context, name: str) -> tuple[Any, Any]:
    """speculators' HiddenStatesWorkerExtension and the method ``name`` it defines itself."""
    extension_cls = worker_module(ctx).HiddenStatesWorkerExtension
    return extension_cls, vars(extension_cls)[name]


def import_generator() -> ModuleType:
    return importlib.import_module(GENERATOR_MODULE)


def import_worker() -> ModuleType:
    return importlib.import_module(WORKER_MODULE)


def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    unwrapped: Callable[..., Any] = inspect.unwrap(fn)
    return unwrapped


@functools.lru_cache(maxsize=64)
def tree_of(fn: Callable[..., Any]) -> ast.AST:
    return source_parsing.parse(textwrap.dedent(inspect.getsource(_unwrapped(fn))))


@functools.lru_cache(maxsize=8)
def module_tree(module: ModuleType) -> ast.Module:
    return source_parsing.parse(inspect.getsource(module))


def attribute_names_used(fn: Callable[..., Any]) -> set[str]:
    return {node.attr for node in ast.walk(tree_of(fn)) if isinstance(node, ast.Attribute)}


def called_names(fn: Callable[..., Any]) -> set[str]:
    """Bare names called in ``fn`` (``mem_get_info()``), i.e. module-level functions it uses."""
    return {
        node.func.id for node in ast.walk(tree_of(fn)) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def dotted_uses(fn: Callable[..., Any]) -> set[str]:
    """Dotted names such as ``torch.cuda.mem_get_info`` appearing in ``fn``."""
    found: set[str] = set()
    for node in ast.walk(tree_of(fn)):
        if isinstance(node, ast.Attribute):
            parts: list[str] = []
            current: ast.AST = node
            while isinstance(current, ast.Attribute):
                parts.append(current.attr)
                current = current.value
            if isinstance(current, ast.Name):
                parts.append(current.id)
                found.add(".".join(reversed(parts)))
    return found


def calls_method(fn: Callable[..., Any], method: str) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
        for node in ast.walk(tree_of(fn))
    )


def _unique_reply_names(tree: ast.AST) -> set[str]:
    """Names bound to the result of ``collective_rpc(..., unique_reply_rank=...)``."""
    targets: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "collective_rpc"
            and any(k.arg == "unique_reply_rank" for k in node.value.keywords)
        ):
            targets.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return targets


def reads_unique_reply_once_per_key(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` read the unique reply by key at exactly one place, inside a for loop?

    speculators 0.4.x: ``for req_id in sorted(...): ... request_states_dict[req_id]`` (then
    ``.clone()`` of each tensor). Any other use of the reply (``in``, ``len``, ``keys()``) is fine.
    """
    tree = tree_of(fn)
    targets = _unique_reply_names(tree)
    reads = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in targets
    ]
    if len(reads) != 1 or isinstance(reads[0].slice, ast.Constant) or not isinstance(reads[0].ctx, ast.Load):
        return False
    return any(
        isinstance(loop, ast.For) and any(node is reads[0] for statement in loop.body for node in ast.walk(statement))
        for loop in ast.walk(tree)
    )


def indexes_unique_reply(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` subscript the result of ``collective_rpc(..., unique_reply_rank=...)``?

    speculators 0.3.0 does (``captured_states_list[0]``: vLLM <= 0.11.0 returned a one-element
    list); 0.4.x uses the value itself (vLLM >= 0.11.2 returns the bare rank result).
    """
    tree = tree_of(fn)
    targets = _unique_reply_names(tree)
    return any(
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id in targets
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, int)
        for node in ast.walk(tree)
    )


def finishes_requests_inside_schedule_loop(fn: Callable[..., Any]) -> bool:
    """speculators 0.3.0 calls scheduler.finish_requests() inside its ``while schedule()`` loop,
    so every request is aborted after its first scheduled chunk."""
    for loop in ast.walk(tree_of(fn)):
        if isinstance(loop, ast.While) and any(
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "finish_requests"
            for statement in loop.body
            for node in ast.walk(statement)
        ):
            return True
    return False


def module_level_constant(module: ModuleType, name: str) -> Any:
    return getattr(module, name, None)


# ---- the calls the generator module makes (read by driver adapters and by preflight) ----------

# Instance attributes of the generator and the class each one is built from.
INSTANCE_TYPES = {"executor": "MultiprocExecutor", "scheduler": "Scheduler"}


@dataclass(frozen=True)
class CallSite:
    callee: str  # module-level name, or "<owner>.<method>" for self.executor / self.scheduler calls
    keywords: frozenset[str]
    n_positional: int
    line: int
    rpc_method: str | None = None  # first argument of collective_rpc, when a string


@functools.lru_cache(maxsize=8)
def call_sites(module: ModuleType) -> tuple[CallSite, ...]:
    tree = source_parsing.parse(inspect.getsource(module))
    sites: list[CallSite] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        keywords = frozenset(k.arg for k in node.keywords if k.arg is not None)
        func = node.func
        if isinstance(func, ast.Name):
            sites.append(CallSite(func.id, keywords, len(node.args), node.lineno))
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Attribute)
            and isinstance(func.value.value, ast.Name)
            and func.value.value.id == "self"
            and func.value.attr in INSTANCE_TYPES
        ):
            rpc = None
            if func.attr == "collective_rpc" and node.args and isinstance(node.args[0], ast.Constant):
                rpc = str(node.args[0].value)
            sites.append(CallSite(f"{func.value.attr}.{func.attr}", keywords, len(node.args), node.lineno, rpc))
    return tuple(sites)
