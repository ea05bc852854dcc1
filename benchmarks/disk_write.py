"""How fast the disk under a directory takes writes, the ways extract could write (issue 27).

``python3 benchmarks/disk_write.py DIR [--gib 4] [--out FILE.json]``: in DIR (removed afterwards)

- ``direct_1``: one stream, O_DIRECT, 16 MiB writes (what ``dd oflag=direct`` measures);
- ``direct_4``: four such streams at once, one file each;
- ``buffered_fsync_8``: 8 threads, each writing 64 MiB files through the page cache and fsyncing
  each (what extract's writer threads do with torch.save, without the hashing);
- ``buffered_nofsync_8``: the same without fsync (the page cache's speed).

Prints and writes GB/s (10^9 bytes per second) per way. Standard library only, so it runs on any
machine the benchmark runs on.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import threading
import time
from pathlib import Path

CHUNK = 16 << 20
FILE_BYTES = 64 << 20


def _direct_stream(path: Path, total: int, buffer: mmap.mmap) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        view = memoryview(buffer)
        written = 0
        while written < total:
            written += os.write(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)


def _buffered_files(folder: Path, files: int, payload: bytes, sync: bool) -> None:
    for index in range(files):
        with (folder / f"f{index}").open("wb", buffering=0) as handle:
            handle.write(payload)
            if sync:
                os.fsync(handle.fileno())


def _timed_threads(targets: list[threading.Thread]) -> float:
    started = time.perf_counter()
    for thread in targets:
        thread.start()
    for thread in targets:
        thread.join()
    return time.perf_counter() - started


def measure(folder: Path, total: int) -> dict[str, float]:
    results: dict[str, float] = {}
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(CHUNK))
    for streams in (1, 4):
        work = folder / f"direct_{streams}"
        work.mkdir()
        threads = [
            threading.Thread(target=_direct_stream, args=(work / f"s{i}", total // streams, buffer))
            for i in range(streams)
        ]
        try:
            results[f"direct_{streams}"] = total / _timed_threads(threads) / 1e9
        except OSError as exc:  # a file system without O_DIRECT (tmpfs)
            results[f"direct_{streams}_error"] = float("nan")
            print(f"direct_{streams}: {exc}")
        shutil.rmtree(work)
    payload = os.urandom(FILE_BYTES)
    per_thread = max(1, total // FILE_BYTES // 8)
    for sync in (True, False):
        name = "buffered_fsync_8" if sync else "buffered_nofsync_8"
        work = folder / name
        work.mkdir()
        folders = [work / str(i) for i in range(8)]
        for sub in folders:
            sub.mkdir()
        threads = [threading.Thread(target=_buffered_files, args=(sub, per_thread, payload, sync)) for sub in folders]
        seconds = _timed_threads(threads)
        results[name] = 8 * per_thread * FILE_BYTES / seconds / 1e9
        shutil.rmtree(work)
        os.sync()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--gib", type=float, default=4.0, help="bytes per way")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    folder = args.dir / "sc_disk_write"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        results = measure(folder, int(args.gib * 2**30) // CHUNK * CHUNK)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record = {"dir": str(args.dir), "gib_per_way": args.gib, "gb_per_s": results, "cpus": os.cpu_count()}
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
