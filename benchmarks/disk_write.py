"""How fast the disk under a directory takes writes, the ways extract could write (issue 27).

``python3 benchmarks/disk_write.py DIR [--gib 4] [--out FILE.json]``: in DIR (removed afterwards)

- ``direct_1``: one stream, O_DIRECT, 16 MiB writes (what ``dd oflag=direct`` measures);
- ``direct_4``: four such streams at once, one file each;
- ``buffered_fsync_8``: 8 threads, each writing 64 MiB files through the page cache and fsyncing
  each (what extract's writer threads do with torch.save, without the hashing);
- ``buffered_nofsync_8``: the same without fsync (the page cache's speed).

``--files`` (issue 27: is a writer of many small files held by the disk or by its fsyncs?) adds, per
way, GB/s of files of extract's sizes (``MB``: 4, 12, 48; a chat sample of 730 tokens is 12 MB):

- ``fsync_{T}t_{MB}mb``: T threads (8, 16), each file written and fsync'd (extract's durability);
- ``extract_8t_{MB}mb``: extract's writer exactly: written under a temporary name, writeback started,
  read back for its sha256, fsync'd, renamed; the folder fsync'd once per batch of 64 files;
- ``syncfs_8t_{MB}mb``: 8 threads write a batch of 64 files unsynced, then one syncfs(2) for the
  batch (one journal commit per batch instead of one per file; Linux only);
- ``direct_8t_{MB}mb``: 8 threads, each file's whole 4 KiB blocks written with O_DIRECT from a
  page-aligned buffer (no page cache), its last partial block through the page cache, fsync'd (could
  a writer that skips the page cache beat the buffered one on this disk?).

Prints and writes GB/s (10^9 bytes per second) per way. Standard library only, so it runs on any
machine the benchmark runs on.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import hashlib
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


FILE_SIZES_MB = (4, 12, 48)
BATCH_FILES = 64
DIRECT_BLOCK = 4096


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _syncfs(fd: int) -> None:
    if _libc().syncfs(fd) != 0:
        raise OSError(ctypes.get_errno(), "syncfs")


def _extract_like(folder: Path, names: list[str], payload: bytes) -> None:
    buffer = bytearray(8 << 20)
    for name in names:
        tmp = folder / (name + ".tmp")
        with tmp.open("wb", buffering=0) as handle:
            handle.write(payload)
        digest = hashlib.sha256()
        with tmp.open("rb", buffering=0) as handle:
            _start_writeback(handle.fileno())
            while count := handle.readinto(buffer):
                digest.update(memoryview(buffer)[:count])
            os.fsync(handle.fileno())
        os.replace(tmp, folder / name)


def _start_writeback(fd: int) -> None:
    """extract's ``files.start_writeback`` (sync_file_range, SYNC_FILE_RANGE_WRITE), standard library only."""
    _libc().sync_file_range(ctypes.c_int(fd), ctypes.c_longlong(0), ctypes.c_longlong(0), ctypes.c_uint(2))


def _batches(folder: Path, total: int, size: int, threads: int, way: str, payload: bytes) -> float:
    """Seconds to write ``total`` bytes as files of ``size`` in batches of BATCH_FILES, ``threads`` at once."""
    files = max(threads, total // size)
    started = time.perf_counter()
    for first in range(0, files, BATCH_FILES):
        names = [f"f{i}" for i in range(first, min(files, first + BATCH_FILES))]
        shares = [names[i::threads] for i in range(threads)]
        if way == "extract":
            targets = [threading.Thread(target=_extract_like, args=(folder, share, payload)) for share in shares]
        elif way == "direct":
            targets = [threading.Thread(target=_direct_files, args=(folder, share, payload)) for share in shares]
        else:
            targets = [
                threading.Thread(target=_named_files, args=(folder, share, payload, way == "fsync")) for share in shares
            ]
        _timed_threads(targets)
        fd = os.open(folder, os.O_RDONLY)
        try:
            if way == "syncfs":
                _syncfs(fd)
            else:
                os.fsync(fd)  # the renames' (extract) or creations' directory entries, once per batch
        finally:
            os.close(fd)
    return files * size / (time.perf_counter() - started) / 1e9


def _direct_files(folder: Path, names: list[str], payload: bytes) -> None:
    aligned = len(payload) // DIRECT_BLOCK * DIRECT_BLOCK
    buffer = mmap.mmap(-1, max(aligned, DIRECT_BLOCK))  # page-aligned, as O_DIRECT needs
    buffer.write(payload[:aligned])
    view = memoryview(buffer)[:aligned]
    for name in names:
        path = folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            written = 0
            while written < aligned:
                written += os.write(fd, view[written:])
        finally:
            os.close(fd)
        with path.open("ab", buffering=0) as handle:
            handle.write(payload[aligned:])
            os.fsync(handle.fileno())


def _named_files(folder: Path, names: list[str], payload: bytes, sync: bool) -> None:
    for name in names:
        with (folder / name).open("wb", buffering=0) as handle:
            handle.write(payload)
            if sync:
                os.fsync(handle.fileno())


def measure_files(folder: Path, total: int) -> dict[str, float]:
    results: dict[str, float] = {}
    for size_mb in FILE_SIZES_MB:
        payload = os.urandom(size_mb * 10**6)
        for way, threads in (("fsync", 8), ("fsync", 16), ("extract", 8), ("syncfs", 8), ("direct", 8)):
            name = f"{way}_{threads}t_{size_mb}mb"
            work = folder / name
            work.mkdir()
            try:
                results[name] = _batches(work, total, len(payload), threads, way, payload)
            except (OSError, AttributeError) as exc:  # no syncfs / sync_file_range here
                print(f"{name}: {exc}")
            shutil.rmtree(work)
            os.sync()
            print(f"{name}: {results.get(name, float('nan')):.2f} GB/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--gib", type=float, default=4.0, help="bytes per way")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--files", action="store_true", help="also files of extract's sizes (module docstring)")
    args = parser.parse_args()
    folder = args.dir / "sc_disk_write"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        results = measure(folder, int(args.gib * 2**30) // CHUNK * CHUNK)
        if args.files:
            results.update(measure_files(folder, int(args.gib * 2**30)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record = {"dir": str(args.dir), "gib_per_way": args.gib, "gb_per_s": results, "cpus": os.cpu_count()}
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
