"""Adapter ``driver-clone-pool``: speculators' ``.clone()`` of the captured states into memory that
is already faulted in (the pool itself: clone_pool.py).

speculators copies every tensor of the captured-states reply on the driver. For tensors of a few MB
glibc maps fresh pages for every copy, so the copy runs at page-fault speed: on an H200 (5B MoE, 24
prompts of 1.5-2k tokens, ~700 MB of states) 0.41 s of a 0.73 s generate() call. With the reply's
tensors as ``clone_pool.CloneSource`` views, each clone is copied into a reused region instead.
"""

from __future__ import annotations

import sys
from typing import Any

from ..options import Context
from . import speculators_code
from .executor_switches import switch_on
from .probe import Probe
from .unit import Adapter


def clone_sources(executor: Any, value: Any) -> Any:
    """The hook on a reply rebuilt over shared memory: its tensors as clone sources of the executor's
    pool (made on first use), or the reply as it is when the switch is off."""
    if not executor.clone_pool:
        return value
    from .. import clone_pool  # imports torch: only once a reply with tensors arrives

    pool = getattr(executor, "driver_clone_pool", None)
    if pool is None:
        pool = executor.driver_clone_pool = clone_pool.ClonePool()
    return clone_pool.as_clone_sources(value, pool)


def close_pool(executor: Any) -> None:
    pool = getattr(executor, "driver_clone_pool", None)
    if pool is not None:
        pool.close()


def probe_clone_pool(ctx: Context) -> Probe:
    if sys.platform != "linux":
        return Probe(False, "anonymous mappings and huge-page advice are Linux-only here")
    generate = speculators_code.generator_module(ctx).VllmHiddenStatesGenerator.generate
    if not speculators_code.calls_method(generate, "clone"):
        return Probe(False, "speculators' generate() does not clone the captured states")
    return Probe(
        True,
        "generate() clones every captured tensor into freshly mapped memory (page-fault speed: 0.41 s of a 0.73 s "
        "call on an H200); the clones go to faulted-in memory reused across calls",
    )


DRIVER_CLONE_POOL = Adapter(
    id="driver-clone-pool",
    notes="""
    why: speculators' per-tensor clone() of the reply ran at page-fault speed (H200, 5B MoE, 1.5-2k-token prompts:
        0.41 s of 0.73 s per call; docs/benchmarks.md, prompt sets)
    vllm change: none: speculators' generate() copies every captured tensor (0.3.0 and 0.4.x)
    detect: AST: generate() calls .clone(); the replies come over shared memory (executor-shared-memory-replies)
    delete when: speculators stops cloning tensors it owns, or hands over the reply's memory
    patches: MultiprocExecutor.collective_rpc (the tensors of a shared-memory reply become CloneSource views, whose
        clone() copies into a reused, faulted-in region; each clone a plain tensor with its own storage)
    """,
    side="driver",
    probe=probe_clone_pool,
    apply=switch_on("clone_pool"),
    after=("executor-shared-memory-replies",),
)
