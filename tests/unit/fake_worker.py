"""A fake speculators custom_worker module in the 0.3.0 or 0.4.x style (read by AST probes)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.unit.source_module import load_source

# What both styles share: the capture forward, which 0.4.x gives the renamed embedding call and a
# **kwargs that swallows extra layer keywords.
FORWARD = """
import types
from itertools import islice

def _patched_forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None{keywords}):
    hidden_states = self.{embed}(input_ids)
    residual = None
    for layer in islice(self.layers, self.start_layer, self.end_layer):
        hidden_states, residual = layer(hidden_states=hidden_states, positions=positions, residual=residual)
    return hidden_states
"""

WORKER_03 = (
    FORWARD.format(embed="get_input_embeddings", keywords="")
    + """
def supports_eagle3(model):
    return getattr(model, "declares_eagle3", False)

class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids):
        model = self.model_runner.model
        if not supports_eagle3(model):
            raise ValueError("Model does not support hidden state extraction")
        base_model = model.model
        base_model.forward = types.MethodType(_patched_forward, base_model)

    def _store_captured_states(self, aux_hidden_states):
        self._captured_states = aux_hidden_states

    def _fail_empty(self):
        raise AssertionError()
"""
)

WORKER_04 = (
    FORWARD.format(embed="embed_input_ids", keywords=", **_kwargs")
    + """
class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids):
        base_model = self.model_runner.model.model
        base_model.forward = types.MethodType(_patched_forward, base_model)

    def _store_captured_states(self, aux_hidden_states):
        input_batch = self.model_runner.input_batch
        self._order = sorted(input_batch.req_id_to_index)
        self._captured_states = aux_hidden_states
"""
)


def fake_worker(tmp: Path, style: str) -> ModuleType:
    return load_source(tmp, f"fake_custom_worker_{style.replace('.', '_')}", WORKER_03 if style == "0.3" else WORKER_04)
