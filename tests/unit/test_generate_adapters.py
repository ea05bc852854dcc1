"""The generate()/__init__ wrappers on a fake generator that orders results like speculators 0.4."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from spec_compat.adapters.contract import contract_violations, int64_key, known_input_keys
from spec_compat.adapters.driver.input_order import reorder_to_inputs
from spec_compat.adapters.driver.input_validation import validated_rows
from spec_compat.adapters.driver.single_step_batches import _verify_worker_order, plan_single_step_batches
from spec_compat.detect import detect
from spec_compat.errors import IncompatibleError, ResultContractError
from spec_compat.options import Context, Options
from spec_compat.patching import Patcher
from spec_compat.registry import BY_ID
from tests.unit.apply_adapters import apply_adapters
from tests.unit.fake_generator_class import fake_generator_module

GENERATE_ADAPTERS = ["single-step-batches", "input-order", "layer-ids", "results-contract", "input-validation"]


def _patched(tmp_path: Path) -> tuple[Any, Patcher, list[str]]:
    module = fake_generator_module(tmp_path)
    patcher, applied = apply_adapters(Context(env=detect(), options=Options(), generator=module), GENERATE_ADAPTERS)
    return module, patcher, applied


def _batch(n: int) -> list[list[int]]:
    return [[(i * 3 + j) % 90 + 1 for j in range(1 + i % 5)] for i in range(n)]


@pytest.mark.parametrize("n", [1, 10, 11, 13, 25])
def test_results_come_back_in_input_and_layer_order(tmp_path: Path, n: int) -> None:
    module, patcher, applied = _patched(tmp_path)
    try:
        assert applied == ["input-order", "layer-ids", "results-contract", "input-validation"]
        generator = module.VllmHiddenStatesGenerator("m", layer_ids=[3, 0, 2])
        results = generator.generate(_batch(n))
        for i, result in enumerate(results):
            assert result["input_ids"].tolist() == _batch(n)[i]
            assert [float(h[0, 0]) for h in result["hidden_states"]] == [3000 + i, 0 + i, 2000 + i]
    finally:
        patcher.revert()


def test_batches_beyond_the_sequence_limit_are_split(tmp_path: Path) -> None:
    module = fake_generator_module(tmp_path)
    ctx = Context(env=detect(), options=Options(), generator=module)
    patcher = Patcher()
    for adapter_id in ["sequence-limit", "input-order", "results-contract"]:
        assert BY_ID[adapter_id].probe(ctx).applies
        BY_ID[adapter_id].install(ctx, patcher)
    try:
        generator = module.VllmHiddenStatesGenerator("m", layer_ids=[0])
        generator.scheduler.max_num_running_reqs = 4
        results = generator.generate(_batch(11))
        assert [len(call) for call in generator.calls] == [4, 4, 3]
        assert [r["input_ids"].tolist() for r in results] == _batch(11)
    finally:
        patcher.revert()


def test_without_adapters_11_inputs_come_back_permuted(tmp_path: Path) -> None:
    module = fake_generator_module(tmp_path)
    results = module.VllmHiddenStatesGenerator("m", layer_ids=[0]).generate(_batch(11))
    assert [r["input_ids"].tolist() for r in results] != _batch(11)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ([], ValueError, "empty"),
        ([[1, 2], []], ValueError, r"token_ids\[1\] is empty"),
        ([[1, -1]], ValueError, "outside the vocabulary"),
        ([[1, 100]], ValueError, "outside the vocabulary"),
        ([[1, 2.0]], TypeError, "is not an int"),
        ([[1, True]], TypeError, "is not an int"),
        (torch.zeros(2, 3), TypeError, "integer dtype"),
        (torch.zeros(3, dtype=torch.long), ValueError, "2-D"),
        ("abc", TypeError, "list of token-id sequences"),
    ],
)
def test_bad_input_is_refused_before_the_engine(tmp_path: Path, bad: Any, error: type, match: str) -> None:
    module, patcher, _ = _patched(tmp_path)
    try:
        generator = module.VllmHiddenStatesGenerator("m", layer_ids=[0])
        with pytest.raises(error, match=match):
            generator.generate(bad)
        assert generator.calls == []  # nothing reached the generator's own code
    finally:
        patcher.revert()


def test_layer_ids_duplicates_refused_and_long_prompts_warned(tmp_path: Path) -> None:
    module, patcher, _ = _patched(tmp_path)
    try:
        with pytest.raises(ValueError, match="repeat"):
            module.VllmHiddenStatesGenerator("m", layer_ids=[1, 1])
        generator = module.VllmHiddenStatesGenerator("m", layer_ids=[0], max_model_len=8)
        with pytest.warns(UserWarning, match="truncated"):
            results = generator.generate([[1] * 20, [2] * 3])
        assert [len(r["input_ids"]) for r in results] == [7, 3]
    finally:
        patcher.revert()


def test_speculators_default_layer_ids_with_repeats_are_refused_before_the_config_is_built(tmp_path: Path) -> None:
    module, patcher, _ = _patched(tmp_path)
    try:
        pattern = r"speculators' default layer_ids for this model \[2, 3, 3, 5\] repeat \[3\].*--layer-ids"
        with pytest.raises(ValueError, match=pattern):
            module.VllmHiddenStatesGenerator("m", num_layers=6)  # the 6-layer model
        with pytest.raises(ValueError, match=r"\[2, 2, 1, 3\] repeat \[2\]"):
            module.VllmHiddenStatesGenerator("m", num_layers=4)
        assert module.CONFIGS_BUILT == []  # refused before anything that leads to the weights
        assert module.VllmHiddenStatesGenerator("m", num_layers=7).layer_ids == [2, 3, 4, 6]
        assert module.CONFIGS_BUILT == [[2, 3, 4, 6]]
    finally:
        patcher.revert()


def test_unschedulable_prompts_are_refused_when_chunked_prefill_is_off(tmp_path: Path) -> None:
    module, patcher, _ = _patched(tmp_path)
    try:
        generator = module.VllmHiddenStatesGenerator("m", layer_ids=[0], max_model_len=200)
        generator.scheduler.scheduler_config.enable_chunked_prefill = False
        with pytest.raises(ValueError, match="chunked prefill off"):
            generator.generate([[1] * 65])
        generator.generate([[1] * 64])
    finally:
        patcher.revert()


def test_contract_violation_is_loud(tmp_path: Path) -> None:
    module = fake_generator_module(tmp_path)
    honest = module.VllmHiddenStatesGenerator.generate

    def flattened(self: Any, token_ids: Any) -> Any:  # per-token vectors instead of per-layer tensors
        results = honest(self, token_ids)
        results[0]["hidden_states"] = list(results[0]["hidden_states"][0].unbind(0))
        return results

    module.VllmHiddenStatesGenerator.generate = flattened
    patcher = Patcher()
    BY_ID["results-contract"].install(Context(env=detect(), options=Options(), generator=module), patcher)
    try:
        with pytest.raises(ResultContractError, match=r"expected 2 hidden-state tensors .* got list of 3"):
            module.VllmHiddenStatesGenerator("m", layer_ids=[0, 1]).generate([[1, 2, 3]])
    finally:
        patcher.revert()
    assert module.VllmHiddenStatesGenerator.generate is flattened


def test_reorder_matches_by_content_with_duplicates() -> None:
    inputs = [[1, 2], [3], [1, 2]]
    results = [{"input_ids": torch.tensor(ids), "tag": k} for k, ids in enumerate([[3], [1, 2], [1, 2]])]
    ordered = reorder_to_inputs(results, inputs)
    assert [r["input_ids"].tolist() for r in ordered] == inputs


def test_single_step_planner() -> None:
    plan = plan_single_step_batches([10, 20, 40, 5, 64], max_tokens=64, max_seqs=3, max_kv_tokens=None, block_size=16)
    assert plan == [[0, 1], [2, 3], [4]]
    assert [i for batch in plan for i in batch] == list(range(5))
    with pytest.raises(ValueError, match=r"speculators 0\.3\.0"):
        plan_single_step_batches([65], max_tokens=64, max_seqs=3, max_kv_tokens=None, block_size=16)
    tight = plan_single_step_batches([15, 15, 15], max_tokens=64, max_seqs=8, max_kv_tokens=32, block_size=16)
    assert tight == [[0, 1], [2]]


def test_normalise_accepts_tensors_and_tuples() -> None:
    assert validated_rows(torch.tensor([[1, 2], [3, 4]]), 10)[0] == [[1, 2], [3, 4]]
    assert validated_rows(([1], (2, 3), torch.tensor([4])), None)[0] == [[1], [2, 3], [4]]


def test_validated_rows_give_each_row_its_int64_key_and_the_contract_reads_it_back() -> None:
    rows, keys = validated_rows([[1, 2, 3], (4, 5)], 10)
    assert rows == [[1, 2, 3], [4, 5]]
    assert keys == [array("q", [1, 2, 3]).tobytes(), array("q", [4, 5]).tobytes()]
    with pytest.raises(ValueError, match=r"token_ids\[0\]\[1\] = 18446744073709551616 is outside the vocabulary"):
        validated_rows([[1, 2**64]], 10)  # beyond int64: the slow path names it
    other = [1, 2, 3]  # equal to rows[0], another object: its key is computed, not looked up
    with known_input_keys(rows, [b"planted", None]):
        assert int64_key(rows[0]) == b"planted"  # the row object itself: the key validation made
        assert int64_key(other) == keys[0]
        assert int64_key(rows[1]) == keys[1]  # no key given for it: computed
    assert int64_key(rows[0]) == keys[0]  # outside the call: computed again
    results = [{"input_ids": torch.tensor(row), "hidden_states": [torch.zeros(len(row), 4)]} for row in rows]
    with known_input_keys(rows, keys):
        assert reorder_to_inputs(results[::-1], rows) == results
        assert contract_violations(results, rows, [0], 4) == []
        assert contract_violations(results[::-1], rows, [0], 4) != []


class _WorkerLogExecutor:
    def __init__(self, log: list[list[str | None]]) -> None:
        self.log = log

    def collective_rpc(self, method: str) -> list[list[list[str | None]]]:
        assert method == "_spec_compat_take_batch_log"
        log, self.log = self.log, []
        return [log]


@pytest.mark.parametrize(
    ("log", "ok"),
    [
        ([["req_0_0", "req_0_1"], ["req_1_0"]], True),
        ([[], ["req_0_0", "req_0_1"], ["req_0_0", "req_0_1", None], ["req_1_0"]], True),  # dummy, repeat
        ([["req_0_1", "req_0_0"], ["req_1_0"]], False),  # the worker permuted the first step
        ([["req_1_0"], ["req_0_0", "req_0_1"]], False),  # steps out of order
        ([["req_0_0"], ["req_1_0"]], False),  # a request missing from the first step
    ],
)
def test_worker_order_is_checked_once_per_call_against_every_step(log: list[list[str | None]], ok: bool) -> None:
    generator = type("Generator", (), {"executor": _WorkerLogExecutor(log)})()
    steps = [["req_0_0", "req_0_1"], ["req_1_0"]]
    if ok:
        _verify_worker_order(generator, steps)
    else:
        with pytest.raises(IncompatibleError, match="wrong requests"):
            _verify_worker_order(generator, steps)
    assert generator.executor.log == []  # the log was taken either way
