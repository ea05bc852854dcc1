"""Random-weight ~110M dense Qwen3 and ~130M Qwen3-MoE checkpoints for the benchmarks.

Built locally with transformers (random init, float32 safetensors) and cached under
``~/.cache/spec_compat/bench_models/<family>``; the tokenizer files come from the test suite's
tiny-model builder (``tests/tiny_models.py``: a 512-token byte-level BPE), so every model here
shares its 512-id vocabulary. A marker file holds a hash of the build spec: a changed spec rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SPEC_COMPAT_BENCH_CACHE", Path.home() / ".cache" / "spec_compat" / "bench_models"))
BUILD_VERSION = 1
MARKER_FILE = "bench_model_build.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.036,  # ~1/sqrt(hidden_size): activations stay O(1) through the layers
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}

# family -> (config class name, model class name, config keywords)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # 16 x (attention 1.57M + MLP 5.31M) + embeddings 0.79M = ~110.9M parameters
    "dense": ("Qwen3Config", "Qwen3ForCausalLM", {**_COMMON, "num_hidden_layers": 16, "intermediate_size": 2304}),
    # 12 x (attention 1.57M + 8 experts x 1.18M + router) + embeddings = ~133M parameters (~48M active)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_COMMON,
            "num_hidden_layers": 12,
            "intermediate_size": 2048,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 512,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
}


def _hash(family: str, seed: int) -> str:
    config_cls, model_cls, kwargs = FAMILIES[family]
    payload = {"v": BUILD_VERSION, "family": family, "seed": seed, "cls": [config_cls, model_cls], "kwargs": kwargs}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _is_built(out_dir: Path, build_hash: str) -> bool:
    marker = out_dir / MARKER_FILE
    return marker.is_file() and json.loads(marker.read_text()).get("hash") == build_hash


def tiny_dense() -> Path:
    """The test suite's tiny dense Qwen3 (``tests/tiny_models.build_model("dense", ...)``), built if needed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_model

    return Path(build_model("dense", CACHE / "tiny_dense"))


def _tokenizer_source() -> Path:
    """Its tokenizer files are reused by the benchmark models."""
    return tiny_dense()


def num_layers(family: str) -> int:
    return int(FAMILIES[family][2]["num_hidden_layers"])


def build(family: str, seed: int = 0) -> Path:
    """The checkpoint folder for ``family``, built on first use."""
    out_dir = CACHE / family
    build_hash = _hash(family, seed)
    if _is_built(out_dir, build_hash):
        return out_dir
    import torch
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    tmp_dir = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    model.save_pretrained(tmp_dir, safe_serialization=True)
    source = _tokenizer_source()
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, tmp_dir / name)
    marker = {"hash": build_hash, "family": family, "seed": seed, "parameters": params}
    (tmp_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


def parameters(model_dir: Path) -> int:
    return int(json.loads((model_dir / MARKER_FILE).read_text())["parameters"])


def build_all() -> dict[str, dict[str, Any]]:
    """Every benchmark model: {name: {"path": ..., "parameters": ..., "layers": ...}}."""
    models: dict[str, dict[str, Any]] = {}
    for name in FAMILIES:
        path = build(name)
        models[name] = {"path": str(path), "parameters": parameters(path), "layers": num_layers(name)}
    tiny = tiny_dense()
    config = json.loads((tiny / "config.json").read_text())
    models["tiny_dense"] = {"path": str(tiny), "layers": int(config["num_hidden_layers"])}
    return models


if __name__ == "__main__":
    # Prints the models as JSON on its last line (benchmarks/run.py reads it).
    print(json.dumps(build_all()))
