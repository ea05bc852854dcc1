"""Failure diagnosis in spec_compat's executor: what a caller sees when a worker fails.

Always on in the subclass (adapter ``executor``, executor.py's own hook): an encoded worker
exception (``loud-worker-errors``) is raised as ``WorkerError`` with the replies of later ranks
drained, and a worker process that died is named (``WorkerProcessDied``). Asking every rank for
its reply is adapter ``executor-all-ranks-reply`` (executor_all_ranks_reply.py).
"""

from __future__ import annotations

import signal
import time
from typing import Any

from ....errors import WorkerError
from ... import remote_errors

DRAIN_TIMEOUT_S = 60.0
# After a worker's own exception, how long a peer's death may take to show (its exit code): a rank
# that failed in a collective because its peer was killed reports within milliseconds of the kill.
DEATH_AFTER_ERROR_WAIT_S = 0.5


def dead_worker_error(
    executor: Any, method: Any, wait_s: float = 2.0, then: WorkerError | None = None
) -> WorkerError | None:
    """A WorkerError naming the worker process that died, if one did (``then``: what another rank
    raised afterwards, named in the message and its traceback kept)."""
    handles = list(getattr(executor, "workers", None) or [])
    if not handles:
        return None
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
    message = "worker process " + "; ".join(describe(h) for h in dead)
    traceback = "(the process died: no Python traceback; see its log or a core dump)"
    if then is not None:
        first_line = (then.message.splitlines() or [""])[0][:300]
        message += f"; then TP rank {then.rank} raised {then.exc_type}: {first_line}"
        traceback += f"\n--- TP rank {then.rank}'s traceback ---\n{then.remote_traceback}"
    return WorkerError(
        exc_type="WorkerProcessDied", message=message, rank=first.rank, remote_traceback=traceback, method=name
    )


def drain_replies_after(executor: Any, failed_rank: int) -> None:
    """vLLM reads replies in rank order and stops at the first failure: the replies of the later
    ranks stay queued and would be taken as the answers to the *next* RPC."""
    for queue in list(getattr(executor, "response_mqs", None) or [])[failed_rank + 1 :]:
        try:
            queue.dequeue(timeout=DRAIN_TIMEOUT_S)
        except Exception as exc:
            executor.is_failed = True
            raise RuntimeError(
                "spec_compat: a worker failed and the other workers' replies could not be drained; "
                "this executor cannot be used further"
            ) from exc


def diagnosed(executor: Any, exc: Exception, method: Any, kwargs: dict[str, Any]) -> Exception | None:
    """The error to raise instead of vLLM's ``exc`` (None: raise ``exc`` itself): the worker process
    that died, else the worker's own exception decoded. A death comes first: the other ranks then
    fail in their collectives (gloo / NCCL "connection closed by peer"), and which of the two
    reaches the caller first is a race, while the cause is the death."""
    decoded = remote_errors.decode(str(exc))
    died = dead_worker_error(executor, method, wait_s=DEATH_AFTER_ERROR_WAIT_S if decoded else 2.0, then=decoded)
    if died is not None:
        return died
    if decoded is not None:
        if kwargs.get("unique_reply_rank") is None and decoded.rank is not None:
            drain_replies_after(executor, decoded.rank)
        return decoded
    return None
