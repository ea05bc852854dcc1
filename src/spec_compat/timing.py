"""Where the time of a ``generate()`` call goes, by spec_compat's own accounting.

Labels: ``own:<what>`` is spec_compat's own work (checks, reordering, RPC handling), in the driver
or reported back by the workers; ``transfer:<what>`` is moving captured states from the worker
to the driver; ``rpc:<method>`` is the driver's wall time in each ``collective_rpc`` method (the
forward is ``rpc:execute_model``; it contains the ``own:`` / ``transfer:`` time spent inside RPCs).
Everything else in a call is speculators' own driver code and vLLM's scheduler.
``benchmarks/gpu.py`` divides the ``own:`` total by the call's wall time (``overhead_fraction``).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_totals: defaultdict[str, float] = defaultdict(float)


def add(label: str, seconds: float) -> None:
    with _lock:
        _totals[label] += seconds


def add_all(pairs: tuple[tuple[str, float], ...]) -> None:
    """Add (label, seconds) pairs, e.g. those a worker reported with its reply."""
    with _lock:
        for label, seconds in pairs:
            _totals[label] += seconds


@contextmanager
def timed(label: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        add(label, time.perf_counter() - started)


def timings() -> dict[str, float]:
    """Seconds accumulated per label since the last ``reset_timings()``."""
    with _lock:
        return dict(_totals)


def reset_timings() -> None:
    with _lock:
        _totals.clear()


class OwnTime:
    """Time a wrapper spends outside the function it wraps (nesting-safe, per thread).

    ``with own.around(): ...`` brackets the wrapper; ``own.inner(fn)`` marks calls whose time is not
    the wrapper's own (the wrapped original)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._local = threading.local()

    def _stack(self) -> list[float]:
        stack: list[float] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @contextmanager
    def around(self) -> Iterator[None]:
        stack = self._stack()
        stack.append(0.0)
        started = time.perf_counter()
        try:
            yield
        finally:
            inner = stack.pop()
            add(self.label, time.perf_counter() - started - inner)

    @contextmanager
    def excluded(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            stack = self._stack()
            if stack:
                stack[-1] += time.perf_counter() - started
