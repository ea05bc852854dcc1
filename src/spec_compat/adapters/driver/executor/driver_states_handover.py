"""Adapter ``driver-states-handover``: speculators' ``.clone()`` of a captured tensor takes the
shared-memory bytes it views instead of copying them (handover.py).

speculators copies every tensor of the captured-states reply on the driver: on an H200 (5B MoE, 24
prompts of 1.5-2k tokens, ~700 MB of states per call) 0.24 s of a 0.46 s generate() call at
page-fault speed, 0.10 s into reused memory (half the forward). The reply comes in a shared-memory
segment the worker does not reuse while any tensor keeps it (executor-shared-memory-replies), so the
clone can keep those bytes.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from ....options import Context
from ....patching import AdapterPatcher
from ... import speculators_code
from ...probe import Probe
from ...unit import Adapter
from .executor import install_hook
from .hooks import ExecutorHook


class StatesHandover(ExecutorHook):
    def start(self, executor: Any) -> contextlib.AbstractContextManager[object] | None:
        """What DriverMappings.open passes each shared-memory reply through (executor.received_states)."""
        from ... import handover  # imports torch, which vLLM's executor has imported already

        executor.clone_sources = handover.as_clone_sources
        return None


def apply_states_handover(ctx: Context, patcher: AdapterPatcher) -> None:
    install_hook(ctx, patcher, StatesHandover())


def probe_states_handover(ctx: Context) -> Probe:
    if sys.platform == "win32":
        return Probe(False, "no shared-memory replies on this platform")
    generate = speculators_code.generator_module(ctx).VllmHiddenStatesGenerator.generate
    if not speculators_code.calls_method(generate, "clone"):
        return Probe(False, "speculators' generate() does not clone the captured states")
    return Probe(
        True,
        "generate() copies every captured tensor of the reply (H200: 0.24 s of a 0.46 s call, the forward 0.20 s); "
        "each clone keeps the shared-memory bytes it views instead",
    )


DRIVER_STATES_HANDOVER = Adapter(
    id="driver-states-handover",
    patches=("speculators.data_generation.vllm_hidden_states_generator.MultiprocExecutor.hooks",),
    how=(
        "hook StatesHandover: the tensors of a shared-memory reply become CloneSource views whose clone() returns a "
        "plain tensor over the same bytes, keeping the segment's lease; a second clone copies"
    ),
    why=(
        "speculators' per-tensor clone() of the reply took 0.24 s of a 0.46 s call (H200, 5B MoE, 1.5-2k-token "
        "prompts; 0.10 s into reused, faulted-in memory): docs/benchmarks.md, prompt sets"
    ),
    vllm_change="none: speculators' generate() copies every captured tensor (0.3.0 and 0.4.x)",
    detect="AST: generate() calls .clone(); the replies come over shared memory (executor-shared-memory-replies)",
    delete_when="speculators stops cloning tensors it owns, or vLLM hands the driver tensors it may keep",
    side="driver",
    probe=probe_states_handover,
    apply=apply_states_handover,
    after=("executor-shared-memory-replies",),
)
