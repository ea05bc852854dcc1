"""The switches of spec_compat's executor subclass, and the executors started with it.

Each ``executor-*`` adapter (and ``worker-malloc-retain``, ``rpc-reply-read-once``) turns on one
behaviour of the subclass (``executor.py``) by setting its switch through the patcher
(``set_flag``), so revert() turns it off again; the behaviour's code (the hooks the subclass
calls), its probe and its apply live in that adapter's own module. A release that needs none of
them runs vLLM's own code.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ..options import Context
from ..patching import AdapterPatcher

EXECUTORS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # id(vllm_config) -> executor


def executor_for(vllm_config: Any) -> Any:
    """spec_compat's executor started for this vLLM config (None if none is alive)."""
    return EXECUTORS.get(id(vllm_config))


class ExecutorSwitches:
    """Class attributes of every spec_compat executor subclass: off unless an adapter set them."""

    worker_options_json: str | None = None  # executor: worker-side adapters run in these workers
    extension_methods: frozenset[str] = frozenset()  # executor: speculators' worker RPCs
    all_ranks_reply = False  # executor-all-ranks-reply: unique_reply_rank=k -> ask every rank
    reply_as_list = False  # executor-reply-shape: speculators expects [rank-k result] (vLLM <= 0.11.0)
    sample_after_execute = False  # executor-sample-tokens: the caller never calls sample_tokens()
    resolve_kv_layout = False  # executor-kv-layout: resolve the KV cache layout as the engine core does
    force_v1_model_runner = False  # executor-model-runner-v1: speculators reads model_runner.input_batch
    close_queues_on_shutdown = False  # executor-close-queues: vLLM leaves the queues' zmq contexts to the GC
    read_once_replies = False  # rpc-reply-read-once: a dict reply gives each entry up when read
    worker_malloc_env: tuple[tuple[str, str], ...] = ()  # worker-malloc-retain: glibc settings for the workers
    shared_memory_replies = False  # executor-shared-memory-replies: states come as shared-memory descriptors
    states_handover = False  # driver-states-handover: speculators' clones of those states keep their bytes
    rpc_timeout_s: float | None = None  # executor-rpc-deadline: deadline of generate()'s RPCs (None: none)
    stopped_reason: str | None = None  # set once the engine was shut down after a failure / a signal


_installer: Callable[[Context, AdapterPatcher], type] | None = None


def register_installer(installer: Callable[[Context, AdapterPatcher], type]) -> None:
    """How ``set_flag`` finds the subclass: ``executor.installed_executor_class``, registered by
    executor.py when imported (so that this module, which every behaviour's module imports, does
    not import the subclass that imports them)."""
    global _installer
    _installer = installer


def set_flag(ctx: Context, patcher: AdapterPatcher, name: str, value: Any) -> None:
    """Turn on one switch of the executor subclass installed under the generator's
    ``MultiprocExecutor`` name (installing it first, as the ``executor`` adapter would),
    recorded under the adapter whose apply this is."""
    if name not in vars(ExecutorSwitches):
        raise AttributeError(f"spec_compat's executor has no switch {name!r}")
    assert _installer is not None, "spec_compat.adapters.executor registers the installer when imported"
    patcher.replace(_installer(ctx, patcher), name, value)


def switch_on(name: str, value: Any = True) -> Callable[[Context, AdapterPatcher], None]:
    """The ``apply`` of an adapter that only turns on one switch: ``value``, or ``value(ctx)`` when
    it is a function of the options."""

    def apply(ctx: Context, patcher: AdapterPatcher) -> None:
        set_flag(ctx, patcher, name, value(ctx) if callable(value) else value)

    apply.__name__ = apply.__qualname__ = f"switch_on_{name}"
    return apply
