"""Adapter ``worker-exception-transport``: a worker exception's type and traceback reach the driver.

Applied only inside worker processes started by spec_compat's executor: it touches vLLM's own
worker classes, so it never runs in the driver (a fork of the driver would carry it into other
engines' workers); the plugin applies it in those workers only.
"""

from __future__ import annotations

import functools
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..remote_errors import encode, is_encoded
from ..support import tp_rank
from ..unit import Adapter


def probe_exception_transport(ctx: Context) -> Probe:
    from vllm.v1.executor import multiproc_executor

    proc_cls = getattr(multiproc_executor, "WorkerProc", None)
    if proc_cls is None or "handle_output" not in vars(proc_cls):
        return Probe(False, "this vLLM's worker process has no handle_output() to carry exceptions through")
    return Probe(True, "WorkerProc replies (FAILURE, str(exc)): any worker RPC error loses its type and traceback")


def apply_exception_transport(ctx: Context, patcher: AdapterPatcher) -> None:
    from vllm.v1.executor.multiproc_executor import WorkerProc

    original = vars(WorkerProc)["handle_output"]

    @functools.wraps(original)
    def handle_output(self: Any, output: Any) -> Any:
        if isinstance(output, Exception) and not is_encoded(str(output)):
            rank = tp_rank()
            output = encode(output, rank if rank is not None else getattr(self, "rank", None), "worker RPC")
        return original(self, output)

    patcher.replace(WorkerProc, "handle_output", handle_output)


WORKER_EXCEPTION_TRANSPORT = Adapter(
    id="worker-exception-transport",
    patches=("vllm.v1.executor.multiproc_executor.WorkerProc.handle_output",),
    how="in spec_compat's worker processes only",
    why="any worker RPC failure (vLLM's own execute_model included) reaches the caller as str(exc) only",
    vllm_change="all releases: WorkerProc replies (FAILURE, str(exc))",
    detect="WorkerProc defines handle_output",
    delete_when="vLLM transports exception type and traceback from workers",
    side="worker-process",
    probe=probe_exception_transport,
    apply=apply_exception_transport,
)
