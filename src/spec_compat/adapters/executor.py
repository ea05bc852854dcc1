"""spec_compat's MultiprocExecutor, installed under the generator module's ``MultiprocExecutor``
(adapter ``executor``).

It is a subclass created at apply() time. Each behaviour is switched on by its own registry
adapter (a switch in ``executor_switches.ExecutorSwitches``, set through the patcher, so revert()
switches it off again) and lives, as the hooks called below, in that adapter's module:

=============================== ======================================= ===============================
behaviour                       adapter                                 module
=============================== ======================================= ===============================
worker-side adapters, entry     executor                                executor_entry
fork/CUDA safety of the start   executor (always)                       executor_fork
failure diagnosis, all ranks    executor (always), executor-all-ranks-  executor_failures
                                reply
reply shape, sample, KV layout, executor-reply-shape, -sample-tokens,   executor_protocol
V1 runner                       -kv-layout, -model-runner-v1
message-queue zmq shutdown      executor-close-queues                   executor_zmq
reply memory                    rpc-reply-read-once                     executor_replies
malloc settings                 worker-malloc-retain                    executor_malloc
shared-memory replies           executor-shared-memory-replies          executor_transfer
clones keep the shared bytes    driver-states-handover                  executor_handover (a hook
                                                                        of executor_transfer)
RPC deadline, hang report       executor-rpc-deadline                   watchdog
=============================== ======================================= ===============================
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any

from .. import timing
from ..environ import scoped_environ
from ..errors import EngineStopped
from ..options import Context
from ..patching import AdapterPatcher
from . import (
    executor_entry,
    executor_failures,
    executor_fork,
    executor_malloc,
    executor_protocol,
    executor_replies,
    executor_transfer,
    executor_zmq,
    transfer,
    watchdog,
)
from .executor_switches import EXECUTORS, ExecutorSwitches, register_installer, switch_on
from .probe import Probe
from .speculators_code import generator_module
from .unit import Adapter

_SUBCLASSES: dict[type, type] = {}
_OWN_RPC_TIME = timing.OwnTime("own:executor-rpc")


def make_executor_class(base: type) -> type:
    """A subclass of vLLM's MultiprocExecutor with switchable compatibility behaviour."""
    if base in _SUBCLASSES:
        return _SUBCLASSES[base]

    class SpecCompatMultiprocExecutor(ExecutorSwitches, base):  # type: ignore[valid-type, misc]
        def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            self.step_log: list[list[tuple[str, int]]] = []
            # Replies of speculators' RPCs that carried tensors: checked finite on the worker or not.
            self.states_replies = {"verified": 0, "unverified": 0}
            self.transfer_fallback_reason: str | None = None
            env: dict[str, str] = {}
            self.replies_read: list[int] = []  # replies read per rank (counted under a deadline)
            self.watchdog_directory: str | None = None
            if self.rpc_timeout_s is not None:
                self.watchdog_directory = watchdog.make_directory()
                weakref.finalize(self, watchdog.remove_directory, self.watchdog_directory)
                env[watchdog.WATCHDOG_DIR_ENV] = self.watchdog_directory
                self.deadlined_methods = watchdog.deadlined_methods(self.extension_methods)
                # vLLM's own model-step deadline is replaced (too short for a first step without
                # warm-up) unless the user set it.
                self.keep_step_timeout = watchdog.STEP_TIMEOUT_ENV in os.environ
            if self.shared_memory_replies:
                directory = transfer.make_directory()
                weakref.finalize(self, transfer.remove_directory, directory)
                self.transfer_directory: str | None = directory
                self.transfer_mappings = transfer.DriverMappings(directory)
                env[transfer.TRANSFER_DIR_ENV] = directory
            env.update(executor_entry.worker_env(self.worker_options_json))
            env.update(executor_protocol.v1_runner_env(self.force_v1_model_runner))
            env.update(executor_malloc.malloc_env(self.worker_malloc_env))
            # Workers are started inside super().__init__(): fork only from a process whose CUDA
            # driver is still uninitialised (scoped like the rest: a later executor checks again).
            env.update(executor_fork.start_method_env())
            entry_point = (
                executor_entry.worker_entry_point()
                if self.worker_options_json is not None
                else contextlib.nullcontext()
            )
            with scoped_environ(env), entry_point:
                super().__init__(vllm_config, *args, **kwargs)
            EXECUTORS[id(vllm_config)] = self
            self.replies_read = [0] * len(getattr(self, "response_mqs", None) or [])
            if self.rpc_timeout_s is not None:
                watchdog.count_replies(self.response_mqs, self.replies_read)
            if self.resolve_kv_layout:
                executor_protocol.resolve_kv_cache_layout(self)

        def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
            speculators_rpc = isinstance(method, str) and method in self.extension_methods
            # Wall time per RPC method ("rpc:execute_model", ...: where a call's time goes, timing.py).
            label = f"rpc:{method if isinstance(method, str) else 'callable'}"
            own = _OWN_RPC_TIME.around() if speculators_rpc else contextlib.nullcontext()
            with timing.timed(label), own:
                return self._collective_rpc(speculators_rpc, method, *args, **kwargs)

        def _collective_rpc(self, speculators_rpc: bool, method: Any, *args: Any, **kwargs: Any) -> Any:
            if self.stopped_reason is not None:
                raise EngineStopped(self.stopped_reason)
            reply_rank = kwargs.get("unique_reply_rank")
            all_ranks = speculators_rpc and reply_rank is not None and self.all_ranks_reply
            if all_ranks:
                kwargs["unique_reply_rank"] = None
            read_before = watchdog.with_deadline(self, method, args, kwargs)
            try:
                with _OWN_RPC_TIME.excluded():
                    result = super().collective_rpc(method, *args, **kwargs)
            except TimeoutError as exc:
                if read_before is None:
                    raise
                raise watchdog.timeout_error(self, method, kwargs, read_before) from exc
            except Exception as exc:
                diagnosed = executor_failures.diagnosed(self, exc, method, kwargs)
                if diagnosed is not None:
                    raise diagnosed from exc
                raise
            blocking = kwargs.get("non_block") is not True
            if all_ranks and blocking:
                result = result[reply_rank]
            if speculators_rpc and blocking:
                result = executor_transfer.received_states(self, result, _OWN_RPC_TIME)
            if speculators_rpc and reply_rank is not None:
                if self.read_once_replies:
                    result = executor_replies.read_once(result)
                if self.reply_as_list:
                    result = [result]
            return result

        def spec_compat_stop(
            self, reason: str, stuck: list[Any] | None = None, term_after_s: float = watchdog.STUCK_TERM_AFTER_S
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
                watchdog.end_stuck_later(stuck, term_after_s)
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
            # Collected first: vLLM's shutdown() drops its references to the queues (sets them to None).
            queues = executor_zmq.message_queues(self) if self.close_queues_on_shutdown else []
            try:
                return super().shutdown(*args, **kwargs)
            finally:
                executor_zmq.close_message_queues(queues)
                directory = getattr(self, "transfer_directory", None)
                if directory:
                    self.transfer_mappings.close()
                    transfer.remove_directory(directory)
                watchdog_directory = getattr(self, "watchdog_directory", None)
                if watchdog_directory:
                    watchdog.remove_directory(watchdog_directory)

        def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self.step_log.append([(req_id, int(n)) for req_id, n in scheduler_output.num_scheduled_tokens.items()])
            output = super().execute_model(scheduler_output, *args, **kwargs)
            if self.sample_after_execute and output is None and hasattr(self, "sample_tokens"):
                output = self.sample_tokens(None)
            return output

    SpecCompatMultiprocExecutor.__qualname__ = SpecCompatMultiprocExecutor.__name__
    _SUBCLASSES[base] = SpecCompatMultiprocExecutor
    return SpecCompatMultiprocExecutor


def installed_executor_class(ctx: Context, patcher: AdapterPatcher) -> type:
    """The spec_compat subclass under the generator's MultiprocExecutor name (installed once),
    recorded under the adapter that needed it first: ``executor``, listed before the switch adapters,
    or, when the user disabled it, the first switch adapter that applies."""
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


register_installer(installed_executor_class)


# ---- adapter "executor": the subclass, and the worker-side adapters reach its workers ----------------


def probe_worker_adapters(ctx: Context) -> Probe:
    return Probe(True, "worker processes need the worker-side adapters (spawned workers do not inherit patches)")


EXECUTOR = Adapter(
    id="executor",
    notes="""
    why: the executor is where RPC reply shapes, the execute/sample protocol, KV layout and worker errors are adapted
    vllm change: see the executor-* adapters
    detect: always
    delete when: the last executor-* adapter is deleted
    patches: vllm_hidden_states_generator.MultiprocExecutor (a subclass; behaviours switched by the adapters below)
    """,
    side="driver",
    probe=probe_worker_adapters,
    apply=switch_on("worker_options_json", lambda ctx: ctx.options.to_json()),
)
