"""``manifest.json``: provenance, a sha256 per file, what failed; ``sample_lengths.json``.

Why a journal: every batch used to rewrite the whole manifest.json and sample_lengths.json (and fsync
them), so a run's recording cost grew with the square of its samples: 0.9 s per batch at 100k
samples on the 2-core machine (benchmarks/manifest_scaling.py), more than an H200 needs to compute
the batch, and the JSON encoder holds the GIL the engine loop needs. Now a batch's new samples are
appended to ``manifest.json.journal`` (one JSON line each, fsync'd), and manifest.json is rewritten
(the journal then removed) only when the journal holds half as many samples as the manifest, or when a
rewrite would take at most ``REWRITE_SHARE`` of the time since the last one (at least every
``REWRITE_MIN_INTERVAL_S``: manifest.json still shows a run's progress), and always at the end of a
run. After a crash, manifest.json plus the journal list what is complete; a rerun replays the
journal (a torn last line is ignored: those samples are extracted again) before it checks every
listed file's sha256. ``SPEC_COMPAT_MANIFEST_JOURNAL=0`` rewrites manifest.json at every save, as
before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import formats, fp8
from .config import JOURNAL, LENGTHS, MANIFEST, BadLine, ExtractConfig, ExtractError, Sample, WriteFailed
from .files import _write_json_atomic, fsync_directory, sha256_of

JOURNAL_ENV = "SPEC_COMPAT_MANIFEST_JOURNAL"  # "0": every save rewrites manifest.json
REWRITE_SHARE = 0.02  # a time-due rewrite costs at most this share of the time since the last one
REWRITE_MIN_INTERVAL_S = 1.0

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
        self.journal_path = output / JOURNAL
        self.journal_enabled = os.environ.get(JOURNAL_ENV, "1") != "0"
        self.replayed = self._replay_journal()  # samples the journal of an interrupted run listed
        self._unsaved: list[str] = []  # sample keys recorded since the last save
        self._journal_lines = 0
        self._rewrite_due = True  # a change only a rewrite records (provenance, runs, failures, the replay)
        self._last_rewrite = float("-inf")
        self._rewrite_s = 0.0  # how long the last rewrite took
        self.rewrites = 0

    def _replay_journal(self) -> int:
        """Add the samples ``manifest.json.journal`` lists (an earlier run's, not yet in manifest.json);
        stops at the first line that is not a complete record (a write cut off by a crash)."""
        try:
            text = self.journal_path.read_text()
        except FileNotFoundError:
            return 0
        replayed = 0
        for line in text.split("\n"):
            try:
                record = json.loads(line)
                key, entry = record["idx"], record["entry"]
                if not isinstance(entry, dict) or not {"file", "sha256"} <= entry.keys():
                    break
            except (ValueError, KeyError, TypeError):
                break
            self.data["samples"][str(key)] = entry
            self.data["failed"].pop(str(key), None)
            replayed += 1
        return replayed

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
        if self.data["failed"].pop(str(idx), None) is not None:
            self._rewrite_due = True
        self._unsaved.append(str(idx))

    def fail(self, indices: list[int], error: str) -> None:
        for idx in indices:
            self.data["failed"][str(idx)] = error
        self._rewrite_due = True

    def invalid(self, bad: list[BadLine]) -> None:
        """Lines this run skipped as invalid (``--on-error skip``); replaced on every run."""
        self.data["invalid"] = {str(b.line - 1): b.reason for b in bad}
        self._rewrite_due = True

    def save(self, sync: bool = False, rewrite: bool = False) -> None:
        """Make what is recorded durable (with ``sync``: a crash or power cut then never leaves a
        manifest or journal that lists a file whose bytes are not on the disk): the new samples
        appended to the journal, or manifest.json rewritten when that is due (see the module's
        docstring) or ``rewrite`` asks (a change to the provenance)."""
        if rewrite or self._rewrite_due or not self.journal_enabled or self._rewrite_is_due():
            self._rewrite(sync)
        elif self._unsaved:
            self._append(sync)

    def close(self, sync: bool = False) -> None:
        """The end of a run (done, failed or interrupted): manifest.json and sample_lengths.json
        complete, no journal left (nothing to do if the last save rewrote them)."""
        if self._unsaved or self._journal_lines or self._rewrite_due:
            self._rewrite(sync)

    def _rewrite_is_due(self) -> bool:
        if self._journal_lines + len(self._unsaved) >= len(self.data["samples"]) // 2:
            return True  # rewrites then come at geometrically growing sizes: O(1) per sample, amortized
        waited = time.monotonic() - self._last_rewrite
        return waited >= max(REWRITE_MIN_INTERVAL_S, self._rewrite_s / REWRITE_SHARE)

    def _append(self, sync: bool) -> None:
        samples = self.data["samples"]
        lines = "".join(
            json.dumps({"idx": key, "entry": samples[key]}, separators=(",", ":")) + "\n" for key in self._unsaved
        )
        created = self._journal_lines == 0
        try:
            with self.journal_path.open("a") as handle:
                handle.write(lines)
                if sync:
                    handle.flush()
                    os.fsync(handle.fileno())
            if sync and created:
                fsync_directory(self.output)
        except OSError as exc:  # a full disk: what was appended may end in a cut-off line, so the next save rewrites
            self._rewrite_due = True
            raise WriteFailed(f"cannot write {self.journal_path}: {exc.strerror or exc}") from None
        self._journal_lines += len(self._unsaved)
        self._unsaved.clear()

    def _rewrite(self, sync: bool) -> None:
        """Atomically (temporary name, rename), then the journal removed (a journal left behind by a
        crash in between lists what manifest.json lists already: replaying it changes nothing)."""
        started = time.monotonic()
        errors = [entry["fp8"] for entry in self.data["samples"].values() if "fp8" in entry]
        if errors:  # the run's fp8 error over every sample listed (a rerun's included)
            self.data["fp8_error"] = fp8.summarize(errors)
        _write_json_atomic(self.path, self.data, sync)
        lengths = {key: entry["num_tokens"] for key, entry in self.data["samples"].items()}
        _write_json_atomic(self.output / LENGTHS, lengths, sync)
        self.journal_path.unlink(missing_ok=True)
        self._journal_lines = 0
        self._unsaved.clear()
        self._rewrite_due = False
        self._last_rewrite = time.monotonic()
        self._rewrite_s = self._last_rewrite - started
        self.rewrites += 1


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
