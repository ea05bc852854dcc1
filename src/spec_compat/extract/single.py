"""One process: the dataset checked, one generator, batches written in the background."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from typing import Any

from . import formats
from .batching import Progress, generate_isolating, plan_batches, sample_payloads, tail_batches, taper_divisor
from .config import (
    STATS,
    ExtractConfig,
    ExtractError,
    WriteFailed,
    engine_step_tokens,
    generator_constants,
    generator_options,
)
from .dataset import checked_samples
from .files import _write_json_atomic, direct_io_staging, disable_zip_crc32
from .manifest import _provenance, open_manifest
from .signals import Interrupted, _install_signal_handlers
from .writer import BackgroundWriter, writer_nice
from .writer_process import WriterProcess


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

    from speculators.data_generation import VllmHiddenStatesGenerator

    # options the installed generator cannot take are refused before the output is touched
    options = generator_options(config, VllmHiddenStatesGenerator)
    speculators_module = sys.modules[VllmHiddenStatesGenerator.__module__]
    manifest, todo = open_manifest(config, _provenance(config, report), todo_all, bad)
    limit = config.max_model_len - 1
    if not todo:
        return 1 if bad else 0

    restore_signals = _install_signal_handlers()
    generator: Any = None
    transfer_mappings: Any = None  # the executor's shared-memory mappings (executor-shared-memory-replies)
    states_replies: dict[str, int] = {}  # the executor's counts of its states replies
    writer: BackgroundWriter | None = None
    process: WriterProcess | None = None  # --writer process
    failures = 0
    try:
        fmt = formats.get(config)
        zip_crc32 = config.zip_crc32 or not disable_zip_crc32()
        staging = direct_io_staging(config.output) if config.direct_io else None
        # made before the engine: a writer process imports torch while the engine loads
        process = start_writer_process(config, fmt, staging, zip_crc32) if config.writer == "process" else None
        writer = BackgroundWriter(
            config.output, manifest, config.writer_threads, config.pending_batches, config.fsync, staging, fmt, process
        )
        started = time.perf_counter()
        try:
            with generator_constants(config, speculators_module):
                generator = VllmHiddenStatesGenerator(
                    config.model,
                    layer_ids=config.layer_ids,
                    max_model_len=config.max_model_len,
                    tensor_parallel_size=config.tensor_parallel_size,
                    gpu_memory_utilization=config.gpu_memory_utilization,
                    **options,
                )
        except (ValueError, TypeError) as exc:  # refused at construction (layer ids), before weights load
            raise ExtractError(str(exc).splitlines()[0]) from None
        engine_start_s = time.perf_counter() - started
        step_tokens = engine_step_tokens(generator)
        # where the states of a reply lie in shared memory (executor-shared-memory-replies), for the process
        writer.locate = getattr(getattr(generator.executor, "transfer_mappings", None), "locate", None)
        save_dtype = formats.state_dtype(config)
        lengths = [min(len(s.input_ids), limit) for s in todo]
        slots = int(getattr(generator.scheduler, "max_num_running_reqs", 0) or 0) or None
        # SPEC_COMPAT_EXTRACT_TAPER, read once for the plan and the stats
        divisor = taper_divisor()
        tail = tail_batches(config.pending_batches, divisor)
        batches = plan_batches(lengths, config.batch_size or slots or 16, config.batch_tokens, slots, tail, divisor)
        progress = Progress(len(todo), sum(lengths))
        first_batch: tuple[float, int] | None = None  # (seconds until its states went to the writer, tokens)
        generate_s = prepare_s = 0.0  # where the engine loop's time goes (the rest: waiting for the writer)
        # per batch, seconds since the loop began: its generate() returned, its files were handed to the
        # writer (after any wait for room), its tokens: the loop's rate between the first batch and the drain
        timeline: list[tuple[float, float, int]] = []
        batch_timings: list[dict[str, float]] = []  # per batch, the engine loop's timings() labels it added
        before: dict[str, float] = {}
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
                names = [fmt.file_name(sample.idx, sample.row) for sample, _ in good]
                del good
                prepare_s += time.perf_counter() - prepare_started
                if payloads:
                    writer.submit(payloads, names)
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
                handed = time.perf_counter() - started
                timeline.append((round(prepare_started - started, 4), round(handed, 4), sum(lengths[begin:end])))
                before = _add_batch_timings(batch_timings, before)
                if first_batch is None:
                    first_batch = (handed, sum(lengths[begin:end]))
                progress.update(len(batch), sum(lengths[begin:end]))
            drain_started = time.perf_counter()
            writer.drain()
            drain_s = time.perf_counter() - drain_started
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
            try:
                if writer is not None:
                    _close_quietly(writer)
            finally:
                # manifest.json complete; if even that cannot be written (a full disk), the journal keeps
                # what is done for the rerun and the error the run reports stays the one shown
                with contextlib.suppress(OSError, WriteFailed):
                    manifest.close(config.fsync)
        finally:
            if generator is not None:
                transfer_mappings = getattr(generator.executor, "transfer_mappings", None)
                states_replies = dict(getattr(generator.executor, "states_replies", {}))
                generator.executor.shutdown()
            del generator  # let speculators' __del__ run now, not at interpreter teardown
            restore_signals()
    tokens = sum(lengths)
    stats = {
        "transfer": transfer_counts(transfer_mappings, states_replies),
        "samples": writer.written_samples,
        "tokens": tokens,
        "format": config.format,
        "save_dtype": config.save_dtype,
        "bytes": writer.written_bytes,  # the samples' files this run wrote
        "bytes_per_token": writer.written_bytes / tokens if tokens else None,
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
        "drain_s": drain_s,  # of writer_wait_s: after the last batch, until the batches in flight were written
        "handoff_s": writer.handoff_s,  # handing the files to the writer (to its process: describing, sending)
        "timeline": timeline,  # [generate() returned, handed to the writer, tokens] per batch
        "batch_timings": batch_timings,  # per batch: rpc: / transfer: seconds (which batch made a segment, ...)
        "writer": "process" if process is not None else "threads",
        "written_by_process": process.samples if process is not None else 0,  # the rest: by driver threads
        "writer_threads": config.writer_threads,
        "writer_nice": writer.nice,
        "pending_batches": config.pending_batches,
        "max_num_batched_tokens": step_tokens,  # the engine's tokens per scheduler step
        "max_num_seqs": slots,  # the engine's running slots (--max-num-seqs; speculators' own 32)
        "writer_room": "bytes" if writer.by_bytes else "batches",  # SPEC_COMPAT_WRITER_BYTE_WINDOW
        "tail_batches": tail,
        "taper_divisor": divisor if tail else None,
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


def start_writer_process(config: ExtractConfig, fmt: Any, staging: Any, zip_crc32: bool) -> WriterProcess | None:
    """The writer process, or None (said on stderr) where one cannot be started: the threads write then."""
    try:
        return WriterProcess(config.output, fmt, config.writer_threads, config.fsync, staging, zip_crc32, writer_nice())
    except OSError as exc:
        print(f"spec-compat extract: no writer process ({exc}); writing on threads of this one", file=sys.stderr)
        return None


def transfer_counts(mappings: Any, states_replies: dict[str, int]) -> dict[str, int] | None:
    """How the run's captured states came to the driver: segments replies came in (``segments_made``),
    the most segments the worker had at once (``segments_live_max``: more than ``segments_made`` when it
    made one that no reply used), replies written step by step (captured-states-streamed), replies whose
    clones kept their segment (driver-states-handover) and those copied instead; None without the
    shared-memory transfer."""
    if mappings is None:
        return None
    return {
        "segments_made": len(getattr(mappings, "segments_seen", ())),
        "segments_live_max": getattr(mappings, "segments_live_max", 0),
        "replies_streamed": states_replies.get("streamed", 0),
        "replies_handed_over": getattr(mappings, "held_count", 0),
        "copied_limit": getattr(mappings, "refused", 0),
    }


LOOP_LABELS = ("rpc:", "transfer:")  # timings() of the engine loop's calls (extract: labels are the writer's)


def _add_batch_timings(batch_timings: list[dict[str, float]], before: dict[str, float]) -> dict[str, float]:
    """Append what one batch added to the engine loop's ``spec_compat.timings()`` (labels of at least a
    millisecond), and return the totals to measure the next batch from."""
    import spec_compat

    now = {label: seconds for label, seconds in spec_compat.timings().items() if label.startswith(LOOP_LABELS)}
    added = {label: round(seconds - before.get(label, 0.0), 4) for label, seconds in now.items()}
    batch_timings.append({label: seconds for label, seconds in added.items() if seconds >= 0.001})
    return now


def _close_quietly(writer: BackgroundWriter) -> None:
    """close() once; a second call (the finally after an interruption) finds nothing in flight."""
    writer.close()
