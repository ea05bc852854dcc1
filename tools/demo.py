"""Demo: the untouched speculators generator on vLLM through spec_compat, checked against HF.

Builds a tiny random-weight Qwen3-MoE model locally (no hub), extracts hidden states at
tensor_parallel_size=2 on CPU, and compares every returned layer with HF transformers (float32).
Prints a few lines; ``--verbose`` adds vLLM's and its workers' logs, Python's warnings and every
adapter's decision.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
# Without --verbose; set before vLLM starts, so its spawned workers (which re-import this file) inherit it.
QUIET_ENV = {
    "SPEC_COMPAT_DEMO_QUIET": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore",
    "TRANSFORMERS_VERBOSITY": "error",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10's warnings (NUMA binding)
    "TQDM_DISABLE": "1",  # progress bars of the checkpoint writer and loaders
}
if os.environ.get("SPEC_COMPAT_DEMO_QUIET"):
    # Messages logged before a logger is configured reach Python's last-resort handler (WARNING and up).
    logging.basicConfig(level=logging.ERROR)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="qwen3_moe", choices=["dense", "qwen3_moe", "deepseek_v3"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "spec_compat" / "demo")
    parser.add_argument("--verbose", action="store_true", help="vLLM's logs, warnings, every adapter's decision")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))
    if not args.verbose:
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
        logging.basicConfig(level=logging.ERROR)
        warnings.simplefilter("ignore")

    import spec_compat

    report = spec_compat.apply(strict=True, dtype="float32")
    if args.verbose:
        print(report)
    else:
        print(str(report).splitlines()[0])
        print(f"  {len(report.applied)} of {len(report.decisions)} adapters apply (--verbose lists them)")

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
