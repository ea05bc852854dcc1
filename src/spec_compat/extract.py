"""``spec-compat extract``: a dataset -> hidden-state training files, with the untouched generator.

Output layout (what speculators' training reads, ``Eagle3SampleFileDataset``): one
``data_{idx}.pt`` per sample holding ``input_ids`` [seq_len] long, ``hidden_states`` (a list of
[seq_len, hidden] tensors, one per layer id) and ``loss_mask`` [seq_len] long, plus
``sample_lengths.json``. ``manifest.json`` records provenance and a sha256 per file; a rerun
skips finished samples after verifying them, and re-extracts any whose file is missing or
corrupted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .timing import timed

MANIFEST = "manifest.json"
LENGTHS = "sample_lengths.json"
STATS = "extract_stats.json"
FORMAT = "speculators-eagle3-v1"


@dataclass
class Sample:
    idx: int
    input_ids: list[int]
    loss_mask: list[int] | None = None


@dataclass
class BadLine:
    line: int  # 1-based line of the input file
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


class ExtractError(Exception):
    """A problem the user fixes (input, model, output): reported as one line, exit code 2."""


@dataclass
class ModelFacts:
    """What the dataset check needs from the model's config.json, read without loading weights."""

    vocab_size: int | None
    num_layers: int | None


@dataclass
class ExtractConfig:
    model: str
    input: Path
    output: Path
    layer_ids: list[int]
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    batch_size: int | None = None  # samples per generate() call; default: the engine's max_num_seqs
    batch_tokens: int = 32768  # and at most this many tokens per call (one sample may exceed it alone)
    writer_threads: int = field(default_factory=lambda: default_writer_threads())
    pending_batches: int = 2  # batches written in the background while the next one runs (memory bound)
    text_field: str | None = None
    ids_field: str = "input_ids"
    shard: tuple[int, int] = (0, 1)
    on_error: str = "stop"
    dtype: str | None = None
    save_dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.8
    zip_crc32: bool = False  # torch.save's per-record zip CRC32 (see disable_zip_crc32)
    fsync: bool = True  # each file reaches the disk before the manifest lists it
    direct_io: bool = False  # stage each file in /dev/shm and write it with O_DIRECT (see direct_io_staging)
    conversations: bool = False  # chat data through speculators' own preprocessing (conversations.py)
    seed: int = 0  # speculators' preprocessing shuffle seed (conversations only)
    extra: dict[str, Any] = field(default_factory=dict)


def default_writer_threads() -> int:
    """Half the cores, 1 to 8: the last batch's files are written after the engine has finished."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def parse_shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError as exc:
        raise ValueError(f"--shard must look like i/N (e.g. 0/4), got {text!r}") from exc
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= i < N")
    return i, n


def model_facts(model: str) -> ModelFacts:
    """Vocabulary size and decoder layer count from the model's config (no weights, no engine)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    except Exception as exc:  # noqa: BLE001 - any failure here is the user's model path
        raise ExtractError(f"--model {model}: cannot read its config ({type(exc).__name__}: {exc})") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
    layers = getattr(text, "num_hidden_layers", None) or getattr(config, "num_hidden_layers", None)
    return ModelFacts(int(vocab) if vocab else None, int(layers) if layers else None)


def _token_ids_problem(ids: Any, field_name: str, vocab_size: int | None) -> str | None:
    if not isinstance(ids, list):
        return f"{field_name!r} must be a list of token ids, got {type(ids).__name__}"
    if not ids:
        return f"{field_name!r} is empty"
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            return f"{field_name!r}[{position}] = {token!r} is not an integer token id"
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            return f"token id {token} at position {position} is outside the vocabulary (size {vocab_size})"
    return None


def _loss_mask_problem(mask: Any, length: int) -> str | None:
    if not isinstance(mask, list) or any(isinstance(x, bool) or x not in (0, 1) for x in mask):
        return "'loss_mask' must be a list of 0 / 1"
    if len(mask) != length:
        return f"'loss_mask' has {len(mask)} entries for {length} tokens"
    return None


def parse_line(
    line: str, config: ExtractConfig, tokenizer: Any | None, vocab_size: int | None
) -> tuple[list[int], list[int] | None]:
    """(token ids, loss mask) of one JSONL line, or ValueError with a one-line reason."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        where = "at the end of the line" if exc.pos >= len(line.rstrip()) else f"at column {exc.colno}"
        raise ValueError(f"not JSON ({exc.msg} {where})") from None
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object (a {type(record).__name__})")
    if config.ids_field in record:
        ids = record[config.ids_field]
        field_name = config.ids_field
    elif config.text_field and config.text_field in record:
        text = record[config.text_field]
        if not isinstance(text, str):
            raise ValueError(f"{config.text_field!r} must be a string, got {type(text).__name__}")
        assert tokenizer is not None
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        field_name = f"{config.text_field} (tokenized)"
    else:
        wanted = f"{config.ids_field!r}" + (f" or {config.text_field!r}" if config.text_field else "")
        raise ValueError(f"no {wanted} field (it has {sorted(record)[:8]})")
    problem = _token_ids_problem(ids, field_name, vocab_size)
    if problem:
        raise ValueError(problem)
    mask = record.get("loss_mask")
    if mask is not None:
        problem = _loss_mask_problem(mask, len(ids))
        if problem:
            raise ValueError(problem)
    return ids, mask


def read_samples(
    config: ExtractConfig, tokenizer: Any | None, vocab_size: int | None = None
) -> tuple[list[Sample], list[BadLine]]:
    """Every sample of this shard, each line checked (JSON, field, token ids in the vocabulary,
    loss mask), before anything is loaded; idx is the 0-based line number of the input file."""
    shard_index, shard_count = config.shard
    samples: list[Sample] = []
    bad: list[BadLine] = []
    try:
        handle = config.input.open("rb")
    except OSError as exc:
        raise ExtractError(f"--input {config.input}: {exc.strerror or exc}") from None
    with handle:
        for idx, raw in enumerate(handle):
            if idx % shard_count != shard_index or not raw.strip():
                continue
            try:
                ids, mask = parse_line(raw.decode("utf-8"), config, tokenizer, vocab_size)
            except UnicodeDecodeError as exc:
                bad.append(BadLine(idx + 1, f"not UTF-8 ({exc.reason} at byte {exc.start})"))
                continue
            except ValueError as exc:
                bad.append(BadLine(idx + 1, str(exc)))
                continue
            samples.append(Sample(idx, ids, mask))
    return samples, bad


def load_dataset(config: ExtractConfig, facts: ModelFacts) -> tuple[list[Sample], list[BadLine]]:
    """The shard's samples and its bad lines, from token ids / text, or conversations through
    speculators' own preprocessing (whose token ids are checked against the vocabulary too)."""
    if config.conversations:
        from .conversations import conversation_samples

        try:
            samples, bad = conversation_samples(config)
        except ValueError as exc:
            raise ExtractError(f"--conversations: {exc}") from None
        for sample in samples:
            problem = _token_ids_problem(sample.input_ids, "input_ids", facts.vocab_size)
            if problem:  # the tokenizer made it: tokenizer and model do not belong together
                raise ExtractError(
                    f"--conversations: sample {sample.idx}: {problem}; does the tokenizer match the model?"
                )
        return samples, bad
    tokenizer = None
    if config.text_field:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(config.model)
        except Exception as exc:  # noqa: BLE001 - the user's model path
            raise ExtractError(
                f"--model {config.model}: cannot load its tokenizer ({type(exc).__name__}: {exc})"
            ) from None
    return read_samples(config, tokenizer, facts.vocab_size)


def check_layer_ids(layer_ids: list[int], facts: ModelFacts) -> None:
    duplicates = sorted({x for x in layer_ids if layer_ids.count(x) > 1})
    if duplicates:
        raise ExtractError(f"--layer-ids {layer_ids} repeat {duplicates}: each layer is captured once")
    if facts.num_layers is not None:
        outside = [x for x in layer_ids if not 0 <= x < facts.num_layers]
        if outside:
            raise ExtractError(f"--layer-ids {outside} outside the model's decoder layers 0..{facts.num_layers - 1}")


class WriteFailed(ExtractError):
    """A file could not be written (no space, permission, read-only, ...): names the file."""


def _sha256_and_sync(path: Path, sync: bool) -> str:
    """sha256 of the file read back into one reused buffer (hashlib hashes it without the GIL);
    with ``sync``, fsync through the same handle so the bytes are on the disk, not in the cache."""
    digest = hashlib.sha256()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
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


class Manifest:
    def __init__(self, output: Path, provenance: dict[str, Any]) -> None:
        self.path = output / MANIFEST
        self.output = output
        if self.path.exists():
            self.data = json.loads(self.path.read_text())
            previous = {k: self.data["provenance"].get(k) for k in ("model", "layer_ids", "format")}
            current = {k: provenance.get(k) for k in ("model", "layer_ids", "format")}
            if previous != current:
                raise ValueError(f"{self.path} was written for {previous}, this run is {current}: use another --output")
        else:
            self.data = {"provenance": provenance, "samples": {}, "failed": {}}
        self.data.setdefault("runs", []).append({"started": time.time(), **provenance["run"]})

    def verified_done(self) -> tuple[set[int], list[str]]:
        """Indices whose file exists with the recorded checksum; and what was wrong with the rest."""
        done: set[int] = set()
        problems: list[str] = []
        for key, entry in list(self.data["samples"].items()):
            path = self.output / entry["file"]
            if not path.exists():
                problems.append(f"sample {key}: {entry['file']} is missing; extracting it again")
            elif sha256_of(path) != entry["sha256"]:
                problems.append(
                    f"sample {key}: {entry['file']} does not match its sha256 (corrupted); extracting it again"
                )
            else:
                done.add(int(key))
                continue
            del self.data["samples"][key]
        return done, problems

    def record(self, idx: int, file: str, num_tokens: int, sha256: str) -> None:
        self.data["samples"][str(idx)] = {"file": file, "num_tokens": num_tokens, "sha256": sha256}
        self.data["failed"].pop(str(idx), None)

    def fail(self, indices: list[int], error: str) -> None:
        for idx in indices:
            self.data["failed"][str(idx)] = error

    def invalid(self, bad: list[BadLine]) -> None:
        """Lines this run skipped as invalid (``--on-error skip``); replaced on every run."""
        self.data["invalid"] = {str(b.line - 1): b.reason for b in bad}

    def save(self, sync: bool = False) -> None:
        """Atomically (temporary name, rename); with ``sync`` durably: a crash or power cut then
        never leaves a manifest that lists a file whose bytes are not on the disk."""
        _write_json_atomic(self.path, self.data, sync)
        lengths = {key: entry["num_tokens"] for key, entry in self.data["samples"].items()}
        _write_json_atomic(self.output / LENGTHS, lengths, sync)


class Progress:
    def __init__(self, total_samples: int, total_tokens: int) -> None:
        self.total_samples, self.total_tokens = total_samples, total_tokens
        self.samples = self.tokens = 0
        self.started = time.perf_counter()

    def update(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = self.tokens / elapsed
        eta = (self.total_tokens - self.tokens) / rate if rate > 0 else float("inf")
        width = 30
        filled = int(width * self.samples / max(self.total_samples, 1))
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.samples}/{self.total_samples} samples "
            f"{rate:,.0f} tok/s ETA {eta:,.0f}s   "
        )
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def plan_batches(lengths: list[int], max_samples: int, max_tokens: int) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive samples: at most ``max_samples`` and ``max_tokens`` each
    (a single sample longer than ``max_tokens`` is a batch of its own)."""
    batches: list[tuple[int, int]] = []
    start = tokens = 0
    for index, length in enumerate(lengths):
        if index > start and (index - start >= max_samples or tokens + length > max_tokens):
            batches.append((start, index))
            start, tokens = index, 0
        tokens += length
    if start < len(lengths):
        batches.append((start, len(lengths)))
    return batches


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


def write_sample(
    output: Path, idx: int, payload: dict[str, Any], sync: bool = True, staging: Path | None = None
) -> tuple[str, int, str]:
    """data_{idx}.pt: written to a temporary name, hashed, fsync'd (``sync``), renamed; returns
    (file name, tokens, sha256). A failed write removes the temporary file and raises WriteFailed
    naming the file, so no partial file ever carries the final name.

    torch.save to a path writes the tensor bytes from C++ without the GIL, and hashlib hashes
    without it: the writer threads barely compete with the engine loop for the interpreter (saving
    through a Python file object copied every tensor into a bytes object under the GIL: extract
    ran at 0.79x the generator's own speed on an H200)."""
    name = sample_file_name(idx)
    return name, *_write_then_rename(output, name, name + ".tmp", payload, sync, rename=True, staging=staging)


def sample_file_name(idx: int) -> str:
    return f"data_{idx}.pt"


def write_sample_unrenamed(
    output: Path, idx: int, payload: dict[str, Any], tmp_name: str, sync: bool = True, staging: Path | None = None
) -> tuple[int, str]:
    """As write_sample, but the file stays under ``tmp_name`` (whoever records it renames it:
    ``spec_compat.distributed``'s driver); returns (tokens, sha256)."""
    return _write_then_rename(output, sample_file_name(idx), tmp_name, payload, sync, rename=False, staging=staging)


def _write_then_rename(
    output: Path, name: str, tmp_name: str, payload: dict[str, Any], sync: bool, rename: bool, staging: Path | None
) -> tuple[int, str]:
    """torch.save to ``tmp_name`` (directly, or into ``staging`` and from there with O_DIRECT),
    hashed, fsync'd with ``sync``, renamed to ``name`` with ``rename``; (tokens, sha256)."""
    import torch

    tmp = output / tmp_name
    # the staged file has the temporary file's own name (torch.save names the archive's records
    # after the file: the same bytes either way), in a folder of this thread's own
    staged = staging / f"spec-compat-{os.getpid()}-{threading.get_ident()}" / tmp.name if staging else None
    try:
        if staged is not None:
            try:
                staged.parent.mkdir(exist_ok=True)
                with timed("extract:torch-save"):
                    torch.save(payload, staged)
            except (OSError, RuntimeError):  # /dev/shm full (or gone): this file through the page cache
                _remove_staged(staged)
                staged = None
        if staged is None:
            with timed("extract:torch-save"):
                torch.save(payload, tmp)
        digest = _sha256_and_sync(tmp, sync) if staged is None else _write_direct(staged, tmp, sync)
        if rename:
            os.replace(tmp, output / name)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WriteFailed(f"cannot write {output / name}: {exc.strerror or exc}") from None
        if isinstance(exc, RuntimeError):  # torch's C++ writer: "unexpected pos 576 vs 534", no errno
            raise WriteFailed(f"cannot write {output / name}: {_why_write_failed(output, payload, exc)}") from None
        raise
    finally:
        if staged is not None:
            _remove_staged(staged)
    return len(payload["input_ids"]), digest


def _remove_staged(staged: Path) -> None:
    staged.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty (a file left by a killed run): left as it is
        staged.parent.rmdir()


def _why_write_failed(output: Path, payload: dict[str, Any], exc: BaseException) -> str:
    """What torch.save's error does not say: full disk, read-only, or no permission."""
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


class BackgroundWriter:
    """Writes finished batches on a few threads while the engine runs the next batch.

    At most ``pending`` batches are in flight (each holds its hidden states in memory). A batch is
    recorded by one recorder thread, in batch order, once all its files are on disk: the
    directory fsync'd (the renames), then the manifest saved; only that thread touches the
    manifest while batches are in flight, so an interrupted run never records a sample whose file
    is not complete. The engine loop waits only when ``pending`` batches are still unrecorded (on
    an H200 the recording in the loop, a directory fsync and a manifest fsync per batch behind 8
    writers' dirty pages, cost up to 1.4 s of a 6.4 s extract)."""

    def __init__(
        self,
        output: Path,
        manifest: Manifest,
        threads: int,
        pending: int,
        sync: bool = True,
        staging: Path | None = None,
    ) -> None:
        self.output = output
        self.sync = sync  # fsync every file (in its writer thread) and the directory before the manifest
        self.staging = staging  # where files are staged for O_DIRECT writes (direct_io_staging); None: buffered
        self.manifest = manifest
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="spec-compat-writer")
        self.recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spec-compat-recorder")
        self.pending = max(1, pending)
        self.in_flight: deque[Future[None]] = deque()  # one per batch: done once it is recorded
        self.written_samples = 0
        self.wait_s = 0.0  # time the engine loop waited for the writer (the writer is the bottleneck)

    def submit(self, samples: list[tuple[int, dict[str, Any]]]) -> None:
        while len(self.in_flight) >= self.pending:
            self._finish_oldest()
        files = [
            (idx, self.pool.submit(write_sample, self.output, idx, payload, self.sync, self.staging))
            for idx, payload in samples
        ]
        self.in_flight.append(self.recorder.submit(self._record, files))

    def _record(self, files: list[tuple[int, Future[tuple[str, int, str]]]]) -> None:
        """On the recorder thread: wait for a batch's files, record the complete ones, then raise
        the first failure (the good files of a failed batch are kept)."""
        written: list[tuple[int, tuple[str, int, str]]] = []
        failure: BaseException | None = None
        for idx, future in files:
            try:
                written.append((idx, future.result()))
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the good files are recorded
                failure = failure or exc
        if written:
            with timed("extract:record"):
                if self.sync:
                    fsync_directory(self.output)  # the renames, before the manifest names the files
                for idx, (name, tokens, digest) in written:
                    self.manifest.record(idx, name, tokens, digest)
                self.manifest.save(self.sync)
            self.written_samples += len(written)
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
        """Finish what can be finished (the files of batches already submitted), then stop."""
        try:
            self.drain()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.recorder.shutdown(wait=True)


def _provenance(config: ExtractConfig, report: Any) -> dict[str, Any]:
    return provenance(config, report.env.as_dict(), list(report.applied))


def provenance(config: ExtractConfig, environment: dict[str, Any], applied: list[str]) -> dict[str, Any]:
    """What manifest.json records about the run (``environment`` / ``applied``: spec_compat's
    report where the generator runs)."""
    return {
        "format": FORMAT,
        "model": str(config.model),
        "layer_ids": list(config.layer_ids),
        "save_dtype": config.save_dtype,
        "environment": environment,
        "adapters_applied": applied,
        "run": {
            "shard": f"{config.shard[0]}/{config.shard[1]}",
            "tensor_parallel_size": config.tensor_parallel_size,
            "max_model_len": config.max_model_len,
            "batch_size": config.batch_size,
            "batch_tokens": config.batch_tokens,
            "dtype": config.dtype,
            "zip_crc32": config.zip_crc32,
        },
    }


class Interrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM during extract: unwinds to the clean-up (files of finished batches are
    recorded, the engine is shut down); a second signal exits at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _install_signal_handlers() -> Callable[[], None]:
    """First SIGINT/SIGTERM: raise Interrupted where the main thread is; second: kill the workers
    and exit now. Returns the function that restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def force(signum: int, frame: Any) -> None:
        sys.stderr.write(f"\nspec-compat extract: second {signal.Signals(signum).name}: exiting now\n")
        _kill_children()
        os._exit(128 + signum)

    def first(signum: int, frame: Any) -> None:
        for each in previous:
            signal.signal(each, force)
        raise Interrupted(signum)

    for signum in previous:
        signal.signal(signum, first)

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def _kill_children() -> None:
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # noqa: BLE001 - exiting anyway; the workers also watch their parent
        pass


def _engine_gone(exc: BaseException) -> bool:
    """Errors after which the engine cannot run another batch (no point retrying samples)."""
    from .errors import EngineStopped, WorkerError, WorkerTimeout

    if isinstance(exc, (EngineStopped, WorkerTimeout)):
        return True
    return isinstance(exc, WorkerError) and exc.exc_type == "WorkerProcessDied"


def generate_isolating(
    generate: Callable[[list[list[int]]], list[dict[str, Any]]], batch: list[Sample]
) -> tuple[list[tuple[Sample, dict[str, Any]]], list[tuple[Sample, str]]]:
    """Run a batch; if it fails, split it in halves until each failure is one sample, so a bad
    sample never takes the good ones of its batch with it (log2(batch) extra calls per bad sample).
    Errors that leave no engine (a dead or silent worker) are raised as they are."""
    try:
        results = generate([s.input_ids for s in batch])
    except Exception as exc:  # kept with the sample it belongs to
        if _engine_gone(exc):
            raise
        if len(batch) == 1:
            return [], [(batch[0], f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")]
        half = len(batch) // 2
        good_a, bad_a = generate_isolating(generate, batch[:half])
        good_b, bad_b = generate_isolating(generate, batch[half:])
        return good_a + good_b, bad_a + bad_b
    return list(zip(batch, results, strict=True)), []


def sample_payloads(good: list[tuple[Sample, dict[str, Any]]], save_dtype: Any) -> list[tuple[int, dict[str, Any]]]:
    """(idx, what data_{idx}.pt holds) for each generated sample: ids, states in ``save_dtype``,
    the loss mask cut to the ids the generator kept (all ones without a mask)."""
    import torch

    payloads = []
    for sample, result in good:
        ids = result["input_ids"].to(torch.long)
        mask = sample.loss_mask[: len(ids)] if sample.loss_mask is not None else [1] * len(ids)
        payloads.append(
            (
                sample.idx,
                {
                    "input_ids": ids,
                    "hidden_states": [h.to(save_dtype).contiguous() for h in result["hidden_states"]],
                    "loss_mask": torch.as_tensor(mask, dtype=torch.long),
                },
            )
        )
    return payloads


def _report_bad_lines(bad: list[BadLine], config: ExtractConfig) -> None:
    for item in bad:
        print(f"spec-compat extract: {config.input}: {item}", file=sys.stderr)


def checked_samples(config: ExtractConfig) -> tuple[list[Sample], list[BadLine]] | None:
    """Everything checked before an engine loads (model config, layer ids, every line); the
    samples and the bad lines, or None when bad lines stop the run (they are printed); the
    output directory exists afterwards."""
    facts = model_facts(config.model)
    check_layer_ids(config.layer_ids, facts)
    todo_all, bad = load_dataset(config, facts)
    if bad:
        _report_bad_lines(bad, config)
        if config.on_error == "stop":
            print(
                f"spec-compat extract: {len(bad)} bad line(s) in {config.input}; nothing was written "
                "(fix them, or --on-error skip to extract every good sample and list these in the manifest)",
                file=sys.stderr,
            )
            return None
    try:
        config.output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExtractError(f"--output {config.output}: {exc.strerror or exc}") from None
    return todo_all, bad


def open_manifest(
    config: ExtractConfig, provenance: dict[str, Any], todo_all: list[Sample], bad: list[BadLine]
) -> tuple[Manifest, list[Sample]]:
    """The output's manifest (new, or the previous run's with its files verified) and the samples
    still to extract; prints what was found and saves the manifest."""
    try:
        manifest = Manifest(config.output, provenance)
    except ValueError as exc:
        raise ExtractError(str(exc)) from None
    manifest.invalid(bad)
    done, problems = manifest.verified_done()
    for problem in problems:
        print(f"spec-compat extract: {problem}", file=sys.stderr)
    todo = [s for s in todo_all if s.idx not in done]
    limit = config.max_model_len - 1
    truncated = sum(1 for s in todo if len(s.input_ids) > limit)
    print(
        f"spec-compat extract: shard {config.shard[0]}/{config.shard[1]}: {len(done)} done, {len(todo)} to do"
        + (f", {len(bad)} invalid line(s) skipped" if bad else "")
        + (f", {truncated} longer than --max-model-len - 1 = {limit} tokens (truncated)" if truncated else ""),
        file=sys.stderr,
    )
    manifest.save(config.fsync)
    return manifest, todo


def run(config: ExtractConfig) -> int:
    """Check everything that can be checked before the engine loads (model config, layer ids,
    every line of the dataset), then extract. Exit codes: 0 all done, 1 some samples failed or
    a write failed (what is done is kept), 2 bad input (nothing written), 128 + signal."""
    checked = checked_samples(config)
    if checked is None:
        return 2
    todo_all, bad = checked

    import spec_compat

    report = spec_compat.apply(strict=True, dtype=config.dtype)

    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    manifest, todo = open_manifest(config, _provenance(config, report), todo_all, bad)
    limit = config.max_model_len - 1
    if not todo:
        return 1 if bad else 0

    restore_signals = _install_signal_handlers()
    generator: Any = None
    writer: BackgroundWriter | None = None
    failures = 0
    try:
        started = time.perf_counter()
        try:
            generator = VllmHiddenStatesGenerator(
                config.model,
                layer_ids=config.layer_ids,
                max_model_len=config.max_model_len,
                tensor_parallel_size=config.tensor_parallel_size,
                gpu_memory_utilization=config.gpu_memory_utilization,
            )
        except (ValueError, TypeError) as exc:  # refused at construction (layer ids), before weights load
            raise ExtractError(str(exc).splitlines()[0]) from None
        engine_start_s = time.perf_counter() - started
        save_dtype = getattr(torch, config.save_dtype)
        zip_crc32 = config.zip_crc32 or not disable_zip_crc32()
        lengths = [min(len(s.input_ids), limit) for s in todo]
        max_samples = config.batch_size or int(getattr(generator.scheduler, "max_num_running_reqs", 0) or 16)
        batches = plan_batches(lengths, max_samples, config.batch_tokens)
        progress = Progress(len(todo), sum(lengths))
        staging = direct_io_staging(config.output) if config.direct_io else None
        writer = BackgroundWriter(
            config.output, manifest, config.writer_threads, config.pending_batches, config.fsync, staging
        )
        first_batch: tuple[float, int] | None = None  # (seconds until its states went to the writer, tokens)
        generate_s = prepare_s = 0.0  # where the engine loop's time goes (the rest: waiting for the writer)
        spec_compat.reset_timings()  # the engine start's RPCs are not the loop's
        started = time.perf_counter()
        try:
            for begin, end in batches:
                batch = todo[begin:end]
                call_started = time.perf_counter()
                good, failed = generate_isolating(generator.generate, batch)
                prepare_started = time.perf_counter()
                generate_s += prepare_started - call_started
                payloads = sample_payloads(good, save_dtype)
                del good
                prepare_s += time.perf_counter() - prepare_started
                if payloads:
                    writer.submit(payloads)
                # the writer holds them now: each batch's states (the shared-memory segment they came in,
                # with driver-states-handover) go as soon as its files are written, not after the next call
                del payloads
                if failed:
                    failures += len(failed)
                    writer.drain()
                    for sample, detail in failed:
                        manifest.fail([sample.idx], detail)
                        print(f"\nspec-compat extract: sample {sample.idx} failed:\n{detail}", file=sys.stderr)
                    manifest.save(config.fsync)
                    if config.on_error == "stop":
                        return 1
                if first_batch is None:
                    first_batch = (time.perf_counter() - started, sum(lengths[begin:end]))
                progress.update(len(batch), sum(lengths[begin:end]))
            writer.drain()
            extract_s = time.perf_counter() - started  # dataset to files on disk (engine start and shutdown excluded)
        finally:
            progress.close()
    except Interrupted as exc:
        if writer is not None:
            _close_quietly(writer)
        recorded = len(manifest.data["samples"])
        print(
            f"spec-compat extract: interrupted by {signal.Signals(exc.signum).name}: {recorded} sample(s) are "
            f"complete and listed in {manifest.path}; run the same command again to extract the rest",
            file=sys.stderr,
        )
        return 128 + exc.signum
    finally:
        try:
            if writer is not None:
                _close_quietly(writer)
        finally:
            if generator is not None:
                generator.executor.shutdown()
            del generator  # let speculators' __del__ run now, not at interpreter teardown
            restore_signals()
    tokens = sum(lengths)
    stats = {
        "samples": writer.written_samples,
        "tokens": tokens,
        "batches": len(batches),
        "engine_start_s": engine_start_s,
        "extract_s": extract_s,
        "tokens_per_s": tokens / extract_s if extract_s > 0 else None,
        # after the first batch (its call also warms the engine up: kernel autotuning, allocator)
        "first_batch_s": first_batch[0] if first_batch else None,
        "steady_tokens_per_s": (tokens - first_batch[1]) / (extract_s - first_batch[0])
        if first_batch and len(batches) > 1 and extract_s > first_batch[0]
        else None,
        "generate_s": generate_s,
        "prepare_s": prepare_s,
        "writer_wait_s": writer.wait_s,
        "writer_threads": config.writer_threads,
        "pending_batches": config.pending_batches,
        "zip_crc32": zip_crc32,
        "fsync": config.fsync,
        "direct_io": staging is not None,
        # spec_compat.timings() over the loop: rpc:<method> and transfer:/own: in the engine loop,
        # extract:<step> summed over the writer threads (torch-save, sha256, fsync) and the recorder
        "timings": {label: round(seconds, 6) for label, seconds in sorted(spec_compat.timings().items())},
    }
    _write_json_atomic(config.output / STATS, stats)
    print(
        f"spec-compat extract: {writer.written_samples} samples, {tokens:,} tokens in {extract_s:.1f} s "
        f"({stats['tokens_per_s'] or 0:,.0f} tok/s; engine start {engine_start_s:.1f} s, "
        f"waited for the writer {writer.wait_s:.1f} s)",
        file=sys.stderr,
    )
    return 1 if failures or bad else 0


def _close_quietly(writer: BackgroundWriter) -> None:
    """close() once; a second call (the finally after an interruption) finds nothing in flight."""
    writer.close()
