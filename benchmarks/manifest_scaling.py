"""What recording a long extract run costs: manifest.json rewritten per batch, or its journal.

``spec-compat extract`` records every batch (its samples' files, sha256 and lengths) before the next
may go on. This replays that recording for runs of N samples in batches of B on one folder, without
an engine: the same ``Manifest`` calls the recorder thread makes, with fsync (``--no-fsync`` to
leave it out), once with the journal (the default) and once as before (``SPEC_COMPAT_MANIFEST_JOURNAL=0``:
every save rewrites manifest.json and sample_lengths.json), and prints per run the seconds spent
recording, the seconds of the last batch, the bytes written and the ratio of the two ways (one run,
alternated per size).

    source ~/.cache/spec_compat/env.sh
    $SPEC_COMPAT_VENV/bin/python benchmarks/manifest_scaling.py --samples 1000,10000,50000 --batch 48

Writes ``--out`` (default ``benchmarks/results/manifest_scaling.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from spec_compat.extract import manifest as manifest_module
from spec_compat.extract.manifest import Manifest

PROVENANCE = {"model": "m", "layer_ids": [2, 10, 18, 26], "format": "speculators-eagle3-v1", "run": {}}


def io_counters() -> dict[str, int]:
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


def one_run(folder: Path, samples: int, batch: int, sync: bool, journal: bool) -> dict[str, Any]:
    os.environ[manifest_module.JOURNAL_ENV] = "1" if journal else "0"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    manifest = Manifest(folder, PROVENANCE)
    manifest.save(sync)
    before = io_counters()
    total = last = 0.0
    for start in range(0, samples, batch):
        for idx in range(start, min(start + batch, samples)):
            manifest.record(idx, f"data_{idx}.pt", 1024 + idx % 3000, f"{idx:064x}")
        began = time.perf_counter()
        manifest.save(sync)
        last = time.perf_counter() - began
        total += last
    began = time.perf_counter()
    manifest.close(sync)
    close_s = time.perf_counter() - began
    wrote = io_counters()["wchar"] - before["wchar"]
    listed = len(json.loads((folder / "manifest.json").read_text())["samples"])
    assert listed == samples, (listed, samples)
    return {
        "journal": journal,
        "recording_s": total,
        "last_batch_s": last,
        "close_s": close_s,
        "bytes_written": wrote,
        "rewrites": manifest.rewrites,
        "batches": -(-samples // batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="1000,10000,50000", help="comma-separated run sizes")
    parser.add_argument("--batch", type=int, default=48, help="samples per batch (extract's default for 48 prompts)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder in /tmp)")
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "manifest_scaling.json")
    args = parser.parse_args()
    sizes = [int(s) for s in args.samples.split(",") if s.strip()]
    base = args.dir or Path(tempfile.mkdtemp(prefix="manifest-scaling-", dir="/tmp"))
    rows = []
    try:
        for samples in sizes:
            runs = {}
            for journal in (False, True):
                runs["journal" if journal else "rewrite_every_batch"] = one_run(
                    base / f"n{samples}", samples, args.batch, not args.no_fsync, journal
                )
            old, new = runs["rewrite_every_batch"], runs["journal"]
            row = {
                "samples": samples,
                **runs,
                "recording_ratio": old["recording_s"] / new["recording_s"] if new["recording_s"] else None,
            }
            rows.append(row)
            print(
                f"{samples:>7} samples, {old['batches']} batches of {args.batch}: recording "
                f"{old['recording_s']:8.2f} s -> {new['recording_s'] + new['close_s']:6.2f} s (close included; "
                f"last batch {old['last_batch_s'] * 1e3:7.1f} -> {new['last_batch_s'] * 1e3:5.1f} ms), written "
                f"{old['bytes_written'] / 1e6:9.1f} -> {new['bytes_written'] / 1e6:6.1f} MB, rewrites "
                f"{old['rewrites']} -> {new['rewrites']}",
                flush=True,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    result = {
        "rows": rows,
        "batch": args.batch,
        "fsync": not args.no_fsync,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
