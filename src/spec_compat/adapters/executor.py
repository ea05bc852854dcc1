"""spec_compat's MultiprocExecutor, installed under the generator module's ``MultiprocExecutor``.

It is a subclass created at apply() time; each behaviour is switched on by its own registry
adapter (a class attribute the adapter sets, so revert() switches it off again).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

from .. import remote_errors, timing, transfer
from ..environ import scoped_environ
from ..errors import EngineStopped, WorkerError, WorkerTimeout
from ..options import WORKER_ENV, Context
from ..patching import Patcher
from . import speculators_code, watchdog
from .driver_calls import _generator
from .probe import Probe

PLUGIN_NAME = "spec_compat"
DRAIN_TIMEOUT_S = 60.0
MP_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
CUDA_SUCCESS = 0
logger = logging.getLogger("spec_compat.executor")
_EXECUTORS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_SUBCLASSES: dict[type, type] = {}


def executor_for(vllm_config: Any) -> Any:
    return _EXECUTORS.get(id(vllm_config))


def cuda_driver_initialized() -> bool:
    """Whether the CUDA driver was initialised (``cuInit``) in this process, asking it nothing else.

    vLLM switches its workers from fork to spawn only when ``torch.cuda.is_initialized()``; but
    ``torch.cuda.is_available()`` (``cudaGetDeviceCount``) runs ``cuInit`` and arms torch's fork
    check while leaving that False, and a worker forked afterwards fails with "Cannot re-initialize
    CUDA in forked subprocess" (seen on 2 x H200, docs/gpu/run3_fork_fallback.txt). ``import vllm``
    sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which makes later calls harmless, so this happens when
    something calls it before vLLM is imported: user code, or ``import speculators`` ahead of
    ``spec_compat.apply()`` (speculators 0.4.x calls it at import, in
    ``speculators.models.eagle3.core.conditional_torch_compile``). Checked without loading or
    initialising anything: libcuda is looked up only if already loaded (``RTLD_NOLOAD``), and
    ``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED until ``cuInit`` has run."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        count = ctypes.c_int(0)
        return bool(libcuda.cuDeviceGetCount(ctypes.byref(count)) == CUDA_SUCCESS)
    except (OSError, AttributeError):  # not loaded in this process (or no such symbol): not initialised
        return False


def _start_method_env() -> dict[str, str]:
    """``{VLLM_WORKER_MULTIPROC_METHOD: "spawn"}`` when the workers would be forked from a process
    whose CUDA driver is initialised (see ``cuda_driver_initialized``): the same switch vLLM's
    ``_maybe_force_spawn`` makes when torch reports CUDA initialised, for the case it cannot see."""
    if os.environ.get(MP_METHOD_ENV, "fork") == "spawn" or not cuda_driver_initialized():
        return {}
    logger.warning(
        "spec_compat: the CUDA driver is already initialised in this process (torch.cuda.is_available() "
        "called before vLLM was imported?), so forked vLLM workers could not use CUDA; starting them with "
        "spawn instead of fork (to keep fork, import vllm or call spec_compat.apply() first, or set "
        "PYTORCH_NVML_BASED_CUDA_CHECK=1)"
    )
    return {MP_METHOD_ENV: "spawn"}


_ORIGINAL_WORKER_MAIN: Any = None


def spec_compat_worker_main(*args: Any, **kwargs: Any) -> Any:
    """vLLM's worker entry point, after applying the worker-side adapters in this process.

    Used as the worker process target while spec_compat's executor starts its workers: a forked
    child runs it directly, a spawned child imports it by name (so it works even where the
    ``vllm.general_plugins`` entry point is filtered out or plugins were loaded before a fork)."""
    from .. import apply_in_worker

    options_json = os.environ.get(WORKER_ENV)
    if options_json:
        apply_in_worker(options_json)
    original = _ORIGINAL_WORKER_MAIN
    if original is None:
        from vllm.v1.executor.multiproc_executor import WorkerProc

        original = WorkerProc.worker_main
    return original(*args, **kwargs)


@contextlib.contextmanager
def _worker_entry_point() -> Iterator[None]:
    global _ORIGINAL_WORKER_MAIN
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError:
        yield
        return
    saved = vars(WorkerProc).get("worker_main")
    if saved is None:
        yield
        return
    _ORIGINAL_WORKER_MAIN = WorkerProc.worker_main
    WorkerProc.worker_main = staticmethod(spec_compat_worker_main)  # type: ignore[method-assign]
    try:
        yield
    finally:
        WorkerProc.worker_main = saved  # type: ignore[method-assign]


def dead_worker_error(executor: Any, method: Any, wait_s: float = 2.0) -> WorkerError | None:
    """A WorkerError naming the worker process that died, if one did."""
    handles = list(getattr(executor, "workers", None) or [])
    deadline = time.monotonic() + wait_s
    while True:
        dead = [h for h in handles if getattr(getattr(h, "proc", None), "exitcode", None) is not None]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not dead:
        return None
    # Workers stopped by vLLM's own shutdown after the first death exit with SIGTERM.
    dead.sort(key=lambda h: h.proc.exitcode == -signal.SIGTERM)
    first = dead[0]

    def describe(handle: Any) -> str:
        code = handle.proc.exitcode
        how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"
        return f"rank {handle.rank} (pid {handle.proc.pid}) {how}"

    name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
    return WorkerError(
        exc_type="WorkerProcessDied",
        message="worker process " + "; ".join(describe(h) for h in dead),
        rank=first.rank,
        remote_traceback="(the process died: no Python traceback; see its log or a core dump)",
        method=name,
    )


def _zmq_contexts(queue: Any) -> list[Any]:
    """The zmq contexts of a vLLM MessageQueue's sockets (its own, and its spin condition's)."""
    import zmq

    contexts: list[Any] = []
    holders = [queue, *(v for v in vars(queue).values() if hasattr(v, "__dict__") and not isinstance(v, type))]
    for holder in holders:
        for value in vars(holder).values():
            if isinstance(value, zmq.Socket) and value.context not in contexts:
                contexts.append(value.context)
    return contexts


class ReadOnceReply(dict):  # type: ignore[type-arg]
    """A reply mapping whose entries are released when read: ``reply[key]`` removes the entry.

    speculators 0.4.x clones every tensor of ``reply[req_id]`` in a loop while the whole reply stays
    referenced until generate() returns, so the driver holds two copies of everything at the end.
    Releasing each entry after its only read keeps about one. A second read of the same key raises.
    """

    __slots__ = ("released",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released: set[Any] = set()

    def __getitem__(self, key: Any) -> Any:
        if key in self.released:
            raise KeyError(
                f"spec_compat: reply entry {key!r} was already read and released (adapter 'rpc-reply-read-once'; "
                "disable it if this code reads an entry twice)"
            )
        value = self.pop(key)
        self.released.add(key)
        return value


def message_queues(executor: Any) -> list[Any]:
    """The executor's vLLM MessageQueues: the broadcast queue and every worker's response queues."""
    queues = [getattr(executor, "rpc_broadcast_mq", None), *(getattr(executor, "response_mqs", None) or [])]
    for handle in getattr(executor, "workers", None) or []:
        queues.append(getattr(handle, "worker_response_mq", None))
        queues.extend(getattr(handle, "peer_worker_response_mqs", None) or [])
    unique: list[Any] = []
    for queue in queues:
        if queue is not None and not any(queue is q for q in unique):
            unique.append(queue)
    return unique


def close_message_queues(queues: list[Any]) -> None:
    """Close message-queue sockets without lingering, then terminate their contexts.

    Each vLLM MessageQueue creates its own zmq context and (before vLLM closed them itself) left
    it to the garbage collector; pyzmq's Context.__del__ then blocks forever in term() when the
    context and its sockets are collected in the same cycle. The driver hangs after the work is
    done (seen with vLLM 0.29 at the first gc.collect() after shutdown).
    """
    for queue in queues:
        for context in _zmq_contexts(queue):
            if not context.closed:
                context.destroy(linger=0)


_OWN_RPC_TIME = timing.OwnTime("own:executor-rpc")
_STATE_REPLIES = (transfer.SharedStates, transfer.InlineStates)


def make_executor_class(base: type) -> type:
    """A subclass of vLLM's MultiprocExecutor with switchable compatibility behaviour."""
    if base in _SUBCLASSES:
        return _SUBCLASSES[base]

    class SpecCompatMultiprocExecutor(base):  # type: ignore[valid-type, misc]
        # Switched on by registry adapters (see registry.py).
        worker_options_json: str | None = None  # worker-side adapters run in these workers
        extension_methods: frozenset[str] = frozenset()  # speculators' worker RPCs
        all_ranks_reply = False  # unique_reply_rank=k -> ask every rank, so no failure is dropped
        reply_as_list = False  # speculators expects [rank-k result] (vLLM <= 0.11.0 shape)
        sample_after_execute = False  # caller never calls sample_tokens()
        resolve_kv_layout = False  # resolve the KV cache layout as the engine core does
        force_v1_model_runner = False  # speculators 0.4 reads model_runner.input_batch
        close_queues_on_shutdown = False  # vLLM leaves its message queues' zmq contexts to the GC
        read_once_replies = False  # a dict reply gives each entry up when it is read (driver memory)
        worker_malloc_env: tuple[tuple[str, str], ...] = ()  # glibc malloc settings for the workers started
        shared_memory_replies = False  # captured states arrive as descriptors of shared-memory segments
        rpc_timeout_s: float | None = None  # deadline of generate()'s RPCs and model steps (None: none)
        stopped_reason: str | None = None  # set once the engine was shut down after a failure / a signal

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
            if self.worker_options_json is not None:
                env[WORKER_ENV] = self.worker_options_json
                plugins = os.environ.get("VLLM_PLUGINS")
                if plugins is not None and PLUGIN_NAME not in plugins.split(","):
                    env["VLLM_PLUGINS"] = f"{plugins},{PLUGIN_NAME}" if plugins else PLUGIN_NAME
            if self.force_v1_model_runner and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ:
                env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            env.update((key, value) for key, value in self.worker_malloc_env if key not in os.environ)
            # Workers are started inside super().__init__(): fork only from a process whose CUDA
            # driver is still uninitialised (scoped like the rest: a later executor checks again).
            env.update(_start_method_env())
            entry_point = _worker_entry_point() if self.worker_options_json is not None else contextlib.nullcontext()
            with scoped_environ(env), entry_point:
                super().__init__(vllm_config, *args, **kwargs)
            _EXECUTORS[id(vllm_config)] = self
            self.replies_read = [0] * len(getattr(self, "response_mqs", None) or [])
            if self.rpc_timeout_s is not None:
                watchdog.count_replies(self.response_mqs, self.replies_read)
            if self.resolve_kv_layout:
                self._resolve_kv_cache_layout()

        def _resolve_kv_cache_layout(self) -> None:
            from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

            specs = [spec for worker_specs in self.get_kv_cache_specs() for spec in worker_specs.values()]
            layout = resolve_kv_cache_layout(self.vllm_config, self.get_supported_kv_cache_layouts(), specs)
            self.set_kv_cache_layout(layout.name)

        def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
            speculators_rpc = isinstance(method, str) and method in self.extension_methods
            with _OWN_RPC_TIME.around() if speculators_rpc else contextlib.nullcontext():
                return self._collective_rpc(speculators_rpc, method, *args, **kwargs)

        def _collective_rpc(self, speculators_rpc: bool, method: Any, *args: Any, **kwargs: Any) -> Any:
            if self.stopped_reason is not None:
                raise EngineStopped(self.stopped_reason)
            reply_rank = kwargs.get("unique_reply_rank")
            if speculators_rpc and reply_rank is not None and self.all_ranks_reply:
                kwargs["unique_reply_rank"] = None
            read_before = None
            if (
                self.rpc_timeout_s is not None
                and not args  # a positional timeout
                and isinstance(method, str)
                and method in self.deadlined_methods
                and kwargs.get("non_block") is not True
            ):
                caller = kwargs.get("timeout")
                if caller is None or (method in watchdog.MODEL_STEPS and not self.keep_step_timeout):
                    kwargs["timeout"] = self.rpc_timeout_s
                else:
                    kwargs["timeout"] = min(caller, self.rpc_timeout_s)
                read_before = self.replies_read.copy()
            try:
                with _OWN_RPC_TIME.excluded():
                    result = super().collective_rpc(method, *args, **kwargs)
            except TimeoutError as exc:
                if read_before is None:
                    raise
                raise self._timed_out(method, kwargs, read_before) from exc
            except Exception as exc:
                decoded = remote_errors.decode(str(exc))
                if decoded is not None:
                    if kwargs.get("unique_reply_rank") is None and decoded.rank is not None:
                        self._drain_replies_after(decoded.rank)
                    raise decoded from exc
                died = dead_worker_error(self, method)
                if died is not None:
                    raise died from exc
                raise
            blocking = kwargs.get("non_block") is not True
            if speculators_rpc and reply_rank is not None and self.all_ranks_reply and blocking:
                result = result[reply_rank]
            if speculators_rpc and blocking:
                result = self._received_states(result)
            if speculators_rpc and reply_rank is not None:
                if self.read_once_replies and type(result) is dict:
                    result = ReadOnceReply(result)
                if self.reply_as_list:
                    result = [result]
            return result

        def _received_states(self, result: Any) -> Any:
            """Replace shared-memory descriptors by the tensors they describe; count checked replies."""
            if isinstance(result, list) and any(isinstance(r, _STATE_REPLIES) for r in result):
                return [self._received_states(r) for r in result]
            if isinstance(result, _STATE_REPLIES):
                timing.add_all(result.timings)
                self.states_replies["verified" if result.all_finite else "unverified"] += 1
                if isinstance(result, transfer.SharedStates):
                    with _OWN_RPC_TIME.excluded(), timing.timed("transfer:driver-map"):
                        return self.transfer_mappings.open(result)
                if self.transfer_fallback_reason is None:
                    self.transfer_fallback_reason = result.reason
                    logger.warning(
                        "spec_compat: captured states came back through vLLM's RPC instead of shared memory "
                        "(slower): %s",
                        result.reason,
                    )
                return result.value
            if result is not None and transfer.flatten(result)[1]:
                self.states_replies["unverified"] += 1
            return result

        def _timed_out(self, method: str, kwargs: dict[str, Any], read_before: list[int]) -> WorkerTimeout:
            """Who answered, every silent rank's stacks and process state, then the engine shut down."""
            timeout_s = float(kwargs["timeout"])
            handles = {h.rank: h for h in list(getattr(self, "workers", None) or [])}
            queues = list(getattr(self, "response_mqs", None) or [])
            reply_rank = kwargs.get("unique_reply_rank")
            aggregated = kwargs.get("kv_output_aggregator") or kwargs.get("ec_output_aggregator")
            asked = list(range(len(queues))) if reply_rank is None or aggregated else [reply_rank]
            read = {r for r in asked if r < len(self.replies_read) and self.replies_read[r] > read_before[r]}
            # Stacks first, at the deadline: every rank whose reply was not read (or was not asked for).
            silent = {rank: h.proc.pid for rank, h in handles.items() if rank not in read}
            stacks = watchdog.take_stacks(silent, self.watchdog_directory)
            answered, stuck = sorted(read), []
            for rank in asked:
                if rank in read:
                    continue
                try:  # vLLM reads in rank order and stops at the first silent rank: later replies wait
                    queues[rank].dequeue(timeout=watchdog.REPLY_PROBE_S)
                    answered.append(rank)
                except Exception:  # noqa: BLE001 - no reply (TimeoutError), or a queue already closed
                    stuck.append(rank)
            answered.sort()
            states = {}
            for rank, handle in sorted(handles.items()):
                role = "answered" if rank in answered else ("NO REPLY" if rank in stuck else "not asked to reply")
                states[rank] = f"TP rank {rank} (pid {handle.proc.pid}): {watchdog.process_state(handle.proc)}; {role}"
            for rank in answered:
                stacks.pop(rank, None)
            name = f"no reply to {method!r} within {timeout_s:g} s from " + (
                ", ".join(f"TP rank {r}" for r in stuck) or "?"
            )
            shutdown = self.spec_compat_stop(name, [handles[r].proc for r in stuck if r in handles])
            error = WorkerTimeout(method, timeout_s, answered, stuck, stacks, states, shutdown)
            logger.error("spec_compat: %s", error)
            return error

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

        def _drain_replies_after(self, failed_rank: int) -> None:
            # vLLM reads replies in rank order and stops at the first failure: the replies of the
            # later ranks stay queued and would be taken as the answers to the *next* RPC.
            for queue in list(getattr(self, "response_mqs", None) or [])[failed_rank + 1 :]:
                try:
                    queue.dequeue(timeout=DRAIN_TIMEOUT_S)
                except Exception as exc:
                    self.is_failed = True
                    raise RuntimeError(
                        "spec_compat: a worker failed and the other workers' replies could not be drained; "
                        "this executor cannot be used further"
                    ) from exc

        def shutdown(self, *args: Any, **kwargs: Any) -> Any:
            # Collected first: vLLM's shutdown() drops its references to the queues (sets them to None).
            queues = message_queues(self) if self.close_queues_on_shutdown else []
            try:
                return super().shutdown(*args, **kwargs)
            finally:
                close_message_queues(queues)
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


def installed_executor_class(ctx: Context, patcher: Patcher) -> type:
    """The spec_compat subclass under the generator's MultiprocExecutor name (installed once)."""
    module = _generator(ctx)
    current = module.MultiprocExecutor
    if current in _SUBCLASSES.values():
        return current  # type: ignore[no-any-return]
    subclass = make_executor_class(current)
    patcher.replace("executor", module, "MultiprocExecutor", subclass)
    worker = ctx.worker
    if worker is not None:
        extension = worker.HiddenStatesWorkerExtension
        methods = frozenset(name for name, value in vars(extension).items() if callable(value))
        patcher.replace("executor", subclass, "extension_methods", methods)
    return subclass


def _set_flag(ctx: Context, patcher: Patcher, adapter_id: str, name: str, value: Any) -> None:
    patcher.replace(adapter_id, installed_executor_class(ctx, patcher), name, value)


# ---- worker-side adapters reach the workers ---------------------------------------------------------


def probe_worker_adapters(ctx: Context) -> Probe:
    return Probe(True, "worker processes need the worker-side adapters (spawned workers do not inherit patches)")


def apply_worker_adapters(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "executor", "worker_options_json", ctx.options.to_json())


# ---- collective_rpc(unique_reply_rank=k): failures on other ranks are dropped -----------------------


def probe_all_ranks_reply(ctx: Context) -> Probe:
    return Probe(
        True,
        "with unique_reply_rank vLLM only reads rank k's reply: an exception on another rank is "
        "logged in that worker and never reaches the caller",
    )


def apply_all_ranks_reply(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "executor-all-ranks-reply", "all_ranks_reply", True)


# ---- collective_rpc(unique_reply_rank=k) return shape -------------------------------------------------
# vLLM <= 0.11.0 returned [result]; 0.11.2+ returns the result itself (PR in 0.11.2 with
# kv_output_aggregator). speculators 0.3.0 indexes [0]; 0.4.x uses the value.


def _vllm_returns_bare_value(base: Any) -> bool:
    import inspect

    return "kv_output_aggregator" in inspect.signature(base.collective_rpc).parameters


def probe_reply_shape(ctx: Context) -> Probe:
    generate = _generator(ctx).VllmHiddenStatesGenerator.generate
    expects_list = speculators_code.indexes_unique_reply(generate)
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    bare = _vllm_returns_bare_value(MultiprocExecutor)
    if expects_list and bare:
        return Probe(True, "speculators indexes the reply [0]; this vLLM returns the bare rank result")
    if not expects_list and not bare:
        return Probe(False, "speculators uses the reply as a dict; this vLLM returns a one-element list", blocking=True)
    return Probe(False, "reply shape matches what speculators expects")


def apply_reply_shape(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "executor-reply-shape", "reply_as_list", True)


# ---- execute_model() + sample_tokens() split (vLLM 0.11.2) -----------------------------------------


def probe_sample_tokens(ctx: Context) -> Probe:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    generate = _generator(ctx).VllmHiddenStatesGenerator.generate
    if not hasattr(MultiprocExecutor, "sample_tokens"):
        return Probe(False, "this vLLM samples inside execute_model")
    if speculators_code.calls_method(generate, "sample_tokens"):
        return Probe(False, "speculators calls sample_tokens() itself")
    return Probe(True, "execute_model() returns None and sample_tokens() must follow; speculators never calls it")


def apply_sample_tokens(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "executor-sample-tokens", "sample_after_execute", True)


# ---- KV cache layout (vLLM 0.29.0) -----------------------------------------------------------------


def probe_kv_layout(ctx: Context) -> Probe:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if not hasattr(MultiprocExecutor, "set_kv_cache_layout"):
        return Probe(False, "this vLLM has no engine-resolved KV cache layout")
    try:
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: F401
    except ImportError:
        return Probe(False, "set_kv_cache_layout exists but resolve_kv_cache_layout does not", blocking=True)
    return Probe(True, "the engine core resolves the KV cache layout and sends it to workers; speculators does not")


def apply_kv_layout(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "executor-kv-layout", "resolve_kv_layout", True)


# ---- Model Runner V2 has no input_batch (default from 0.22.1 on GPU) ----------------------------------


def probe_v1_model_runner(ctx: Context) -> Probe:
    import vllm.envs as vllm_envs

    if "VLLM_USE_V2_MODEL_RUNNER" not in dir(vllm_envs):
        return Probe(False, "this vLLM has no Model Runner V2 switch")
    worker = ctx.worker
    if worker is not None:
        store = worker.HiddenStatesWorkerExtension._store_captured_states
        if "input_batch" in speculators_code.attribute_names_used(store):
            return Probe(True, "speculators reads model_runner.input_batch, which Model Runner V2 does not have")
    return Probe(
        True,
        "speculators slices captures in the V1 runner's batch order; V2 sorts the batch by token count",
    )


def apply_v1_model_runner(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "executor-model-runner-v1", "force_v1_model_runner", True)


# ---- message-queue zmq contexts left to the garbage collector ---------------------------------------


def _closes_sockets_without_linger(tree: ast.AST) -> bool:
    """Does the module call ``<socket>.close(linger=0)`` anywhere?"""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "close"
        and any(k.arg == "linger" and isinstance(k.value, ast.Constant) and k.value.value == 0 for k in node.keywords)
        for node in ast.walk(tree)
    )


def probe_close_queues(ctx: Context) -> Probe:
    from vllm.distributed.device_communicators import shm_broadcast

    if _closes_sockets_without_linger(speculators_code.module_tree(shm_broadcast)):
        return Probe(False, "vLLM closes its message queues' zmq sockets itself (close(linger=0))")
    return Probe(
        True,
        "vLLM leaves each message queue's zmq context to the GC, where Context.__del__ can block forever in term()",
    )


def apply_close_queues(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "executor-close-queues", "close_queues_on_shutdown", True)


# ---- driver memory: the reply stays referenced while speculators clones it --------------------------


def probe_read_once_reply(ctx: Context) -> Probe:
    generate = _generator(ctx).VllmHiddenStatesGenerator.generate
    if not speculators_code.reads_unique_reply_once_per_key(generate):
        return Probe(False, "speculators does not read the captured-states reply once per key in a loop")
    return Probe(
        True,
        "speculators copies each reply entry (clone) while the whole reply stays referenced: ~2x the returned "
        "bytes in the driver; each entry is released after its read",
    )


def apply_read_once_reply(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "rpc-reply-read-once", "read_once_replies", True)


# ---- CPU workers: speculators' capture copies make glibc hand memory back and fault it in again -----

# Keep freed memory in the worker's heap instead of returning it to the kernel after every call.
WORKER_MALLOC_ENV = (
    ("MALLOC_MMAP_THRESHOLD_", str(1 << 30)),
    ("MALLOC_TRIM_THRESHOLD_", str(1 << 32)),
    ("MALLOC_TOP_PAD_", str(1 << 29)),
)


def probe_worker_malloc(ctx: Context) -> Probe:
    if ctx.env.platform != "cpu":
        return Probe(False, f"platform {ctx.env.platform!r}: captured states live in device memory")
    if sys.platform != "linux":
        return Probe(False, "not glibc/Linux")
    preset = [key for key, _ in WORKER_MALLOC_ENV if key in os.environ]
    if len(preset) == len(WORKER_MALLOC_ENV):
        return Probe(False, f"the user set {preset} already")
    return Probe(
        True,
        "CPU workers copy every captured state ~4 times per call (speculators' capture); glibc returns that "
        "memory to the kernel and vLLM's own temporaries fault in again (MoE TP=2: ~2x the page faults, 0.8x "
        "vLLM's throughput); the workers keep freed memory instead",
    )


def apply_worker_malloc(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "worker-malloc-retain", "worker_malloc_env", WORKER_MALLOC_ENV)


# ---- captured states through shared memory instead of pickled tensors --------------------------------


def probe_shared_memory_replies(ctx: Context) -> Probe:
    if sys.platform == "win32":
        return Probe(False, "no POSIX shared memory and flock on this platform")
    return Probe(
        True,
        "captured states are pickled tensor by tensor through vLLM's message queue (H200: 1.66 s of a 2.74 s call); "
        "they come through a shared-memory segment instead, described by a small reply",
    )


def apply_shared_memory_replies(ctx: Context, patcher: Patcher) -> None:
    _set_flag(ctx, patcher, "executor-shared-memory-replies", "shared_memory_replies", True)
