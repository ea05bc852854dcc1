"""``--replicas N``'s bookkeeping: a batch of the queue, a replica's place in the job, what is reported."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .config import Sample


@dataclass
class WorkItem:
    id: int
    samples: list[Sample]
    tokens: int
    deaths: int = 0  # engines that died while this batch was the one running
    attempts: int = 0


@dataclass
class Slot:
    """A replica's place in the job, across the actors that fill it (a restart is a new actor)."""

    index: int
    actor: Any = None
    state: str = "starting"  # starting, ready, failed (start failed, not retried yet), retired
    in_flight: dict[Any, WorkItem] = field(default_factory=dict)  # ObjectRef -> batch, oldest first
    start_failures: int = 0  # in a row
    restarts: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    first_ready: float | None = None
    batches: int = 0
    samples: int = 0
    tokens: int = 0
    generate_s: float = 0.0
    engine_start_s: list[float] = field(default_factory=list)
    last_error: str | None = None


def cpu_binding(slot: int, tp: int, replicas: int, cpus: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for one replica of a local CPU job: each of its TP ranks gets its
    own share of the cores ("0-3|4-7"), replicas side by side (more ranks than cores share)."""
    share = max(1, cpus // max(1, replicas * tp))
    ranks = []
    for rank in range(tp):
        first = ((slot * tp + rank) * share) % cpus
        last = min(first + share, cpus) - 1
        ranks.append(str(first) if first == last else f"{first}-{last}")
    return "|".join(ranks)


def after_engine_death(
    items: list[WorkItem], culprit: WorkItem, max_retries: int, limit: int, next_id: int
) -> tuple[list[WorkItem], WorkItem | None, int]:
    """A replica's in-flight batches after its engine died under ``culprit``: (what goes back to the
    front of the queue, in order; the single-sample batch given up, if it was the culprit once too
    often; the next batch id). The culprit is retried ``max_retries`` times, then split in halves
    with one attempt each, down to one sample."""
    requeue: list[WorkItem] = []
    given_up: WorkItem | None = None
    for item in items:
        if item is not culprit:
            requeue.append(item)
            continue
        item.deaths += 1
        if item.deaths <= max_retries:
            requeue.append(item)
        elif len(item.samples) > 1:  # one of its samples may take the engine down: halves, one attempt each
            half = len(item.samples) // 2
            for part in (item.samples[:half], item.samples[half:]):
                tokens = sum(min(len(s.input_ids), limit) for s in part)
                requeue.append(WorkItem(next_id, part, tokens, deaths=max_retries))
                next_id += 1
        else:
            given_up = item
    return requeue, given_up, next_id


def progress_line(
    slots: list[Slot], done_samples: int, total_samples: int, done_tokens: int, total_tokens: int, started: float | None
) -> str:
    """The job's progress and each ready replica's samples and rate, drawn over itself."""
    now = time.perf_counter()
    elapsed = max(now - (started or now), 1e-9)
    rate = done_tokens / elapsed
    eta = (total_tokens - done_tokens) / rate if rate > 0 else float("inf")
    width = 30
    filled = int(width * done_samples / max(total_samples, 1))
    per = " ".join(
        f"r{s.index} {s.samples} ({s.tokens / max(now - s.first_ready, 1e-9):,.0f} tok/s)"
        for s in slots
        if s.first_ready is not None
    )
    return (
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done_samples}/{total_samples} samples "
        f"{rate:,.0f} tok/s ETA {eta:,.0f}s | {per}   "
    )


def summary_rows(slots: list[Slot], now: float) -> list[dict[str, Any]]:
    """One row per replica for extract_stats.json and the closing lines."""
    rows = []
    for s in slots:
        busy = now - s.first_ready if s.first_ready is not None else 0.0
        rows.append(
            {
                "replica": s.index,
                "host": s.info.get("host"),
                "gpus": s.info.get("gpus"),
                "cpu_bind": s.info.get("cpu_bind"),
                "batches": s.batches,
                "samples": s.samples,
                "tokens": s.tokens,
                "tokens_per_s": s.tokens / busy if busy > 0 else None,
                "generate_s": s.generate_s,
                "engine_start_s": s.engine_start_s,
                "restarts": s.restarts,
                "state": s.state,
                "last_error": s.last_error,
            }
        )
    return rows


def print_summary(rows: list[dict[str, Any]]) -> None:
    """The closing line of each replica (its batches, samples, rate, engine starts, restarts)."""
    for row in rows:
        restarts = f", {row['restarts']} restart(s) (last: {row['last_error']})" if row["restarts"] else ""
        if not row["engine_start_s"]:
            why = row["last_error"] or "still starting when the work ran out"
            print(f"spec-compat extract: replica {row['replica']}: ran no batch ({why}){restarts}", file=sys.stderr)
            continue
        starts = ", ".join(f"{s:.1f}" for s in row["engine_start_s"])
        print(
            f"spec-compat extract: replica {row['replica']} ({row['host']}): {row['batches']} batches, "
            f"{row['samples']} samples, {row['tokens']:,} tokens, {row['tokens_per_s'] or 0:,.0f} tok/s "
            f"(generating {row['generate_s']:.1f} s), engine start {starts} s{restarts}",
            file=sys.stderr,
        )
