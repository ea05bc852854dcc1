"""extract's sample files written by a process of its own (``--writer process``).

Why: the writer threads share the engine loop's interpreter. torch.save's pickling and each file's
bookkeeping take the GIL, so beside 8 writer threads speculators' driver loop, vLLM's RPC handling
and spec_compat's own work between the forwards all slow down: on an H100 extract's ``generate()``
calls took 12-25 % longer than the same calls without a writer (run T, docs/benchmarks.md), and on
the 2-core development machine a Python loop ran at 0.37 of its speed beside the threads against
0.91 beside the same writer in another process (benchmarks/writer_interference.py).

How: the captured states are already in shared memory. With the handover (adapter
driver-states-handover) each state tensor of a sample is a storage of exactly its own bytes in a
segment file the driver has mapped (``DriverMappings.locate``). The driver sends only where those
bytes lie; this process maps the same file, rebuilds the payload over it and runs the format's
``save`` through ``write_file``, exactly as a writer thread would: the same serializer on a tensor
of the same bytes and storage, so the same file, byte for byte. The driver keeps the payload (and
with it the segment's lease, so the worker leaves those bytes alone) until the file is reported
written. A sample whose states are not in a segment (handover off or refused, a cast to another
dtype) is written on a driver thread as before (``BackgroundWriter``).

The process: ``python -c "...writer_process.main..." JOBS_FD REPLIES_FD`` (``PROCESS_CODE``), two pipes,
length-prefixed pickles. It runs in a session of its own and ignores SIGINT and SIGTERM (a Ctrl-C
or a stop is the driver's: it finishes the batches in flight, then says "end"), and it stops when
its job pipe closes (a driver killed outright), at once, leaving at most temporary files, like a
killed run's threads. Its ``spec_compat.timings()`` are added to
the driver's when it ends.

No vLLM import here.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ..timing import add_all, timings
from .config import WriteFailed
from .files import Saved, disable_zip_crc32, write_file
from .formats import Format


def lower_this_threads_priority(increment: int) -> None:
    """Make the calling thread ``increment`` nicer (Linux only: there a thread id names one thread,
    elsewhere the call would renice the whole process).

    Why: sha256 and the copies into the page cache keep the writer threads busy for 3-4 cores per
    second of extract on an H200 (12-22 CPU-s for an 11 GB run of 5 s); beside them the engine's
    own threads (this loop, vLLM's engine core and worker) lose their cores, and the forward RPCs
    took 1.9-4.0 s where the generator alone takes 2.0 (run R, docs/benchmarks.md). Nicer writers
    would still get every core the engine leaves idle."""
    if increment <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))


def write_in_format(
    fmt: Format, output: Path, name: str, tmp_name: str, payload: dict[str, Any], sync: bool, rename: bool,
    staging: Path | None,
) -> Saved:  # fmt: skip
    """One sample's file in ``fmt`` (its ``save`` on this thread), through ``write_file``."""
    return write_file(output, name, tmp_name, payload, fmt.save, fmt.save_label, sync, rename, staging)


_HEADER = struct.Struct("<Q")
# bytes of tensors outside segments a sample may send through the pipe (ids and loss mask: 16 per
# token); a sample with more is written on a driver thread instead of being copied through the pipe
INLINE_LIMIT = 1 << 20
# the job pipe's buffer (Linux, F_SETPIPE_SZ; 1 MiB is the default most a process may ask for): a batch's
# jobs (~30 KB per 2k-token sample) fit without the engine loop blocking on the writer process, whose
# reading thread shares its interpreter with the writer threads (H200, run W: 0.2-1.0 s of a 7-9 s
# extract went to handing files over, 0.8 ms per sample)
JOB_PIPE_BYTES = 1 << 20
# "0": hand files over as before (tensors pickled, the pipe's default size), for an A/B of both on the GPU
FAST_HANDOFF_ENV = "SPEC_COMPAT_WRITER_FAST_HANDOFF"


def fast_handoff() -> bool:
    return os.environ.get(FAST_HANDOFF_ENV, "1") != "0"


class RawTensor(NamedTuple):
    """A small CPU tensor (ids, loss mask) sent as its storage's bytes and its view of them: pickling a
    torch tensor runs torch.save / torch.load on its storage (~0.1 ms each way for a 2k-token sample
    on a 2.8 GHz core, against ~0.01 ms for this), on the engine loop and on the process's one
    reading thread. Rebuilt over a storage of the same bytes, dtype, offset, shape and strides, so
    the format's ``save`` writes the same file."""

    dtype: str
    storage: bytes
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _storage_bytes(tensor: Any) -> int:
    return int(tensor.untyped_storage().nbytes()) if hasattr(tensor, "untyped_storage") else 0


def raw_tensors(values: dict[str, Any], states: list[Any]) -> dict[str, Any]:
    """``values`` with each plain CPU tensor as a ``RawTensor``; unchanged (pickled as before) when one
    is not plain (a subclass, a grad, Python attributes, not strided) or two share a storage (with
    each other or with ``states``: rebuilt apart, they would be saved as two storages)."""
    import torch

    tensors = {key: value for key, value in values.items() if isinstance(value, torch.Tensor)}
    plain = all(
        type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
        and not getattr(t, "__dict__", None) and not t.is_complex() and not t.is_quantized
        for t in tensors.values()
    )  # fmt: skip
    storages = [t.untyped_storage().data_ptr() for t in (*tensors.values(), *states) if t.untyped_storage().nbytes()]
    if not plain or len(set(storages)) != len(storages):
        return values
    out = dict(values)
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage()
        data = ctypes.string_at(storage.data_ptr(), storage.nbytes()) if storage.nbytes() else b""
        dtype = str(tensor.dtype).removeprefix("torch.")
        out[key] = RawTensor(dtype, data, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()))
    return out


def rebuilt(value: Any) -> Any:
    """A ``RawTensor`` as the tensor it was (anything else as it is)."""
    if not isinstance(value, RawTensor):
        return value
    import torch

    if value.storage:
        storage = torch.frombuffer(bytearray(value.storage), dtype=torch.uint8).untyped_storage()
    else:
        storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=getattr(torch, value.dtype)).set_(storage, value.offset, value.shape, value.stride)


EXIT_TIMEOUT_S = 120.0  # after "end", everything it was sent already written
# The process runs this module imported, not as ``-m``'s __main__: then the classes it unpickles (RawTensor)
# are this module's, and runpy does not warn that the package had already imported it (every run did)
PROCESS_CODE = f"import sys; from {__name__} import main; sys.exit(main(sys.argv[1:]))"


def _send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    """The next message; None once the other end has closed the pipe."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack(header)
    data = stream.read(length)
    if len(data) < length:
        return None
    return pickle.loads(data)


def describe(payload: dict[str, Any], locate: Callable[[Any], Any], raw: bool = True) -> dict[str, Any] | None:
    """``payload`` with each state tensor replaced by where it lies in a segment (``locate``: path,
    inode, offset, dtype name, shape) and, with ``raw``, its other tensors by ``raw_tensors``; None when
    a state does not lie in one, or when the rest would send more than ``INLINE_LIMIT`` bytes through
    the pipe."""
    states = []
    for tensor in payload["hidden_states"]:
        where = locate(tensor)
        if where is None:
            return None
        states.append((where.path, where.inode, where.offset, where.dtype, where.shape))
    rest = {key: value for key, value in payload.items() if key != "hidden_states"}
    if sum(_storage_bytes(value) for value in rest.values()) > INLINE_LIMIT:  # a tensor goes with its storage
        return None
    sent = raw_tensors(rest, payload["hidden_states"]) if raw else rest
    return {key: states if key == "hidden_states" else sent[key] for key in payload}  # the payload's key order


class WriterProcess:
    """The driver's end: ``submit`` a sample's file, get a Future of its ``Saved``; ``close`` ends it."""

    def __init__(
        self, output: Path, fmt: Any, threads: int, sync: bool, staging: Path | None, zip_crc32: bool, nice: int
    ) -> None:
        jobs_read, jobs_write = os.pipe()
        replies_read, replies_write = os.pipe()
        self.fast_handoff = fast_handoff()  # read once: the pipe's size and how jobs are described agree
        if self.fast_handoff:
            with contextlib.suppress(AttributeError, OSError):  # not Linux, or over the allowed size: the default
                fcntl.fcntl(jobs_write, fcntl.F_SETPIPE_SZ, JOB_PIPE_BYTES)  # type: ignore[attr-defined]
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", PROCESS_CODE, str(jobs_read), str(replies_write)],
                pass_fds=(jobs_read, replies_write),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno(),
                start_new_session=True,  # a Ctrl-C is the driver's: it finishes the batches in flight, then ends this
            )
        finally:
            os.close(jobs_read)
            os.close(replies_write)
        self.jobs = os.fdopen(jobs_write, "wb")
        self.replies = os.fdopen(replies_read, "rb")
        self.pending: dict[int, tuple[Future[Saved], dict[str, Any]]] = {}  # job -> (its Future, its payload)
        self.next_id = 0
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.failure: str | None = None  # why the process is gone, once it is
        self.samples = 0  # files this process wrote
        settings = {"output": str(output), "fmt": fmt, "threads": threads, "sync": sync, "nice": nice}
        _send(self.jobs, ("start", {**settings, "staging": str(staging) if staging else None, "crc32": zip_crc32}))
        self.reader = threading.Thread(target=self._read_replies, name="spec-compat-writer-replies", daemon=True)
        self.reader.start()

    def submit(self, name: str, payload: dict[str, Any], described: dict[str, Any]) -> Future[Saved]:
        """Write one sample to ``name``: ``described`` (``describe(payload)``) goes to the process,
        ``payload`` is kept here (and with it its segment's lease) until the file is written."""
        future: Future[Saved] = Future()
        with self.lock:
            if self.failure is not None:
                future.set_exception(WriteFailed(self.failure))
                return future
            job = self.next_id
            self.next_id += 1
            self.pending[job] = (future, payload)
            with contextlib.suppress(OSError, ValueError):  # the process is gone: its reader fails what is pending
                _send(self.jobs, ("write", job, name, described))
        return future

    def _read_replies(self) -> None:
        why = "ended"
        try:
            while (message := _receive(self.replies)) is not None:
                kind, *rest = message
                if kind == "timings":
                    add_all(rest[0])
                    continue
                job, outcome = rest
                with self.lock:
                    future, _ = self.pending.pop(job)  # the payload goes here: its lease with it
                if kind == "done":
                    self.samples += 1
                    future.set_result(outcome)
                else:
                    future.set_exception(outcome)
        except Exception as exc:  # noqa: BLE001 - a reply that cannot be read: every pending file fails with it
            why = f"sent a reply that could not be read ({type(exc).__name__}: {exc})"
            self.process.kill()
        code = self.process.wait()
        with self.lock:
            self.failure = f"extract's writer process {why} (exit code {code}) with files still to write"
            pending, self.pending = self.pending, {}
        for future, _ in pending.values():
            future.set_exception(WriteFailed(self.failure))
        self.ended.set()

    def close(self) -> None:
        """Say "end" (the process finishes what it was sent, reports its timings, exits) and wait; once
        (extract closes its writer again after an interruption)."""
        if self.jobs.closed:
            return
        with self.lock, contextlib.suppress(OSError):
            _send(self.jobs, ("end",))
        with contextlib.suppress(OSError):
            self.jobs.close()
        if not self.ended.wait(EXIT_TIMEOUT_S):
            self.process.kill()
            self.ended.wait()
        self.replies.close()


# ---- the process --------------------------------------------------------------------------------


class _Mappings:
    """Segment files mapped here, by path; one whose file is gone or replaced is dropped (its memory
    goes once no tensor of it is left), so this process never keeps a freed segment's pages."""

    def __init__(self) -> None:
        self.maps: dict[str, tuple[int, mmap.mmap]] = {}

    def tensor(self, ref: tuple[str, int, int, str, tuple[int, ...]]) -> Any:
        import torch

        path, inode, offset, dtype_name, shape = ref
        mapped = self.maps.get(path)
        if mapped is None or mapped[0] != inode:
            fd = os.open(path, os.O_RDWR)
            try:
                if os.fstat(fd).st_ino != inode:
                    raise WriteFailed(f"segment {path} was replaced while its states were being written")
                mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            mapped = self.maps[path] = (inode, mapping)
        dtype = getattr(torch, dtype_name)
        count = 1
        for size in shape:
            count *= size
        return torch.frombuffer(mapped[1], dtype=dtype, count=count, offset=offset).view(shape)

    def drop_stale(self) -> None:
        for path, (inode, _) in list(self.maps.items()):
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current != inode:
                del self.maps[path]


def _serve(jobs: BinaryIO, replies: BinaryIO) -> int:
    start = _receive(jobs)
    if start is None or start[0] != "start":
        return 2
    settings = start[1]
    if not settings["crc32"]:
        disable_zip_crc32()
    output = Path(settings["output"])
    staging = Path(settings["staging"]) if settings["staging"] else None
    fmt = settings["fmt"]
    send_lock = threading.Lock()
    pool = ThreadPoolExecutor(
        max_workers=max(1, settings["threads"]),
        thread_name_prefix="spec-compat-writer",
        initializer=lower_this_threads_priority,
        initargs=(settings["nice"],),
    )
    mappings = _Mappings()

    def reply(message: Any) -> None:
        with send_lock:
            _send(replies, message)

    def write(job: int, name: str, payload: dict[str, Any]) -> None:
        try:
            saved = write_in_format(fmt, output, name, name + ".tmp", payload, settings["sync"], True, staging)
        except BaseException as exc:  # noqa: BLE001 - reported to the driver, which raises it
            reply(("failed", job, _picklable(exc)))
            return
        del payload
        reply(("done", job, saved))

    while (message := _receive(jobs)) is not None:
        if message[0] == "end":
            pool.shutdown(wait=True)
            reply(("timings", tuple(timings().items())))
            return 0
        _, job, name, described = message
        try:
            mappings.drop_stale()
            states = [mappings.tensor(ref) for ref in described["hidden_states"]]
        except (OSError, WriteFailed) as exc:
            reply(("failed", job, _picklable(exc)))
            continue
        pool.submit(write, job, name, {**{k: rebuilt(v) for k, v in described.items()}, "hidden_states": states})
    # The driver is gone (its end of the pipe closed without "end"): stop now, mid-file if need be. Nothing
    # written here is listed without the driver, and a file finished later could land under the name a
    # rerun is writing (a temporary file left now is harmless: the rerun writes its own).
    os._exit(1)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception that does not survive the pipe goes as its message
        return WriteFailed(f"{type(exc).__name__}: {exc}")
    return exc


def main(argv: list[str]) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    import torch  # noqa: F401 - imported while the driver's engine loads, not at the first file

    with os.fdopen(int(argv[0]), "rb") as jobs, os.fdopen(int(argv[1]), "wb") as replies:
        return _serve(jobs, replies)
