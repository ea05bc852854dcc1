"""What handing files to extract's writer process costs the engine loop, with the fast hand-off and without
(issue 27: on an H200, run W, 0.2-1.0 s of a 7-9 s extract went to handing files over, ~0.8 ms a sample).

``python benchmarks/writer_handoff.py DIR [--samples 384] [--tokens 1800] [--hidden 256] [--rounds 3] [--out FILE]``

States go through the real transfer (a worker-side ``SegmentPool``, the driver's ``DriverMappings``
with speculators' clone handover), so each sample is described to the process by where its states lie,
as in extract; batches of 16 samples go to a ``BackgroundWriter`` with a ``WriterProcess`` (8 threads,
2 pending batches, fsync'd into DIR). Measured per mode, alternating ``--rounds`` times in one run:
``handoff_s`` (the loop's time in ``submit`` once there is room: describing and sending) and the waits.
``fast`` is the default (small tensors as bytes, a 1 MiB job pipe); ``pickled`` sets
``SPEC_COMPAT_WRITER_FAST_HANDOFF=0`` (tensors pickled, the pipe's default size). The hand-off cost
grows with the tokens per sample (ids and loss mask cross the pipe), not with ``--hidden``. Linux.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from spec_compat import extract
from spec_compat.adapters import handover, transfer
from spec_compat.extract.formats.v1 import SpeculatorsV1
from spec_compat.extract.writer import BackgroundWriter
from spec_compat.extract.writer_process import FAST_HANDOFF_ENV, WriterProcess

BATCH = 16
LAYERS = 4


def batches(
    pool: transfer.SegmentPool, mappings: transfer.DriverMappings, samples: int, tokens: int, hidden: int
) -> list[list[tuple[int, dict[str, Any]]]]:
    """Every batch's payloads, their states in segments handed over as extract's are."""
    out = []
    for start in range(0, samples, BATCH):
        count = min(BATCH, samples - start)
        sent = {
            f"req_{i}": [torch.randn(tokens, hidden).to(torch.bfloat16) for _ in range(LAYERS)] for i in range(count)
        }
        packed = transfer.pack(sent, pool)
        reply = mappings.open(packed, handover.as_clone_sources)
        out.append([
            (start + i, {
                "input_ids": torch.randint(0, 32000, (tokens,), dtype=torch.long),
                "hidden_states": [h.clone() for h in reply[f"req_{i}"]],
                "loss_mask": torch.ones(tokens, dtype=torch.long),
            })
            for i in range(count)
        ])  # fmt: skip
        del reply
    return out


def one_run(folder: Path, work: list[list[tuple[int, dict[str, Any]]]], locate: Any) -> dict[str, float]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    manifest = extract.Manifest(folder, {"model": "m", "layer_ids": [1], "format": extract.FORMAT, "run": {}})
    process = WriterProcess(folder, SpeculatorsV1(), 8, True, None, False, 0)
    writer = BackgroundWriter(folder, manifest, 8, 2, fmt=SpeculatorsV1(), process=process)
    writer.locate = locate
    time.sleep(1.0)  # the process imports torch
    started = time.perf_counter()
    for batch in work:
        writer.submit(batch)
    writer.close()
    total = time.perf_counter() - started
    samples = sum(len(b) for b in work)
    assert process.samples == samples, (process.samples, samples)
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "handoff_s": writer.handoff_s,
        "wait_s": writer.wait_s,
        "total_s": total,
        "per_sample_ms": writer.handoff_s / samples * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--tokens", type=int, default=1800)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    directory = Path("/dev/shm") / f"{transfer.DIR_PREFIX}{os.getpid()}-handoff"
    directory.mkdir()
    pool = transfer.SegmentPool(str(directory), "w")
    # every batch is made up front and held: no hand-over limit, so every sample goes to the process
    mappings = transfer.DriverMappings(str(directory), held_limit=1 << 40, held_segments_limit=1 << 20)
    results: dict[str, list[dict[str, float]]] = {"fast": [], "pickled": []}
    try:
        work = batches(pool, mappings, args.samples, args.tokens, args.hidden)
        for round_ in range(args.rounds):
            for mode in ("fast", "pickled"):
                os.environ[FAST_HANDOFF_ENV] = "1" if mode == "fast" else "0"
                record = one_run(args.dir / f"handoff_{mode}", work, mappings.locate)
                results[mode].append(record)
                print(f"round {round_} {mode:8s} " + " ".join(f"{k} {v:.3f}" for k, v in record.items()), flush=True)
    finally:
        work = []
        pool.close()
        shutil.rmtree(directory, ignore_errors=True)
    summary = {
        mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for mode, runs in results.items()
    }
    summary["pickled_over_fast_handoff"] = {"ratio": summary["pickled"]["handoff_s"] / summary["fast"]["handoff_s"]}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                        "median": summary}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
