"""Adapter ``sequence-limit``: batches larger than the scheduler's sequence limit."""

from __future__ import annotations

from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from .. import speculators_code
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import Run, run_in_parts, wrap_generate
from ..unit import Adapter

# speculators never reports model outputs to the scheduler (no update_from_output), so a request
# that finished its prefill is never finished: it keeps one of the max_num_seqs (32) running slots
# and the requests beyond the first max_num_seqs are never scheduled ("Request ... not found").


def probe_sequence_limit(ctx: Context) -> Probe:
    generate = generator_module(ctx).VllmHiddenStatesGenerator.generate
    if speculators_code.calls_method(generate, "update_from_output"):
        return Probe(False, "generate() reports outputs to the scheduler, which frees finished requests")
    return Probe(True, "generate() never frees finished requests: inputs beyond max_num_seqs would never be scheduled")


def apply_sequence_limit(ctx: Context, patcher: AdapterPatcher) -> None:
    def in_running_slots(generator: Any, token_ids: list[list[int]], run: Run) -> Any:
        limit = int(getattr(generator.scheduler, "max_num_running_reqs", 0) or len(token_ids))
        if len(token_ids) <= limit:
            return run(token_ids)
        return run_in_parts(run, (token_ids[start : start + limit] for start in range(0, len(token_ids), limit)))

    wrap_generate(ctx, patcher, in_running_slots)


SEQUENCE_LIMIT = Adapter(
    id="sequence-limit",
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.generate",),
    how="sub-batches of at most max_num_seqs inputs",
    why=(
        "requests beyond max_num_seqs (32) are never scheduled: 'Request req_0_32 not found in captured states' for "
        "a batch of 48"
    ),
    vllm_change=(
        "none: speculators never calls scheduler.update_from_output, so prefilled requests keep their running slot "
        "(found on the H200 with a 48-prompt batch)"
    ),
    detect="AST: generate() does not call update_from_output",
    delete_when="speculators frees finished requests or splits batches itself",
    side="driver",
    probe=probe_sequence_limit,
    apply=apply_sequence_limit,
    # each part that fits the running slots is planned into single steps (0.3.0)
    after=("single-step-batches",),
)
