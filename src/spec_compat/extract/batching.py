"""Batches: planning them, running one with bad samples isolated, the payloads, progress."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from .config import Sample


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


# N: the tail's batches take at most max_tokens / N tokens; "0" (or "1"): the last batches as large as the
# others (no tapered tail). For A/Bs on the GPU (run Y: the tail's 6-8 small batches each pay a call's fixed cost).
TAPER_ENV = "SPEC_COMPAT_EXTRACT_TAPER"
TAPER_DIVISOR = 4  # the default N


def taper_divisor() -> int:
    """SPEC_COMPAT_EXTRACT_TAPER as a whole number (default ``TAPER_DIVISOR``); anything else is refused."""
    value = os.environ.get(TAPER_ENV, str(TAPER_DIVISOR)).strip()
    if not value.isdigit():
        raise ValueError(f"{TAPER_ENV}={value!r}: want a whole number (0: no tapered tail, N: batches of 1/N)")
    return int(value)


def tail_batches(pending_batches: int, divisor: int | None = None) -> int:
    """How many of the last batches ``plan_batches`` replans smaller: as many as the writer holds
    at the end (``--pending-batches``), or 0 with a divisor of 0 or 1 (``divisor``, else read from
    SPEC_COMPAT_EXTRACT_TAPER)."""
    return 0 if (taper_divisor() if divisor is None else divisor) <= 1 else pending_batches


def plan_batches(
    lengths: list[int],
    max_samples: int,
    max_tokens: int,
    slots: int | None = None,
    tail: int = 0,
    divisor: int = TAPER_DIVISOR,
) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive samples: at most ``max_samples`` and ``max_tokens`` each
    (a single sample longer than ``max_tokens`` is a batch of its own).

    ``tail``: the samples of the last ``tail`` batches are replanned with ``max_tokens / divisor``
    (a quarter by default: a tapered tail). Why: when the last ``generate()`` returns, the writer still
    holds up to ``--pending-batches`` batches, and the run ends only when they are on the disk
    (H200, run W: the end's wait was about 0.5 s of a 7-9 s extract of 0.7M tokens, two 32k-token
    batches at 2.1 GB/s). Smaller last batches leave a quarter of that to wait for where the writer
    keeps up with the engine; where it is behind, the wait only moves to the tail's first batches
    (H100, run X: drain 0.09-0.18 s, tail waits 0.35-0.61 s). The same samples, in the same order,
    in the same files.

    ``slots``: the generator's running slots (its scheduler's max_num_seqs). A call of more samples
    runs in parts of ``slots`` (adapter sequence-limit), each a whole engine run of its own; a batch
    of more than ``slots`` samples is cut to a whole number of parts, so no part is a short tail (on
    an H200, --batch-size 64 with the token limit made batches of ~35 samples: a 32-sample part and a
    3-sample one per call, and the forward ran 1.25-1.5x slower per token than in whole parts)."""
    batches = _plan(lengths, 0, max_samples, max_tokens, slots)
    if tail and len(batches) > tail:
        start = batches[-tail][0]
        smaller = _plan(lengths, start, max_samples, max(1, max_tokens // max(1, divisor)), slots)
        if len(smaller) > tail:
            batches = batches[:-tail] + smaller
    return batches


def _plan(
    lengths: list[int], start: int, max_samples: int, max_tokens: int, slots: int | None
) -> list[tuple[int, int]]:
    batches: list[tuple[int, int]] = []
    while start < len(lengths):
        end, tokens = start, 0
        while end < len(lengths) and end - start < max_samples:
            if end > start and tokens + lengths[end] > max_tokens:
                break
            tokens += lengths[end]
            end += 1
        if slots and end - start > slots:
            end = start + (end - start) // slots * slots
        batches.append((start, end))
        start = end
    return batches


def _engine_gone(exc: BaseException) -> bool:
    """Errors after which the engine cannot run another batch (no point retrying samples)."""
    from ..errors import EngineStopped, WorkerError, WorkerTimeout

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
