"""Repeated use of one real engine: 200 generate() calls of varying batch sizes against fresh
single-prompt calls, RSS of the driver and workers over them, and worker log visibility.

Usage: python tests/cells/state_cell.py MODEL_DIR TP CALLS OUT_JSON   (vLLM is imported before apply())
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any


def _rss(pids: list[int]) -> list[int]:
    import psutil

    return [psutil.Process(pid).memory_info().rss for pid in pids]


def main() -> None:
    model, tp, calls, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import os

    import torch
    import vllm  # noqa: F401 - apply() after vLLM is already imported

    import spec_compat

    spec_compat.apply(dtype="float32", worker_log_level="INFO")
    from speculators.data_generation import VllmHiddenStatesGenerator

    generator = VllmHiddenStatesGenerator(model, layer_ids=[1, 3], max_model_len=256, tensor_parallel_size=tp)
    pids = [os.getpid(), *(h.proc.pid for h in generator.executor.workers)]
    rng = random.Random(3)
    pool = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 120))] for _ in range(24)]
    single = [generator.generate([p])[0]["hidden_states"] for p in pool]
    record: dict[str, Any] = {"pids": pids, "rss_start": _rss(pids)}
    directory = generator.executor.transfer_directory
    segments_seen: set[str] = set()
    segments_max = 0
    worst = 0.0
    identical = 0
    compared = 0
    durations = []
    for call in range(calls):
        picks = [rng.randrange(len(pool)) for _ in range(rng.randrange(1, 14))]
        started = time.perf_counter()
        results = generator.generate([pool[i] for i in picks])
        durations.append(time.perf_counter() - started)
        for index, result in zip(picks, results, strict=True):
            for got, want in zip(result["hidden_states"], single[index], strict=True):
                compared += 1
                identical += int(torch.equal(got, want))
                worst = max(worst, float((got - want).abs().max()) / max(1.0, float(want.abs().max())))
        del results
        names = os.listdir(directory)
        segments_seen.update(names)
        segments_max = max(segments_max, len(names))
        if call == 9:
            record["rss_after_10"] = _rss(pids)
            record["driver_fds_after_10"] = len(os.listdir("/proc/self/fd"))
        if call % 25 == 24:
            record.setdefault("rss_curve", []).append([call + 1, *_rss(pids)])
    record.update(
        rss_end=_rss(pids),
        max_rel_diff_vs_single=worst,
        identical_fraction=identical / max(compared, 1),
        compared=compared,
        call_seconds_median=sorted(durations)[len(durations) // 2],
        call_seconds_first=durations[0],
        driver_fds_end=len(os.listdir("/proc/self/fd")),
        segments_max=segments_max,
        segments_made=len(segments_seen),
        states_replies=dict(generator.executor.states_replies),
    )
    generator.executor.shutdown()
    record["transfer_directory_left"] = os.path.exists(directory)
    with open(out_path, "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    from cell_main import run

    run(main)
