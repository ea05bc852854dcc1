"""A fake generator module whose VllmHiddenStatesGenerator mimics speculators 0.4.x's result
ordering (string-sorted request ids, layers ascending), with no engine behind it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.unit.source_module import load_source

SOURCE = """
import torch
from types import SimpleNamespace

HIDDEN = 4
CONFIGS_BUILT = []


class VllmHiddenStatesGenerator:
    def __init__(self, model_path, layer_ids=None, max_model_len=32, tensor_parallel_size=1, num_layers=6):
        # speculators' order: choose the default, range-check, then build the vLLM config
        self.layer_ids = layer_ids if layer_ids is not None else [2, num_layers // 2, num_layers - 3, num_layers - 1]
        for layer_id in self.layer_ids:
            if layer_id < 0 or layer_id >= num_layers:
                raise ValueError(f"Layer index {layer_id} out of bounds [0, {num_layers - 1}]")
        self._request_counter = 0
        self.vllm_config = self._create_vllm_config(max_model_len)
        self.scheduler = SimpleNamespace(
            max_num_scheduled_tokens=64,
            max_num_running_reqs=32,
            scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
        )
        self.calls = []

    def _create_vllm_config(self, max_model_len):
        CONFIGS_BUILT.append(self.layer_ids)  # the real one comes right before the executor loads the weights
        return SimpleNamespace(
            model_config=SimpleNamespace(
                max_model_len=max_model_len, get_vocab_size=lambda: 100, get_hidden_size=lambda: HIDDEN
            )
        )

    def generate(self, token_ids):
        self.calls.append(token_ids)
        max_len = self.vllm_config.model_config.max_model_len - 1
        token_ids = [ids[:max_len] for ids in token_ids]
        ids = {f"req_{self._request_counter}_{i}": i for i in range(len(token_ids))}
        self._request_counter += 1
        results = []
        for req_id in sorted(ids):
            i = ids[req_id]
            n = len(token_ids[i])
            states = [torch.full((n, HIDDEN), float(1000 * layer + i)) for layer in sorted(set(self.layer_ids))]
            results.append({"input_ids": torch.tensor(token_ids[i]), "hidden_states": states, "loss_mask": None})
        return results
"""


def fake_generator_module(tmp: Path) -> ModuleType:
    return load_source(tmp, "fake_generator_class", SOURCE)
