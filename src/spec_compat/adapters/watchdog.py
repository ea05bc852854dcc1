"""Never a silent wait: RPC deadlines with a hang report, and SIGINT/SIGTERM during generate().

Three registry adapters use this module:

``executor-rpc-deadline`` (driver): spec_compat's executor passes a deadline (``rpc_timeout_s``) as
vLLM's own ``collective_rpc(timeout=...)`` for the model steps and speculators' worker RPCs of
generate(); vLLM's message queues wait on it themselves (no watchdog thread, no thread hop per
call). When it passes, the executor works out which ranks answered (it counts the replies read from
each rank's response queue), signals the others for their Python stacks, records every worker's
process state, shuts the engine down and raises ``WorkerTimeout``.

``worker-stack-dump`` (worker-process): each worker started by that executor registers
``faulthandler`` on SIGUSR2, writing every thread's stack to ``<watchdog dir>/<pid>.stack``.
faulthandler's handler is C code run at signal delivery, so it answers even when the worker's
Python code is blocked in a C call. Where no dump arrives, ``py-spy dump`` is used if installed.

``generate-signal-shutdown`` (driver): while generate() runs in the main thread, SIGINT and SIGTERM
(where the caller left their default handlers) stop it at once, shut the engine down (no worker
left) and then raise KeyboardInterrupt / exit with 128 + 15; a second signal kills the workers and
exits immediately.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

from ..environ import scoped_environ
from ..errors import WorkerTimeout
from ..options import Context
from ..patching import AdapterPatcher
from .executor import install_hook
from .executor_hooks import CORE_STAGE, ExecutorHook, RpcCall
from .generate import Run, wrap_generate
from .probe import Probe
from .unit import Adapter

logger = logging.getLogger("spec_compat.executor")

WATCHDOG_DIR_ENV = "SPEC_COMPAT_WATCHDOG_DIR"  # set while spec_compat's executor starts its workers
STACK_SIGNAL: int | None = getattr(signal, "SIGUSR2", None)
MODEL_STEPS = frozenset({"execute_model", "sample_tokens"})
SETUP_PREFIX = "_setup"  # speculators' capture set-up RPCs run during the engine load: no deadline
STEP_TIMEOUT_ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"  # vLLM's own deadline of its model steps
STACK_WAIT_S = 3.0  # how long the driver waits for the stack dumps
REPLY_PROBE_S = 0.5  # a rank whose reply was not read yet: is one queued behind a stuck rank?
PY_SPY_TIMEOUT_S = 20.0
INTERRUPT_GRACE_S = 2.0  # after SIGINT/SIGTERM: workers still running this long into the shutdown get SIGTERM


# ---- per-executor directory -------------------------------------------------------------------------


def make_directory() -> str:
    return tempfile.mkdtemp(prefix="spec_compat-watchdog-")


def remove_directory(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def deadlined_methods(extension_methods: frozenset[str]) -> frozenset[str]:
    """The RPCs generate() drives: vLLM's model steps and speculators' worker methods, less the
    capture set-up (part of the engine load, which is never cut short)."""
    return MODEL_STEPS | frozenset(m for m in extension_methods if not m.startswith(SETUP_PREFIX))


def count_replies(queues: Sequence[Any], counts: list[int]) -> None:
    """``counts[rank] += 1`` for every reply read from ``queues[rank]`` (their ``dequeue``).

    The wrapper holds its queue weakly: a reference cycle would leave the queue's zmq context to the
    cyclic garbage collector, where pyzmq can block forever in ``Context.term()``."""
    for rank, queue in enumerate(queues):
        original = vars(queue).get("dequeue")
        if original is None:
            unbound = type(queue).dequeue
            ref = weakref.ref(queue)

            def dequeue(*args: Any, _rank: int = rank, _unbound: Any = unbound, _ref: Any = ref, **kwargs: Any) -> Any:
                reply = _unbound(_ref(), *args, **kwargs)
                counts[_rank] += 1
                return reply

        else:

            def dequeue(*args: Any, _rank: int = rank, _original: Any = original, **kwargs: Any) -> Any:
                reply = _original(*args, **kwargs)
                counts[_rank] += 1
                return reply

        queue.dequeue = dequeue


# ---- process states and stacks ----------------------------------------------------------------------


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def process_state(proc: Any) -> str:
    """alive (psutil's status) / zombie / exited with code N / killed by signal N."""
    pid = proc.pid
    try:
        import psutil

        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            status = None
        if status == psutil.STATUS_ZOMBIE:
            return "zombie (exited, not reaped yet)"
        if status is not None:
            return f"alive ({status})"
    except ImportError:
        try:
            with open(f"/proc/{pid}/status") as handle:
                state = next((line.split(None, 1)[1].strip() for line in handle if line.startswith("State:")), "?")
            return "zombie (exited, not reaped yet)" if state.startswith("Z") else f"alive ({state})"
        except OSError:
            pass
    code = proc.exitcode
    return "gone (no exit code)" if code is None else describe_exit(code)


def py_spy_dump(pid: int) -> str | None:
    tool = shutil.which("py-spy")
    if tool is None:
        return None
    try:
        done = subprocess.run(
            [tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def take_stacks(targets: dict[int, int], directory: str | None) -> dict[int, str]:
    """{rank: every thread's Python stack now} for ``targets`` ({rank: pid}): SIGUSR2 to each, then
    read what its faulthandler appended to ``<directory>/<pid>.stack`` (py-spy where none came)."""
    pending: dict[int, tuple[str, int]] = {}
    stacks: dict[int, str] = {}
    for rank, pid in targets.items():
        path = os.path.join(directory, f"{pid}.stack") if directory else ""
        if not path or not os.path.exists(path) or STACK_SIGNAL is None:
            continue
        start = os.path.getsize(path)
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            continue
        pending[rank] = (path, start)
    deadline = time.monotonic() + STACK_WAIT_S
    last: dict[int, int] = {}
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank, (path, start) in list(pending.items()):
            size = os.path.getsize(path)
            if size > start and last.get(rank) == size:  # written, and not growing any more
                with open(path, "rb") as handle:
                    handle.seek(start)
                    stacks[rank] = handle.read().decode("utf-8", "replace")
                del pending[rank]
            last[rank] = size
    for rank, pid in targets.items():
        if rank not in stacks:
            stacks[rank] = py_spy_dump(pid) or (
                "(no stack: the process did not answer SIGUSR2 within "
                f"{STACK_WAIT_S:g} s, or the worker-stack-dump adapter is not active in it; py-spy not installed)"
            )
    return stacks


# ---- worker side: faulthandler on SIGUSR2 -----------------------------------------------------------


def probe_worker_stack_dump(ctx: Context) -> Probe:
    if STACK_SIGNAL is None or not hasattr(faulthandler, "register"):
        return Probe(False, "no SIGUSR2 / faulthandler.register on this platform")
    if not os.environ.get(WATCHDOG_DIR_ENV):
        return Probe(False, "this worker's executor has no RPC deadline (executor-rpc-deadline)")
    return Probe(True, "a worker that never answers must show where it is stuck: its stacks on SIGUSR2")


def apply_worker_stack_dump(ctx: Context, patcher: AdapterPatcher) -> None:
    assert STACK_SIGNAL is not None
    stack_signal = STACK_SIGNAL
    path = os.path.join(os.environ[WATCHDOG_DIR_ENV], f"{os.getpid()}.stack")
    handle = open(path, "a")  # noqa: SIM115 - faulthandler writes to it for the life of the process
    faulthandler.register(stack_signal, file=handle, all_threads=True, chain=False)

    def undo() -> None:
        faulthandler.unregister(stack_signal)
        handle.close()

    patcher.on_revert(f"faulthandler.register(SIGUSR2, {path})", undo)


WORKER_STACK_DUMP = Adapter(
    id="worker-stack-dump",
    notes="""
    why: a rank that never answers must say where it is stuck: the driver's hang report (WorkerTimeout) carries every
        thread's Python stack of each silent rank, taken at the deadline
    vllm change: none: vLLM workers have no stack-dump hook (a stuck rank is silent on every release)
    detect: SIGUSR2 and faulthandler.register exist; the driver's executor set SPEC_COMPAT_WATCHDOG_DIR
        (executor-rpc-deadline)
    delete when: vLLM reports stuck workers' stacks itself
    patches: faulthandler.register(SIGUSR2, <watchdog dir>/<pid>.stack, all_threads=True), in spec_compat's worker
        processes only
    """,
    side="worker-process",
    probe=probe_worker_stack_dump,
    apply=apply_worker_stack_dump,
)


# ---- driver side: the executor's deadline -----------------------------------------------------------


def probe_rpc_deadline(ctx: Context) -> Probe:
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if "timeout" not in inspect.signature(MultiprocExecutor.collective_rpc).parameters:
        return Probe(False, "this vLLM's collective_rpc takes no timeout: RPCs have no deadline")
    if "timeout" not in inspect.signature(MessageQueue.dequeue).parameters:
        return Probe(False, "this vLLM's message queue cannot wait with a timeout: RPCs have no deadline")
    return Probe(
        True,
        f"speculators' RPCs pass no timeout: a rank that never answers leaves generate() waiting forever; "
        f"deadline {ctx.options.rpc_timeout_s:g} s (rpc_timeout_s / SPEC_COMPAT_RPC_TIMEOUT)",
    )


class RpcDeadline(ExecutorHook):
    """``timeout_s`` on generate()'s RPCs, the replies counted per rank, a timeout reported."""

    stage = CORE_STAGE - 10  # its TimeoutError is reported before the subclass diagnoses errors

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def start(self, executor: Any) -> contextlib.AbstractContextManager[object] | None:
        executor.replies_read = []  # replies read per rank (counted once the workers are up)
        directory = executor.watchdog_directory = make_directory()
        weakref.finalize(executor, remove_directory, directory)
        executor.deadlined_methods = deadlined_methods(executor.extension_methods)
        # vLLM's own model-step deadline is replaced (too short for a first step without
        # warm-up) unless the user set it.
        executor.keep_step_timeout = STEP_TIMEOUT_ENV in os.environ
        return scoped_environ({WATCHDOG_DIR_ENV: directory})

    def started(self, executor: Any) -> None:
        executor.replies_read = [0] * len(getattr(executor, "response_mqs", None) or [])
        count_replies(executor.response_mqs, executor.replies_read)

    def before_rpc(self, executor: Any, call: RpcCall) -> None:
        call.read_before = with_deadline(executor, self.timeout_s, call.method, call.args, call.kwargs)

    def on_error(self, executor: Any, call: RpcCall, exc: Exception) -> BaseException | None:
        if isinstance(exc, TimeoutError) and call.read_before is not None:
            return timeout_error(executor, call.method, call.kwargs, call.read_before)
        return None

    def shutdown(self, executor: Any) -> Callable[[], None] | None:
        return functools.partial(remove_watchdog_directory, executor)


def remove_watchdog_directory(executor: Any) -> None:
    directory = getattr(executor, "watchdog_directory", None)
    if directory:
        remove_directory(directory)


def apply_rpc_deadline(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, RpcDeadline(ctx.options.rpc_timeout_s))


EXECUTOR_RPC_DEADLINE = Adapter(
    id="executor-rpc-deadline",
    notes="""
    why: speculators' RPCs pass no timeout: a rank blocked forever (tried: rank 1 inside _get_captured_states, TP=2)
        left generate() waiting with no output for as long as one waited (issue 14); vLLM's own model-step deadline (300
        s) is too short for a first step without warm-up and its TimeoutError names no rank
    vllm change: none: every release's collective_rpc(timeout=) defaults to None for callers that pass none
    detect: collective_rpc and MessageQueue.dequeue accept timeout (every release 0.10.2-0.33.0)
    delete when: vLLM gives every worker RPC a deadline and reports the stuck ranks
    patches: MultiprocExecutor.__init__ / collective_rpc / shutdown (timeout= on generate()'s model steps and
        speculators' worker RPCs; replies counted per rank; a timeout becomes WorkerTimeout with the silent ranks'
        stacks and process states, then the engine is shut down; later calls raise EngineStopped)
    """,
    side="driver",
    probe=probe_rpc_deadline,
    apply=apply_rpc_deadline,
)


def with_deadline(
    executor: Any, timeout_s: float, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[int] | None:
    """Before an RPC: the deadline put into ``kwargs['timeout']`` where it applies; returns the
    replies read per rank so far (None: no deadline on this call)."""
    if (
        args  # a positional timeout
        or not isinstance(method, str)
        or method not in executor.deadlined_methods
        or kwargs.get("non_block") is True
    ):
        return None
    caller = kwargs.get("timeout")
    if caller is None or (method in MODEL_STEPS and not executor.keep_step_timeout):
        kwargs["timeout"] = timeout_s
    else:
        kwargs["timeout"] = min(caller, timeout_s)
    return list(executor.replies_read)


def timeout_error(executor: Any, method: str, kwargs: dict[str, Any], read_before: list[int]) -> WorkerTimeout:
    """When the deadline passed: who answered, every silent rank's stacks and process
    state, then the engine shut down (``executor.spec_compat_stop``)."""
    timeout_s = float(kwargs["timeout"])
    handles = {h.rank: h for h in list(getattr(executor, "workers", None) or [])}
    queues = list(getattr(executor, "response_mqs", None) or [])
    reply_rank = kwargs.get("unique_reply_rank")
    aggregated = kwargs.get("kv_output_aggregator") or kwargs.get("ec_output_aggregator")
    asked = list(range(len(queues))) if reply_rank is None or aggregated else [reply_rank]
    replies_read = executor.replies_read
    read = {r for r in asked if r < len(replies_read) and replies_read[r] > read_before[r]}
    # Stacks first, at the deadline: every rank whose reply was not read (or was not asked for).
    silent = {rank: h.proc.pid for rank, h in handles.items() if rank not in read}
    stacks = take_stacks(silent, executor.watchdog_directory)
    answered, stuck = sorted(read), []
    for rank in asked:
        if rank in read:
            continue
        try:  # vLLM reads in rank order and stops at the first silent rank: later replies wait
            queues[rank].dequeue(timeout=REPLY_PROBE_S)
            answered.append(rank)
        except Exception:  # noqa: BLE001 - no reply (TimeoutError), or a queue already closed
            stuck.append(rank)
    answered.sort()
    states = {}
    for rank, handle in sorted(handles.items()):
        role = "answered" if rank in answered else ("NO REPLY" if rank in stuck else "not asked to reply")
        states[rank] = f"TP rank {rank} (pid {handle.proc.pid}): {process_state(handle.proc)}; {role}"
    for rank in answered:
        stacks.pop(rank, None)
    name = f"no reply to {method!r} within {timeout_s:g} s from " + (", ".join(f"TP rank {r}" for r in stuck) or "?")
    shutdown = executor.spec_compat_stop(name, [handles[r].proc for r in stuck if r in handles])
    error = WorkerTimeout(method, timeout_s, answered, stuck, stacks, states, shutdown)
    logger.error("spec_compat: %s", error)
    return error


# ---- driver side: SIGINT / SIGTERM during generate() ------------------------------------------------


def kill_workers(executor: Any) -> None:
    for handle in list(getattr(executor, "workers", None) or []):
        proc = getattr(handle, "proc", None)
        if proc is not None and proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)


class SignalShutdown:
    """While generate() runs: the first SIGINT/SIGTERM interrupts it, the engine is shut down, then
    KeyboardInterrupt / SystemExit(128 + SIGTERM) goes on; a second one kills the workers and exits.

    Only signals whose handler is still Python's default are taken over: a caller with its own
    handler (spec-compat extract, say) keeps it, and its KeyboardInterrupt/SystemExit still shuts the
    engine down on the way out of generate()."""

    DEFAULTS: tuple[tuple[int, Any], ...] = (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGTERM, signal.SIG_DFL),
    )

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.previous: dict[int, Any] = {}
        self.received: int | None = None

    def __enter__(self) -> SignalShutdown:
        for signum, default in self.DEFAULTS:
            if signal.getsignal(signum) is default:
                self.previous[signum] = signal.signal(signum, self._first)
        return self

    def _first(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        for taken in self.previous:
            signal.signal(taken, self._force)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _force(self, signum: int, frame: FrameType | None) -> None:
        os.write(2, b"spec_compat: second signal: killing the vLLM workers and exiting now\n")
        kill_workers(self.executor)
        os._exit(128 + signum)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is not None and not isinstance(exc, Exception) and not isinstance(exc, GeneratorExit):
                for taken in self.previous:
                    signal.signal(taken, self._force)
                what = signal.Signals(self.received).name if self.received is not None else type(exc).__name__
                stop = getattr(self.executor, "spec_compat_stop", None)
                if stop is not None and getattr(self.executor, "stopped_reason", None) is None:
                    sys.stderr.write(
                        f"spec_compat: {what} during generate(): shutting the engine down "
                        "(send it again to exit at once)\n"
                    )
                    sys.stderr.flush()
                    # A worker busy with the interrupted call would finish it first: the ones not
                    # gone after INTERRUPT_GRACE_S of vLLM's shutdown get SIGTERM, then SIGKILL.
                    procs = [h.proc for h in list(getattr(self.executor, "workers", None) or [])]
                    outcome = stop(f"{what} during generate()", procs, INTERRUPT_GRACE_S)
                    sys.stderr.write(f"spec_compat: {outcome}\n")
                    sys.stderr.flush()
        finally:
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)


def probe_signal_shutdown(ctx: Context) -> Probe:
    if not hasattr(signal, "SIGTERM") or sys.platform == "win32":
        return Probe(False, "no POSIX signals on this platform")
    return Probe(True, "a signal during generate() would leave the workers mid-call; the engine is shut down first")


def apply_signal_shutdown(ctx: Context, patcher: AdapterPatcher) -> None:
    def with_signal_shutdown(generator: Any, token_ids: Any, run: Run) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return run(token_ids)  # signal handlers live in the main thread
        with SignalShutdown(getattr(generator, "executor", None)):
            return run(token_ids)

    wrap_generate(ctx, patcher, with_signal_shutdown)


GENERATE_SIGNAL_SHUTDOWN = Adapter(
    id="generate-signal-shutdown",
    notes="""
    why: Ctrl-C or SIGTERM in the middle of generate() left the workers mid-call (SIGTERM: the driver killed with no
        cleanup); the user must not need `ps aux` to know whether anything is still running
    vllm change: none: speculators' generator drives the engine itself, outside vLLM's engine-core signal handling
    detect: POSIX signals
    delete when: speculators' generator runs on vLLM's LLM / engine core, which handles signals
    patches: VllmHiddenStatesGenerator.generate (SIGINT/SIGTERM handlers while it runs in the main thread, where the
        caller left the defaults; the engine is shut down before KeyboardInterrupt / exit 143)
    """,
    side="driver",
    probe=probe_signal_shutdown,
    apply=apply_signal_shutdown,
    # outermost: its handlers are in place for the whole call, every other wrapper's work included
    after=("single-step-batches", "sequence-limit", "input-order", "layer-ids", "results-contract", "input-validation"),
)
