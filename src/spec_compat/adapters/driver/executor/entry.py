"""The worker-side adapters reach every worker spec_compat's executor starts (adapter ``executor``).

Two ways, both while the executor starts its workers: the options in the environment
(``SPEC_COMPAT_WORKER_OPTIONS``, read by the ``vllm.general_plugins`` entry point, added to
``VLLM_PLUGINS`` where the user narrowed it) and vLLM's worker entry point replaced by
``spec_compat_worker_main`` (which works even where plugins are filtered out or were loaded
before a fork). What a worker applies is the package's ``apply_in_worker``, registered here by
the package (``set_worker_setup``) so that nothing in adapters/ imports the package's API.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from ....options import PLUGIN_NAME, WORKER_ENV

_ORIGINAL_WORKER_MAIN: Any = None
_worker_setup: Callable[[str], object] | None = None


def set_worker_setup(setup: Callable[[str], object]) -> None:
    """What a worker runs with the options' JSON before vLLM's own entry point (``apply_in_worker``)."""
    global _worker_setup
    _worker_setup = setup


def worker_env(options_json: str | None) -> dict[str, str]:
    """The variables the workers start with: the options, and the plugin where VLLM_PLUGINS omits it."""
    if options_json is None:
        return {}
    env = {WORKER_ENV: options_json}
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and PLUGIN_NAME not in plugins.split(","):
        env["VLLM_PLUGINS"] = f"{plugins},{PLUGIN_NAME}" if plugins else PLUGIN_NAME
    return env


def spec_compat_worker_main(*args: Any, **kwargs: Any) -> Any:
    """vLLM's worker entry point, after applying the worker-side adapters in this process.

    Used as the worker process target while spec_compat's executor starts its workers: a forked
    child runs it directly, a spawned child imports it by name (importing the package first, which
    registers its worker set-up)."""
    options_json = os.environ.get(WORKER_ENV)
    if options_json:
        assert _worker_setup is not None, "spec_compat's package registers its worker set-up when imported"
        _worker_setup(options_json)
    original = _ORIGINAL_WORKER_MAIN
    if original is None:
        from vllm.v1.executor.multiproc_executor import WorkerProc

        original = WorkerProc.worker_main
    return original(*args, **kwargs)


@contextlib.contextmanager
def worker_entry_point() -> Iterator[None]:
    """vLLM's ``WorkerProc.worker_main`` is ``spec_compat_worker_main`` inside the block."""
    global _ORIGINAL_WORKER_MAIN
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError:
        yield
        return
    saved = vars(WorkerProc).get("worker_main")
    if saved is None:
        yield
        return
    _ORIGINAL_WORKER_MAIN = WorkerProc.worker_main
    WorkerProc.worker_main = staticmethod(spec_compat_worker_main)  # type: ignore[method-assign]
    try:
        yield
    finally:
        WorkerProc.worker_main = saved  # type: ignore[method-assign]
