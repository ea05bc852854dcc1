"""Real-engine cells, run in one fresh interpreter (vLLM workers are spawned processes): apply()
once, then one generator per cell, each shut down before the next (the pool groups cells that
differ only in their model: engine_harness.CellGroup).

Usage: python tests/cells/engine_cell.py SPECS_JSON
SPECS_JSON: a list of {"out": path, "model": dir, "tp": int, "layer_ids": [...], "prompts": [[...]],
            "chunk_budget": int, "chunk_prompts": [[...]], "big_batch": [[...]], "apply": bool,
            "disable": [...], "max_model_len": int}, every one with the same "apply" and "disable".
Writes to each "out" {"results": [...], "repeat_equal": bool, "big_batch": {...}, "chunked": [...] | error
text, "timings": {...}}; a cell that raises prints its traceback, the next one still runs, and the
process exits 3 at the end.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any


def _tensors(results: list[dict[str, Any]]) -> list[list[Any]]:
    return [[h.float().clone() for h in r["hidden_states"]] for r in results]


def main() -> None:
    with open(sys.argv[1]) as handle:
        specs = json.load(handle)
    options = {(spec.get("apply", True), tuple(spec.get("disable", []))) for spec in specs}
    if len(options) != 1:
        raise ValueError(f"one process, one apply(): these cells ask for {sorted(options)}")
    applied: dict[str, Any] = {}
    t0 = time.perf_counter()
    if specs[0].get("apply", True):
        import spec_compat

        report = spec_compat.apply(dtype="float32", disable=specs[0].get("disable", []))
        applied = {"applied": report.applied, "problems": report.problems}
    apply_s = time.perf_counter() - t0
    failed = []
    for spec in specs:
        try:
            run_one(spec, {**applied, "timings": {"apply_s": apply_s}})
        except Exception:  # noqa: BLE001 - this cell fails its tests; the next one still runs
            print(f"engine cell {spec['out']} failed:", file=sys.stderr)
            traceback.print_exc()
            failed.append(spec["out"])
        apply_s = 0.0  # paid once, by the first cell
    if failed:
        sys.exit(3)


def run_one(spec: dict[str, Any], record: dict[str, Any]) -> None:
    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    generator = VllmHiddenStatesGenerator(
        spec["model"],
        layer_ids=spec["layer_ids"],
        max_model_len=spec["max_model_len"],
        tensor_parallel_size=spec["tp"],
        **kwargs,
    )
    record["timings"]["init_s"] = time.perf_counter() - t0
    # speculators 0.4.x's requests hash their prompt blocks unless block-hashes-off dropped the hasher
    record["block_hasher_set"] = getattr(generator, "block_hasher", None) is not None
    try:
        t0 = time.perf_counter()
        results = generator.generate(spec["prompts"])
        record["timings"]["generate_s"] = time.perf_counter() - t0
        record["input_ids"] = [r["input_ids"].tolist() for r in results]
        # Each returned state a plain tensor with a storage of exactly its own bytes (the clone pool's
        # contract, and a plain clone's).
        record["results_own_storage"] = all(
            type(h) is torch.Tensor and h.untyped_storage().nbytes() == h.numel() * h.element_size()
            for r in results
            for h in r["hidden_states"]
        )
        record["results"] = _tensors(results)
        again = generator.generate(spec["prompts"])
        record["repeat_equal"] = all(
            torch.equal(a, b)
            for x, y in zip(results, again, strict=True)
            for a, b in zip(x["hidden_states"], y["hidden_states"], strict=True)
        )
        # Results keep the shared-memory segment they came in (driver-states-handover): dropped here,
        # the worker reuses those segments for the calls below instead of making new ones.
        del results, again
        # Nothing held between calls: the worker reuses its segments and makes no new one.
        directory = getattr(generator.executor, "transfer_directory", None)
        before = sorted(os.listdir(directory)) if directory and os.path.isdir(directory) else []
        for _ in range(2):
            generator.generate(spec["prompts"])
        after = sorted(os.listdir(directory)) if directory and os.path.isdir(directory) else []
        record["segments_reused"] = {"before": before, "after": after}
        replies = getattr(generator.executor, "states_replies", {})
        # replies written step by step (captured-states-streamed) after each part of this cell
        record["streamed_after"] = {"repeats": replies.get("streamed", 0)}
        if spec.get("big_batch"):
            # More prompts in one call than vLLM's max_num_seqs (32): every one scheduled, in order.
            results = generator.generate(spec["big_batch"])
            ids = [r["input_ids"].tolist() for r in results]
            record["big_batch"] = {"input_ids": ids, "results": _tensors(results)}
            del results
            record["streamed_after"]["big_batch"] = replies.get("streamed", 0)
        if spec.get("chunk_budget"):
            # A small per-step token budget forces chunked prefill (what max_num_batched_tokens sets).
            generator.scheduler.max_num_scheduled_tokens = spec["chunk_budget"]
            record["chunked_prefill"] = bool(generator.scheduler.scheduler_config.enable_chunked_prefill)
            for name in ("chunk_prompts", "chunk_prompts_long"):
                if name in spec:
                    try:
                        record[name] = _tensors(generator.generate(spec[name]))
                    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
                        record[name] = f"{type(exc).__name__}: {exc}"
                    record["streamed_after"][name] = replies.get("streamed", 0)
        if spec.get("fault"):
            # An exception inside a worker RPC (speculators' own worker code raising TypeError).
            try:
                generator.executor.collective_rpc("_store_captured_states", args=(None,))
                record["fault"] = None
            except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
                record["fault"] = {
                    "type": type(exc).__name__,
                    "text": str(exc),
                    "exc_type": getattr(exc, "exc_type", None),
                    "rank": getattr(exc, "rank", None),
                }
    finally:
        executor = generator.executor
        directory = getattr(executor, "transfer_directory", None)
        record["transfer"] = {
            "states_replies": dict(getattr(executor, "states_replies", {})),
            "segments_handed_over": getattr(getattr(executor, "transfer_mappings", None), "held_count", 0),
            "directory": directory,
            "segments_before_shutdown": sorted(os.listdir(directory)) if directory and os.path.isdir(directory) else [],
        }
        executor.shutdown()
        record["transfer"]["directory_left"] = bool(directory and os.path.exists(directory))
        del generator, executor
        gc.collect()
    torch.save(record, spec["out"])


if __name__ == "__main__":
    from cell_main import run  # a sibling: this folder is sys.path[0]

    run(main)
