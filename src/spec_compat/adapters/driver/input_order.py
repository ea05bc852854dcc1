"""Adapter ``input-order``: results in input order (speculators 0.4.x sorts request ids as strings)."""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from .. import speculators_code
from ..contract import int64_key
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import GeneratorMethod, Run, as_run, wrap_generate
from ..unit import SPECULATORS_0_4_ONLY, Adapter


def _sorts_request_ids(generate: GeneratorMethod) -> bool:
    tree = speculators_code.tree_of(generate)
    return any(
        isinstance(node, ast.For)
        and isinstance(node.iter, ast.Call)
        and isinstance(node.iter.func, ast.Name)
        and node.iter.func.id == "sorted"
        for node in ast.walk(tree)
    )


def probe_input_order(ctx: Context) -> Probe:
    if _sorts_request_ids(generator_module(ctx).VllmHiddenStatesGenerator.generate):
        return Probe(True, "generate() returns results in sorted(request_id) order: 'req_0_10' < 'req_0_2'")
    return Probe(False, "generate() returns results in input order")


def reorder_to_inputs(results: list[Any], inputs: list[list[int]]) -> list[Any]:
    """Put results back in input order by their input_ids (equal inputs are interchangeable)."""
    by_ids: defaultdict[bytes, deque[Any]] = defaultdict(deque)
    for result in results:
        by_ids[int64_key(result["input_ids"])].append(result)
    ordered = []
    for ids in inputs:
        queue = by_ids.get(int64_key(ids))
        if not queue:
            return results  # leave it to the contract check to say what is wrong
        ordered.append(queue.popleft())
    return ordered


def apply_input_order(ctx: Context, patcher: AdapterPatcher) -> None:
    def in_input_order(generator: Any, token_ids: list[list[int]], run: Run) -> Any:
        results = run(token_ids)
        if not isinstance(results, list) or not all(isinstance(r, dict) and "input_ids" in r for r in results):
            return results
        return reorder_to_inputs(results, as_run(generator, token_ids))

    wrap_generate(ctx, patcher, in_input_order)


INPUT_ORDER = Adapter(
    id="input-order",
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.generate",),
    how="results back in input order",
    why="results come back in sorted(request_id) order: 'req_0_10' < 'req_0_2', batches of 11+ permuted",
    vllm_change="none: speculators 0.4.x bug (speculators PR #365)",
    detect="AST: generate() iterates sorted(...)",
    delete_when="speculators returns results in input order",
    side="driver",
    probe=probe_input_order,
    apply=apply_input_order,
    # once over the whole batch's results, after the splitting wrappers joined their parts
    after=("single-step-batches", "sequence-limit"),
    speculators=SPECULATORS_0_4_ONLY,
)
