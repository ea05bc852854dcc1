"""Durable file writing: temporary name, sha256, fsync, rename; O_DIRECT from /dev/shm; JSON."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import mmap
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..timing import timed
from .config import WriteFailed

EARLY_WRITEBACK_ENV = "SPEC_COMPAT_EARLY_WRITEBACK"  # "0": the disk gets a file's bytes only at its fsync
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writing the dirty pages of the range, do not wait
_sync_file_range: Any = None  # libc's, looked up once (False: this platform has none)


def start_writeback(fd: int) -> bool:
    """Ask the kernel to start writing ``fd``'s dirty pages to the disk now, without waiting
    (Linux's sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE); nothing elsewhere or with
    SPEC_COMPAT_EARLY_WRITEBACK=0). Whether it was asked.

    Why: a written file is read back for its sha256 before its fsync; started here, the disk writes
    the file while the thread hashes it, and the fsync waits only for what is left. 8 threads writing,
    hashing and fsyncing 150 files of 33 MB on the 2-core development machine: 1.16-1.22 GB/s without,
    1.31-1.41 GB/s with (three runs each, alternated). It changes no byte and no durability: the
    fsync after it is what makes the file durable, as before."""
    global _sync_file_range
    if os.environ.get(EARLY_WRITEBACK_ENV, "1") == "0":
        return False
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform == "linux":
            with contextlib.suppress(OSError, AttributeError):
                function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
                function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
                function.restype = ctypes.c_int
                _sync_file_range = function
    if _sync_file_range is False:
        return False
    # a file system without it (EINVAL, ESPIPE) leaves the whole write to the fsync, as without this
    return bool(_sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0)


def _sha256_and_sync(path: Path, sync: bool) -> str:
    """sha256 of the file read back into one reused buffer (hashlib hashes it without the GIL);
    with ``sync``, fsync through the same handle so the bytes are on the disk, not in the cache
    (the disk starts on them before the read-back: ``start_writeback``)."""
    digest = hashlib.sha256()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        if sync:
            start_writeback(handle.fileno())
        with timed("extract:sha256"):
            while count := handle.readinto(buffer):
                digest.update(view[:count])
        if sync:
            with timed("extract:fsync"):
                os.fsync(handle.fileno())
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    return _sha256_and_sync(path, sync=False)


def disable_zip_crc32() -> bool:
    """Stop torch.save computing the zip CRC32 of every record, in this process; True if it could.

    The CRC is a second full pass over every byte written (a quarter of a writer thread's time);
    torch.load does not check it (PyTorch builds miniz with its reader CRC check off), and the
    manifest's sha256 of each file is what a rerun verifies. Feature-probed: torch < 2.6 has no
    switch and keeps computing it."""
    import torch

    set_crc32 = getattr(torch.serialization, "set_crc32_options", None)
    if set_crc32 is None:
        return False
    set_crc32(False)
    return True


def fsync_directory(path: Path) -> None:
    """Make renames into ``path`` durable (a file's own fsync does not cover its directory entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, value: Any, sync: bool = False) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with tmp.open("w") as handle:
            handle.write(json.dumps(value, indent=1, sort_keys=True))
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteFailed(f"cannot write {path}: {exc.strerror or exc}") from None
    if sync:
        fsync_directory(path.parent)


DIRECT_ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses in multiples of the block size
DIRECT_CHUNK = 64 << 20  # bytes per write() call


def direct_io_staging(output: Path) -> Path | None:
    """/dev/shm, where files written into ``output`` can go through O_DIRECT; else None (buffered).

    Why (``--direct-io``, off by default): through the page cache every byte is copied into it and
    written back by the kernel before fsync returns. Which is faster depends on the disk: on the
    2-core development machine 8 threads wrote 0.6 GB/s that way against 2.4 GB/s with O_DIRECT
    (benchmarks/disk_write.py) and extract's writer 0.46-0.55 against 0.75 GB/s
    (benchmarks/extract_writer.py); on the H200 machine's virtual disk the writer did 1.56-1.60
    through the page cache against 1.28-1.35 GB/s with O_DIRECT. O_DIRECT needs block-aligned
    buffers and lengths, which torch.save's file does not have, so each file is saved into memory
    (/dev/shm, page-aligned when mapped), hashed there and written from there, padded to a block,
    then truncated to its size. Probed here: a block written with O_DIRECT into ``output`` (tmpfs
    and some network file systems refuse it)."""
    staging = Path("/dev/shm")
    if not hasattr(os, "O_DIRECT") or not staging.is_dir() or not os.access(staging, os.W_OK):
        return None
    probe = output / f".spec-compat-direct-probe-{os.getpid()}"
    block = mmap.mmap(-1, DIRECT_ALIGN)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.write(fd, block)
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        block.close()
        probe.unlink(missing_ok=True)
    return staging


def _write_direct(staged: Path, target: Path, sync: bool) -> str:
    """Write the file at ``staged`` (in memory) to ``target`` with O_DIRECT; its sha256.

    The staged file is extended with zeros to a whole block so that one page-aligned mapping holds
    every byte the writes need; ``target`` is then truncated to the real size. A file system that
    refuses a write as unaligned (EINVAL) gets the same bytes through the page cache instead."""
    size = staged.stat().st_size
    padded = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
    os.truncate(staged, padded)
    with staged.open("rb") as handle, mmap.mmap(handle.fileno(), padded, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            with timed("extract:sha256"):
                digest = hashlib.sha256(view[:size]).hexdigest()
            with timed("extract:write"):
                # direct_io_staging opened and wrote a file of this folder with O_DIRECT already
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
                try:
                    _write_all(fd, view, padded)
                    os.ftruncate(fd, size)
                    if sync:
                        with timed("extract:fsync"):
                            os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            view.release()
    return digest


def _write_all(fd: int, view: memoryview, length: int) -> None:
    offset = 0
    while offset < length:
        try:
            offset += os.write(fd, view[offset : min(offset + DIRECT_CHUNK, length)])
        except OSError as exc:
            if exc.errno != errno.EINVAL or not _drop_o_direct(fd):
                raise
            # a file system that takes O_DIRECT opens but refuses these writes: the page cache


def _drop_o_direct(fd: int) -> bool:
    """Clear O_DIRECT on ``fd``; False if it was not set (the EINVAL was not about alignment)."""
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & os.O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
    return True


@dataclass(frozen=True)
class Saved:
    """One sample's file as written: its tokens, sha256 and size, and what its format adds to the manifest."""

    tokens: int
    sha256: str
    size: int
    extra: dict[str, Any] | None = None


def torch_save(payload: dict[str, Any], path: Path) -> None:
    """speculators-v1's serializer (looked up at call time: the tests replace torch.save)."""
    import torch

    torch.save(payload, path)


def write_file(
    output: Path,
    name: str,
    tmp_name: str,
    payload: dict[str, Any],
    save: Callable[[dict[str, Any], Path], dict[str, Any] | None],
    label: str,
    sync: bool,
    rename: bool,
    staging: Path | None,
) -> Saved:
    """``save`` the payload to ``tmp_name`` (directly, or into ``staging`` and from there with
    O_DIRECT), hashed, fsync'd with ``sync``, renamed to ``name`` with ``rename``. A failed write
    removes the temporary file and raises WriteFailed naming the file, so no partial file ever
    carries the final name."""
    tmp = output / tmp_name
    # the staged file has the temporary file's own name (torch.save names the archive's records
    # after the file: the same bytes either way), in a folder of this thread's own
    staged = staging / f"spec-compat-{os.getpid()}-{threading.get_ident()}" / tmp.name if staging else None
    extra: dict[str, Any] | None = None
    try:
        if staged is not None:
            try:
                staged.parent.mkdir(exist_ok=True)
                with timed(label):
                    extra = save(payload, staged)
            except Exception:  # noqa: BLE001 - /dev/shm full (or gone): this file through the page cache
                _remove_staged(staged)
                staged = None
        if staged is None:
            with timed(label):
                extra = save(payload, tmp)
        digest = _sha256_and_sync(tmp, sync) if staged is None else _write_direct(staged, tmp, sync)
        size = tmp.stat().st_size
        if rename:
            os.replace(tmp, output / name)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WriteFailed(f"cannot write {output / name}: {exc.strerror or exc}") from None
        # torch's C++ writer: "unexpected pos 576 vs 534", no errno; safetensors' Rust one: its SafetensorError
        if isinstance(exc, RuntimeError) or type(exc).__name__ == "SafetensorError":
            raise WriteFailed(f"cannot write {output / name}: {_why_write_failed(output, payload, exc)}") from None
        raise
    finally:
        if staged is not None:
            _remove_staged(staged)
    return Saved(len(payload["input_ids"]), digest, size, extra)


def _write_then_rename(
    output: Path, name: str, tmp_name: str, payload: dict[str, Any], sync: bool, rename: bool, staging: Path | None
) -> tuple[int, str]:
    """speculators-v1's torch.save through ``write_file``; (tokens, sha256)."""
    saved = write_file(output, name, tmp_name, payload, torch_save, "extract:torch-save", sync, rename, staging)
    return saved.tokens, saved.sha256


def _remove_staged(staged: Path) -> None:
    staged.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty (a file left by a killed run): left as it is
        staged.parent.rmdir()


def _why_write_failed(output: Path, payload: dict[str, Any], exc: BaseException) -> str:
    """What the serializer's error does not say: full disk, read-only, or no permission."""
    needed = sum(t.numel() * t.element_size() for t in [payload["input_ids"], *payload["hidden_states"]])
    try:
        stat = os.statvfs(output)
    except OSError:
        return str(exc).splitlines()[0]
    free = stat.f_bavail * stat.f_frsize
    if stat.f_flag & os.ST_RDONLY:
        return "Read-only file system"
    if free < needed + (1 << 20):
        return f"No space left on device ({free:,} bytes free, this file needs about {needed:,})"
    if not os.access(output, os.W_OK):
        return "Permission denied"
    return str(exc).splitlines()[0]
