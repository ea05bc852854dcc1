"""The kimi_k25 family's HF reference is transformers' own Kimi-K2.5 wrapper on the checkpoint vLLM loads.

The engine cells (tests/test_engine.py, family ``kimi_k25``) compare vLLM's KimiK25ForConditionalGeneration
with it; here: transformers loads every tensor of the checkpoint (written under the original names vLLM's
loader reads) with nothing missing or left over, and its text model is the deepseek_v3 family's, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine_harness import LAYER_IDS, model_dir, prompts

# Builds the kimi_k25 and deepseek_v3 checkpoints and runs HF on them: slow, kept out of -m "not engine".
pytestmark = pytest.mark.engine


def test_transformers_loads_the_wrapper_checkpoint_completely() -> None:
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(
        model_dir("kimi_k25"), dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    assert {k: v for k, v in info.items() if v} == {}, info
    assert model.config.vision_config.num_hidden_layers >= 1


def test_reference_text_model_is_the_deepseek_v3_family() -> None:
    from tiny_models import hf_layer_outputs

    short = [p for p in prompts() if len(p) <= 40]
    wrapper = hf_layer_outputs(model_dir("kimi_k25"), short, LAYER_IDS)
    text = hf_layer_outputs(model_dir("deepseek_v3"), short, LAYER_IDS)
    for got, want in zip(wrapper, text, strict=True):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
