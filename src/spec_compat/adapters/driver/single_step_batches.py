"""Adapter ``single-step-batches``: speculators 0.3.0: one scheduler step per call."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...errors import IncompatibleError
from ...options import Context
from ...patching import AdapterPatcher
from .. import speculators_code
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import Run, as_run, run_in_parts, wrap_generate
from ..unit import SPECULATORS_0_3_ONLY, Adapter

# 0.3.0 aborts every request after its first scheduled chunk and slices one concatenated capture by
# input offsets. That is right only if every prompt is prefilled whole, in one step, in input
# order. Split the batch into sub-batches that fit one step, and verify what ran.


def probe_single_step(ctx: Context) -> Probe:
    generate = generator_module(ctx).VllmHiddenStatesGenerator.generate
    if speculators_code.finishes_requests_inside_schedule_loop(generate):
        return Probe(
            True, "generate() aborts every request after its first scheduled chunk (and slices by input offsets)"
        )
    return Probe(False, "generate() finishes requests only after the schedule loop")


def plan_single_step_batches(
    lengths: Sequence[int], max_tokens: int, max_seqs: int, max_kv_tokens: int | None, block_size: int
) -> list[list[int]]:
    """Greedy split of input indices into runs that one scheduler step prefills whole."""
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = blocks = 0
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"sequence {index} has {length} tokens but one scheduler step takes at most {max_tokens} "
                "(max_num_batched_tokens); speculators 0.3.0 would silently keep only the first chunk. "
                "Raise max_num_batched_tokens or use speculators 0.4.x"
            )
        need_blocks = math.ceil((length + 1) / block_size)
        if max_kv_tokens is not None and need_blocks * block_size > max_kv_tokens:
            raise ValueError(f"sequence {index} ({length} tokens) does not fit the KV cache ({max_kv_tokens} tokens)")
        fits = (
            len(current) < max_seqs
            and tokens + length <= max_tokens
            and (max_kv_tokens is None or (blocks + need_blocks) * block_size <= max_kv_tokens)
        )
        if current and not fits:
            batches.append(current)
            current, tokens, blocks = [], 0, 0
        current.append(index)
        tokens += length
        blocks += need_blocks
    if current:
        batches.append(current)
    return batches


def _verify_single_step(executor: Any, request_lengths: list[int], steps_before: int) -> list[str]:
    """The request ids of the one scheduler step the sub-batch ran in, in scheduled order."""
    steps = executor.step_log[steps_before:]
    ran = [step for step in steps if step]
    if len(ran) != 1:
        raise IncompatibleError(f"expected the sub-batch to run in one scheduler step, it ran in {len(ran)}: {ran}")
    scheduled = [n for _, n in ran[0]]
    if scheduled != request_lengths:
        raise IncompatibleError(
            f"scheduler step did not prefill the sub-batch whole and in order: expected token counts "
            f"{request_lengths}, scheduled {scheduled}"
        )
    return [req_id for req_id, _ in ran[0]]


def apply_single_step(ctx: Context, patcher: AdapterPatcher) -> None:
    def in_single_steps(generator: Any, token_ids: list[list[int]], run: Run) -> Any:
        batch = as_run(generator, token_ids)
        scheduler = generator.scheduler
        cache_config = generator.vllm_config.cache_config
        num_blocks = getattr(cache_config, "num_gpu_blocks", None)
        block_size = int(cache_config.block_size)
        plan = plan_single_step_batches(
            [len(ids) for ids in batch],
            max_tokens=int(scheduler.max_num_scheduled_tokens),
            max_seqs=int(scheduler.max_num_running_reqs),
            max_kv_tokens=(int(num_blocks) - 1) * block_size if num_blocks else None,
            block_size=block_size,
        )

        step_orders: list[list[str]] = []  # the request order of each sub-batch's one step

        def run_verified(sub_batch: list[list[int]]) -> Any:
            steps_before = len(getattr(generator.executor, "step_log", []))
            results = run(sub_batch)
            if hasattr(generator.executor, "step_log"):
                lengths = [len(ids) for ids in sub_batch]
                step_orders.append(_verify_single_step(generator.executor, lengths, steps_before))
            return results

        results = run_in_parts(run_verified, ([batch[i] for i in indices] for indices in plan))
        # Once per call, not per sub-batch: one RPC for the worker's log of every step (a chat call
        # of 64 prompts runs 8+ sub-batches); nothing is returned before it is checked.
        _verify_worker_order(generator, step_orders)
        return results

    wrap_generate(ctx, patcher, in_single_steps)


SINGLE_STEP_BATCHES = Adapter(
    id="single-step-batches",
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.generate",),
    how="sub-batches of one scheduler step, verified",
    why=(
        "0.3.0 aborts requests after their first chunk and slices by input offsets: chunked prefill or a reordered "
        "batch gives wrong states silently"
    ),
    vllm_change="none: speculators 0.3.0 logic (fixed in 0.4 by speculators #283)",
    detect="AST: generate() calls finish_requests and slices by offset",
    delete_when="speculators 0.3.0 is no longer supported",
    side="driver",
    probe=probe_single_step,
    apply=apply_single_step,
    speculators=SPECULATORS_0_3_ONLY,
)


def _verify_worker_order(generator: Any, step_orders: list[list[str]]) -> None:
    """The worker's batch order for each capture must be the scheduler's (input) order of its step:
    every capture the worker logged, in turn, one of ``step_orders`` at or after the previous one's."""
    try:
        logs = generator.executor.collective_rpc("_spec_compat_take_batch_log")
    except Exception:  # noqa: BLE001 - the worker adapter is not there: nothing to compare
        return
    log = logs[0] if isinstance(logs, list) and logs else None
    if not log or not step_orders:
        return
    position = 0
    for worker_order in log:
        order = [r for r in worker_order if r is not None]
        if not order:
            continue  # a dummy/profile forward (vLLM's warm-up on GPU) carries no request
        while position < len(step_orders) and step_orders[position] != order:
            position += 1
        if position == len(step_orders):
            raise IncompatibleError(
                f"the worker batched requests in order {worker_order}, the scheduler in "
                f"{step_orders if len(step_orders) > 1 else step_orders[0]}: speculators 0.3.0 would slice "
                "states of the wrong requests"
            )
