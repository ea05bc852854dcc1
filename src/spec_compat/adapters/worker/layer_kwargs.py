"""Adapter ``layer-kwargs``: extra layer keywords (vLLM 0.15.1: forward(..., **extra_layer_kwargs))."""

from __future__ import annotations

import functools
import warnings
from itertools import islice
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..probe import Probe
from ..speculators_code import worker_module
from ..support import layer_accepts
from ..unit import Adapter

# The model's own forward hands extra keywords to every decoder layer; speculators 0.4's capture
# forward swallows them (0.3.0's rejects them). Bind them to the layers for that one forward.


def probe_layer_kwargs(ctx: Context) -> Probe:
    return Probe(True, "models may pass extra keywords to their layers (LlamaModel since vLLM 0.15.1)")


def apply_layer_kwargs(ctx: Context, patcher: AdapterPatcher) -> None:
    worker = worker_module(ctx)
    original = worker._patched_forward

    @functools.wraps(original)
    def _patched_forward(
        self: Any,
        input_ids: Any,
        positions: Any,
        intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
        **kwargs: Any,
    ) -> Any:
        extra = {k: v for k, v in kwargs.items() if v is not None}
        if not extra:
            return original(self, input_ids, positions, intermediate_tensors, inputs_embeds)
        layers = list(islice(self.layers, self.start_layer, self.end_layer))
        accepted = {k: v for k, v in extra.items() if all(layer_accepts(layer, k) for layer in layers)}
        ignored = sorted(set(extra) - set(accepted))
        if ignored:
            warnings.warn(
                f"spec_compat: keywords {ignored} are not decoder-layer keywords; not passed to layers", stacklevel=2
            )
        for layer in layers:
            layer.forward = functools.partial(type(layer).forward, layer, **accepted)
        try:
            return original(self, input_ids, positions, intermediate_tensors, inputs_embeds)
        finally:
            for layer in layers:
                del layer.forward

    patcher.replace(worker, "_patched_forward", _patched_forward)


LAYER_KWARGS = Adapter(
    id="layer-kwargs",
    patches=("speculators.data_generation.custom_worker._patched_forward",),
    why=(
        "the model's forward hands extra keywords to every layer; speculators' capture forward drops (0.4) or "
        "rejects (0.3) them"
    ),
    vllm_change="0.15.1 LlamaModel.forward(..., **extra_layer_kwargs)",
    detect="at run time: the forward receives non-None extra keywords",
    delete_when="speculators' capture forward passes layer keywords through",
    side="worker",
    probe=probe_layer_kwargs,
    apply=apply_layer_kwargs,
)
