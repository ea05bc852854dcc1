"""Adapter ``generate-signal-shutdown``: SIGINT / SIGTERM during generate().

While generate() runs in the main thread, SIGINT and SIGTERM (where the caller left their default
handlers) stop it at once, shut the engine down (no worker left) and then raise KeyboardInterrupt /
exit with 128 + 15; a second signal kills the workers and exits immediately.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..support import Run, wrap_generate
from ..unit import Adapter

INTERRUPT_GRACE_S = 2.0  # after SIGINT/SIGTERM: workers still running this long into the shutdown get SIGTERM


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
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.generate",),
    how=(
        "SIGINT/SIGTERM handlers while it runs in the main thread, where the caller left the defaults; the engine is "
        "shut down before KeyboardInterrupt / exit 143"
    ),
    why=(
        "Ctrl-C or SIGTERM in the middle of generate() left the workers mid-call (SIGTERM: the driver killed with no "
        "cleanup); the user must not need `ps aux` to know whether anything is still running"
    ),
    vllm_change="none: speculators' generator drives the engine itself, outside vLLM's engine-core signal handling",
    detect="POSIX signals",
    delete_when="speculators' generator runs on vLLM's LLM / engine core, which handles signals",
    side="driver",
    probe=probe_signal_shutdown,
    apply=apply_signal_shutdown,
    # outermost: its handlers are in place for the whole call, every other wrapper's work included
    after=("single-step-batches", "sequence-limit", "input-order", "layer-ids", "results-contract", "input-validation"),
)
