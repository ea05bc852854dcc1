"""Engines shut down while the interpreter is still intact (driver side, adapter ``shutdown-at-exit``).

speculators shuts its engine down only from ``VllmHiddenStatesGenerator.__del__``. A generator
still alive at the end of a script is finalised during interpreter teardown, after module globals
have been set to None: the executor's shutdown fails there (spec_compat's executor module, vLLM's,
are half gone), and the ``log.warning`` in speculators' ``except`` fails too, so every run ended
with ``Exception ignored in: <function VllmHiddenStatesGenerator.__del__> ... AttributeError:
'NoneType' object has no attribute 'warning'``.

Here every generator is tracked by a weak reference from its ``__init__``; an ``atexit`` handler
shuts down the executors of those still alive, while everything is importable, and a generator
shut down that way has nothing left to do in ``__del__``. The handler is registered at the first
generator construction, so it runs before the handlers registered earlier (atexit is last-in,
first-out): before multiprocessing's exit function (which would terminate the workers without
vLLM's shutdown) and before the weakref finalizers (the transfer directory).
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import generator_module
from ..unit import Adapter

ADAPTER_ID = "shutdown-at-exit"
logger = logging.getLogger("spec_compat.lifecycle")


class ExitState:
    """``enabled`` is switched by the adapter through the patcher, so revert() switches it off."""

    enabled = False
    registered = False  # the atexit handler is registered once per process; disabled, it does nothing


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # generators constructed while the adapter was on
# Set in a generator's __dict__ by the handler. An attribute, not a set: __del__ runs during teardown,
# when even weakref's module globals may be gone.
SHUT_MARK = "_spec_compat_shut_down_at_exit"


def shutdown_live_generators() -> int:
    """Shut down the executor of every live generator (the atexit handler); returns how many."""
    if not ExitState.enabled:
        return 0
    count = 0
    for generator in list(_LIVE):
        vars(generator)[SHUT_MARK] = True
        executor = vars(generator).get("executor")
        if executor is None:
            continue
        try:
            executor.shutdown()
            count += 1
        except Exception as exc:  # noqa: BLE001 - at exit: report and go on with the other engines
            logger.warning("spec_compat: shutting down an engine at exit failed: %s: %s", type(exc).__name__, exc)
    return count


def probe_shutdown_at_exit(ctx: Context) -> Probe:
    cls = generator_module(ctx).VllmHiddenStatesGenerator
    if "__del__" in vars(cls):
        return Probe(True, "the engine is shut down only by __del__, which fails during interpreter teardown")
    return Probe(True, "nothing shuts the engine down at exit (no __del__): workers would be left to multiprocessing")


def apply_shutdown_at_exit(ctx: Context, patcher: AdapterPatcher) -> None:
    cls = generator_module(ctx).VllmHiddenStatesGenerator
    original_init: Callable[..., None] = cls.__init__
    live, mark = _LIVE, SHUT_MARK  # closed over: __del__ may run after this module's globals are gone

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        live.add(self)  # before the engine starts: a half-built generator's workers are shut down too
        if not ExitState.registered:
            ExitState.registered = True
            atexit.register(shutdown_live_generators)
        original_init(self, *args, **kwargs)

    __init__.spec_compat_adapter = ADAPTER_ID  # type: ignore[attr-defined]
    patcher.replace(cls, "__init__", __init__)

    original_del: Callable[[Any], None] | None = vars(cls).get("__del__")
    if original_del is not None:

        @functools.wraps(original_del)
        def __del__(self: Any) -> None:
            if self.__dict__.get(mark):  # shut down at exit, while the interpreter was intact
                return
            original_del(self)

        __del__.spec_compat_adapter = ADAPTER_ID  # type: ignore[attr-defined]
        patcher.replace(cls, "__del__", __del__)
    patcher.replace(ExitState, "enabled", True)


SHUTDOWN_AT_EXIT = Adapter(
    id=ADAPTER_ID,
    patches=(
        "speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.__init__",
        "speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.__del__",
        "spec_compat.adapters.driver.shutdown_at_exit.ExitState.enabled",
    ),
    how=(
        "__init__ tracks each generator by a weak reference, __del__ has nothing left to do once shut down at exit; "
        "an atexit handler, registered at the first generator, shuts down the live generators' executors"
    ),
    why=(
        "every run ended with `Exception ignored in: <function VllmHiddenStatesGenerator.__del__> ... "
        "AttributeError: 'NoneType' object has no attribute 'warning'`: __del__ shut the engine down during "
        "interpreter teardown, when module globals (the executor's, speculators' `log`) were already None"
    ),
    vllm_change="none: speculators shuts its engine down only from __del__ (0.3.0 and 0.4.x)",
    detect="always (the reason says whether the generator class defines __del__)",
    delete_when="speculators shuts the engine down itself (a close() / context manager, or its own atexit)",
    side="driver",
    probe=probe_shutdown_at_exit,
    apply=apply_shutdown_at_exit,
    # outside layer-ids' __init__: a generator is tracked before any check or engine start, so a
    # half-built generator's workers are shut down too
    after=("layer-ids",),
)
