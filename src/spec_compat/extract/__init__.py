"""``spec-compat extract``: a dataset -> hidden-state training files, with the untouched generator.

One module per concern, in an order no import goes against (a module imports only modules above it):

- ``config``: the run's configuration, samples, bad lines and errors (imports nothing of extract);
- ``conversations``: chat data through speculators' own preprocessing;
- ``files``: durable writing (temporary name, sha256, fsync, rename; O_DIRECT from /dev/shm);
- ``fp8``: ``--save-dtype fp8`` (float8 states, per-token scales, their error);
- ``formats``: the output layouts behind one interface (``formats/v1.py``, ``formats/hs.py``);
- ``dataset``: the input read and checked before an engine loads (model facts, lines, layer ids);
- ``manifest``: ``manifest.json`` (provenance, a sha256 per file, failures), its journal and ``sample_lengths.json``;
- ``batching``: batch planning, bad-sample isolation, the payloads, progress;
- ``writer_process``: ``--writer process`` (the default): a process of its own writes the files,
  reading the states from the engine's shared-memory segments;
- ``writer``: a sample's file, the background writer (writer threads, one recorder thread), adopting
  files another process wrote;
- ``signals``: SIGINT / SIGTERM handling;
- ``single``: the single-process run;
- ``replica``, ``slots``, ``distributed``: ``--replicas N`` over Ray.

tests/unit/test_extract_formats.py checks that order (and so that no import circle exists).

The default output layout (what speculators 0.3 / 0.4's training reads, ``Eagle3SampleFileDataset``):
one ``data_{idx}.pt`` per sample holding ``input_ids`` [seq_len] long, ``hidden_states`` (a list of
[seq_len, hidden] tensors, one per layer id) and ``loss_mask`` [seq_len] long, plus
``sample_lengths.json``. ``manifest.json`` records provenance and a sha256 per file; a rerun skips
finished samples after verifying them, and re-extracts any whose file is missing or corrupted.

This package keeps the names ``spec_compat.extract`` had as one module (cli.py, the benchmarks and
the tests use them).
"""

from __future__ import annotations

import os  # noqa: F401 - ``extract.os``: tests patch os functions through it, as when this was one module

from .batching import Progress, generate_isolating, plan_batches, sample_payloads, tail_batches, taper_divisor
from .config import (
    FORMAT,
    LENGTHS,
    MANIFEST,
    STATS,
    BadLine,
    ExtractConfig,
    ExtractError,
    ModelFacts,
    Sample,
    WriteFailed,
    default_writer_threads,
    parse_shard,
)
from .dataset import check_layer_ids, checked_samples, load_dataset, model_facts, parse_line, read_samples
from .files import (
    DIRECT_ALIGN,
    DIRECT_CHUNK,
    direct_io_staging,
    disable_zip_crc32,
    fsync_directory,
    sha256_of,
)
from .manifest import Manifest, open_manifest, provenance
from .signals import Interrupted
from .single import run
from .writer import BackgroundWriter, sample_file_name, write_sample

__all__ = [
    "DIRECT_ALIGN",
    "DIRECT_CHUNK",
    "FORMAT",
    "LENGTHS",
    "MANIFEST",
    "STATS",
    "BackgroundWriter",
    "BadLine",
    "ExtractConfig",
    "ExtractError",
    "Interrupted",
    "Manifest",
    "ModelFacts",
    "Progress",
    "Sample",
    "WriteFailed",
    "check_layer_ids",
    "checked_samples",
    "default_writer_threads",
    "direct_io_staging",
    "disable_zip_crc32",
    "fsync_directory",
    "generate_isolating",
    "load_dataset",
    "model_facts",
    "open_manifest",
    "parse_line",
    "parse_shard",
    "plan_batches",
    "provenance",
    "read_samples",
    "run",
    "sample_file_name",
    "sample_payloads",
    "sha256_of",
    "tail_batches",
    "taper_divisor",
    "write_sample",
]
