"""extract's writer alone, without an engine: how fast it puts samples on a disk (issue 27).

``python benchmarks/extract_writer.py DIR [--gib 4] [--tokens 4096] [--hidden 2048] [--layers 4]
[--threads 8] [--out FILE.json]`` writes the same synthetic samples (bf16 states of the given shape,
as ``spec-compat extract`` saves them) into DIR/sc_writer_bench with ``spec_compat.extract``'s
BackgroundWriter, fsync on, once through the page cache and once staged in /dev/shm and written with
O_DIRECT (``direct_io_staging``), and prints GB/s per mode with where the writer threads' time went
(``spec_compat.timings()``'s ``extract:`` labels, summed over threads). Needs torch and spec_compat.

``--room-ab [--batch-files 5] [--rounds 3]``: instead, the writer's room by bytes against room by whole
batches (``SPEC_COMPAT_WRITER_BYTE_WINDOW`` 1 / 0, alternating, through the page cache), with samples of
four lengths from ``--tokens`` / 2 to 2 x ``--tokens`` (a batch's files finish at different times, as a
real batch's do) in batches of ``--batch-files`` (run X's 4k-8k set: 4-5 files a batch, 8 threads).
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

import spec_compat
from spec_compat import extract


def synthetic_samples(count: int, tokens: int, hidden: int, layers: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16) for _ in range(layers)]
    ids = torch.arange(tokens)
    mask = torch.ones(tokens, dtype=torch.long)
    return [{"input_ids": ids, "hidden_states": states, "loss_mask": mask} for _ in range(count)]


def varied_samples(count: int, tokens: int, hidden: int, layers: int) -> list[dict[str, Any]]:
    """``count`` samples cycling through four lengths, tokens / 2 .. 2 x tokens, each its own tensors."""
    generator = torch.Generator().manual_seed(0)
    shapes = [tokens // 2, tokens, 3 * tokens // 2, 2 * tokens]
    by_length = {
        n: {
            "input_ids": torch.arange(n),
            "hidden_states": [torch.randn(n, hidden, generator=generator).to(torch.bfloat16) for _ in range(layers)],
            "loss_mask": torch.ones(n, dtype=torch.long),
        }
        for n in shapes
    }
    return [by_length[shapes[(i * 7) % 4]] for i in range(count)]


def room_ab(
    folder: Path, payloads: list[dict[str, Any]], threads: int, batch_files: int, rounds: int
) -> dict[str, Any]:
    out: dict[str, list[float]] = {"bytes": [], "batches": []}
    for _ in range(rounds):
        for room, env in (("bytes", "1"), ("batches", "0")):
            os.environ["SPEC_COMPAT_WRITER_BYTE_WINDOW"] = env
            record = run_mode(folder, payloads, threads, False, batch_files)
            out[room].append(record["gb_per_s"])
            print(room, f"{record['gb_per_s']:.3f} GB/s", flush=True)
    return {room: {"gb_per_s": values, "median": statistics.median(values)} for room, values in out.items()}


def run_mode(
    folder: Path, payloads: list[dict[str, Any]], threads: int, direct: bool, batch_files: int | None = None
) -> dict[str, Any]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    staging = extract.direct_io_staging(folder) if direct else None
    if direct and staging is None:
        return {"status": "unsupported", "why": "no O_DIRECT on this file system or no /dev/shm"}
    manifest = extract.Manifest(folder, {"model": "m", "layer_ids": [0], "format": extract.FORMAT, "run": {}})
    writer = extract.BackgroundWriter(folder, manifest, threads, pending=2, sync=True, staging=staging)
    spec_compat.reset_timings()
    batch = batch_files or max(1, threads)
    started = time.perf_counter()
    for begin in range(0, len(payloads), batch):
        writer.submit([(begin + k, p) for k, p in enumerate(payloads[begin : begin + batch])])
    writer.close()
    seconds = time.perf_counter() - started
    written = sum(f.stat().st_size for f in folder.glob("data_*.pt"))
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "status": "ok",
        "seconds": seconds,
        "bytes": written,
        "gb_per_s": written / seconds / 1e9,
        "timings": {k: round(v, 4) for k, v in sorted(spec_compat.timings().items()) if k.startswith("extract:")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=extract.default_writer_threads())
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--room-ab", action="store_true", help="room by bytes against by batches (docstring)")
    parser.add_argument("--batch-files", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    extract.disable_zip_crc32()
    sample_bytes = args.tokens * args.hidden * args.layers * 2
    count = max(1, int(args.gib * 2**30 // sample_bytes))
    if args.room_ab:
        folder = args.dir / "sc_writer_bench"
        payloads = varied_samples(count, args.tokens, args.hidden, args.layers)
        result = room_ab(folder, payloads, args.threads, args.batch_files, args.rounds)
        result = {"samples": count, "threads": args.threads, "batch_files": args.batch_files, "room": result}
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        return
    payloads = synthetic_samples(count, args.tokens, args.hidden, args.layers)
    folder = args.dir / "sc_writer_bench"
    record: dict[str, Any] = {"samples": count, "sample_bytes": sample_bytes, "threads": args.threads, "modes": {}}
    for name, direct in (("buffered", False), ("direct", True), ("buffered_again", False), ("direct_again", True)):
        record["modes"][name] = run_mode(folder, payloads, args.threads, direct)
        print(name, json.dumps(record["modes"][name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
