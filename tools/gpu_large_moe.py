"""A random-weight Qwen3-MoE large enough to fill a real fraction of an H200, on the device.

Builds the checkpoint on the GPU (bf16, written to local disk), then runs speculators' untouched
generator through spec_compat at TP=1 and TP=2 (each a fresh interpreter) on the same prompts,
and compares TP=2 with TP=1 per token. Records engine start, generate throughput and peak GPU
memory per rank. Run after ``tools/gpu_install.sh`` and ``. /tmp/sc/env.sh``:

    python3 tools/gpu_large_moe.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LAYER_IDS = [2, 8, 13, 15]
CONFIG = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 4096,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}


def build_random_checkpoint(
    model_dir: Path, family: str, fields: dict[str, Any], device: str = "cuda"
) -> dict[str, Any]:
    """A random-weight bf16 checkpoint of ``family`` ("qwen3" or "qwen3_moe") with the test tokenizer,
    built on ``device`` (a multi-GB model builds in seconds on a GPU); reused when it exists."""
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "tests"))
    import tiny_models

    if (model_dir / "config.json").exists():
        return {"reused": True}
    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    started = time.perf_counter()
    config = config_class(
        vocab_size=tiny_models.VOCAB_SIZE,
        pad_token_id=tiny_models.PAD_TOKEN_ID,
        bos_token_id=tiny_models.BOS_TOKEN_ID,
        eos_token_id=tiny_models.EOS_TOKEN_ID,
        dtype="bfloat16",
        **fields,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir, safe_serialization=True)
    tiny_models._build_tokenizer().save_pretrained(model_dir)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"params": params, "bytes": size, "build_s": time.perf_counter() - started}


def build(model_dir: Path) -> dict[str, Any]:
    return build_random_checkpoint(model_dir, "qwen3_moe", CONFIG)


def peak_memory(worker: Any) -> dict[str, float]:
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30, "used_gib": (total - free) / 2**30}


def cell(model_dir: str, tp: int, out: str) -> None:
    import spec_compat

    spec_compat.apply(strict=True, dtype="bfloat16")
    import random

    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(256, 1024))] for _ in range(48)]
    started = time.perf_counter()
    generator = VllmHiddenStatesGenerator(model_dir, layer_ids=LAYER_IDS, max_model_len=2048, tensor_parallel_size=tp)
    start_s = time.perf_counter() - started
    timings = []
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        results = generator.generate(prompts)
        timings.append(time.perf_counter() - started)
    tokens = sum(len(p) for p in prompts)
    memory = generator.executor.collective_rpc(peak_memory)
    torch.save([[h.float() for h in r["hidden_states"]] for r in results[:16]], out + ".pt")
    generator.executor.shutdown()
    record = {
        "tp": tp,
        "engine_start_s": start_s,
        "generate_s": timings,
        "tokens": tokens,
        "tokens_per_s_best": tokens / min(timings),
        "peak_memory_per_rank": memory,
        "applied": spec_compat.apply(strict=True, dtype="bfloat16").applied,
    }
    Path(out).write_text(json.dumps(record))


def compare(a: str, b: str) -> dict[str, float]:
    import torch

    x, y = torch.load(a), torch.load(b)
    rel, cos = [], []
    for rx, ry in zip(x, y, strict=True):
        for hx, hy in zip(rx, ry, strict=True):
            rel.append((hx - hy).norm(dim=-1) / hy.norm(dim=-1).clamp_min(1e-12))
            cos.append(torch.nn.functional.cosine_similarity(hx, hy, dim=-1))
    r, c = torch.cat(rel), torch.cat(cos)
    return {"rel_l2_mean": float(r.mean()), "rel_l2_p99": float(torch.quantile(r, 0.99)), "rel_l2_max": float(r.max()),
            "cosine_mean": float(c.mean()), "cosine_min": float(c.min())}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/sc_large_moe"))
    parser.add_argument("--speculators", default="0.4.0.1")
    parser.add_argument("--cell", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        cell(args.cell[0], int(args.cell[1]), args.cell[2])
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"config": CONFIG, "build": build(args.model_dir)}
    installs = dict(item.split("=", 1) for item in os.environ["SPEC_COMPAT_SPECULATORS"].split(","))
    env = dict(os.environ, PYTHONPATH=f"{installs[args.speculators]}:{os.environ.get('PYTHONPATH', '')}")
    for tp in (1, 2):
        out = str(args.out / f"large_moe_tp{tp}.json")
        command = [sys.executable, __file__, "--out", str(args.out), "--cell", str(args.model_dir), str(tp), out]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
        (args.out / f"large_moe_tp{tp}.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
        summary[f"tp{tp}"] = json.loads(Path(out).read_text()) if proc.returncode == 0 else {"failed": proc.returncode}
    if all("failed" not in summary[f"tp{tp}"] for tp in (1, 2)):
        summary["tp2_vs_tp1"] = compare(
            str(args.out / "large_moe_tp2.json.pt"), str(args.out / "large_moe_tp1.json.pt")
        )
    (args.out / "large_moe.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
