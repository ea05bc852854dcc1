"""Adapter ``executor-rpc-deadline``: never a silent wait on a worker.

spec_compat's executor passes a deadline (``rpc_timeout_s``) as vLLM's own
``collective_rpc(timeout=...)`` for the model steps and speculators' worker RPCs of generate();
vLLM's message queues wait on it themselves (no watchdog thread, no thread hop per call). When it
passes, the executor works out which ranks answered (it counts the replies read from each rank's
response queue), signals the others for their Python stacks (adapter ``worker-stack-dump``),
records every worker's process state, shuts the engine down and raises ``WorkerTimeout``. Where no
dump arrives, ``py-spy dump`` is used if installed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ....environ import scoped_environ
from ....errors import WorkerTimeout
from ....options import Context
from ....patching import AdapterPatcher
from ...probe import Probe
from ...support import STACK_SIGNAL, WATCHDOG_DIR_ENV
from ...unit import Adapter
from .executor import install_hook
from .hooks import CORE_STAGE, ExecutorHook, RpcCall

logger = logging.getLogger("spec_compat.executor")
MODEL_STEPS = frozenset({"execute_model", "sample_tokens"})
SETUP_PREFIX = "_setup"  # speculators' capture set-up RPCs run during the engine load: no deadline
STEP_TIMEOUT_ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"  # vLLM's own deadline of its model steps
STACK_WAIT_S = 3.0  # how long the driver waits for the stack dumps
REPLY_PROBE_S = 0.5  # a rank whose reply was not read yet: is one queued behind a stuck rank?
PY_SPY_TIMEOUT_S = 20.0


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
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how=(
        "hook RpcDeadline: timeout= on generate()'s model steps and speculators' worker RPCs; replies counted per "
        "rank; a timeout becomes WorkerTimeout with the silent ranks' stacks and process states, then the engine is "
        "shut down; later calls raise EngineStopped"
    ),
    why=(
        "speculators' RPCs pass no timeout: a rank blocked forever (tried: rank 1 inside _get_captured_states, TP=2) "
        "left generate() waiting with no output for as long as one waited (issue 14); vLLM's own model-step deadline "
        "(300 s) is too short for a first step without warm-up and its TimeoutError names no rank"
    ),
    vllm_change="none: every release's collective_rpc(timeout=) defaults to None for callers that pass none",
    detect="collective_rpc and MessageQueue.dequeue accept timeout (every release 0.10.2-0.33.0)",
    delete_when="vLLM gives every worker RPC a deadline and reports the stuck ranks",
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
