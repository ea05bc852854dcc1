"""spec_compat's MultiprocExecutor, installed under the generator module's ``MultiprocExecutor``
(adapter ``executor``), and the registration of executor behaviours (``install_hook``).

It is a subclass created at apply() time that runs the hooks registered on it (``HookSet``,
``hooks.py`` describes the phases): each executor behaviour is one ``ExecutorHook`` in its
adapter's own file, whose apply calls ``install_hook``. Its own behaviour, on whatever release and
whichever adapters apply (``_CORE``): the workers started with spawn where the CUDA driver is
initialised (``fork.py``), a failing worker's error decoded and a dead worker named
(``failures.py``), speculators' replies of shared-memory states mapped and counted
(``received_states``), the model steps logged (``step_log``), and ``spec_compat_stop``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from .... import timing
from ....environ import scoped_environ
from ....errors import EngineStopped
from ....options import Context
from ....patching import AdapterPatcher
from ... import transfer
from ...probe import Probe
from ...speculators_code import generator_module
from ...unit import Adapter
from . import entry, failures, fork
from .hooks import EXECUTORS, ExecutorHook, HookSet, RpcCall

logger = logging.getLogger("spec_compat.executor")
_SUBCLASSES: dict[type, type] = {}
_OWN_RPC_TIME = timing.OwnTime("own:executor-rpc")
STATE_REPLIES = (transfer.SharedStates, transfer.InlineStates)
STUCK_TERM_AFTER_S = 1.0  # silent ranks get SIGTERM this long after the engine's shutdown began


def received_states(executor: Any, result: Any, own_time: timing.OwnTime) -> Any:
    """A reply of speculators' RPC: shared-memory descriptors replaced by the tensors they describe;
    replies checked finite on the worker (or not) counted."""
    if isinstance(result, list) and any(isinstance(r, STATE_REPLIES) for r in result):
        return [received_states(executor, r, own_time) for r in result]
    if isinstance(result, STATE_REPLIES):
        timing.add_all(result.timings)
        executor.states_replies["verified" if result.all_finite else "unverified"] += 1
        if isinstance(result, transfer.SharedStates):
            executor.states_replies["streamed"] += int(result.streamed)
            with own_time.excluded(), timing.timed("transfer:driver-map"):
                return executor.transfer_mappings.open(result, executor.clone_sources)
        if executor.transfer_fallback_reason is None:
            executor.transfer_fallback_reason = result.reason
            logger.warning(
                "spec_compat: captured states came back through vLLM's RPC instead of shared memory (slower): %s",
                result.reason,
            )
        return result.value
    if result is not None and transfer.flatten(result)[1]:
        executor.states_replies["unverified"] += 1
    return result


class _Core(ExecutorHook):
    """The subclass's own behaviour (see the module docstring)."""

    def start(self, executor: Any) -> contextlib.AbstractContextManager[object] | None:
        # Workers are started inside super().__init__(): fork only from a process whose CUDA
        # driver is still uninitialised (scoped: a later executor checks again).
        env = fork.start_method_env()
        return scoped_environ(env) if env else None

    def on_error(self, executor: Any, call: RpcCall, exc: Exception) -> BaseException | None:
        if isinstance(exc, TimeoutError):
            return None  # a deadline's (executor-rpc-deadline reports it), or vLLM's own
        return failures.diagnosed(executor, exc, call.method, call.kwargs)

    def on_reply(self, executor: Any, call: RpcCall, result: Any) -> Any:
        if call.kwargs.get("non_block") is True:
            return result
        return received_states(executor, result, _OWN_RPC_TIME)


_CORE = HookSet((_Core(),))


def end_stuck_later(procs: list[Any], term_after_s: float = STUCK_TERM_AFTER_S, kill_after_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, the processes of ranks that never answered, from a helper thread once
    the executor's own shutdown is under way (they would not exit on vLLM's graceful request)."""

    def end() -> None:
        time.sleep(term_after_s)
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()
        until = time.monotonic() + kill_after_s
        while any(p.exitcode is None for p in procs) and time.monotonic() < until:
            time.sleep(0.05)
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()

    threading.Thread(target=end, name="spec_compat-end-stuck-ranks", daemon=True).start()


def make_executor_class(base: type) -> type:
    """A subclass of vLLM's MultiprocExecutor that runs the hooks registered on it."""
    if base in _SUBCLASSES:
        return _SUBCLASSES[base]

    class SpecCompatMultiprocExecutor(base):  # type: ignore[valid-type, misc]
        hooks: HookSet = _CORE  # install_hook adds to it (through the patcher); an executor keeps its start's
        extension_methods: frozenset[str] = frozenset()  # speculators' worker RPCs (installed_executor_class)
        clone_sources: Any = None  # what shared-memory states pass through when mapped (driver-states-handover)
        stopped_reason: str | None = None  # set once the engine was shut down after a failure / a signal

        def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            hooks = self.hooks = type(self).hooks  # fixed for this executor's life
            self.step_log: list[list[tuple[str, int]]] = []
            # Replies of speculators' RPCs that carried tensors: checked finite on the worker or not (and of
            # the shared-memory ones, how many were written step by step: captured-states-streamed).
            self.states_replies = {"verified": 0, "unverified": 0, "streamed": 0}
            self.transfer_fallback_reason: str | None = None
            with contextlib.ExitStack() as stack:
                for hook in hooks.start:
                    around = hook.start(self)
                    if around is not None:
                        stack.enter_context(around)
                super().__init__(vllm_config, *args, **kwargs)
            EXECUTORS[id(vllm_config)] = self
            for hook in hooks.started:
                hook.started(self)

        def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
            speculators_rpc = isinstance(method, str) and method in self.extension_methods
            # Wall time per RPC method ("rpc:execute_model", ...: where a call's time goes, timing.py).
            label = f"rpc:{method if isinstance(method, str) else 'callable'}"
            own = _OWN_RPC_TIME.around() if speculators_rpc else contextlib.nullcontext()
            with timing.timed(label), own:
                return self._collective_rpc(speculators_rpc, method, args, kwargs)

        def _collective_rpc(self, speculators_rpc: bool, method: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
            if self.stopped_reason is not None:
                raise EngineStopped(self.stopped_reason)
            hooks = self.hooks
            call = RpcCall(method, args, kwargs, speculators_rpc)
            for hook in hooks.before_rpc:
                hook.before_rpc(self, call)
            try:
                with _OWN_RPC_TIME.excluded():
                    result = super().collective_rpc(method, *args, **kwargs)
            except Exception as exc:
                for hook in hooks.on_error:
                    error = hook.on_error(self, call, exc)
                    if error is not None:
                        raise error from exc
                raise
            if speculators_rpc:
                for hook in hooks.on_reply:
                    result = hook.on_reply(self, call, result)
            return result

        def spec_compat_stop(
            self, reason: str, stuck: list[Any] | None = None, term_after_s: float = STUCK_TERM_AFTER_S
        ) -> str:
            """Shut the engine down for good (after a hang or a signal): no worker left; later calls
            raise EngineStopped at once. ``stuck``: worker processes known not to answer; they get
            SIGTERM, then SIGKILL, ``term_after_s`` after vLLM's shutdown began instead of after its
            grace period. Returns what happened, for the message."""
            self.stopped_reason = reason
            self.is_failed = True
            procs = [(h.rank, h.proc) for h in list(getattr(self, "workers", None) or [])]
            started = time.monotonic()
            problem = ""
            if stuck:
                end_stuck_later(stuck, term_after_s)
            try:
                self.shutdown()
            except Exception as exc:  # noqa: BLE001 - the processes are checked and killed below
                problem = f" (shutdown raised {type(exc).__name__}: {exc})"
            left = []
            for rank, proc in procs:
                proc.join(timeout=max(0.0, 10.0 - (time.monotonic() - started)))
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(timeout=5.0)
                if proc.exitcode is None:
                    left.append(f"TP rank {rank} (pid {proc.pid})")
            seconds = time.monotonic() - started
            if left:
                return f"the engine was shut down in {seconds:.1f} s{problem}; STILL RUNNING: {', '.join(left)}"
            return f"the engine was shut down in {seconds:.1f} s{problem}, no worker process left"

        def shutdown(self, *args: Any, **kwargs: Any) -> Any:
            # Each hook's part before vLLM's shutdown (which drops its references to the queues) and after.
            after = [finish for finish in (hook.shutdown(self) for hook in self.hooks.shutdown) if finish is not None]
            try:
                return super().shutdown(*args, **kwargs)
            finally:
                for finish in after:
                    finish()

        def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self.step_log.append([(req_id, int(n)) for req_id, n in scheduler_output.num_scheduled_tokens.items()])
            output = super().execute_model(scheduler_output, *args, **kwargs)
            for hook in self.hooks.after_step:
                output = hook.after_step(self, output)
            return output

    SpecCompatMultiprocExecutor.__qualname__ = SpecCompatMultiprocExecutor.__name__
    _SUBCLASSES[base] = SpecCompatMultiprocExecutor
    return SpecCompatMultiprocExecutor


def installed_executor_class(ctx: Context, patcher: AdapterPatcher) -> type:
    """The spec_compat subclass under the generator's MultiprocExecutor name (installed once),
    recorded under the adapter that needed it first: ``executor``, listed before the hook adapters,
    or, when the user disabled it, the first hook adapter that applies."""
    module = generator_module(ctx)
    current = module.MultiprocExecutor
    if current in _SUBCLASSES.values():
        return current  # type: ignore[no-any-return]
    subclass = make_executor_class(current)
    patcher.replace(module, "MultiprocExecutor", subclass)
    worker = ctx.worker
    if worker is not None:
        extension = worker.HiddenStatesWorkerExtension
        methods = frozenset(name for name, value in vars(extension).items() if callable(value))
        patcher.replace(subclass, "extension_methods", methods)
    return subclass


def install_hook(ctx: Context, patcher: AdapterPatcher, hook: ExecutorHook) -> None:
    """Register an executor behaviour (the subclass installed first if it is not yet), recorded
    under the adapter whose apply this is: revert() takes it out again."""
    subclass = installed_executor_class(ctx, patcher)
    registered: HookSet = vars(subclass)["hooks"]
    patcher.replace(subclass, "hooks", registered.adding(hook))


# ---- adapter "executor": the subclass, and the worker-side adapters reach its workers ----------------


class WorkerSetup(ExecutorHook):
    """The workers start with the options (and the plugin) in their environment and spec_compat's
    worker entry point (entry.py), so the worker-side adapters run in them."""

    def __init__(self, options_json: str) -> None:
        self.options_json = options_json

    def start(self, executor: Any) -> contextlib.AbstractContextManager[object] | None:
        return self._around_start()

    @contextlib.contextmanager
    def _around_start(self) -> Iterator[None]:
        with scoped_environ(entry.worker_env(self.options_json)), entry.worker_entry_point():
            yield


def probe_executor(ctx: Context) -> Probe:
    return Probe(True, "worker processes need the worker-side adapters (spawned workers do not inherit patches)")


def apply_executor(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, WorkerSetup(ctx.options.to_json()))


EXECUTOR = Adapter(
    id="executor",
    patches=(
        "speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor",
        "speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.extension_methods",
        "speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",
    ),
    how="a subclass that runs the executor hooks the adapters below register",
    why="the executor is where RPC reply shapes, the execute/sample protocol, KV layout and worker errors are adapted",
    vllm_change="see the executor-* adapters",
    detect="always",
    delete_when="the last executor-* adapter is deleted",
    side="driver",
    probe=probe_executor,
    apply=apply_executor,
)
