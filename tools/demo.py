"""Demo: the untouched speculators generator on vLLM through spec_compat, checked against HF.

Builds a tiny random-weight Qwen3-MoE model locally (no hub), extracts hidden states at
tensor_parallel_size=2 on CPU, and compares every returned layer with HF transformers (float32).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="qwen3_moe", choices=["dense", "qwen3_moe", "deepseek_v3"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "spec_compat" / "demo")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))

    import spec_compat

    report = spec_compat.apply(strict=True, dtype="float32")
    print(report)

    from speculators.data_generation import VllmHiddenStatesGenerator

    from tiny_models import build_model, hf_layer_outputs

    model = build_model(args.family, args.model_dir / args.family)
    layer_ids = [0, 2, 3]
    prompts = [[(31 * i + 7 * j) % 480 + 10 for j in range(4 + 9 * i)] for i in range(13)]

    started = time.perf_counter()
    generator = VllmHiddenStatesGenerator(
        str(model), layer_ids=layer_ids, max_model_len=512, tensor_parallel_size=args.tp
    )
    print(f"engine start: {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    results = generator.generate(prompts)
    elapsed = time.perf_counter() - started
    tokens = sum(len(p) for p in prompts)
    print(f"generate: {len(results)} sequences, {tokens} tokens in {elapsed:.2f} s")
    generator.executor.shutdown()

    reference = hf_layer_outputs(model, prompts, layer_ids)
    worst = 0.0
    for got, want in zip(results, reference, strict=True):
        for g, w in zip(got["hidden_states"], want, strict=True):
            diff = float((g.float() - w).abs().max())
            worst = max(worst, diff / max(1.0, float(w.abs().max())))
    verdict = "OK" if worst <= 1e-3 else "MISMATCH"
    print(
        f"max relative difference vs HF transformers over {len(prompts)} prompts x {len(layer_ids)} layers: "
        f"{worst:.2e} -> {verdict}"
    )
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
