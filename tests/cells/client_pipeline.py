"""A client of speculators' generator, shaped like speculators' own offline pipeline script.

It knows nothing of spec_compat (run it under ``spec-compat run -- python tests/cells/client_pipeline.py``):
speculators is imported at module level, vLLM's workers are started with spawn (so each of them
re-imports this module, speculators included, before vLLM loads its plugins), samples go through
``generate()`` in batches, and a thread pool saves one ``data_{i}.pt`` per sample while the next
batch runs; ``sample_lengths.json`` records each sample's length. The engine is never shut down
explicitly: like speculators' script, it relies on the interpreter's exit.

Usage: python tests/cells/client_pipeline.py --model DIR --data JSONL --output-dir DIR
           [--layer-ids 2 0 3] [--tp 1] [--batch-size 12] [--max-model-len 256]
JSONL: one preprocessed sample per line, {"input_ids": [...], "loss_mask": [...]}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

# Workers by spawn, as speculators' script sets it (fork breaks CUDA in the workers).
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

from speculators.data_generation.vllm_hidden_states_generator import (
    VllmHiddenStatesGenerator,
)

SAVE_THREADS = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hidden states of preprocessed samples -> data_{i}.pt files")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--layer-ids", type=int, nargs="+", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--max-model-len", type=int, default=256)
    return parser.parse_args()


def load_samples(path: Path) -> list[dict[str, list[int]]]:
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def save(sample: dict[str, Any], path: Path) -> Path:
    torch.save(sample, path)
    return path


def main() -> None:
    args = parse_args()
    samples = load_samples(args.data)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    generator = VllmHiddenStatesGenerator(
        model_path=args.model,
        layer_ids=args.layer_ids,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tp,
    )
    engine_s = time.perf_counter() - started
    lengths: dict[str, int] = {}
    pending: list[Future[Path]] = []
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=SAVE_THREADS) as pool:
        for first in range(0, len(samples), args.batch_size):
            batch = samples[first : first + args.batch_size]
            results = generator.generate([s["input_ids"] for s in batch])
            for offset, (sample, result) in enumerate(zip(batch, results, strict=True)):
                index = first + offset
                length = len(result["input_ids"])
                lengths[str(index)] = length
                record = {
                    "input_ids": result["input_ids"],
                    "hidden_states": [h.contiguous() for h in result["hidden_states"]],
                    "loss_mask": torch.tensor(sample["loss_mask"][:length], dtype=torch.long),
                }
                pending.append(pool.submit(save, record, args.output_dir / f"data_{index}.pt"))
        for future in pending:
            future.result()
    (args.output_dir / "sample_lengths.json").write_text(json.dumps(lengths, indent=2))
    tokens = sum(lengths.values())
    print(
        f"client_pipeline: {len(lengths)} samples, {tokens} tokens, batches of {args.batch_size}, "
        f"TP={args.tp}: engine start {engine_s:.1f} s, generate+save {time.perf_counter() - started:.2f} s"
    )


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn", force=True)
    main()
