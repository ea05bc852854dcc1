"""``manifest.json``: provenance, a sha256 per file, what failed; ``sample_lengths.json``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from . import formats, fp8
from .config import LENGTHS, MANIFEST, BadLine, ExtractConfig, ExtractError, Sample
from .files import _write_json_atomic, sha256_of

# what a rerun into the same --output must keep (shard: speculators-hs only, whose files are numbered per shard)
RESUME_KEYS = ("model", "layer_ids", "format", "save_dtype", "shard")


class Manifest:
    def __init__(self, output: Path, provenance: dict[str, Any]) -> None:
        self.path = output / MANIFEST
        self.output = output
        if self.path.exists():
            self.data = json.loads(self.path.read_text())
            # save_dtype too: one output never mixes bf16 and fp8 files
            previous = {k: self.data["provenance"].get(k) for k in RESUME_KEYS}
            current = {k: provenance.get(k) for k in RESUME_KEYS}
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

    def record(self, idx: int, file: str, num_tokens: int, sha256: str, extra: dict[str, Any] | None = None) -> None:
        """``extra``: what the format adds to the sample's entry (fp8: its error per layer)."""
        self.data["samples"][str(idx)] = {"file": file, "num_tokens": num_tokens, "sha256": sha256, **(extra or {})}
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
        errors = [entry["fp8"] for entry in self.data["samples"].values() if "fp8" in entry]
        if errors:  # the run's fp8 error over every sample listed (a rerun's included)
            self.data["fp8_error"] = fp8.summarize(errors)
        _write_json_atomic(self.path, self.data, sync)
        lengths = {key: entry["num_tokens"] for key, entry in self.data["samples"].items()}
        _write_json_atomic(self.output / LENGTHS, lengths, sync)


def _provenance(config: ExtractConfig, report: Any) -> dict[str, Any]:
    return provenance(config, report.env.as_dict(), list(report.applied))


def provenance(config: ExtractConfig, environment: dict[str, Any], applied: list[str]) -> dict[str, Any]:
    """What manifest.json records about the run (``environment`` / ``applied``: spec_compat's
    report where the generator runs)."""
    fmt = formats.get(config)
    return {
        **fmt.provenance(config),
        "format": fmt.manifest_format,
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
    formats.get(config).prepare(config.output, todo_all, limit, config.fsync)
    return manifest, todo
