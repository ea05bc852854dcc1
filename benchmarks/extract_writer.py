"""extract's writer alone, without an engine: how fast it puts samples on a disk (issue 27).

``python benchmarks/extract_writer.py DIR [--gib 4] [--tokens 4096] [--hidden 2048] [--layers 4]
[--threads 8] [--out FILE.json]`` writes the same synthetic samples (bf16 states of the given shape,
as ``spec-compat extract`` saves them) into DIR/sc_writer_bench with ``spec_compat.extract``'s
BackgroundWriter, fsync on, once through the page cache and once staged in /dev/shm and written with
O_DIRECT (``direct_io_staging``), and prints GB/s per mode with where the writer threads' time went
(``spec_compat.timings()``'s ``extract:`` labels, summed over threads). Needs torch and spec_compat.
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def run_mode(folder: Path, payloads: list[dict[str, Any]], threads: int, direct: bool) -> dict[str, Any]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    staging = extract.direct_io_staging(folder) if direct else None
    if direct and staging is None:
        return {"status": "unsupported", "why": "no O_DIRECT on this file system or no /dev/shm"}
    manifest = extract.Manifest(folder, {"model": "m", "layer_ids": [0], "format": extract.FORMAT, "run": {}})
    writer = extract.BackgroundWriter(folder, manifest, threads, pending=2, sync=True, staging=staging)
    spec_compat.reset_timings()
    batch = max(1, threads)
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
    args = parser.parse_args()
    extract.disable_zip_crc32()
    sample_bytes = args.tokens * args.hidden * args.layers * 2
    count = max(1, int(args.gib * 2**30 // sample_bytes))
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
