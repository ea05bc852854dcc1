"""Adapter ``loud-worker-errors``: a worker exception reaches the driver encoded, with its type and
traceback."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..remote_errors import EncodedWorkerException, encode
from ..speculators_code import worker_module
from ..support import tp_rank
from ..unit import Adapter


def _loud(method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EncodedWorkerException:
            raise
        except Exception as exc:
            raise encode(exc, tp_rank(), method) from exc

    wrapper.spec_compat_loud = True  # type: ignore[attr-defined]
    return wrapper


def probe_loud_worker_errors(ctx: Context) -> Probe:
    return Probe(True, "vLLM sends only str(exc) from a worker: no type, rank or traceback ('' for AssertionError())")


def apply_loud_worker_errors(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    extension = worker.HiddenStatesWorkerExtension
    for name, value in list(vars(extension).items()):
        if inspect.isfunction(value) and not getattr(value, "spec_compat_loud", False):
            patcher.replace(extension, name, _loud(name, value))
    patcher.replace(
        worker,
        "_patched_forward",
        _loud("model forward (_patched_forward)", worker._patched_forward),
    )


LOUD_WORKER_ERRORS = Adapter(
    id="loud-worker-errors",
    patches=(
        "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension.*",
        "speculators.data_generation.custom_worker._patched_forward",
    ),
    how="every HiddenStatesWorkerExtension method",
    why="a worker exception reaches the caller as `Worker failed with error ''`: no type, rank or traceback",
    vllm_change="all releases: WorkerProc replies (FAILURE, str(exc))",
    detect="always",
    delete_when="vLLM transports exception type and traceback from workers",
    side="worker",
    probe=probe_loud_worker_errors,
    apply=apply_loud_worker_errors,
    # wraps the extension's methods and _patched_forward as the other worker adapters left them (it
    # skips what is already loud, so one applied after it would replace a loud method with a silent one)
    after=("wrapper-base-model", "capture-setup", "layer-kwargs", "batch-order-log", "captured-states-shared-memory"),
)
