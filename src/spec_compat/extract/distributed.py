"""``spec-compat extract --replicas N``: the same extraction over Ray, one generator per replica.

Driver (this process): checks the dataset before anything loads (``dataset.checked_samples``),
owns ``manifest.json``, plans the batches a single-process run would (``batching.plan_batches``)
and hands them out from one queue to whichever replica has room (at most ``--pending-batches``
each), so a fast replica takes more.

Replica (a Ray actor: one process and its vLLM workers): ``spec_compat.apply()`` before
speculators is imported (its vLLM workers get the worker side through spec_compat's plugin, as in
a single-process run), one untouched ``VllmHiddenStatesGenerator``; a batch runs with bad samples
isolated (``batching.generate_isolating``), each sample's file (in its format) is written under a temporary
directory unique to the attempt (fsync'd, sha256 of the bytes written) and the replica
returns (idx, temporary name, tokens, sha256, size).

Exactly once: only the driver gives a file its final name (``os.replace``), after checking that
the file it sees has the size the replica wrote, and only for a sample not listed yet; then the
directory fsync, then the manifest. A replica given up for lost can at worst finish writing under
its attempt's temporary directory, which the driver deletes.

Faults: a replica whose engine died (a dead or silent vLLM worker: spec_compat's
``WorkerProcessDied`` / ``WorkerTimeout`` / ``EngineStopped``) or whose process died is killed and
started again, and its batches go back to the front of the queue. A batch that was running when
engines died ``max_retries + 1`` times is split in halves, each of which gets one more attempt,
down to single samples; a single sample that takes an engine down then is recorded as failed
(never retried forever). A replica slot that fails to start ``max_retries + 1`` times in a row is
given up; the job goes on with the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from . import formats
from .batching import plan_batches, tail_batches, taper_divisor
from .config import MANIFEST, STATS, ExtractConfig, ExtractError, Sample, WriteFailed
from .dataset import checked_samples
from .files import _write_json_atomic
from .manifest import Manifest, open_manifest, provenance
from .replica import TMP_DIR, Replica, _one_line
from .signals import SIGNALS, Interrupted
from .slots import Slot, WorkItem, after_engine_death, cpu_binding, print_summary, progress_line, summary_rows
from .writer import adopt_files, record_written

POLL_S = 0.5  # ray.wait timeout: how often progress is redrawn and a signal is noticed
SHUTDOWN_WAIT_S = 30.0  # replicas' engine shutdown at the end (an interrupted job: a third of it)
DEFAULT_MAX_RETRIES = 2
NO_RAY = "--replicas needs Ray, which is not installed: pip install 'spec-compat[ray]' (or: pip install ray)"


def _absolute_if_local(model: str) -> str:
    return str(Path(model).resolve()) if Path(model).exists() else model


class Job:
    """The driver's side: queue, replicas, manifest."""

    def __init__(
        self,
        ray: Any,
        config: ExtractConfig,
        manifest: Manifest,
        todo: list[Sample],
        replicas: int,
        max_retries: int,
        local: bool,
        new_manifest: bool,
    ) -> None:
        self.ray = ray
        self.config = config
        self.manifest = manifest
        self.todo = todo
        self.max_retries = max_retries
        self.new_manifest = new_manifest
        self.limit = config.max_model_len - 1
        self.fmt = formats.get(config)
        self.bytes = 0  # the samples' files recorded
        self.total_samples = len(todo)
        self.total_tokens = sum(min(len(s.input_ids), self.limit) for s in todo)
        self.slots = [Slot(i) for i in range(replicas)]
        self.refs: dict[Any, Slot] = {}  # run_batch ObjectRefs
        self.starting: dict[Any, Slot] = {}  # info() ObjectRefs of replicas starting
        self.queue: deque[WorkItem] | None = None  # planned once the first replica says its max_num_seqs
        self.next_id = 0
        self.failures = 0
        self.stopping = False
        self.done_samples = self.done_tokens = 0
        self.started: float | None = None  # the first replica ready: batches start
        self.finished: float | None = None  # the last batch recorded (the shutdown after it not counted)
        self.ever_ready = False
        self.actor_class = ray.remote(Replica)
        resources = ray.cluster_resources()
        tp = config.tensor_parallel_size
        self.gpus = float(resources.get("GPU", 0))
        if self.gpus > 0:
            self.options: dict[str, Any] = {"num_gpus": tp, "num_cpus": 1}
            needed, have, what = replicas * tp, self.gpus, "GPUs"
        else:
            self.options = {"num_cpus": tp}
            needed, have, what = replicas * tp, float(resources.get("CPU", 0)), "CPUs"
        if have < needed:
            raise ExtractError(f"--replicas {replicas} x --tp {tp} needs {needed} {what}; the Ray cluster has {have:g}")
        bind_cpus = local and self.gpus == 0 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
        self.cpus = os.cpu_count() or 1
        self.bind = bind_cpus

    # --- replicas -------------------------------------------------------------------------

    def start(self, slot: Slot) -> None:
        bind = (
            cpu_binding(slot.index, self.config.tensor_parallel_size, len(self.slots), self.cpus) if self.bind else None
        )
        slot.actor = self.actor_class.options(
            max_concurrency=self.config.pending_batches + 2, max_restarts=0, **self.options
        ).remote(self.config, slot.index, bind)
        slot.state = "starting"
        self.starting[slot.actor.info.remote()] = slot

    def _kill(self, slot: Slot) -> None:
        if slot.actor is not None:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(slot.actor, no_restart=True)
        slot.actor = None
        for ref in slot.in_flight:
            self.refs.pop(ref, None)
        slot.in_flight.clear()

    def on_started(self, ref: Any, slot: Slot) -> None:
        try:
            info = self.ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the actor process died while starting
            info = {"error": _one_line(exc)}
        if info.get("error"):
            self._kill(slot)
            slot.start_failures += 1
            slot.last_error = info["error"]
            if slot.start_failures > self.max_retries:
                slot.state = "retired"
                _say(f"replica {slot.index} could not start {slot.start_failures} times: given up ({info['error']})")
            elif self.ever_ready:
                _say(f"replica {slot.index} could not start ({info['error']}): starting it again")
                self.start(slot)
            else:
                slot.state = "failed"  # retried once another replica shows the job can start at all
                _say(f"replica {slot.index} could not start: {info['error']}")
            return
        slot.state, slot.info, slot.start_failures = "ready", info, 0
        slot.engine_start_s.append(info["engine_start_s"])
        if slot.first_ready is None:
            slot.first_ready = time.perf_counter()
        where = f"on {info['host']} (pid {info['pid']}, vLLM workers {' '.join(map(str, info['worker_pids']))}"
        where += f", GPUs {info['gpus']})" if self.gpus else f", CPUs {info['cpu_bind'] or 'as vLLM binds them'})"
        _say(f"replica {slot.index} ready {where} in {info['engine_start_s']:.1f} s")
        if not self.ever_ready:
            self.ever_ready = True
            self._first_ready(info)
            for other in self.slots:
                if other.state == "failed":
                    self.start(other)

    def _first_ready(self, info: dict[str, Any]) -> None:
        if self.new_manifest:  # what the replicas run with (the driver may not even have vLLM)
            self.manifest.data["provenance"]["environment"] = info["environment"]
            self.manifest.data["provenance"]["adapters_applied"] = info["applied"]
            self.manifest.save(self.config.fsync, rewrite=True)
        lengths = [min(len(s.input_ids), self.limit) for s in self.todo]
        slots = info["max_num_seqs"] or None
        max_samples = self.config.batch_size or slots or 16
        divisor = taper_divisor()  # SPEC_COMPAT_EXTRACT_TAPER, read once for the plan
        self.queue = deque(
            WorkItem(i, self.todo[begin:end], sum(lengths[begin:end]))
            for i, (begin, end) in enumerate(
                plan_batches(
                    lengths,
                    max_samples,
                    self.config.batch_tokens,
                    slots,
                    tail_batches(self.config.pending_batches, divisor),
                    divisor,
                )
            )
        )
        self.next_id = len(self.queue)
        self.started = time.perf_counter()

    def lose(self, slot: Slot, reason: str, culprit: WorkItem) -> None:
        """The replica's engine (or process) is gone: its batches back to the queue, a new replica."""
        items = list(slot.in_flight.values())
        self._kill(slot)
        slot.restarts += 1
        slot.last_error = reason
        assert self.queue is not None
        requeue, given_up, self.next_id = after_engine_death(items, culprit, self.max_retries, self.limit, self.next_id)
        if given_up is not None:
            sample = given_up.samples[0]
            self.failures += 1
            self.manifest.fail([sample.idx], f"an engine died while running it, {given_up.deaths} times: {reason}")
            self.manifest.save(self.config.fsync)
            _say(f"sample {sample.idx} failed: an engine died while running it, {given_up.deaths} times ({reason})")
            if self.config.on_error == "stop":
                self.stopping = True
        self.queue.extendleft(reversed(requeue))
        _say(
            f"replica {slot.index} lost ({reason}) while running batch {culprit.id} ({len(culprit.samples)} samples): "
            f"{len(requeue)} batch(es) back in the queue; starting a new replica"
        )
        if not self.stopping:
            self.start(slot)
        else:
            slot.state = "retired"

    # --- batches ---------------------------------------------------------------------------

    def fill(self) -> None:
        if self.queue is None or self.stopping:
            return
        for slot in self.slots:
            while slot.state == "ready" and self.queue and len(slot.in_flight) < self.config.pending_batches:
                item = self.queue.popleft()
                item.attempts += 1
                ref = slot.actor.run_batch.remote(item.id, item.attempts, item.samples)
                slot.in_flight[ref] = item
                self.refs[ref] = slot

    def on_result(self, ref: Any, slot: Slot) -> None:
        item = slot.in_flight[ref]
        oldest = next(iter(slot.in_flight.values()))  # the one holding the engine, as far as the driver knows
        try:
            result = self.ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the actor process died (killed, out of memory, its node)
            self.lose(slot, f"replica process died: {_one_line(exc)}", oldest)
            return
        if "lost" in result:
            self.lose(slot, result["lost"], item if result["ran"] else oldest)
            return
        del slot.in_flight[ref]
        self.refs.pop(ref)
        if "write_failed" in result:
            raise WriteFailed(result["write_failed"])
        self.record(slot, item, result)

    def record(self, slot: Slot, item: WorkItem, result: dict[str, Any]) -> None:
        rows = {sample.idx: sample.row for sample in item.samples}
        adopted = adopt_files(
            self.config.output,
            result["written"],
            self.manifest.data["samples"],
            lambda idx: self.fmt.file_name(idx, rows.get(idx)),
            f"replica {slot.index}",
            str(slot.info.get("host")),
        )
        record_written(self.manifest, self.config.output, adopted, self.config.fsync)
        self.bytes += sum(saved.size for _, _, saved in adopted)
        for idx, detail in result["failed"]:
            self.failures += 1
            self.manifest.fail([idx], detail)
            _say(f"sample {idx} failed:\n{detail}")
            if self.config.on_error == "stop":
                self.stopping = True
        self.manifest.save(self.config.fsync)
        slot.batches += 1
        slot.samples += len(adopted)
        slot.tokens += item.tokens
        slot.generate_s += result["generate_s"]
        self.done_samples += len(item.samples)
        self.done_tokens += item.tokens
        self.progress()

    def progress(self) -> None:
        sys.stderr.write(progress_line(self.slots, self.done_samples, self.total_samples, self.done_tokens,
                                       self.total_tokens, self.started))  # fmt: skip
        sys.stderr.flush()

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        for slot in self.slots:
            self.start(slot)
        while True:
            self.fill()
            if self.queue is not None and (self.stopping or not self.queue) and not self.refs:
                self.finished = time.perf_counter()
                return
            if not self.refs and not self.starting and not any(s.state in ("ready", "starting") for s in self.slots):
                first = next((s.last_error for s in self.slots if s.last_error), "unknown error")
                if not self.ever_ready:
                    raise ExtractError(f"no replica could start: {first}")
                raise ReplicasLost(f"every replica was lost or could not be restarted (last: {first})")
            waiting = list(self.refs) + list(self.starting)
            ready, _ = self.ray.wait(waiting, num_returns=1, timeout=POLL_S)
            for ref in ready:
                with SIGNALS.deferred():  # a batch's renames, manifest and sample_lengths.json: all or nothing
                    if ref in self.starting:
                        self.on_started(ref, self.starting.pop(ref))
                    elif ref in self.refs:
                        self.on_result(ref, self.refs[ref])

    def shutdown(self, wait_s: float) -> None:
        """Each ready replica shuts its engine down (its vLLM workers exit), then every replica
        process is killed (one still loading at once: its workers exit with their parent)."""
        refs = []
        for slot in self.slots:
            if slot.actor is not None and slot.state == "ready":
                with contextlib.suppress(Exception):  # already gone
                    refs.append(slot.actor.shutdown.remote())
        if refs:
            with contextlib.suppress(Exception):  # replicas that do not answer are killed below
                self.ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for slot in self.slots:
            self._kill(slot)

    def summary(self) -> list[dict[str, Any]]:
        return summary_rows(self.slots, self.finished or time.perf_counter())


class ReplicasLost(WriteFailed):
    """No replica is left to run the rest (what is done is kept: a rerun finishes it)."""


def _say(text: str) -> None:
    sys.stderr.write(f"\nspec-compat extract: {text}\n")
    sys.stderr.flush()


def _init_ray(ray: Any, address: str | None, replicas: int, tp: int) -> None:
    if address is not None:
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ExtractError(f"--ray-address {address}: cannot join the Ray cluster ({_one_line(exc)})") from None
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=max(os.cpu_count() or 1, replicas * tp),  # logical: replicas x TP always fit on this machine
        include_dashboard=False,
        object_store_memory=512 * 1024 * 1024,  # batches of token ids and file names, nothing large
        log_to_driver=True,
    )


def run_distributed(
    config: ExtractConfig, replicas: int, ray_address: str | None = None, max_retries: int = DEFAULT_MAX_RETRIES
) -> int:
    """``extract.run`` over ``replicas`` Ray actors; same checks, files, manifest and exit codes
    (0 all done, 1 samples failed / a write failed / every replica lost, 2 bad input, 128 + signal)."""
    try:
        import ray
    except ImportError:
        raise ExtractError(NO_RAY) from None
    config = dataclasses.replace(
        config, output=config.output.resolve(), input=config.input.resolve(), model=_absolute_if_local(config.model)
    )
    checked = checked_samples(config)
    if checked is None:
        return 2
    todo_all, bad = checked
    shutil.rmtree(config.output / TMP_DIR, ignore_errors=True)  # attempts of an earlier job
    from ..detect import detect

    new_manifest = not (config.output / MANIFEST).exists()
    manifest, todo = open_manifest(config, provenance(config, detect().as_dict(), []), todo_all, bad)
    manifest.data["runs"][-1].update(replicas=replicas, ray_address=ray_address, max_retries=max_retries)
    manifest.save(config.fsync, rewrite=True)
    if not todo:
        return 1 if bad else 0

    SIGNALS.install()
    job: Job | None = None
    interrupted: Interrupted | None = None
    try:
        _init_ray(ray, ray_address, replicas, config.tensor_parallel_size)
        job = Job(ray, config, manifest, todo, replicas, max_retries, ray_address is None, new_manifest)
        try:
            job.run()
        finally:
            sys.stderr.write("\n")
    except Interrupted as exc:
        interrupted = exc
    finally:
        try:
            if job is not None:
                job.shutdown(SHUTDOWN_WAIT_S / 3 if interrupted else SHUTDOWN_WAIT_S)
            if ray.is_initialized():
                ray.shutdown()
            shutil.rmtree(config.output / TMP_DIR, ignore_errors=True)
        finally:
            with contextlib.suppress(OSError, WriteFailed):  # if manifest.json cannot be, the journal keeps the rest
                manifest.close(config.fsync)
            SIGNALS.restore()
    assert job is not None
    extract_s = (job.finished or time.perf_counter()) - job.started if job.started is not None else 0.0
    rows = job.summary()
    print_summary(rows)
    if interrupted is not None:
        print(
            f"spec-compat extract: interrupted by {interrupted.args[0]}: {len(manifest.data['samples'])} sample(s) "
            f"are complete and listed in {manifest.path}; run the same command again to extract the rest",
            file=sys.stderr,
        )
        return 128 + interrupted.signum
    stats = {
        "samples": sum(r["samples"] for r in rows),
        "tokens": job.done_tokens,
        "batches": sum(r["batches"] for r in rows),
        "extract_s": extract_s,
        "tokens_per_s": job.done_tokens / extract_s if extract_s > 0 else None,
        "format": config.format,
        "save_dtype": config.save_dtype,
        "bytes": job.bytes,
        "replicas": rows,
        "tensor_parallel_size": config.tensor_parallel_size,
        "ray_address": ray_address,
        "fsync": config.fsync,
    }
    _write_json_atomic(config.output / STATS, stats)
    print(
        f"spec-compat extract: {stats['samples']} samples, {job.done_tokens:,} tokens in {extract_s:.1f} s "
        f"({stats['tokens_per_s'] or 0:,.0f} tok/s over {replicas} replica{'s' if replicas != 1 else ''}; "
        "from the first replica ready)",
        file=sys.stderr,
    )
    return 1 if job.failures or bad else 0
