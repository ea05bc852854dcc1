from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_compat.adapters.contract import check_results, contract_violations
from spec_compat.errors import ResultContractError

HIDDEN = 8


def _valid(lengths: list[int], layers: int) -> tuple[list[list[int]], list[dict[str, object]]]:
    inputs = [[(i * 7 + j) % 50 for j in range(n)] for i, n in enumerate(lengths)]
    results = [
        {
            "input_ids": torch.tensor(ids),
            "hidden_states": [torch.randn(len(ids), HIDDEN) for _ in range(layers)],
            "loss_mask": None,
        }
        for ids in inputs
    ]
    return inputs, results


batches = st.lists(st.integers(1, 12), min_size=1, max_size=8)


@given(batches, st.integers(1, 4))
@settings(max_examples=50, deadline=None)
def test_valid_results_pass(lengths: list[int], layers: int) -> None:
    inputs, results = _valid(lengths, layers)
    assert contract_violations(results, inputs, list(range(layers)), HIDDEN) == []


@given(
    batches, st.integers(1, 4), st.sampled_from(["drop", "swap", "shape", "nan", "layers", "ids", "flatten"]), st.data()
)
@settings(max_examples=100, deadline=None)
def test_corruptions_are_caught(lengths: list[int], layers: int, corruption: str, data: st.DataObject) -> None:
    inputs, results = _valid(lengths, layers)
    k = data.draw(st.integers(0, len(results) - 1))
    if corruption == "drop":
        results.pop(k)
    elif corruption == "swap":
        distinct = [i for i in range(len(inputs)) if inputs[i] != inputs[k]]
        if not distinct:
            return
        other = data.draw(st.sampled_from(distinct))
        results[k], results[other] = results[other], results[k]
    elif corruption == "shape":
        results[k]["hidden_states"][0] = torch.randn(lengths[k] + 1, HIDDEN)
    elif corruption == "nan":
        results[k]["hidden_states"][-1][0, 0] = float("nan")
    elif corruption == "layers":
        results[k]["hidden_states"] = results[k]["hidden_states"][:-1]
    elif corruption == "ids":
        results[k]["input_ids"] = torch.tensor([x + 1 for x in inputs[k]])
    elif corruption == "flatten":  # the user's 771 x [512] story: per-token vectors instead of per-layer tensors
        results[k]["hidden_states"] = list(torch.cat(results[k]["hidden_states"]).unbind(0))
    with pytest.raises(ResultContractError):
        check_results(results, inputs, list(range(layers)), HIDDEN)


def test_message_says_expected_and_actual() -> None:
    inputs = [list(range(771))]
    results = [{"input_ids": torch.arange(771), "hidden_states": [torch.zeros(512)] * 771}]
    with pytest.raises(ResultContractError, match=r"expected 4 hidden-state tensors .* got list of 771 .*\[512\]"):
        check_results(results, inputs, [2, 30, 58, 60], 7168)
