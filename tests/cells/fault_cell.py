"""Fault injection against a real TP=2 engine (run in a fresh interpreter).

Usage: python tests/cells/fault_cell.py MODEL_DIR SCENARIO[,SCENARIO...] OUT_JSON
One driver process, one apply(), one engine per scenario (started after the previous one is shut
down); OUT_JSON holds {scenario: record}. Scenarios: errors (empty-message exceptions on rank 0 /
rank 1 only, an exception in the model forward), kill (a worker process killed in the middle of
generate()), transfer (a NaN in one captured layer, then rank 0 killed half-way through writing its
shared-memory segment).
Each fault is injected with collective_rpc(callable): functions defined here are pickled by value.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from outcomes import alive, capture


def _rank(worker: Any) -> int:
    from vllm.distributed import get_tp_group

    return int(get_tp_group().rank_in_group)


def raise_on_rank_0(worker: Any) -> None:
    if _rank(worker) == 0:
        raise AssertionError()


def break_get_captured_states_on_rank_1(worker: Any) -> None:
    if _rank(worker) == 1:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("")

        worker.worker._get_captured_states = broken


def restore_get_captured_states(worker: Any) -> None:
    worker.worker.__dict__.pop("_get_captured_states", None)


def _layer(worker: Any, index: int) -> Any:
    model = worker.worker.model_runner.model
    return model.model.layers[index]


def break_forward_on_rank_0(worker: Any) -> None:
    if _rank(worker) == 0:
        layer = _layer(worker, 1)

        def forward(*args: Any, **kwargs: Any) -> Any:
            raise ValueError("injected failure in decoder layer 1")

        layer.forward = forward


def restore_forward(worker: Any) -> None:
    _layer(worker, 1).__dict__.pop("forward", None)


def kill_on_next_forward_rank_1(worker: Any) -> None:
    if _rank(worker) == 1:
        layer = _layer(worker, 1)

        def forward(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), 9)

        layer.forward = forward


def nan_after_layer_2_on_rank_0(worker: Any) -> None:
    if _rank(worker) == 0:
        layer = _layer(worker, 2)
        original = type(layer).forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            hidden, residual = original(layer, *args, **kwargs)
            hidden = hidden.clone()
            hidden[-1] = float("nan")  # the last token of the batch, in layer 2's output only
            return hidden, residual

        layer.forward = forward


def restore_layer_2(worker: Any) -> None:
    _layer(worker, 2).__dict__.pop("forward", None)


def kill_while_writing_states_on_rank_0(worker: Any) -> None:
    if _rank(worker) == 0:
        from spec_compat.adapters import stream, transfer

        def pack(value: Any, pool: Any) -> Any:
            _, tensors = transfer.flatten(value)
            segment = pool.acquire(sum(t.numel() * t.element_size() for t in tensors), pin=False)
            segment.host[: segment.size // 2].fill_(7)  # half-written
            os.kill(os.getpid(), 9)

        def copy(self: Any, reply: Any, tensors: Any, moves: Any) -> None:  # a step's rows (captured-states-streamed)
            reply.segment.host[: reply.segment.size // 2].fill_(7)
            os.kill(os.getpid(), 9)

        transfer.pack = pack
        stream.StatesStreamer._copy = copy  # type: ignore[method-assign]


def _capture(fn: Any) -> dict[str, Any]:
    return capture(fn, lambda exc: {"exc_type": getattr(exc, "exc_type", None), "rank": getattr(exc, "rank", None)})


def main() -> None:
    model, scenarios, out_path = sys.argv[1:4]
    import spec_compat

    spec_compat.apply(dtype="float32")
    records = {scenario: run_scenario(model, scenario) for scenario in scenarios.split(",")}
    with open(out_path, "w") as handle:
        json.dump(records, handle)


def run_scenario(model: str, scenario: str) -> dict[str, Any]:
    from speculators.data_generation import VllmHiddenStatesGenerator

    generator = VllmHiddenStatesGenerator(model, layer_ids=[0, 2], max_model_len=128, tensor_parallel_size=2)
    executor = generator.executor
    pids = [h.proc.pid for h in executor.workers]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    record: dict[str, Any] = {"pids": pids}
    if scenario == "errors":
        import torch

        bad_inputs = {
            "empty_batch": [],
            "empty_sequence": [[5, 6], []],
            "negative_id": [[5, -1]],
            "non_integer_id": [[5, 6.0]],
            "id_beyond_vocab": [[5, 10_000]],
            "float_tensor": torch.zeros(2, 3),
            "one_dim_tensor": torch.tensor([5, 6, 7]),
        }
        steps_before = len(executor.step_log)
        record["bad_input"] = {name: _capture(lambda b=bad: generator.generate(b)) for name, bad in bad_inputs.items()}
        record["bad_input_reached_engine"] = len(executor.step_log) != steps_before
        long_prompt = [7] * 300  # max_model_len 128: truncated to 127 with a warning, as speculators does
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            truncated = generator.generate([long_prompt])
        record["long_prompt"] = {
            "tokens": len(truncated[0]["input_ids"]),
            "shape": list(truncated[0]["hidden_states"][0].shape),
            "warned": any("truncated" in str(w.message) for w in caught),
        }
        record["rpc_empty_rank0"] = _capture(lambda: executor.collective_rpc(raise_on_rank_0))
        executor.collective_rpc(break_get_captured_states_on_rank_1)
        record["speculators_rpc_empty_rank1"] = _capture(lambda: generator.generate(prompts))
        executor.collective_rpc(restore_get_captured_states)
        record["healthy_after"] = _capture(lambda: generator.generate(prompts))
        executor.collective_rpc(break_forward_on_rank_0)
        record["forward_error"] = _capture(lambda: generator.generate(prompts))
    elif scenario == "kill":
        executor.collective_rpc(kill_on_next_forward_rank_1)
        record["killed"] = _capture(lambda: generator.generate(prompts))
    elif scenario == "transfer":
        record["transfer_directory"] = executor.transfer_directory
        executor.collective_rpc(nan_after_layer_2_on_rank_0)
        record["nan"] = _capture(lambda: generator.generate(prompts))  # the engine's first reply: packed
        record["states_replies_after_nan"] = dict(executor.states_replies)
        executor.collective_rpc(restore_layer_2)
        record["healthy_after"] = _capture(lambda: generator.generate(prompts))
        executor.collective_rpc(nan_after_layer_2_on_rank_0)
        record["nan_streamed"] = _capture(lambda: generator.generate(prompts))  # a later one: streamed
        record["states_replies_after_nan_streamed"] = dict(executor.states_replies)
        executor.collective_rpc(restore_layer_2)
        executor.collective_rpc(kill_while_writing_states_on_rank_0)
        record["killed"] = _capture(lambda: generator.generate(prompts))
    started = time.perf_counter()
    executor.shutdown()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    record["orphans"] = [p for p in pids if alive(p)]
    directory = getattr(executor, "transfer_directory", None)
    record["transfer_directory_left"] = bool(directory and os.path.exists(directory))
    record["shutdown_seconds"] = time.perf_counter() - started
    return record


if __name__ == "__main__":
    from cell_main import run

    run(main)
