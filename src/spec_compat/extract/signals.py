"""SIGINT / SIGTERM during extract: unwind to the clean-up once, exit at once the second time."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Interrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM during extract: unwinds to the clean-up (files of finished batches are
    recorded, the engine is shut down); a second signal exits at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _install_signal_handlers() -> Callable[[], None]:
    """First SIGINT/SIGTERM: raise Interrupted where the main thread is; second: kill the workers
    and exit now. Returns the function that restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def force(signum: int, frame: Any) -> None:
        sys.stderr.write(f"\nspec-compat extract: second {signal.Signals(signum).name}: exiting now\n")
        _kill_children()
        os._exit(128 + signum)

    def first(signum: int, frame: Any) -> None:
        for each in previous:
            signal.signal(each, force)
        raise Interrupted(signum)

    for signum in previous:
        signal.signal(signum, first)

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def _kill_children() -> None:
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # noqa: BLE001 - exiting anyway; the workers also watch their parent
        pass


class Signals:
    """First SIGINT / SIGTERM: ``Interrupted`` where the main thread is, or at the end of a
    ``deferred()`` block (recording a batch: no half-renamed batch, no stray manifest temporary);
    second: kill every child process (the local Ray, replicas, vLLM workers) and exit at once."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._first)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()
        self.pending, self.depth = None, 0

    def _first(self, signum: int, frame: Any) -> None:
        for each in self.previous:
            signal.signal(each, self._force)
        if self.depth:
            self.pending = signum
            return
        raise Interrupted(signum)

    def _force(self, signum: int, frame: Any) -> None:
        sys.stderr.write(f"\nspec-compat extract: second {signal.Signals(signum).name}: exiting now\n")
        _kill_children()
        os._exit(128 + signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)


SIGNALS = Signals()
