"""Adapter ``worker-stack-dump``: each worker started by spec_compat's executor registers
``faulthandler`` on SIGUSR2, writing every thread's stack to ``<watchdog dir>/<pid>.stack``.

faulthandler's handler is C code run at signal delivery, so it answers even when the worker's
Python code is blocked in a C call (adapter ``executor-rpc-deadline`` asks for the stacks).
"""

from __future__ import annotations

import faulthandler
import os

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..support import STACK_SIGNAL, WATCHDOG_DIR_ENV
from ..unit import Adapter


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
    patches=("faulthandler.register()",),
    how="SIGUSR2 -> <watchdog dir>/<pid>.stack, all_threads=True, in spec_compat's worker processes only",
    why=(
        "a rank that never answers must say where it is stuck: the driver's hang report (WorkerTimeout) carries "
        "every thread's Python stack of each silent rank, taken at the deadline"
    ),
    vllm_change="none: vLLM workers have no stack-dump hook (a stuck rank is silent on every release)",
    detect=(
        "SIGUSR2 and faulthandler.register exist; the driver's executor set SPEC_COMPAT_WATCHDOG_DIR "
        "(executor-rpc-deadline)"
    ),
    delete_when="vLLM reports stuck workers' stacks itself",
    side="worker-process",
    probe=probe_worker_stack_dump,
    apply=apply_worker_stack_dump,
)
