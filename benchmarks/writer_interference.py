"""How much extract's writer slows the loop that drives the engine, in-process threads against a process of
its own (issue 27: on an H100 extract's generate() calls took 12-25 % longer than the shim's alone).

``python benchmarks/writer_interference.py DIR [--seconds 8] [--threads 8] [--tokens 1800] [--out FILE]``

A stand-in for the driver's step loop (small Python work and small torch calls, what the driver does
between RPCs) runs on core 0 for ``--seconds``, three ways: alone; while ``spec_compat.extract``'s
BackgroundWriter writes samples (bf16 states, ``--layers`` x ``--tokens`` x ``--hidden``, fsync'd into
DIR) on threads of the same interpreter, pinned to core 1; and while the same writer runs in a process of
its own, pinned to core 1. It prints the loop's iterations per second and the GB/s written in each mode;
``threads / alone`` against ``process / alone`` tells what sharing the interpreter costs beyond sharing
the machine's memory and disk. Needs torch and spec_compat; Linux (affinity); two or more cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from extract_writer import synthetic_samples  # this folder: on sys.path when run as a script

from spec_compat import extract

LOOP_CORE, WRITER_CORE = 0, 1


def payload(tokens: int, hidden: int, layers: int) -> dict[str, Any]:
    return synthetic_samples(1, tokens, hidden, layers)[0]  # extract_writer.py's synthetic sample


def engine_like_loop(seconds: float) -> float:
    """Iterations per second of small Python and torch work on this thread (pinned to LOOP_CORE)."""
    os.sched_setaffinity(0, {LOOP_CORE})
    small = torch.zeros(64)
    iterations, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        requests = {f"r{i}": [i, i + 1, i + 2] for i in range(32)}
        order = sorted(requests, key=lambda key: requests[key][0])
        small.add_(1.0)
        iterations += len(order) // 32
    return iterations / elapsed


def write_for(folder: Path, seconds: float, threads: int, sample: dict[str, Any], pin_threads: bool) -> dict[str, Any]:
    """Submit batches of 8 samples to a BackgroundWriter for ``seconds``; returns what was written."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    manifest = extract.Manifest(folder, {"model": "m", "layer_ids": [0], "format": extract.FORMAT, "run": {}})
    writer = extract.BackgroundWriter(folder, manifest, threads=threads, pending=2, sync=True)
    started, index = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        writer.submit([(index + k, sample) for k in range(8)])
        index += 8
        if pin_threads:  # the pool's threads exist once the first batch is submitted
            for thread in threading.enumerate():
                if thread.name.startswith(("spec-compat-writer", "spec-compat-recorder")) and thread.native_id:
                    os.sched_setaffinity(thread.native_id, {WRITER_CORE})
    writer.close()
    elapsed = time.perf_counter() - started
    return {"gb_per_s": writer.written_bytes / elapsed / 1e9, "samples": writer.written_samples, "seconds": elapsed}


def _writer_process(folder: str, seconds: float, threads: int, shape: tuple[int, int, int], out: Any) -> None:
    os.sched_setaffinity(0, {WRITER_CORE})
    out.send(write_for(Path(folder), seconds, threads, payload(*shape), pin_threads=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1800)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two cores")
    folder = args.dir / "sc_writer_interference"
    shape = (args.tokens, args.hidden, args.layers)
    sample = payload(*shape)
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "threads": [], "process": []}
    for _ in range(args.rounds):
        runs["alone"].append({"loop_per_s": engine_like_loop(args.seconds)})
        written: dict[str, Any] = {}
        feeder = threading.Thread(
            target=lambda into=written: into.update(write_for(folder, args.seconds + 1, args.threads, sample, True))
        )
        feeder.start()
        time.sleep(0.5)  # the writer under way
        runs["threads"].append({"loop_per_s": engine_like_loop(args.seconds)})
        feeder.join()
        runs["threads"][-1].update(written)
        receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        process = multiprocessing.get_context("spawn").Process(
            target=_writer_process, args=(str(folder), args.seconds + 4, args.threads, shape, send)
        )
        process.start()
        time.sleep(3.5)  # its imports and its payload
        runs["process"].append({"loop_per_s": engine_like_loop(args.seconds)})
        runs["process"][-1].update(receive.recv())
        process.join()
    shutil.rmtree(folder, ignore_errors=True)
    median = {mode: sorted(r["loop_per_s"] for r in records)[len(records) // 2] for mode, records in runs.items()}
    result = {
        "settings": vars(args) | {"dir": str(args.dir), "out": str(args.out) if args.out else None},
        "runs": runs,
        "threads_vs_alone": median["threads"] / median["alone"],
        "process_vs_alone": median["process"] / median["alone"],
    }
    for mode, records in runs.items():
        rates = ", ".join(f"{r['loop_per_s']:,.0f}/s" + (f" ({r['gb_per_s']:.2f} GB/s)" if "gb_per_s" in r else "")
                          for r in records)  # fmt: skip
        print(f"{mode:8s} loop {rates}")
    print(f"loop with the writer on threads: {result['threads_vs_alone']:.3f} of alone; "
          f"in a process: {result['process_vs_alone']:.3f}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
