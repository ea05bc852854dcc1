"""The W8A8 reference of tests/tiny_models.py: HF's twin of a block-FP8 checkpoint quantizes every
quantized projection's input per token and group, as vLLM's kernels do, and says so loudly when
a code path bypasses it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import (
    ACTIVATION_QUANTIZATION_FILE,
    FP8_E4M3_MAX,
    ActivationQuantization,
    build_model,
    load_hf_model,
    quantize_activation_groups,
    reference_model_dir,
)


def test_group_quantization_is_per_token_and_group() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 256)
    x[2, 130] = 40.0  # one large value: only its own group's scale grows
    q = quantize_activation_groups(x, 128)
    assert q.shape == x.shape and q.dtype == x.dtype
    groups, qgroups = x.reshape(5, 2, 128), q.reshape(5, 2, 128)
    # each group's largest magnitude maps to 448, so it comes back (to float32 rounding)
    torch.testing.assert_close(qgroups.abs().amax(-1), groups.abs().amax(-1), rtol=1e-6, atol=0)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for values in the normal range
    scale = groups.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX
    normal = groups.abs() >= scale * 2**-6
    assert ((qgroups - groups).abs() <= groups.abs() * 2**-4 + 1e-12)[normal].all()
    # the other group of row 2 and the other rows are untouched by the outlier
    assert torch.equal(q[0], quantize_activation_groups(x[0:1], 128)[0])
    assert not torch.equal(q, x)
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_activation_groups(torch.randn(2, 100), 128)


class _Block(torch.nn.Module):
    """A quantized linear, an unquantized one and a fused expert tensor used per expert slice."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(128, 128, bias=False)
        self.gate = torch.nn.Linear(128, 4, bias=False)
        self.experts_down = torch.nn.Parameter(torch.randn(2, 128, 128) / 12)
        self.skip_experts = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        out = self.gate(h).sum(-1, keepdim=True) * h
        if not self.skip_experts:
            for e in range(2):
                out = out + torch.nn.functional.linear(h, self.experts_down[e])
        return out


def test_only_matched_parameters_get_quantized_inputs() -> None:
    torch.manual_seed(1)
    linear = torch.nn.functional.linear
    block = _Block()
    x = torch.randn(3, 128)
    with torch.no_grad():
        h = torch.nn.functional.linear(quantize_activation_groups(x, 128), block.proj.weight)
        want = block.gate(h).sum(-1, keepdim=True) * h  # the router's input is not quantized
        for e in range(2):
            want = want + torch.nn.functional.linear(quantize_activation_groups(h, 128), block.experts_down[e])
        ActivationQuantization(block, r"^(proj\.weight|experts_down)$", 128).install()
        got = block(x)
    assert torch.equal(got, want)
    assert torch.nn.functional.linear is linear  # put back after the forward


def test_a_bypassed_parameter_is_an_error() -> None:
    linear = torch.nn.functional.linear
    block = _Block()
    ActivationQuantization(block, r"^(proj\.weight|experts_down)$", 128).install()
    block.skip_experts = True  # as transformers' grouped_mm experts would: never through F.linear
    with pytest.raises(RuntimeError, match="never reached"):
        block(torch.randn(2, 128))
    assert torch.nn.functional.linear is linear  # put back after the error
    with pytest.raises(ValueError, match="no parameter"):
        ActivationQuantization(block, r"^nothing$", 128)


def test_fp8_twin_reference_quantizes_activations(tmp_path: Path) -> None:
    """The real family: the twin carries the file, HF loads it with eager experts, every quantized
    projection (attention, dense MLP, shared and routed experts) is reached, and the output moves
    by about what e4m3 rounding of the inputs costs."""
    model_dir = build_model("deepseek_v3_fp8", tmp_path / "fp8")
    twin = reference_model_dir(model_dir)
    assert (twin / ACTIVATION_QUANTIZATION_FILE).is_file()
    assert not (model_dir / ACTIVATION_QUANTIZATION_FILE).exists()
    ids = torch.tensor([[3, 17, 42, 99, 250, 7, 8, 300]])
    with torch.no_grad():
        quantized = load_hf_model(twin)(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        (twin / ACTIVATION_QUANTIZATION_FILE).rename(tmp_path / "aside.json")
        plain = load_hf_model(twin)(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    rel = float((quantized - plain).norm() / plain.norm())
    assert 1e-3 < rel < 0.3, rel
