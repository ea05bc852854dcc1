"""The quantized tiny checkpoints (tests/tiny_models.py ``QUANTIZED_FAMILIES``, GPU kernels only):
int4 pack / unpack and FP8 block quantize / dequantize round trips, the packing checked against
compressed-tensors' own helpers when installed, and a built checkpoint's tensors and config
against the names and shapes vLLM's loaders read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny_models
from tiny_models import (
    QUANTIZED_FAMILIES,
    dequantize_fp8_blocks,
    dequantize_int4_groups,
    pack_int4,
    quantize_fp8_blocks,
    quantize_int4_groups,
    unpack_int4,
)


def test_int4_pack_round_trip_covers_every_value() -> None:
    values = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 4)  # [3, 64], each nibble value
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (3, 8)
    assert torch.equal(unpack_int4(packed), values)


def test_int4_pack_matches_compressed_tensors() -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = torch.randint(-8, 8, (16, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    theirs = helpers.pack_to_int32(values, 4)
    assert torch.equal(pack_int4(values), theirs)
    assert torch.equal(helpers.unpack_from_int32(theirs, 4, torch.Size([16, 256])), values)


def test_int4_group_quantization_round_trip() -> None:
    weight = 0.1 * torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    values, scales = quantize_int4_groups(weight, 128)
    assert values.dtype == torch.int8 and int(values.min()) >= -8 and int(values.max()) <= 7
    assert scales.dtype == torch.bfloat16 and tuple(scales.shape) == (64, 2)
    restored = dequantize_int4_groups(values, scales)
    # Each entry within half a quantization step of the original (the scale is max|w| / 7, rounded).
    step = scales.float().repeat_interleave(128, dim=1)
    assert float(((restored - weight).abs() / step).max()) <= 0.5 + 1e-2
    # Dequantizing again from the packed form gives bit-identical weights.
    assert torch.equal(dequantize_int4_groups(unpack_int4(pack_int4(values)), scales), restored)
    with pytest.raises(ValueError, match="multiple of group size"):
        quantize_int4_groups(weight[:, :200], 128)


def test_fp8_block_round_trip_with_partial_tiles() -> None:
    weight = 0.1 * torch.randn(576, 200, generator=torch.Generator().manual_seed(2))  # 4.5 x 1.6 tiles
    fp8, scale_inv = quantize_fp8_blocks(weight, 128)
    assert fp8.dtype == torch.float8_e4m3fn and tuple(fp8.shape) == (576, 200)
    assert scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == (5, 2)
    assert torch.isfinite(fp8.float()).all()
    restored = dequantize_fp8_blocks(fp8, scale_inv, 128)
    assert float((restored - weight).norm() / weight.norm()) < 0.05  # e4m3: 3 mantissa bits
    # Scales are bfloat16 values, so scale * fp8 is exact in float32 (the reference's weights).
    assert torch.equal(scale_inv.to(torch.bfloat16).float(), scale_inv)


@pytest.mark.parametrize("family", sorted(QUANTIZED_FAMILIES))
def test_built_checkpoint_layout(family: str, tmp_path: Path) -> None:
    model_dir = tiny_models.build_model(family, tmp_path / family)
    reference = tiny_models.reference_model_dir(model_dir)
    assert reference != model_dir and (reference / "model.safetensors").is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in json.loads((reference / "config.json").read_text())
    quantized, dequantized = load_file(model_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    spec = QUANTIZED_FAMILIES[family]
    expert = "model.layers.1.mlp.experts.0.down_proj"
    if spec.scheme == "w4a16":
        assert config["quantization_config"]["format"] == "pack-quantized"
        assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 128
        hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
        assert hidden % 128 == 0 and inter % 128 == 0  # Marlin MoE's shape rule
        assert tuple(quantized[f"{expert}.weight_packed"].shape) == (hidden, inter // 8)
        assert tuple(quantized[f"{expert}.weight_scale"].shape) == (hidden, inter // 128)
        assert quantized[f"{expert}.weight_shape"].tolist() == [hidden, inter]
        again = dequantize_int4_groups(
            unpack_int4(quantized[f"{expert}.weight_packed"]), quantized[f"{expert}.weight_scale"]
        )
        assert "model.layers.1.self_attn.q_proj.weight" in quantized  # attention stays float
        assert "model.layers.1.mlp.gate.weight" in quantized  # so does the router
    else:
        assert config["quantization_config"]["weight_block_size"] == [128, 128]
        assert quantized[f"{expert}.weight"].dtype == torch.float8_e4m3fn
        again = dequantize_fp8_blocks(quantized[f"{expert}.weight"], quantized[f"{expert}.weight_scale_inv"], 128)
        assert quantized["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
        assert quantized["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert torch.equal(again, dequantized[f"{expert}.weight"])
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    assert config["num_experts_per_tok"] == experts  # every expert routed
