"""extract's dataset check (before any engine) and its per-sample isolation of failures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spec_compat import extract
from spec_compat.errors import EngineStopped, WorkerError


def _config(path: Path, **kwargs: Any) -> extract.ExtractConfig:
    return extract.ExtractConfig(model="m", input=path, output=path.parent / "out", layer_ids=[0], **kwargs)


def test_every_bad_line_is_reported_with_its_number_and_every_good_one_kept(tmp_path: Path) -> None:
    lines = [
        json.dumps({"input_ids": [1, 2, 3]}),  # 1 good
        '{"input_ids": [1, 2,',  # 2 cut off
        json.dumps([1, 2]),  # 3 not an object
        json.dumps({"text": "hi"}),  # 4 no field
        json.dumps({"input_ids": []}),  # 5 empty
        json.dumps({"input_ids": [1, 2.5]}),  # 6 not ints
        json.dumps({"input_ids": [1, 100]}),  # 7 outside the vocabulary of 100
        json.dumps({"input_ids": [True, 1]}),  # 8 a bool is not a token id
        json.dumps({"input_ids": [1, 2], "loss_mask": [1]}),  # 9 mask length
        "",  # 10 blank: skipped, not bad
        json.dumps({"input_ids": [4, 5], "loss_mask": [0, 1]}),  # 11 good, with its mask
    ]
    path = tmp_path / "data.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"input_ids": [1], "x": "\xff"}\n')  # 12 not UTF-8
    samples, bad = extract.read_samples(_config(path), None, vocab_size=100)
    assert [(s.idx, s.input_ids, s.loss_mask) for s in samples] == [(0, [1, 2, 3], None), (10, [4, 5], [0, 1])]
    reasons = {b.line: b.reason for b in bad}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 8, 9, 12]
    assert reasons[2] == "not JSON (Expecting value at the end of the line)"
    assert reasons[3] == "not a JSON object (a list)"
    assert reasons[4].startswith("no 'input_ids' field")
    assert reasons[5] == "'input_ids' is empty"
    assert reasons[6] == "'input_ids'[1] = 2.5 is not an integer token id"
    assert reasons[7] == "token id 100 at position 1 is outside the vocabulary (size 100)"
    assert reasons[8] == "'input_ids'[0] = True is not an integer token id"
    assert reasons[9] == "'loss_mask' has 1 entries for 2 tokens"
    assert reasons[12].startswith("not UTF-8")
    assert str(bad[0]) == f"line 2: {reasons[2]}"


def test_shards_take_their_own_lines_and_a_missing_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [i + 1]}) + "\n" for i in range(5)))
    samples, bad = extract.read_samples(_config(path, shard=(1, 2)), None, vocab_size=None)
    assert [s.idx for s in samples] == [1, 3] and bad == []
    with pytest.raises(extract.ExtractError, match=r"^--input .*missing\.jsonl: No such file or directory$"):
        extract.read_samples(_config(tmp_path / "missing.jsonl"), None)


def _sample(idx: int, *ids: int) -> extract.Sample:
    return extract.Sample(idx, list(ids))


def test_a_bad_sample_never_fails_the_good_ones_of_its_batch() -> None:
    calls: list[int] = []

    def generate(batch: list[list[int]]) -> list[dict[str, Any]]:
        calls.append(len(batch))
        if any(13 in ids for ids in batch):
            raise ValueError("a sample the engine refuses")
        return [{"input_ids": ids} for ids in batch]

    batch = [_sample(i, i + 20) for i in range(8)]
    batch[5] = _sample(5, 13)
    good, failed = extract.generate_isolating(generate, batch)
    assert [s.idx for s, _ in good] == [0, 1, 2, 3, 4, 6, 7]
    assert all(result["input_ids"] == sample.input_ids for sample, result in good)
    assert [s.idx for s, _ in failed] == [5] and "ValueError: a sample the engine refuses" in failed[0][1]
    assert len(calls) == 1 + 2 * 3  # the batch, then one split per level down to the bad sample


@pytest.mark.parametrize(
    "error",
    [
        EngineStopped("a worker hung"),
        WorkerError("WorkerProcessDied", "rank 0 died", 0, "", "execute_model"),
    ],
)
def test_errors_that_leave_no_engine_are_not_retried(error: Exception) -> None:
    calls: list[int] = []

    def generate(batch: list[list[int]]) -> list[dict[str, Any]]:
        calls.append(len(batch))
        raise error

    with pytest.raises(type(error)):
        extract.generate_isolating(generate, [_sample(i, 5) for i in range(4)])
    assert calls == [4]


class _GeneratorWithStepBudget:  # speculators 0.4.x's constructor
    def __init__(self, model_path: str, max_num_batched_tokens: int | None = None) -> None: ...


class _GeneratorWithoutStepBudget:  # speculators 0.3.0's
    def __init__(self, model_path: str, tensor_parallel_size: int = 1) -> None: ...


def test_the_step_budget_goes_to_a_generator_that_takes_it_and_is_refused_by_one_that_does_not(
    tmp_path: Path,
) -> None:
    from spec_compat.extract.config import generator_options

    assert generator_options(_config(tmp_path / "d.jsonl"), _GeneratorWithoutStepBudget) == {}  # not asked: nothing
    asked = _config(tmp_path / "d.jsonl", max_num_batched_tokens=16384)
    assert generator_options(asked, _GeneratorWithStepBudget) == {"max_num_batched_tokens": 16384}
    with pytest.raises(extract.ExtractError, match="takes no max_num_batched_tokens") as refused:
        generator_options(asked, _GeneratorWithoutStepBudget)
    assert "\n" not in str(refused.value)


def test_running_slots_are_set_only_while_the_generator_is_made_and_refused_where_speculators_has_no_constant(
    tmp_path: Path,
) -> None:
    import types

    from spec_compat.extract.config import check_generator_constants, generator_constants

    class Generator:  # speculators' shape: _create_vllm_config reads the module constant
        def _create_vllm_config(self) -> int:
            return MAX_NUM_SEQS  # type: ignore[name-defined]  # noqa: F821 - read from the fake module below

    module = types.SimpleNamespace(MAX_NUM_SEQS=32, VllmHiddenStatesGenerator=Generator)
    asked = _config(tmp_path / "d.jsonl", max_num_seqs=64)
    with generator_constants(asked, module):
        assert module.MAX_NUM_SEQS == 64
    assert module.MAX_NUM_SEQS == 32  # restored once the generator is made
    with pytest.raises(RuntimeError), generator_constants(asked, module):
        raise RuntimeError("the engine failed to start")
    assert module.MAX_NUM_SEQS == 32  # ... and when it is not
    with generator_constants(_config(tmp_path / "d.jsonl"), module):  # not asked: untouched
        assert module.MAX_NUM_SEQS == 32

    class Hardwired:  # a speculators that builds its engine without the constant
        def _create_vllm_config(self) -> int:
            return 32

    for other in (types.SimpleNamespace(MAX_NUM_SEQS=32, VllmHiddenStatesGenerator=Hardwired), types.SimpleNamespace()):
        with pytest.raises(extract.ExtractError, match="--max-num-seqs: the installed speculators") as refused:
            check_generator_constants(asked, other)
        assert "\n" not in str(refused.value)
