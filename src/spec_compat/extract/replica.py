"""A replica of ``extract --replicas N``: one generator in a Ray actor's process."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import formats
from .batching import generate_isolating, sample_payloads
from .config import (
    ExtractConfig,
    Sample,
    WriteFailed,
    engine_step_tokens,
    generator_constants,
    generator_options,
)
from .files import Saved, direct_io_staging, disable_zip_crc32
from .writer_process import write_in_format

# a replica's files until the driver renames them: {output}/TMP_DIR/{batch}-{attempt}/{file's name}.tmp (the
# same base name as a single-process run's temporary file: torch.save names the archive's records after it, so
# both runs write the same bytes)
TMP_DIR = ".spec-compat-replicas"


def _one_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if isinstance(exc, BaseException) else first


class Replica:
    """One generator in a Ray actor's process (``ray.remote(Replica)`` in ``run_distributed``).

    Threaded (``max_concurrency``): one batch generates (under ``lock``) while the previous one's
    files are written, and ``info`` / ``shutdown`` answer while a batch runs. The constructor never
    raises: a failure is kept in ``start_error`` and reported by ``info()``, as one line."""

    def __init__(self, config: ExtractConfig, slot: int, cpu_bind: str | None) -> None:
        started = time.perf_counter()
        self.config = config
        self.slot = slot
        self.lock = threading.Lock()
        self.lost: str | None = None  # why the engine can run no more batches
        self.generator: Any = None
        self.start_error: str | None = None
        self.report: Any = None
        self.fmt = formats.get(config)
        self.pool = ThreadPoolExecutor(max(1, config.writer_threads), thread_name_prefix="spec-compat-writer")
        self.staging = direct_io_staging(config.output) if config.direct_io else None  # O_DIRECT writes
        if cpu_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind  # the vLLM workers this process starts
        try:
            import spec_compat

            self.report = spec_compat.apply(strict=True, dtype=config.dtype)

            from speculators.data_generation import VllmHiddenStatesGenerator

            self.save_dtype = formats.state_dtype(config)
            if not config.zip_crc32:
                disable_zip_crc32()
            options = generator_options(config, VllmHiddenStatesGenerator)  # refused before the engine loads
            with generator_constants(config, sys.modules[VllmHiddenStatesGenerator.__module__]):
                self.generator = VllmHiddenStatesGenerator(
                    config.model,
                    layer_ids=config.layer_ids,
                    max_model_len=config.max_model_len,
                    tensor_parallel_size=config.tensor_parallel_size,
                    gpu_memory_utilization=config.gpu_memory_utilization,
                    **options,
                )
        except Exception as exc:  # noqa: BLE001 - reported by info(), the driver decides
            self.start_error = _one_line(exc)
            sys.stderr.write(traceback.format_exc())
        self.engine_start_s = time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        workers = list(getattr(getattr(self.generator, "executor", None), "workers", None) or [])
        max_seqs = getattr(getattr(self.generator, "scheduler", None), "max_num_running_reqs", 0)
        return {
            "error": self.start_error,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "worker_pids": [h.proc.pid for h in workers if getattr(h, "proc", None) is not None],
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cpu_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "max_num_seqs": int(max_seqs or 0),
            "max_num_batched_tokens": engine_step_tokens(self.generator),
            "engine_start_s": self.engine_start_s,
            "environment": self.report.env.as_dict() if self.report is not None else {},
            "applied": list(self.report.applied) if self.report is not None else [],
        }

    def run_batch(self, batch: int, attempt: int, samples: list[Sample]) -> dict[str, Any]:
        """Generate and write one batch; ``lost`` (with ``ran``: this batch was the one running)
        when the engine can run no more, ``write_failed`` when a file could not be written."""
        output, sync = self.config.output, self.config.fsync
        with self.lock:
            if self.lost is not None:
                return {"lost": self.lost, "ran": False}
            started = time.perf_counter()
            try:
                good, failed = generate_isolating(self.generator.generate, samples)
            except Exception as exc:  # noqa: BLE001 - generate_isolating raises only errors that leave no engine
                self.lost = _one_line(exc)
                self._stop_engine()
                return {"lost": self.lost, "ran": True}
            generate_s = time.perf_counter() - started
            payloads = sample_payloads(good, self.save_dtype)
            names = [self.fmt.file_name(sample.idx, sample.row) for sample, _ in good]
            del good
        written_started = time.perf_counter()
        futures: list[tuple[int, str, Future[Saved]]] = []
        attempt_dir = f"{TMP_DIR}/{batch}-{attempt}"
        (output / attempt_dir).mkdir(parents=True, exist_ok=True)
        for (idx, payload), name in zip(payloads, names, strict=True):
            tmp = f"{attempt_dir}/{Path(name).name}.tmp"
            future = self.pool.submit(write_in_format, self.fmt, output, name, tmp, payload, sync, False, self.staging)
            futures.append((idx, tmp, future))
        del payloads
        written: list[tuple[int, str, int, str, int, dict[str, Any] | None]] = []
        problem: str | None = None
        for idx, tmp, future in futures:
            try:
                saved = future.result()
                written.append((idx, tmp, saved.tokens, saved.sha256, saved.size, saved.extra))
            except (WriteFailed, OSError) as exc:
                problem = problem or str(exc)
        if problem is not None:
            for _, tmp, _ in futures:
                (output / tmp).unlink(missing_ok=True)
            return {"write_failed": problem}
        return {
            "written": written,
            "failed": [(sample.idx, detail) for sample, detail in failed],
            "generate_s": generate_s,
            "write_s": time.perf_counter() - written_started,
        }

    def _stop_engine(self) -> None:
        executor = getattr(self.generator, "executor", None)
        if executor is not None:
            with contextlib.suppress(Exception):  # the engine is being given up anyway
                executor.shutdown()

    def shutdown(self) -> None:
        self._stop_engine()
        self.pool.shutdown(wait=True, cancel_futures=True)
