"""Adapter ``executor-close-queues``: the message queues' zmq contexts destroyed at shutdown.

Each vLLM MessageQueue creates its own zmq context and (before vLLM closed them itself) left it to
the garbage collector; pyzmq's Context.__del__ then blocks forever in term() when the context and
its sockets are collected in the same cycle: the driver hangs after the work is done (seen with
vLLM 0.29 at the first gc.collect() after shutdown).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

from ....options import Context
from ....patching import AdapterPatcher
from ... import speculators_code
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import CORE_STAGE, ExecutorHook


def _zmq_contexts(queue: Any) -> list[Any]:
    """The zmq contexts of a vLLM MessageQueue's sockets (its own, and its spin condition's)."""
    import zmq

    contexts: list[Any] = []
    holders = [queue, *(v for v in vars(queue).values() if hasattr(v, "__dict__") and not isinstance(v, type))]
    for holder in holders:
        for value in vars(holder).values():
            if isinstance(value, zmq.Socket) and value.context not in contexts:
                contexts.append(value.context)
    return contexts


def message_queues(executor: Any) -> list[Any]:
    """The executor's vLLM MessageQueues: the broadcast queue and every worker's response queues."""
    queues = [getattr(executor, "rpc_broadcast_mq", None), *(getattr(executor, "response_mqs", None) or [])]
    for handle in getattr(executor, "workers", None) or []:
        queues.append(getattr(handle, "worker_response_mq", None))
        queues.extend(getattr(handle, "peer_worker_response_mqs", None) or [])
    unique: list[Any] = []
    for queue in queues:
        if queue is not None and not any(queue is q for q in unique):
            unique.append(queue)
    return unique


def close_message_queues(queues: list[Any]) -> None:
    """Close message-queue sockets without lingering, then terminate their contexts."""
    for queue in queues:
        for context in _zmq_contexts(queue):
            if not context.closed:
                context.destroy(linger=0)


class CloseQueues(ExecutorHook):
    stage = CORE_STAGE - 40  # first after vLLM's shutdown

    def shutdown(self, executor: Any) -> Callable[[], None] | None:
        # Collected first: vLLM's shutdown() drops its references to the queues (sets them to None).
        return functools.partial(close_message_queues, message_queues(executor))


def apply_close_queues(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, CloseQueues())


def closes_sockets_without_linger(tree: ast.AST) -> bool:
    """Does the module call ``<socket>.close(linger=0)`` anywhere?"""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "close"
        and any(k.arg == "linger" and isinstance(k.value, ast.Constant) and k.value.value == 0 for k in node.keywords)
        for node in ast.walk(tree)
    )


def probe_close_queues(ctx: Context) -> Probe:
    from vllm.distributed.device_communicators import shm_broadcast

    if closes_sockets_without_linger(speculators_code.module_tree(shm_broadcast)):
        return Probe(False, "vLLM closes its message queues' zmq sockets itself (close(linger=0))")
    return Probe(
        True,
        "vLLM leaves each message queue's zmq context to the GC, where Context.__del__ can block forever in term()",
    )


EXECUTOR_CLOSE_QUEUES = Adapter(
    id="executor-close-queues",
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how="hook CloseQueues: at shutdown, destroy the message queues' zmq contexts with linger=0",
    why=(
        "the driver hangs forever after the work is done: pyzmq's Context.__del__ blocks in term() when a message "
        "queue's context and sockets are collected together (found by the version matrix on vLLM 0.29.0 at the first "
        "gc.collect() after shutdown)"
    ),
    vllm_change=(
        "every release up to 0.31.0 leaves MessageQueue's per-queue zmq context to the GC; 0.32.0 closes the sockets "
        "with linger=0 from a weakref finalizer (the probe decides, per the matrix)"
    ),
    detect="vllm.distributed.device_communicators.shm_broadcast never closes a socket with linger=0",
    delete_when="vLLM releases without the MessageQueue finalizer are no longer supported",
    side="driver",
    probe=probe_close_queues,
    apply=apply_close_queues,
)
