"""Writing samples: one file (``write_sample``) and batches in the background (``BackgroundWriter``)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..timing import timed
from .config import ExtractError, WriteFailed
from .files import Saved, _write_then_rename, fsync_directory
from .formats import Format
from .formats.v1 import SpeculatorsV1
from .manifest import Manifest
from .writer_process import WriterProcess, describe, lower_this_threads_priority, write_in_format

WRITER_NICE_ENV = "SPEC_COMPAT_WRITER_NICE"  # niceness the writer threads add to their own (0-19)
# 0 until measured on the GPU: run R's A/B of it got no figure (that machine's vLLM-native path alone
# ran past its timeout), and nothing on the data path changes default without one
DEFAULT_WRITER_NICE = 0


# "1": room for the next batch by bytes not yet written (``BackgroundWriter``); else by whole batches recorded.
# Off until measured on the GPU: on the 2-core development machine the writer is held by its CPUs (sha256 on
# 2 cores), where neither way can show its threads' idle time (benchmarks/extract_writer.py --room-ab)
BYTE_WINDOW_ENV = "SPEC_COMPAT_WRITER_BYTE_WINDOW"
DEFAULT_BYTE_WINDOW = "0"


def byte_window() -> bool:
    return os.environ.get(BYTE_WINDOW_ENV, DEFAULT_BYTE_WINDOW) == "1"


def payload_bytes(payload: dict[str, Any]) -> int:
    """The bytes of a sample's tensors (what its payload holds in memory until its file is written)."""
    tensors = [*payload["hidden_states"], *(v for k, v in payload.items() if k != "hidden_states")]
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))


def writer_nice() -> int:
    """How much lower the writer threads' CPU priority is than the engine loop's (0-19)."""
    try:
        return max(0, min(19, int(os.environ.get(WRITER_NICE_ENV, DEFAULT_WRITER_NICE))))
    except ValueError:
        return DEFAULT_WRITER_NICE


def write_sample(
    output: Path, idx: int, payload: dict[str, Any], sync: bool = True, staging: Path | None = None
) -> tuple[str, int, str]:
    """speculators-v1's data_{idx}.pt: written to a temporary name, hashed, fsync'd (``sync``),
    renamed; returns (file name, tokens, sha256) (``write_file``).

    torch.save to a path, not through a Python file object (which copied every tensor into a bytes
    object under the GIL: extract ran at 0.79x the generator's own speed on an H200). The threads
    still share the GIL with the engine loop: on 2 CPU cores a Python loop ran at 0.37 of its speed
    beside 8 writer threads and 0.91 beside the same writer in another process
    (benchmarks/writer_interference.py; torch.save is most of it)."""
    name = sample_file_name(idx)
    return name, *_write_then_rename(output, name, name + ".tmp", payload, sync, rename=True, staging=staging)


def sample_file_name(idx: int) -> str:
    return SpeculatorsV1().file_name(idx, None)


def record_written(manifest: Manifest, output: Path, written: list[tuple[int, str, Saved]], sync: bool) -> None:
    """List complete files in the manifest (not saved yet): with ``sync`` their folders are fsync'd
    first, so the renames are on the disk before the manifest names the files."""
    if sync:
        for folder in sorted({(output / name).parent for _, name, _ in written}):
            fsync_directory(folder)
    for idx, name, saved in written:
        manifest.record(idx, name, saved.tokens, saved.sha256, saved.extra)


def adopt_files(
    output: Path,
    written: list[tuple[Any, ...]],
    listed: dict[str, Any],
    name_of: Callable[[int], str],
    who: str,
    host: str,
) -> list[tuple[int, str, Saved]]:
    """Give the files another process wrote under temporary names (``written``: (idx, temporary
    name, tokens, sha256, size[, extra])) their final names, each after checking that the file seen
    here has the size written there; a sample already ``listed`` keeps its file (exactly once). The
    temporary files' folder is removed."""
    adopted: list[tuple[int, str, Saved]] = []
    for idx, tmp, tokens, digest, size, *extra in written:
        path = output / tmp
        if str(idx) in listed:  # a duplicate (cannot happen with one queue; kept exactly once regardless)
            path.unlink(missing_ok=True)
            continue
        try:
            seen = path.stat().st_size
        except FileNotFoundError:
            raise ExtractError(
                f"{who} on {host} wrote {path}, which this machine cannot see: "
                "--output must be a directory every node shares"
            ) from None
        if seen != size:
            raise WriteFailed(f"{path}: {who} wrote {size} bytes, {seen} are on the disk")
        name = name_of(idx)
        os.replace(path, output / name)
        adopted.append((idx, name, Saved(tokens, digest, size, extra[0] if extra else None)))
    if written:
        shutil.rmtree(output / Path(written[0][1]).parent, ignore_errors=True)
    return adopted


class BackgroundWriter:
    """Writes finished batches on a few threads while the engine runs the next batch.

    At most ``pending`` batches are in flight (each holds its hidden states in memory). A batch is
    recorded by one recorder thread, in batch order, once all its files are on disk: the
    directory fsync'd (the renames), then the manifest saved; only that thread touches the
    manifest while batches are in flight, so an interrupted run never records a sample whose file
    is not complete. The engine loop waits only when ``pending`` batches are still unrecorded (on
    an H200 the recording in the loop, a directory fsync and a manifest fsync per batch behind 8
    writers' dirty pages, cost up to 1.4 s of a 6.4 s extract).

    Room by bytes (``byte_window``, SPEC_COMPAT_WRITER_BYTE_WINDOW=1): the loop hands a batch over as soon as the files
    not yet written, with it, hold at most ``pending`` times the largest batch's bytes, and at most
    ``pending`` + 1 batches are unrecorded. The memory held is the same as with whole batches; what
    changes is that the next batch no longer waits for the last, slowest file of the oldest one.
    Why: waiting for whole batches left the writer's threads idle while a batch's last files were
    written (H100, run X: on average 3.6 of 8 threads busy on 4-8k-token samples, 4-5 files a batch,
    5.6-6.2 on the other sets), and the engine loop waited 0.8-1.6 s of each 9 s run for room."""

    def __init__(
        self,
        output: Path,
        manifest: Manifest,
        threads: int,
        pending: int,
        sync: bool = True,
        staging: Path | None = None,
        fmt: Format | None = None,
        process: WriterProcess | None = None,
    ) -> None:
        self.output = output
        self.fmt: Format = fmt or SpeculatorsV1()
        self.sync = sync  # fsync every file (in its writer thread) and the directory before the manifest
        self.staging = staging  # where files are staged for O_DIRECT writes (direct_io_staging); None: buffered
        self.manifest = manifest
        self.nice = writer_nice()
        self.pool = ThreadPoolExecutor(
            max_workers=max(1, threads),
            thread_name_prefix="spec-compat-writer",
            initializer=lower_this_threads_priority,
            initargs=(self.nice,),
        )
        self.recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spec-compat-recorder")
        self.pending = max(1, pending)
        self.in_flight: deque[Future[None]] = deque()  # one per batch: done once it is recorded
        self.by_bytes = byte_window()  # room by bytes not yet written (else by whole batches recorded)
        self.unwritten = 0  # bytes of the files handed over and not yet written (or failed)
        self.largest_batch = 0  # bytes of the largest batch handed over so far
        self.room = threading.Condition()  # notified as files are written and batches recorded
        self.written_samples = 0
        self.written_bytes = 0
        self.wait_s = 0.0  # time the engine loop waited for the writer (the writer is the bottleneck)
        self.handoff_s = 0.0  # time the engine loop spent handing files over once there was room
        # --writer process: samples whose states lie in shared-memory segments are written there
        # (writer_process.py); ``locate`` (the engine's DriverMappings.locate) finds them, once it runs
        self.process = process
        self.locate: Callable[[Any], Any] | None = None

    def submit(self, samples: list[tuple[int, dict[str, Any]]], names: list[str] | None = None) -> None:
        """Write ``samples`` ((idx, payload) each) to ``names`` (default: the format's name of each idx)."""
        sizes = [payload_bytes(payload) for _, payload in samples]
        self.largest_batch = max(self.largest_batch, sum(sizes))
        if self.by_bytes:
            self._wait_for_bytes(sum(sizes))
        else:
            while len(self.in_flight) >= self.pending:
                self._finish_oldest()
        started = time.perf_counter()
        if names is None:
            names = [self.fmt.file_name(idx, idx) for idx, _ in samples]
        files = []
        for (idx, payload), name, size in zip(samples, names, sizes, strict=True):
            with self.room:
                self.unwritten += size
            future = self._submit_file(name, payload)
            future.add_done_callback(functools.partial(self._room_freed, size))
            files.append((idx, name, future))
        batch = self.recorder.submit(self._record, files)
        batch.add_done_callback(functools.partial(self._room_freed, 0))
        self.in_flight.append(batch)
        self.handoff_s += time.perf_counter() - started

    def _room_freed(self, size: int, _: Future[Any]) -> None:
        """A file done (``size`` of its bytes) or a batch recorded (0): wake a loop waiting for room."""
        with self.room:
            self.unwritten -= size
            self.room.notify_all()

    def _wait_for_bytes(self, incoming: int) -> None:
        """Until the files not yet written, with ``incoming`` more, hold at most ``pending`` times the
        largest batch's bytes and fewer than ``pending`` + 1 batches are unrecorded; a recorded batch's
        failure is raised here, as ``_finish_oldest`` raises it."""
        started = time.perf_counter()
        waited = False
        try:
            while self.in_flight:
                if self.in_flight[0].done():
                    self.in_flight.popleft().result()
                    continue
                with self.room:
                    fits = self.unwritten + incoming <= self.pending * self.largest_batch or self.unwritten == 0
                    if fits and len(self.in_flight) <= self.pending:
                        return
                    waited = True
                    self.room.wait(0.1)  # woken by a written file or a recorded batch; a signal is seen within 0.1 s
        finally:
            if waited:
                self.wait_s += time.perf_counter() - started

    def _submit_file(self, name: str, payload: dict[str, Any]) -> Future[Saved]:
        if self.process is not None and self.locate is not None:
            described = describe(payload, self.locate, self.process.fast_handoff)
            if described is not None:
                return self.process.submit(name, payload, described)
        return self.pool.submit(self._write, name, payload)

    def _write(self, name: str, payload: dict[str, Any]) -> Saved:
        return write_in_format(self.fmt, self.output, name, name + ".tmp", payload, self.sync, True, self.staging)

    def _record(self, files: list[tuple[int, str, Future[Saved]]]) -> None:
        """On the recorder thread: wait for a batch's files, record the complete ones, then raise
        the first failure (the good files of a failed batch are kept)."""
        written: list[tuple[int, str, Saved]] = []
        failure: BaseException | None = None
        for idx, name, future in files:
            try:
                written.append((idx, name, future.result()))
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the good files are recorded
                failure = failure or exc
        if written:
            with timed("extract:record"):
                record_written(self.manifest, self.output, written, self.sync)
                self.manifest.save(self.sync)
            self.written_samples += len(written)
            self.written_bytes += sum(saved.size for _, _, saved in written)
        if failure is not None:
            raise failure

    def _finish_oldest(self) -> None:
        started = time.perf_counter()
        try:
            self.in_flight.popleft().result()
        finally:
            self.wait_s += time.perf_counter() - started

    def drain(self) -> None:
        """Wait until every submitted batch is recorded; then raise the first failure, if any."""
        failure: BaseException | None = None
        while self.in_flight:
            try:
                self._finish_oldest()
            except Exception as exc:  # noqa: BLE001 - re-raised after the later batches are recorded (not a signal)
                failure = failure or exc
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Finish what can be finished (the files of batches already submitted), then stop, with
        manifest.json complete (``Manifest.close``; if a full disk refuses even that, its journal
        keeps what is done and the error raised is the write's that failed first)."""
        try:
            self.drain()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            if self.process is not None:
                self.process.close()
            self.recorder.shutdown(wait=True)
            with contextlib.suppress(OSError, WriteFailed):
                self.manifest.close(self.sync)
