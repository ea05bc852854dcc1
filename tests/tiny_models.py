"""Tiny random-weight checkpoints for tests, built locally (no model hub).

Three families are described in ``MODEL_FAMILIES``: a dense Qwen3, a Qwen3-MoE
and a DeepSeek-V3 (MLA + MoE); ``WRAPPER_FAMILIES`` adds multimodal wrappers
around one of them (``kimi_k25``: Kimi-K2.5, a vision tower + projector around
the DeepSeek-V3 text model, its text weights the ``deepseek_v3`` family's own).
``qwen3_moe_all_experts`` / ``deepseek_v3_all_experts`` route every token to every expert;
``QUANTIZED_FAMILIES`` (GPU kernels only) are a W4A16 (compressed-tensors int4) Qwen3-MoE and a
block-FP8 DeepSeek-V3, each with its dequantized float32 twin for HF (``reference_model_dir``);
the FP8 twin's HF model also quantizes each projection's input per token and 128-column group
(``ActivationQuantization``: W8A8, the arithmetic vLLM's block-FP8 kernels do).
``build_model`` writes a float32 safetensors
checkpoint with a byte-level BPE tokenizer that ``AutoTokenizer`` loads
offline; ``hf_layer_outputs`` gives the HF transformers reference output of
chosen decoder layers.

Constraints the configs respect (vLLM 0.32 on CPU):

* head and expert counts divisible by 2, so tensor parallel size 2 works;
* DeepSeek-V3: the CPU MLA decode kernel only supports a latent cache of
  576 = kv_lora_rank (512) + qk_rope_head_dim (64), and block size 16
  (vLLM forces it);
* DeepSeek-V3 routing needs ``scoring_func="sigmoid"`` and
  ``topk_method="noaux_tc"`` in the config: vLLM defaults to softmax routing
  without the correction bias, while HF always uses sigmoid + bias;
* DeepSeek-V3 uses YaRN rope, as the real model does. With the default rope,
  vLLM's CPU ``rotary_embedding`` kernel reads MLA's 3-D query
  ``[tokens, heads, rope_dim]`` as ``tokens * heads`` one-head tokens (wrong,
  batch-dependent positions), so vLLM disagrees with HF; the YaRN rope class
  runs PyTorch-native code on CPU and matches.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Bump when the build procedure changes, so existing checkpoints get rebuilt.
BUILD_VERSION = 1
MARKER_FILE = "tiny_model_build.json"

VOCAB_SIZE = 512
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2

# Std of the random init. HF's usual 0.02 leaves the residual stream at
# ~0.05 rms, where layers and prompts differ by only ~0.1-0.3. With 0.1
# (about 1/sqrt(hidden_size)) the residual is ~1-5 rms and adjacent layers
# differ by > 3 (max abs), with logits of a few units: distinct, bf16-safe.
INITIALIZER_RANGE = 0.1

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": INITIALIZER_RANGE,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "dtype": "float32",
}

# Qwen3's attention (dense and MoE share it): grouped-query, explicit head_dim, default RoPE.
_QWEN3: dict[str, Any] = {
    **_COMMON,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class ModelFamily:
    config_cls: type[PretrainedConfig]
    model_cls: type[PreTrainedModel]
    config_kwargs: dict[str, Any]


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "dense": ModelFamily(
        config_cls=Qwen3Config,
        model_cls=Qwen3ForCausalLM,
        config_kwargs=_QWEN3,
    ),
    "qwen3_moe": ModelFamily(
        config_cls=Qwen3MoeConfig,
        model_cls=Qwen3MoeForCausalLM,
        config_kwargs={
            **_QWEN3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    "deepseek_v3": ModelFamily(
        config_cls=DeepseekV3Config,
        model_cls=DeepseekV3ForCausalLM,
        config_kwargs={
            **_COMMON,
            "num_key_value_heads": 4,
            # YaRN as in the real DeepSeek-V3 (there: factor 40 over 4096).
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "rope_interleave": True,
            "q_lora_rank": 96,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
        },
    ),
}


def _derived(base: str, **overrides: Any) -> ModelFamily:
    """``base``'s family with some config values changed (its own build hash: the base stays as it is)."""
    spec = MODEL_FAMILIES[base]
    return ModelFamily(spec.config_cls, spec.model_cls, {**spec.config_kwargs, **overrides})


# Every expert routed (top-k = number of experts, one expert group): the MoE output is a smooth
# function of the router logits, so kernel rounding cannot flip an expert choice and a strict
# per-token comparison with HF is meaningful on the GPU (the top-k families flip near ties there).
MODEL_FAMILIES["qwen3_moe_all_experts"] = _derived("qwen3_moe", num_experts=4, num_experts_per_tok=4)
MODEL_FAMILIES["deepseek_v3_all_experts"] = _derived(
    "deepseek_v3", n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1
)


@dataclass(frozen=True)
class WrapperFamily:
    """A multimodal wrapper checkpoint around the text model of ``text_family``.

    ``config`` is the wrapper's config.json minus ``text_config`` (the text family's config goes
    there); ``vision_weights`` gives every non-text tensor's shape under the names vLLM's loader
    reads (the original checkpoint layout, which HF's loader converts itself); ``text_prefix``
    is put before every text-model tensor name; ``files`` are extra JSON files (image processor)."""

    text_family: str
    architecture: str
    config: dict[str, Any]
    vision_weights: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    text_prefix: str
    files: dict[str, dict[str, Any]]
    # Special tokens the wrapper's tokenizer holds at fixed ids (replacing the byte-pair merges
    # there): vLLM's processor builds its profiling prompt from the placeholder's text, which must
    # tokenize back to that one id (vLLM >= 0.25 reads Kimi-K2.5's from the tokenizer).
    special_tokens: dict[str, int] = field(default_factory=dict)


def _kimi_k25_vision_weights(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    vision = config["vision_config"]
    dim, mlp, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = dim * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (dim, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (dim,),
        "vision_tower.patch_embed.pos_emb.weight": (vision["pos_emb_height"], vision["pos_emb_width"], dim),
        "vision_tower.encoder.final_layernorm.weight": (dim,),
        "vision_tower.encoder.final_layernorm.bias": (dim,),
        "mm_projector.pre_norm.weight": (dim,),
        "mm_projector.pre_norm.bias": (dim,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (config["_text_hidden_size"], merged),
        "mm_projector.proj.2.bias": (config["_text_hidden_size"],),
    }
    for i in range(vision["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}"
        for name, shape in {
            "norm0": (dim,),
            "norm1": (dim,),
            "wqkv": (3 * dim, dim),
            "wo": (dim, dim),
            "mlp.fc0": (mlp, dim),
            "mlp.fc1": (dim, mlp),
        }.items():
            shapes[f"{block}.{name}.weight"] = shape
            shapes[f"{block}.{name}.bias"] = (shape[0],)
    return shapes


# Token ids the wrapper reserves for media; above every id the tests' prompts use (3..499).
_KIMI_MEDIA_IDS = {
    "image_token_id": 511,
    "media_placeholder_token_id": 511,
    "video_token_id": 510,
    "vision_start_token_id": 509,
    "vision_end_token_id": 508,
}
# Kimi-K2.5's own media token texts at those ids (its placeholder string is
# "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>").
_KIMI_SPECIAL_TOKENS = {
    "<|media_pad|>": 511,
    "<|kimi_k25_video_placeholder|>": 510,
    "<|media_begin|>": 509,
    "<|media_end|>": 508,
    "<|media_content|>": 507,
}

WRAPPER_FAMILIES: dict[str, WrapperFamily] = {
    "kimi_k25": WrapperFamily(
        text_family="deepseek_v3",
        architecture="KimiK25ForConditionalGeneration",
        config={
            "model_type": "kimi_k25",
            # The smallest vision tower the configs take: one block, 2 heads of 16, a 4x4 position grid.
            "vision_config": {
                "model_type": "kimi_k25_vision",
                "patch_size": 14,
                "pos_emb_height": 4,
                "pos_emb_width": 4,
                "pos_emb_time": 1,
                # The original checkpoints' names: vLLM <= 0.22.1 reads only these (64 x 64 otherwise),
                # newer releases read them first.
                "init_pos_emb_height": 4,
                "init_pos_emb_width": 4,
                "init_pos_emb_time": 1,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "hidden_act": "gelu_pytorch_tanh",
                "merge_kernel_size": [2, 2],
                "projector_ln_eps": 1e-5,
            },
            "projection_hidden_size": 32,
            "projection_layer_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            **_KIMI_MEDIA_IDS,
        },
        vision_weights=_kimi_k25_vision_weights,
        text_prefix="language_model.",
        special_tokens=_KIMI_SPECIAL_TOKENS,
        files={
            # vLLM's Kimi-K2.5 image processor reads media_proc_cfg; a small patch limit keeps the
            # dummy image of its profiling run (3000x3000) to a few patches.
            "preprocessor_config.json": {
                "image_processor_type": "KimiK25FusedVisionProcessor",
                "media_proc_cfg": {
                    "patch_size": 14,
                    "merge_kernel_size": 2,
                    "in_patch_limit": 64,
                    "in_patch_limit_each_frame": 64,
                    "in_patch_limit_video": 64,
                    "patch_limit_on_one_side": 16,
                    "fixed_output_tokens": None,
                    "temporal_merge_kernel_size": 1,
                    "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5],
                },
            },
        },
    ),
}


@dataclass(frozen=True)
class QuantizedFamily:
    """A quantized checkpoint (GPU kernels only) of a float model ``base``.

    ``scheme`` is ``"w4a16"`` (compressed-tensors pack-quantized int4, symmetric, per group of
    ``group_size`` input columns: the format of Kimi-K2.5's INT4 experts, vLLM's Marlin MoE path)
    or ``"fp8_block"`` (float8_e4m3fn weights with a float32 ``weight_scale_inv`` per
    ``block`` x ``block`` tile, DeepSeek-V3's own checkpoint format). Tensors whose name matches
    ``quantized`` are quantized; the rest stay float32. ``build_model`` also writes the
    dequantized float32 checkpoint next to it (``reference_model_dir``): HF's reference runs on
    exactly the weights vLLM's kernels see."""

    base: ModelFamily
    scheme: str
    quantized: str  # regular expression over tensor names
    group_size: int = 128
    block: int = 128
    # W8A8 schemes: the parameters (HF's names, per-expert or fused) whose linear inputs vLLM's
    # kernels quantize per token and group of ``block`` columns; HF's reference does the same
    # (``ActivationQuantization``) so it computes the checkpoint's own arithmetic.
    activation_inputs: str | None = None


# Sizes the GPU kernels take: Marlin MoE needs hidden % 128 == 0 and intermediate (per TP rank)
# % max(64, group size) == 0; block FP8 needs every merged / split output and every input a
# multiple of 128 (q_lora_rank too: it is merged with kv_a_proj_with_mqa, whose 576 may be last).
# Every expert routed, as the *_all_experts families: the strict per-token verdict can pass.
_FP8_BASE = _derived(
    "deepseek_v3_all_experts",
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=128,
    q_lora_rank=128,
    # Smaller weights than the other families' 0.1: with W8A8's activation quantization the model
    # is discontinuous, and at 0.1 its layers grow so fast that one input element crossing an FP8
    # rounding boundary moves whole tokens (HF's own bfloat16 vs float32 on it: rel-L2 0.29-0.65
    # per layer; at 0.02: 0.064-0.088).
    initializer_range=0.02,
)
# What DeepSeek-V3's checkpoint quantizes: every projection but the router and embeddings.
_FP8_QUANTIZED = (
    r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$"
)
QUANTIZED_FAMILIES: dict[str, QuantizedFamily] = {
    "qwen3_moe_w4a16": QuantizedFamily(
        base=_derived("qwen3_moe_all_experts", hidden_size=256, intermediate_size=512, moe_intermediate_size=256),
        scheme="w4a16",
        quantized=r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$",
    ),
    "deepseek_v3_fp8": QuantizedFamily(
        base=_FP8_BASE,
        scheme="fp8_block",
        quantized=_FP8_QUANTIZED,
        # The same projections as HF holds them: transformers 5 fuses the experts into
        # ``experts.gate_up_proj`` / ``experts.down_proj``.
        activation_inputs=r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight"
        r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj\.weight"
        r"|mlp\.experts\.(gate_up_proj|down_proj))$",
    ),
    # The same checkpoint run through vLLM's weight-only FP8 Marlin kernels (W8A16: the GPU cells set
    # VLLM_TEST_FORCE_FP8_MARLIN and disable the W8A8 block kernels), so HF on the plain dequantized
    # twin is its exact reference: the checkpoint's loading (weights, weight_scale_inv, 128 x 128
    # blocks) checked at the strict limits, apart from W8A8's activation quantization.
    "deepseek_v3_fp8_w8a16": QuantizedFamily(base=_FP8_BASE, scheme="fp8_block", quantized=_FP8_QUANTIZED),
}

INT4_MAX = 7  # symmetric int4: values in [-8, 7]; scales from max|w| / 7
FP8_E4M3_MAX = 448.0
DEQUANTIZED_SUFFIX = ".dequantized"


def _round_to_bfloat16(values: torch.Tensor) -> torch.Tensor:
    """Scales kept bfloat16-representable: scale * (int4 or fp8 value) is then exact in float32,
    so the dequantized reference holds exactly the products the kernels form."""
    return values.to(torch.bfloat16).to(torch.float32)


def quantize_int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (int8 values in [-8, 7] [out, in], bfloat16 scales [out, in // group_size])."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"input size {in_features} is not a multiple of group size {group_size}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    scales = _round_to_bfloat16(groups.abs().amax(dim=-1).clamp_min(1e-8) / INT4_MAX)
    values = torch.round(groups / scales.unsqueeze(-1)).clamp(-INT4_MAX - 1, INT4_MAX).to(torch.int8)
    return values.reshape(out_features, in_features), scales.to(torch.bfloat16)


def dequantize_int4_groups(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out_features, in_features = values.shape
    group_size = in_features // scales.shape[1]
    grouped = values.float().reshape(out_features, -1, group_size) * scales.float().unsqueeze(-1)
    return grouped.reshape(out_features, in_features)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized layout: value + 8 as an unsigned nibble, eight per int32
    along the input dimension, the first value in the lowest bits ([out, in] -> [out, in // 8])."""
    out_features, in_features = values.shape
    if in_features % 8:
        raise ValueError(f"input size {in_features} is not a multiple of 8")
    nibbles = (values.to(torch.int64) + 8).reshape(out_features, in_features // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (nibbles << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``pack_int4``'s inverse: [out, in // 8] int32 -> [out, in] int8 in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - 8).reshape(packed.shape[0], -1).to(torch.int8)


def quantize_fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (float8_e4m3fn [out, in], float32 ``weight_scale_inv``
    [ceil(out / block), ceil(in / block)]); a partial last tile has its own scale, as DeepSeek-V3's."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // block), -(-in_features // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out_features, :in_features] = weight.float()
    tiles = padded.reshape(rows, block, cols, block)
    scales = _round_to_bfloat16(tiles.abs().amax(dim=(1, 3)).clamp_min(1e-8) / FP8_E4M3_MAX)
    # The bfloat16-rounded scale may sit just under max / 448: clamp, as float8 does not saturate.
    scaled = (tiles / scales[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).reshape(rows * block, cols * block)
    return scaled[:out_features, :in_features].to(torch.float8_e4m3fn), scales


def dequantize_fp8_blocks(values: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    expanded = scale_inv.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return values.float() * expanded[: values.shape[0], : values.shape[1]]


def quantize_activation_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` quantized to float8_e4m3fn and back, per token and group of ``group`` columns, as
    vLLM's block-FP8 linear and MoE kernels do with their inputs (dynamic per-token-group scales,
    ``amax / 448``, no power-of-two rounding: run vLLM with ``VLLM_USE_DEEP_GEMM_E8M0=0``)."""
    columns = x.shape[-1]
    if columns % group:
        raise ValueError(f"activation width {columns} is not a multiple of the group size {group}")
    groups = x.float().reshape(*x.shape[:-1], columns // group, group)
    scales = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / FP8_E4M3_MAX
    values = (groups / scales).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (values.float() * scales).reshape(x.shape).to(x.dtype)


ACTIVATION_QUANTIZATION_FILE = "activation_quantization.json"  # in a W8A8 family's dequantized twin


class ActivationQuantization:
    """HF's reference for a W8A8 checkpoint: while the model's forward runs, every
    ``torch.nn.functional.linear`` whose weight is one of ``pattern``'s parameters (by storage, so
    a fused expert tensor's per-expert slices count) gets its input through
    ``quantize_activation_groups``. A forward that completes without reaching every such
    parameter raises: an HF code path that bypasses ``F.linear`` (``grouped_mm`` experts) would
    otherwise silently give the unquantized reference."""

    def __init__(self, model: torch.nn.Module, pattern: str, group: int) -> None:
        self.model = model
        self.pattern = re.compile(pattern)
        self.group = group
        self.inner_forward = model.forward
        if not any(self.pattern.search(name) for name, _ in model.named_parameters()):
            raise ValueError(f"no parameter of the model matches {pattern!r}")

    def install(self) -> None:
        self.model.forward = self.forward  # type: ignore[method-assign]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        targets = {
            p.untyped_storage().data_ptr(): name
            for name, p in self.model.named_parameters()
            if self.pattern.search(name)
        }
        reached: set[int] = set()
        linear = torch.nn.functional.linear

        def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            key = weight.untyped_storage().data_ptr()
            if key in targets:
                reached.add(key)
                x = quantize_activation_groups(x, self.group)
            return linear(x, weight, bias)

        torch.nn.functional.linear = quantized_linear  # type: ignore[assignment]
        try:
            output = self.inner_forward(*args, **kwargs)
        finally:
            torch.nn.functional.linear = linear
        missed = sorted(name for key, name in targets.items() if key not in reached)
        if missed:
            raise RuntimeError(
                f"activation quantization never reached {missed[:4]} (of {len(missed)}): not through F.linear"
            )
        return output


def _w4a16_quantization_config(spec: QuantizedFamily) -> dict[str, Any]:
    """compressed-tensors' config as llm-compressor writes it (Kimi-K2.5 INT4's layout, group 128)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": spec.group_size,
                    "dynamic": False,
                    "actorder": None,
                    "block_structure": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        # Only the routed experts are int4 (as in Kimi-K2.5): attention, the router and lm_head stay float.
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"],
        "kv_cache_scheme": None,
    }


def _fp8_quantization_config(spec: QuantizedFamily) -> dict[str, Any]:
    """DeepSeek-V3's own quantization_config."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [spec.block, spec.block],
    }


def quantize_tensors(
    spec: QuantizedFamily, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """(checkpoint tensors for vLLM, dequantized float32 tensors for HF, figures of the quantization)."""
    pattern = re.compile(spec.quantized)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    worst = 0.0
    count = 0
    for name, tensor in tensors.items():
        if not pattern.search(name):
            quantized[name] = tensor
            dequantized[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        if spec.scheme == "w4a16":
            values, scales = quantize_int4_groups(tensor, spec.group_size)
            quantized[f"{stem}.weight_packed"] = pack_int4(values)
            quantized[f"{stem}.weight_scale"] = scales
            quantized[f"{stem}.weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
            restored = dequantize_int4_groups(values, scales)
        elif spec.scheme == "fp8_block":
            fp8, scale_inv = quantize_fp8_blocks(tensor, spec.block)
            quantized[name] = fp8
            quantized[f"{stem}.weight_scale_inv"] = scale_inv
            restored = dequantize_fp8_blocks(fp8, scale_inv, spec.block)
        else:
            raise ValueError(f"unknown quantization scheme {spec.scheme!r}")
        dequantized[name] = restored
        worst = max(worst, float((restored - tensor).norm() / tensor.norm()))
        count += 1
    if not count:
        raise ValueError(f"no tensor matches {spec.quantized!r}")
    figures = {"scheme": spec.scheme, "quantized_tensors": count, "max_rel_weight_error": worst}
    return quantized, dequantized, figures


def _write_quantized(family: str, seed: int, tmp_dir: Path, reference_tmp: Path) -> dict[str, Any]:
    """The quantized checkpoint into ``tmp_dir``, its dequantized float32 twin into ``reference_tmp``."""
    spec = QUANTIZED_FAMILIES[family]
    _text_model_from_spec(spec.base, seed).save_pretrained(reference_tmp, safe_serialization=True)
    tensors = load_file(reference_tmp / "model.safetensors")
    quantized, dequantized, figures = quantize_tensors(spec, tensors)
    save_file(dequantized, str(reference_tmp / "model.safetensors"), metadata={"format": "pt"})
    save_file(quantized, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((reference_tmp / "config.json").read_text())
    maker = _w4a16_quantization_config if spec.scheme == "w4a16" else _fp8_quantization_config
    config["quantization_config"] = maker(spec)
    (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = reference_tmp / "generation_config.json"
    if generation.exists():
        shutil.copy(generation, tmp_dir / generation.name)
    return figures


def reference_model_dir(model_dir: Path) -> Path:
    """The checkpoint HF's reference loads: a quantized family's dequantized twin, else ``model_dir``."""
    model_dir = Path(model_dir)
    marker = json.loads((model_dir / MARKER_FILE).read_text())
    if not marker.get("reference_dir"):
        return model_dir
    reference = model_dir.with_name(marker["reference_dir"])
    if not reference.is_dir():
        raise FileNotFoundError(f"{reference} (the dequantized twin of {model_dir}) is missing: rebuild")
    return reference


def _build_tokenizer(special_tokens: dict[str, int] | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE covering exactly ``VOCAB_SIZE`` ids, specials first; ``special_tokens``
    (text -> id, ids past the byte alphabet) take those ids instead of the merges there."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for token in [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *byte_chars]:
        vocab[token] = len(vocab)
    # Fill the rest of the vocab with merges of space+letter and letter pairs.
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pairs = [("Ġ", c) for c in letters] + [(a, b) for a in letters for b in letters]
    merges: list[tuple[str, str]] = []
    for left, right in pairs:
        if len(vocab) == VOCAB_SIZE:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    assert len(vocab) == VOCAB_SIZE
    specials = special_tokens or {}
    if specials:
        first_merge = 3 + len(byte_chars)
        if min(specials.values()) < first_merge or max(specials.values()) >= VOCAB_SIZE:
            raise ValueError(f"special token ids must lie in [{first_merge}, {VOCAB_SIZE})")
        by_id = {i: t for t, i in vocab.items()}
        replaced = {by_id[i] for i in specials.values()}
        merges = [m for m in merges if m[0] + m[1] not in replaced]
        vocab = {t: i for t, i in vocab.items() if t not in replaced} | specials

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if specials:
        tokenizer.add_special_tokens(list(specials))  # already in the vocab: they keep their ids
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=_COMMON["max_position_embeddings"],
    )


def _build_hash(family: str, seed: int) -> str:
    if family in WRAPPER_FAMILIES:
        wrapper = WRAPPER_FAMILIES[family]
        wrapper_payload = {
            "build_version": BUILD_VERSION,
            "family": family,
            "text": _build_hash(wrapper.text_family, seed),
            "architecture": wrapper.architecture,
            "config": wrapper.config,
            "text_prefix": wrapper.text_prefix,
            "files": wrapper.files,
            "special_tokens": wrapper.special_tokens,
        }
        return hashlib.sha256(json.dumps(wrapper_payload, sort_keys=True).encode()).hexdigest()
    if family in QUANTIZED_FAMILIES:
        quantized = QUANTIZED_FAMILIES[family]
        quantized_payload = {
            "build_version": BUILD_VERSION,
            "family": family,
            "seed": seed,
            "config_cls": quantized.base.config_cls.__name__,
            "config_kwargs": quantized.base.config_kwargs,
            "scheme": quantized.scheme,
            "quantized": quantized.quantized,
            "group_size": quantized.group_size,
            "block": quantized.block,
            "activation_inputs": quantized.activation_inputs,
        }
        return hashlib.sha256(json.dumps(quantized_payload, sort_keys=True).encode()).hexdigest()
    spec = MODEL_FAMILIES[family]
    payload = {
        "build_version": BUILD_VERSION,
        "family": family,
        "seed": seed,
        "config_cls": spec.config_cls.__name__,
        "model_cls": spec.model_cls.__name__,
        "config_kwargs": spec.config_kwargs,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _is_built(out_dir: Path, build_hash: str) -> bool:
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("hash") == build_hash


def config_kwargs_for_installed_transformers(spec: ModelFamily) -> dict[str, Any]:
    """transformers 5 takes ``rope_parameters``; 4.x (what vLLM <= 0.23 pins) ``rope_theta`` + ``rope_scaling``."""
    kwargs = dict(spec.config_kwargs)
    if "rope_parameters" in inspect.signature(spec.config_cls.__init__).parameters:
        return kwargs
    rope = dict(kwargs.pop("rope_parameters"))
    kwargs["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    kwargs["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, "type": rope_type, **rope}
    kwargs["torch_dtype"] = kwargs.pop("dtype")
    return kwargs


def _text_model(family: str, seed: int) -> PreTrainedModel:
    return _text_model_from_spec(MODEL_FAMILIES[family], seed)


def _text_model_from_spec(spec: ModelFamily, seed: int) -> PreTrainedModel:
    config = spec.config_cls(**config_kwargs_for_installed_transformers(spec))
    config.architectures = [spec.model_cls.__name__]
    torch.manual_seed(seed)
    model = spec.model_cls(config).to(torch.float32).eval()
    if spec.config_cls is DeepseekV3Config:
        # HF inits the routing correction bias to zeros; make it non-zero so
        # a checkpoint loader that drops it gives different routing.
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.05 * torch.randn_like(buffer))
    return model


def _write_wrapper(family: str, seed: int, tmp_dir: Path) -> None:
    """The text family's checkpoint, its tensors renamed under the wrapper, plus vision tensors."""
    wrapper = WRAPPER_FAMILIES[family]
    text_dir = tmp_dir / "text"
    _text_model(wrapper.text_family, seed).save_pretrained(text_dir, safe_serialization=True)
    text_config = json.loads((text_dir / "config.json").read_text())
    tensors = {wrapper.text_prefix + k: v for k, v in load_file(text_dir / "model.safetensors").items()}
    shutil.rmtree(text_dir)
    config = {**wrapper.config, "_text_hidden_size": text_config["hidden_size"]}
    generator = torch.Generator().manual_seed(seed + 1)
    for name, shape in wrapper.vision_weights(config).items():
        if "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):  # LayerNorm scales
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = INITIALIZER_RANGE * torch.randn(shape, generator=generator)
    save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
    text_config.pop("architectures", None)
    config.pop("_text_hidden_size")
    full = {
        **config,
        "architectures": [wrapper.architecture],
        "text_config": text_config,
        "dtype": "float32",
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    }
    (tmp_dir / "config.json").write_text(json.dumps(full, indent=2) + "\n")
    for name, content in wrapper.files.items():
        (tmp_dir / name).write_text(json.dumps(content, indent=2) + "\n")


def build_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a random-weight float32 checkpoint + tokenizer to ``out_dir``.

    Returns ``out_dir`` at once if it already holds the same build (marker
    file with a hash of the family spec and seed). The model is written to a
    sibling temporary folder and renamed into place, so a half-written build
    is never mistaken for a complete one. A ``WRAPPER_FAMILIES`` family holds
    its text family's weights (same seed: the same tensors) under the wrapper's names.
    """
    out_dir = Path(out_dir)
    build_hash = _build_hash(family, seed)
    if _is_built(out_dir, build_hash):
        return out_dir

    tmp_dir = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    marker: dict[str, Any] = {"hash": build_hash, "family": family, "seed": seed}
    if family in WRAPPER_FAMILIES:
        _write_wrapper(family, seed, tmp_dir)
    elif family in QUANTIZED_FAMILIES:
        reference_dir = out_dir.with_name(out_dir.name + DEQUANTIZED_SUFFIX)
        reference_tmp = reference_dir.with_name(f"{reference_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(reference_tmp, ignore_errors=True)
        marker["quantization"] = _write_quantized(family, seed, tmp_dir, reference_tmp)
        spec = QUANTIZED_FAMILIES[family]
        if spec.activation_inputs:
            activation = {"format": "float8_e4m3fn", "group_size": spec.block, "parameters": spec.activation_inputs}
            (reference_tmp / ACTIVATION_QUANTIZATION_FILE).write_text(json.dumps(activation, indent=2) + "\n")
        _build_tokenizer().save_pretrained(reference_tmp)
        shutil.rmtree(reference_dir, ignore_errors=True)
        reference_tmp.rename(reference_dir)
        marker["reference_dir"] = reference_dir.name  # a sibling of out_dir
    else:
        _text_model(family, seed).save_pretrained(tmp_dir, safe_serialization=True)
    specials = WRAPPER_FAMILIES[family].special_tokens if family in WRAPPER_FAMILIES else None
    _build_tokenizer(specials).save_pretrained(tmp_dir)
    (tmp_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")

    if _is_built(out_dir, build_hash):  # another process finished first
        shutil.rmtree(tmp_dir)
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


def load_hf_model(model_dir: Path) -> PreTrainedModel:
    """HF reference model: float32, CPU, eager attention, eval mode (a multimodal wrapper: its
    image-text-to-text class, transformers' own code, loading the checkpoint's original names)."""
    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    activation_file = Path(model_dir) / ACTIVATION_QUANTIZATION_FILE
    if not activation_file.is_file():
        model = auto.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        return model.eval()
    # A W8A8 checkpoint's twin: the experts through F.linear (transformers 5 would pick grouped_mm),
    # every quantized projection's input quantized as the checkpoint's kernels do.
    activation = json.loads(activation_file.read_text())
    model = auto.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    ActivationQuantization(model, activation["parameters"], activation["group_size"]).install()
    return model.eval()


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The text decoder layers of a causal LM (``model.layers``) or of a wrapper (``model.language_model.layers``)."""
    inner = model.model
    layers = inner.layers if hasattr(inner, "layers") else inner.language_model.layers
    assert isinstance(layers, torch.nn.ModuleList)
    return layers


def hf_layer_outputs(model_dir: Path, token_ids: list[list[int]], layer_ids: list[int]) -> list[list[torch.Tensor]]:
    """Outputs of decoder layers ``layer_ids`` for each prompt, run alone.

    Returns ``result[prompt][k]`` of shape ``[num_tokens, hidden_size]`` for
    layer ``layer_ids[k]``: the residual stream after that layer, before the
    final norm (unlike the last entry of HF's ``output_hidden_states``).
    """
    model = load_hf_model(model_dir)
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}

    def make_hook(layer_id: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            captured[layer_id] = hidden.detach()[0].clone()

        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in layer_ids]
    results: list[list[torch.Tensor]] = []
    try:
        with torch.inference_mode():
            for ids in token_ids:
                captured.clear()
                model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
                results.append([captured[i] for i in layer_ids])
    finally:
        for handle in handles:
            handle.remove()
    return results


# A chat template for speculators' preprocessing (``spec-compat extract --conversations``). It is
# not in build_model's tokenizer: the cached checkpoints every other test shares stay byte-for-byte
# as they are; build_chat_model puts it in a sibling directory. ``{% generation %}`` marks the
# assistant tokens for HF's assistant mask (speculators 0.4 uses it when present, 0.3 never does);
# CHAT_TEMPLATE_PLAIN has no such tags (most real templates), so 0.4 detects the assistant spans
# with its regex, as 0.3 always does.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|bos|>assistant: {% generation %}{{ message['content'] }}<|eos|>"
    "{% endgeneration %}{% else %}<|bos|>{{ message['role'] }}: {{ message['content'] }}<|eos|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)
CHAT_TEMPLATE_PLAIN = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CHAT_MARKER_FILE = "chat_model_build.json"


def build_chat_model(base_dir: Path, out_dir: Path, chat_template: str = CHAT_TEMPLATE) -> Path:
    """``base_dir`` (a build_model checkpoint) with ``chat_template`` in its tokenizer config.

    Every other file is a symlink to the base's (same weights, same token ids); built in a sibling
    temporary folder and renamed into place, like build_model, and reused while base and template
    are unchanged."""
    base_dir, out_dir = Path(base_dir).resolve(), Path(out_dir)
    base_marker = json.loads((base_dir / MARKER_FILE).read_text())
    marker = {"base": str(base_dir), "base_hash": base_marker["hash"], "chat_template": chat_template}
    marker_path = out_dir / CHAT_MARKER_FILE
    if marker_path.is_file() and json.loads(marker_path.read_text()) == marker:
        return out_dir
    tmp_dir = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    for item in base_dir.iterdir():
        if item.name not in ("tokenizer_config.json", MARKER_FILE):
            (tmp_dir / item.name).symlink_to(item)
    tokenizer_config = json.loads((base_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = chat_template
    (tmp_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (tmp_dir / CHAT_MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir
