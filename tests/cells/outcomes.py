"""What the fault and hang cells record of a call, and whether a process is still running; shared
by those cells (run in the driver, never pickled into a worker) and tests/test_hang.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: only its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            return "zombie" not in handle.read()
    except FileNotFoundError:
        return False


def capture(fn: Callable[[], Any], details: Callable[[Exception], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s outcome: ``raised`` (the exception's type name, or None), the cell's ``details``
    of the exception, its ``text``, and the ``seconds`` the call took."""
    started = time.perf_counter()
    try:
        fn()
        outcome: dict[str, Any] = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - the outcome is the point
        outcome = {"raised": type(exc).__name__, **details(exc), "text": str(exc)}
    outcome["seconds"] = time.perf_counter() - started
    return outcome
