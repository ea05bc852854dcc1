"""``spec-compat extract``: a dataset -> hidden-state training files, with the untouched generator.

Output layout (what speculators' training reads, ``Eagle3SampleFileDataset``): one
``data_{idx}.pt`` per sample holding ``input_ids`` [seq_len] long, ``hidden_states`` (a list of
[seq_len, hidden] tensors, one per layer id) and ``loss_mask`` [seq_len] long, plus
``sample_lengths.json``. ``manifest.json`` records provenance and a sha256 per file; a rerun
skips finished samples after verifying them, and re-extracts any whose file is missing or
corrupted.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def read_samples(config: ExtractConfig, tokenizer: Any | None) -> Iterator[Sample]:
    """The samples of this shard; idx is the 0-based line number in the JSONL file."""
    shard_index, shard_count = config.shard
    with config.input.open() as handle:
        for idx, line in enumerate(handle):
            if idx % shard_count != shard_index or not line.strip():
                continue
            record = json.loads(line)
            if config.ids_field in record:
                ids = record[config.ids_field]
            elif config.text_field and config.text_field in record:
                if tokenizer is None:
                    raise ValueError("a text field needs the model's tokenizer")
                ids = tokenizer(record[config.text_field], add_special_tokens=True)["input_ids"]
            else:
                raise ValueError(f"line {idx + 1}: no {config.ids_field!r} (or text field {config.text_field!r})")
            yield Sample(idx, [int(t) for t in ids], record.get("loss_mask"))


def sha256_of(path: Path) -> str:
    """Read into one reused buffer (no per-block objects); hashlib hashes it without the GIL."""
    digest = hashlib.sha256()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


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


def _write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


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

    def save(self) -> None:
        _write_json_atomic(self.path, self.data)
        lengths = {key: entry["num_tokens"] for key, entry in self.data["samples"].items()}
        _write_json_atomic(self.output / LENGTHS, lengths)


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


def write_sample(output: Path, idx: int, payload: dict[str, Any]) -> tuple[str, int, str]:
    """data_{idx}.pt, written to a temporary name and renamed; (file name, tokens, sha256).

    torch.save to a path writes the tensor bytes from C++ without the GIL, and hashlib hashes
    without it: the writer threads barely compete with the engine loop for the interpreter (saving
    through a Python file object copied every tensor into a bytes object under the GIL: extract
    ran at 0.79x the generator's own speed on an H200)."""
    import torch

    name = f"data_{idx}.pt"
    tmp = output / (name + ".tmp")
    try:
        torch.save(payload, tmp)
        digest = sha256_of(tmp)
        os.replace(tmp, output / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return name, len(payload["input_ids"]), digest


class BackgroundWriter:
    """Writes finished batches on a few threads while the engine runs the next batch.

    At most ``pending`` batches are in flight (each holds its hidden states in memory); the
    manifest is only touched by the caller's thread, in batch order, once a batch's files are all
    on disk, so an interrupted run never records a sample whose file is not complete."""

    def __init__(self, output: Path, manifest: Manifest, threads: int, pending: int) -> None:
        self.output = output
        self.manifest = manifest
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="spec-compat-writer")
        self.pending = max(1, pending)
        self.in_flight: deque[list[tuple[int, Future[tuple[str, int, str]]]]] = deque()
        self.written_samples = 0
        self.wait_s = 0.0  # time the engine loop waited for the writer (the writer is the bottleneck)

    def submit(self, samples: list[tuple[int, dict[str, Any]]]) -> None:
        while len(self.in_flight) >= self.pending:
            self._finish_oldest()
        futures = [(idx, self.pool.submit(write_sample, self.output, idx, payload)) for idx, payload in samples]
        self.in_flight.append(futures)

    def _finish_oldest(self) -> None:
        started = time.perf_counter()
        batch = self.in_flight.popleft()
        try:
            written = [(idx, future.result()) for idx, future in batch]
        finally:
            self.wait_s += time.perf_counter() - started
        for idx, (name, tokens, digest) in written:
            self.manifest.record(idx, name, tokens, digest)
        self.manifest.save()
        self.written_samples += len(written)

    def drain(self) -> None:
        while self.in_flight:
            self._finish_oldest()

    def close(self) -> None:
        """Finish what can be finished (the files of batches already submitted), then stop."""
        try:
            self.drain()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _provenance(config: ExtractConfig, report: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "model": str(config.model),
        "layer_ids": list(config.layer_ids),
        "save_dtype": config.save_dtype,
        "environment": report.env.as_dict(),
        "adapters_applied": report.applied,
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


def run(config: ExtractConfig) -> int:
    import spec_compat

    report = spec_compat.apply(strict=True, dtype=config.dtype)

    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    config.output.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(config.output, _provenance(config, report))
    done, problems = manifest.verified_done()
    for problem in problems:
        print(f"spec-compat extract: {problem}", file=sys.stderr)

    tokenizer = None
    if config.text_field:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model)
    todo = [s for s in read_samples(config, tokenizer) if s.idx not in done]
    limit = config.max_model_len - 1
    print(
        f"spec-compat extract: shard {config.shard[0]}/{config.shard[1]}: {len(done)} done, {len(todo)} to do",
        file=sys.stderr,
    )
    manifest.save()
    if not todo:
        return 0

    started = time.perf_counter()
    generator = VllmHiddenStatesGenerator(
        config.model,
        layer_ids=config.layer_ids,
        max_model_len=config.max_model_len,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    engine_start_s = time.perf_counter() - started
    save_dtype = getattr(torch, config.save_dtype)
    zip_crc32 = config.zip_crc32 or not disable_zip_crc32()
    lengths = [min(len(s.input_ids), limit) for s in todo]
    max_samples = config.batch_size or int(getattr(generator.scheduler, "max_num_running_reqs", 0) or 16)
    batches = plan_batches(lengths, max_samples, config.batch_tokens)
    progress = Progress(len(todo), sum(lengths))
    writer = BackgroundWriter(config.output, manifest, config.writer_threads, config.pending_batches)
    failures = 0
    first_batch: tuple[float, int] | None = None  # (seconds until its states were handed to the writer, tokens)
    generate_s = prepare_s = 0.0  # where the engine loop's time goes (the rest: waiting for the writer)
    started = time.perf_counter()
    try:
        for begin, end in batches:
            batch = todo[begin:end]
            call_started = time.perf_counter()
            try:
                results = generator.generate([s.input_ids for s in batch])
            except Exception as exc:  # noqa: BLE001 - reported with the samples; the user picks stop or skip
                failures += len(batch)
                detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                writer.drain()
                manifest.fail([s.idx for s in batch], detail)
                manifest.save()
                print(
                    f"\nspec-compat extract: batch of samples {[s.idx for s in batch]} failed:\n{detail}",
                    file=sys.stderr,
                )
                if config.on_error == "stop":
                    return 1
                continue
            prepare_started = time.perf_counter()
            generate_s += prepare_started - call_started
            payloads = []
            for sample, result in zip(batch, results, strict=True):
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
            del results
            prepare_s += time.perf_counter() - prepare_started
            writer.submit(payloads)
            if first_batch is None:
                first_batch = (time.perf_counter() - started, sum(lengths[begin:end]))
            progress.update(len(batch), sum(lengths[begin:end]))
        writer.drain()
        extract_s = time.perf_counter() - started  # dataset to files on disk (engine start and shutdown excluded)
    finally:
        progress.close()
        try:
            writer.close()
        finally:
            generator.executor.shutdown()
            del generator  # let speculators' __del__ run now, not at interpreter teardown
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
        "zip_crc32": zip_crc32,
        "writer_threads": config.writer_threads,
        "pending_batches": config.pending_batches,
    }
    _write_json_atomic(config.output / STATS, stats)
    print(
        f"spec-compat extract: {writer.written_samples} samples, {tokens:,} tokens in {extract_s:.1f} s "
        f"({stats['tokens_per_s'] or 0:,.0f} tok/s; engine start {engine_start_s:.1f} s, "
        f"waited for the writer {writer.wait_s:.1f} s)",
        file=sys.stderr,
    )
    return 1 if failures else 0
