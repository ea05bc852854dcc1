"""Adapter ``executor-shared-memory-replies``: the driver's half of captured states through shared
memory (the worker's half is adapter ``captured-states-shared-memory``).

The executor gives its workers a transfer directory; a worker's reply is a small descriptor of a
segment there, which the driver maps and hands speculators as tensors (and skips its CPU NaN/Inf
scan when the worker checked on the device).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from ....environ import scoped_environ
from ....options import Context
from ....patching import AdapterPatcher
from ... import transfer
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import CORE_STAGE, ExecutorHook


class SharedMemoryReplies(ExecutorHook):
    """A transfer directory for the workers (their replies then describe segments in it, which the
    subclass maps: executor.received_states), removed at shutdown."""

    stage = CORE_STAGE - 30  # its directory goes after the message queues, before the watchdog's

    def start(self, executor: Any) -> contextlib.AbstractContextManager[object] | None:
        directory = transfer.make_directory()
        weakref.finalize(executor, transfer.remove_directory, directory)
        executor.transfer_directory = directory
        executor.transfer_mappings = transfer.DriverMappings(directory)
        return scoped_environ({transfer.TRANSFER_DIR_ENV: directory})

    def shutdown(self, executor: Any) -> Callable[[], None] | None:
        return functools.partial(close_transfer, executor)


def close_transfer(executor: Any) -> None:
    directory = getattr(executor, "transfer_directory", None)
    if directory:
        executor.transfer_mappings.close()
        transfer.remove_directory(directory)


def apply_shared_memory_replies(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, SharedMemoryReplies())


def probe_shared_memory_replies(ctx: Context) -> Probe:
    if sys.platform == "win32":
        return Probe(False, "no POSIX shared memory and flock on this platform")
    return Probe(
        True,
        "captured states are pickled tensor by tensor through vLLM's message queue (H200: 1.66 s of a 2.74 s call); "
        "they come through a shared-memory segment instead, described by a small reply",
    )


EXECUTOR_SHARED_MEMORY_REPLIES = Adapter(
    id="executor-shared-memory-replies",
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how=(
        "hook SharedMemoryReplies: a transfer directory for the workers, removed at shutdown; descriptors in "
        "speculators' replies become tensors over shared memory"
    ),
    why=(
        "see captured-states-shared-memory: the driver maps the segment instead of unpickling 192 tensors, and skips "
        "its CPU NaN/Inf scan when the worker checked on the device"
    ),
    vllm_change="none: all releases send RPC replies by pickling them",
    detect="POSIX flock and mmap (Linux, macOS)",
    delete_when="vLLM offers a zero-copy tensor channel from workers to the driver",
    side="driver",
    probe=probe_shared_memory_replies,
    apply=apply_shared_memory_replies,
)
