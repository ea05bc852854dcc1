"""The data path's speed-ups on a real engine: the shared-memory transfer (written step by step where
speculators 0.4.x allows: captured-states-streamed), the handover of its bytes to speculators' clones and
requests without prefix-cache hashes (block-hashes-off) give the same tensors,
bit for bit, as vLLM's own RPC path with copying clones and hashed requests (the adapters disabled),
for both speculators reply shapes, TP=1 and TP=2."""

from __future__ import annotations

from typing import Any

import pytest

from engine_harness import Cell, CellPool

pytestmark = pytest.mark.engine
SPEED_UPS = (
    "captured-states-shared-memory",
    "captured-states-streamed",
    "executor-shared-memory-replies",
    "driver-states-handover",
    "block-hashes-off",
)
CASES = [Cell("0.4.0.1", "qwen3_moe", 2), Cell("0.3.0", "dense", 1)]  # test_engine.py's cells, read again
PAIRS = [(cell, Cell(cell.speculators, cell.family, cell.tp, disable=SPEED_UPS)) for cell in CASES]


def _bitwise_equal(a: list[list[Any]], b: list[list[Any]]) -> bool:
    import torch

    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(("cell", "without"), PAIRS, ids=[c.name for c in CASES])
def test_transfer_is_bitwise_equal_to_vllm_rpc(cell: Cell, without: Cell, engine_cells: CellPool) -> None:
    shared, output = engine_cells.result(cell)
    assert shared is not None, output
    pickled, output = engine_cells.result(without)
    assert pickled is not None, output
    assert pickled["transfer"]["directory"] is None and pickled["transfer"]["states_replies"]["verified"] == 0
    assert shared["transfer"]["states_replies"]["verified"] > 0
    # speculators 0.4.x's replies after the engine's first are written step by step (captured-states-streamed),
    # the chunked-prefill ones included; 0.3.0's worker keeps no per-step request metadata
    assert pickled["transfer"]["states_replies"]["streamed"] == 0
    if cell.speculators.startswith("0.4"):
        after = shared["streamed_after"]
        assert after["repeats"] >= 3  # every call after the first (its size unknown until it ends)
        assert after["chunk_prompts"] > after.get("big_batch", after["repeats"])  # prompts split across steps
    else:
        assert shared["transfer"]["states_replies"]["streamed"] == 0
    assert pickled["transfer"]["segments_handed_over"] == 0
    assert shared["transfer"]["segments_handed_over"] >= 1  # speculators' clones kept the shared bytes
    assert shared["results_own_storage"] and pickled["results_own_storage"]
    # speculators 0.4.x hashes prompt blocks unless block-hashes-off is on; 0.3.0 has no hasher either way
    assert pickled["block_hasher_set"] is cell.speculators.startswith("0.4")
    assert shared["block_hasher_set"] is False
    assert shared["input_ids"] == pickled["input_ids"]
    assert _bitwise_equal(shared["results"], pickled["results"])
    assert _bitwise_equal(shared["big_batch"]["results"], pickled["big_batch"]["results"])
    for name in ("chunk_prompts", "chunk_prompts_long"):
        if isinstance(pickled[name], str):
            assert shared[name] == pickled[name]  # the same refusal
        else:
            assert _bitwise_equal(shared[name], pickled[name]), name
