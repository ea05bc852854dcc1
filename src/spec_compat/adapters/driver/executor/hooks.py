"""The hooks of spec_compat's executor subclass (``executor.py``), and the executors started with it.

An executor behaviour is one ``ExecutorHook`` in its adapter's own file; the adapter's apply
registers it (``executor.install_hook``, through the patcher, so revert() takes it out again). The
subclass snapshots the registered ``HookSet`` when it starts and runs each phase over the hooks that
define it, in ``stage`` order, from tuples made when a hook is registered (no per-call lookup or
allocation of hook lists). A release that needs no hook runs vLLM's own code.

Phases (every method optional; the default does nothing):

- ``start(executor)``: a context manager around the workers' start (``super().__init__``), e.g.
  ``scoped_environ`` for variables the workers start with; ``started(executor)``: once they are up.
- ``before_rpc(executor, call)``: before each ``collective_rpc``; may change ``call.kwargs`` (what
  vLLM gets) and keep what it needs on ``call``.
- ``on_error(executor, call, exc)``: vLLM's RPC raised; the first hook returning an exception has
  it raised instead (``from exc``); none: ``exc`` itself.
- ``on_reply(executor, call, result)``: the reply of one of speculators' worker RPCs, returned as
  the hook passes it on.
- ``after_step(executor, output)``: what ``execute_model`` returns.
- ``shutdown(executor)``: before vLLM's shutdown; a returned function runs after it (even if it raised).

``stage``: the order in every phase, lowest first; a reply passes from vLLM up through the stages,
so a hook below ``CORE_STAGE`` sees vLLM's reply and one above it what speculators will get (the
subclass's own hook, at ``CORE_STAGE``, maps shared-memory states and decodes worker errors).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

EXECUTORS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # id(vllm_config) -> executor
CORE_STAGE = 50


def executor_for(vllm_config: Any) -> Any:
    """spec_compat's executor started for this vLLM config (None if none is alive)."""
    return EXECUTORS.get(id(vllm_config))


class RpcCall:
    """One ``collective_rpc`` as the hooks see it. Hooks may keep their own attributes on it."""

    def __init__(self, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any], speculators_rpc: bool) -> None:
        self.method = method
        self.args = args
        self.kwargs = kwargs  # passed on to vLLM: a before_rpc hook's change is what vLLM gets
        self.speculators_rpc = speculators_rpc  # one of speculators' worker methods
        self.reply_rank: int | None = kwargs.get("unique_reply_rank")  # as the caller asked

    if TYPE_CHECKING:  # a hook's own per-call values (its before_rpc sets them): any name, any type

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...


class ExecutorHook:
    """One behaviour of spec_compat's executor (see the module docstring for the phases)."""

    stage: ClassVar[int] = CORE_STAGE

    def start(self, executor: Any) -> contextlib.AbstractContextManager[object] | None:
        return None

    def started(self, executor: Any) -> None:
        return None

    def before_rpc(self, executor: Any, call: RpcCall) -> None:
        return None

    def on_error(self, executor: Any, call: RpcCall, exc: Exception) -> BaseException | None:
        return None

    def on_reply(self, executor: Any, call: RpcCall, result: Any) -> Any:
        return result

    def after_step(self, executor: Any, output: Any) -> Any:
        return output

    def shutdown(self, executor: Any) -> Callable[[], None] | None:
        return None


PHASES = ("start", "started", "before_rpc", "on_error", "on_reply", "after_step", "shutdown")


class HookSet:
    """The registered hooks in stage order, and per phase the ones that define it."""

    def __init__(self, hooks: tuple[ExecutorHook, ...] = ()) -> None:
        self.hooks = tuple(sorted(hooks, key=lambda hook: hook.stage))  # stable: equal stages keep their order
        by_phase = {
            phase: tuple(h for h in self.hooks if getattr(type(h), phase) is not getattr(ExecutorHook, phase))
            for phase in PHASES
        }
        self.start = by_phase["start"]
        self.started = by_phase["started"]
        self.before_rpc = by_phase["before_rpc"]
        self.on_error = by_phase["on_error"]
        self.on_reply = by_phase["on_reply"]
        self.after_step = by_phase["after_step"]
        self.shutdown = by_phase["shutdown"]

    def adding(self, hook: ExecutorHook) -> HookSet:
        return HookSet((*self.hooks, hook))

    def __repr__(self) -> str:
        return f"HookSet({', '.join(type(h).__name__ for h in self.hooks)})"
