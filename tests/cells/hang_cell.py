"""A TP=2 rank that blocks forever inside _get_captured_states (run in a fresh interpreter).

Usage: python tests/cells/hang_cell.py MODEL_DIR RPC_TIMEOUT_S OUT_JSON
Two engines one after the other: rank 1 (not the reply rank) blocks, then rank 0 (the reply rank).
For each: a healthy call first (the deadline does not fire on it; inductor's one-time ISA probe is
done before it, prepare_first_step), the blocked call (WorkerTimeout expected), a later call
(EngineStopped expected at once), and the worker processes left.
The block is injected with collective_rpc(callable): functions defined here are pickled by value.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from outcomes import alive, capture


def _block_on(worker: Any, rank: int) -> None:
    from vllm.distributed import get_tp_group

    if int(get_tp_group().rank_in_group) == rank:

        def blocked_forever_in_get_captured_states(*args: Any, **kwargs: Any) -> None:
            import threading

            threading.Event().wait()  # never set

        worker.worker._get_captured_states = blocked_forever_in_get_captured_states


def block_rank_0(worker: Any) -> None:
    _block_on(worker, 0)


def block_rank_1(worker: Any) -> None:
    _block_on(worker, 1)


def prepare_first_step(worker: Any) -> None:
    """At TP > 1 vLLM compiles its vocabulary-parallel embedding's masking with inductor (on CPU,
    enforce_eager or not), and the first compiled graph a process loads makes inductor probe the CPU's
    vector ISA by building and loading a test library in fresh Python processes: 2-3 s of the first
    model step on 2 idle cores, past the 8 s deadline on a loaded machine. Done here, in a callable
    RPC (no deadline), so the healthy call measures the deadline and not that probe."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
    except ImportError:  # a torch without it: nothing to prepare
        return
    pick_vec_isa()


def _capture(fn: Any) -> dict[str, Any]:
    def details(exc: Exception) -> dict[str, Any]:
        return {
            "is_worker_error": isinstance(exc, __import__("spec_compat").WorkerError),
            "rank": getattr(exc, "rank", None),
            "answered": getattr(exc, "answered", None),
            "stuck": getattr(exc, "stuck", None),
        }

    return capture(fn, details)


def main() -> None:
    model, timeout_s, out_path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    import spec_compat

    spec_compat.apply(dtype="float32", rpc_timeout_s=timeout_s)
    from speculators.data_generation import VllmHiddenStatesGenerator

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    record: dict[str, Any] = {"timeout_s": timeout_s}
    for name, inject in (("rank1", block_rank_1), ("rank0", block_rank_0)):
        generator = VllmHiddenStatesGenerator(model, layer_ids=[0, 2], max_model_len=128, tensor_parallel_size=2)
        executor = generator.executor
        pids = [h.proc.pid for h in executor.workers]
        case: dict[str, Any] = {"pids": pids, "watchdog_directory": executor.watchdog_directory}
        executor.collective_rpc(prepare_first_step)
        case["healthy"] = _capture(lambda g=generator: g.generate(prompts))
        executor.collective_rpc(inject)
        case["blocked"] = _capture(lambda g=generator: g.generate(prompts))
        case["later"] = _capture(lambda g=generator: g.generate(prompts))
        case["orphans"] = [p for p in pids if alive(p)]
        import os

        case["watchdog_directory_left"] = os.path.exists(executor.watchdog_directory)
        record[name] = case
        del generator, executor
    with open(out_path, "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    from cell_main import run

    run(main)
