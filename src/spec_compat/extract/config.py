"""What an extract run is given and works on: its configuration, samples, bad lines, errors."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
JOURNAL = "manifest.json.journal"  # samples recorded since manifest.json was last rewritten (manifest.py)
LENGTHS = "sample_lengths.json"
STATS = "extract_stats.json"
FORMAT = "speculators-eagle3-v1"


@dataclass
class Sample:
    idx: int
    input_ids: list[int]
    loss_mask: list[int] | None = None
    row: int | None = None  # its place among the shard's samples (checked_samples): speculators-hs's file number


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
    writer: str = "process"  # the files written by a process of its own (writer_process.py), or "threads"
    pending_batches: int = 2  # batches written in the background while the next one runs (memory bound)
    text_field: str | None = None
    ids_field: str = "input_ids"
    shard: tuple[int, int] = (0, 1)
    on_error: str = "stop"
    dtype: str | None = None
    save_dtype: str = "bfloat16"  # or fp8: float8_e4m3fn with per-token scales (fp8.py)
    format: str = "speculators-v1"  # the output layout (formats/)
    gpu_memory_utilization: float = 0.8
    # tokens the engine runs per scheduler step (vLLM's max_num_batched_tokens); None: speculators' own,
    # max(8192, max_model_len). A --batch-tokens call of 32k tokens is then 4 steps, each with its own
    # scheduling, RPCs and forward launch (generator_options)
    max_num_batched_tokens: int | None = None
    # the engine's running slots (vLLM's max_num_seqs), which speculators fixes at its module constant
    # MAX_NUM_SEQS (32): a call of short samples holds at most that many (generator_constants)
    max_num_seqs: int | None = None
    zip_crc32: bool = False  # torch.save's per-record zip CRC32 (see disable_zip_crc32)
    fsync: bool = True  # each file reaches the disk before the manifest lists it
    direct_io: bool = False  # stage each file in /dev/shm and write it with O_DIRECT (see direct_io_staging)
    conversations: bool = False  # chat data through speculators' own preprocessing (conversations.py)
    seed: int = 0  # speculators' preprocessing shuffle seed (conversations only)
    extra: dict[str, Any] = field(default_factory=dict)


def generator_options(config: ExtractConfig, generator_class: Any) -> dict[str, Any]:
    """The keyword arguments beyond speculators' required ones that ``config`` asks of the generator.
    Every engine option the installed speculators cannot take (as a keyword, or as the module constant
    ``generator_constants`` sets) is refused here, before the engine loads."""
    check_generator_constants(config, sys.modules[generator_class.__module__])
    if config.max_num_batched_tokens is None:
        return {}
    if "max_num_batched_tokens" not in inspect.signature(generator_class.__init__).parameters:
        raise ExtractError(
            "--max-num-batched-tokens: the installed speculators' VllmHiddenStatesGenerator takes no "
            "max_num_batched_tokens (speculators 0.4.x does)"
        )
    return {"max_num_batched_tokens": config.max_num_batched_tokens}


# the speculators module constant --max-num-seqs overrides while a generator is made (the engine keeps it)
SLOTS_CONSTANT = "MAX_NUM_SEQS"


def check_generator_constants(config: ExtractConfig, module: Any) -> None:
    """Refuse, before the engine loads, an option whose constant the installed speculators does not read
    when it builds its engine's configuration."""
    if config.max_num_seqs is None:
        return
    build = getattr(getattr(module, "VllmHiddenStatesGenerator", None), "_create_vllm_config", None)
    reads = SLOTS_CONSTANT in getattr(getattr(build, "__code__", None), "co_names", ())
    if not isinstance(getattr(module, SLOTS_CONSTANT, None), int) or not reads:
        raise ExtractError(
            "--max-num-seqs: the installed speculators does not build its engine from a MAX_NUM_SEQS constant"
        )


@contextlib.contextmanager
def generator_constants(config: ExtractConfig, module: Any) -> Iterator[None]:
    """While one generator is made: speculators' MAX_NUM_SEQS as ``--max-num-seqs`` asks (``generator_options``
    has checked that the module builds its engine from it), restored right after; nothing else in the process
    reads it then."""
    if config.max_num_seqs is None:
        yield
        return
    before = getattr(module, SLOTS_CONSTANT)
    setattr(module, SLOTS_CONSTANT, config.max_num_seqs)
    try:
        yield
    finally:
        setattr(module, SLOTS_CONSTANT, before)


def engine_step_tokens(generator: Any) -> int | None:
    """The tokens its engine runs per scheduler step (max_num_batched_tokens), where it says."""
    scheduler_config = getattr(getattr(generator, "vllm_config", None), "scheduler_config", None)
    value = getattr(scheduler_config, "max_num_batched_tokens", None)
    return int(value) if value else None


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


class WriteFailed(ExtractError):
    """A file could not be written (no space, permission, read-only, ...): names the file."""
