"""Adapter ``layer-ids``: the layer ids speculators captures, checked before the weights load, in
the requested order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import generator_module
from ..support import GeneratorMethod, Run, wrap_generate, wrap_method
from ..unit import Adapter

# Both speculators versions keep layer ids in a frozenset and capture in model order: duplicates
# come back once and an unsorted list comes back sorted, so hidden_states[k] would silently not be
# layer_ids[k].


def probe_layer_ids(ctx: Context) -> Probe:
    return Probe(True, "captures come back once per distinct layer, in ascending layer order")


def layer_ids_problem(layer_ids: Sequence[Any], defaulted: bool) -> str | None:
    """Why this selection cannot be captured as asked (None: it can); one line, says how to fix it."""
    layer_ids = list(layer_ids)
    source = "speculators' default layer_ids for this model" if defaulted else "layer_ids"
    how = "pass layer_ids=[...] with distinct decoder layer ids (spec-compat extract: --layer-ids 2,5,9)"
    bad = [x for x in layer_ids if isinstance(x, bool) or not isinstance(x, int)]
    if bad:
        return f"{source} {layer_ids}: {bad} are not ints; {how}"
    if not layer_ids:
        return f"{source} is empty: {how}"
    duplicates = sorted({x for x in layer_ids if layer_ids.count(x) > 1})
    if duplicates:
        return f"{source} {layer_ids} repeat {duplicates} (each layer is captured once: fewer tensors come back); {how}"
    return None


def apply_layer_ids(ctx: Context, patcher: AdapterPatcher) -> None:
    def make_init(original: GeneratorMethod) -> GeneratorMethod:
        def __init__(
            self: Any, model_path: str, layer_ids: Sequence[int] | None = None, *args: Any, **kwargs: Any
        ) -> None:
            if layer_ids is not None:
                layer_ids = list(layer_ids)
                problem = layer_ids_problem(layer_ids, defaulted=False)
                if problem:
                    raise (TypeError if "not ints" in problem else ValueError)(problem)
            self._spec_compat_layer_ids_defaulted = layer_ids is None
            original(self, model_path, layer_ids, *args, **kwargs)

        return __init__

    def make_create_config(original: GeneratorMethod) -> GeneratorMethod:
        # Both speculators versions choose their default ([2, n // 2, n - 3, n - 1], which repeats
        # ids below 8 layers) and range-check it right before building the vLLM config: the last
        # moment before the executor loads weights at which self.layer_ids is known.
        def _create_vllm_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            layer_ids = getattr(self, "layer_ids", None)
            if layer_ids is not None:
                problem = layer_ids_problem(layer_ids, getattr(self, "_spec_compat_layer_ids_defaulted", False))
                if problem:
                    raise ValueError(problem)
            return original(self, *args, **kwargs)

        return _create_vllm_config

    def in_requested_order(generator: Any, token_ids: Any, run: Run) -> Any:
        results = run(token_ids)
        requested = list(generator.layer_ids)
        captured = sorted(requested)
        if requested == captured or not isinstance(results, list):
            return results
        position = {layer: k for k, layer in enumerate(captured)}
        for result in results:
            states = result.get("hidden_states") if isinstance(result, dict) else None
            if isinstance(states, list) and len(states) == len(captured):
                result["hidden_states"] = [states[position[layer]] for layer in requested]
        return results

    wrap_method(ctx, patcher, "__init__", make_init)
    if hasattr(generator_module(ctx).VllmHiddenStatesGenerator, "_create_vllm_config"):
        wrap_method(ctx, patcher, "_create_vllm_config", make_create_config)
    wrap_generate(ctx, patcher, in_requested_order)


LAYER_IDS = Adapter(
    id="layer-ids",
    patches=(
        "speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.__init__",
        "speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator._create_vllm_config",
        "speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.generate",
    ),
    how=(
        "__init__ and _create_vllm_config reject duplicates, given or speculators' default, before the weights load; "
        "generate returns the requested layer order"
    ),
    why=(
        "duplicates come back once and an unsorted list comes back sorted: hidden_states[k] is not layer_ids[k]; "
        "speculators' default for a model under 8 layers repeats ids (6 layers: [2, 3, 3, 5])"
    ),
    vllm_change="none: speculators keeps layer ids in a frozenset",
    detect="always",
    delete_when="speculators validates and orders layer ids",
    side="driver",
    probe=probe_layer_ids,
    apply=apply_layer_ids,
    # generate: the layers of the whole batch's results, once, after the splitting and reordering wrappers
    after=("single-step-batches", "sequence-limit", "input-order"),
)
