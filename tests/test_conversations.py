"""``spec-compat extract --conversations``: samples equal speculators' own preprocessing (both releases),
bad lines with their line numbers, unusable speculators refused in one line; and, with a real engine,
``data_{i}.pt`` equal to what speculators' pipeline writes (its preprocessing + hidden states)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_constants import LAYER_IDS
from shared_constants import MAX_MODEL_LEN as SHARED_MAX_MODEL_LEN

from engine_harness import CACHE, model_dir, require_speculators
from tiny_models import CHAT_TEMPLATE, CHAT_TEMPLATE_PLAIN, build_chat_model, hf_layer_outputs

CELLS = Path(__file__).resolve().parent / "cells"
WORDS = ["the", "a", "model", "layer", "state", "hidden", "token", "vllm", "draft", "eagle", "speculative"]
WORDS += ["train", "data", "batch", "worker", "engine"]
MAX_MODEL_LEN = 96  # the long conversations exceed it: truncation as speculators does it
# line number: (its content, a fragment of the reason it is reported with)
BAD_LINES = {
    3: ("{not json", "not JSON"),
    6: ('["a", "list"]', "not a JSON object (a list)"),
    9: ('{"id": 9, "text": "no conversation"}', "no 'conversations' or 'messages' field"),
    12: ('{"conversations": []}', "'conversations' is not a non-empty list of turns"),
    14: ('{"messages": [{"content": "who am I"}]}', "'messages' turn 1 is not an object with 'from' or 'role'"),
}


def chat_model(template: str) -> Path:
    name = "dense-chat" if template == CHAT_TEMPLATE else "dense-chat-plain"
    return build_chat_model(model_dir("dense"), CACHE / "models" / name, template)


def _conversation(rng: random.Random, long: bool = False) -> list[dict[str, str]]:
    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    turns = [{"from": "system", "value": sentence(4)}] if rng.random() < 0.3 else []
    for _ in range(3 if long else rng.randint(1, 3)):
        turns.append({"from": "human", "value": sentence(rng.randint(2, 8))})
        turns.append({"from": "gpt", "value": sentence(rng.randint(20, 30) if long else rng.randint(3, 12))})
    return turns


def sharegpt_file(path: Path, count: int, bad: dict[int, tuple[str, str]] | None = None) -> tuple[Path, Path]:
    """(file with ``count`` conversations and the bad lines interleaved, the same file without them)."""
    rng = random.Random(11)
    lines: list[str] = []
    good: list[str] = []
    bad = bad or {}
    while len(good) < count:
        number = len(lines) + 1
        if number in bad:
            lines.append(bad[number][0])
            continue
        if number == 5:
            lines.append("")  # blank lines are skipped, not bad
            continue
        line = json.dumps({"id": str(len(good)), "conversations": _conversation(rng, long=len(good) % 7 == 3)})
        lines.append(line)
        good.append(line)
    path.write_text("\n".join(lines) + "\n")
    clean = path.with_name(path.stem + "-clean.jsonl")
    clean.write_text("\n".join(good) + "\n")
    return path, clean


def _env(speculators: Path | None) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = str(speculators) if speculators else ""
    return env


CellRun = tuple[Path, Path | None, dict[str, Any]]


def run_cells(*runs: CellRun) -> list[dict[str, Any]]:
    """conversations_cell.py for each (work directory, speculators install, spec), all at once: each
    a one-core process that no test times; their results in the order given."""
    procs = []
    for tmp, speculators, spec in runs:
        (tmp / "cwd").mkdir(parents=True, exist_ok=True)
        spec = {"work": str(tmp), "max_model_len": MAX_MODEL_LEN, "seed": 0, **spec}
        (tmp / "spec.json").write_text(json.dumps(spec))
        command = [
            sys.executable,
            str(CELLS / "conversations_cell.py"),
            str(tmp / "spec.json"),
            str(tmp / "result.json"),
        ]
        with (tmp / "cell.log").open("w") as log:
            proc = subprocess.Popen(
                command, env=_env(speculators), cwd=tmp / "cwd", stdout=subprocess.DEVNULL, stderr=log
            )
        procs.append(proc)
    results = []
    for (tmp, _, _), proc in zip(runs, procs, strict=True):
        proc.wait(timeout=600)
        assert proc.returncode == 0, (tmp / "cell.log").read_text()[-4000:]
        results.append(json.loads((tmp / "result.json").read_text()))
    return results


def run_cell(tmp: Path, speculators: Path | None, **spec: Any) -> dict[str, Any]:
    return run_cells((tmp, speculators, spec))[0]


@pytest.mark.parametrize(
    ("version", "template"),
    [("0.4.0.1", CHAT_TEMPLATE), ("0.4.0.1", CHAT_TEMPLATE_PLAIN), ("0.3.0", CHAT_TEMPLATE)],
    ids=["spec0.4.0.1-hf-mask", "spec0.4.0.1-regex", "spec0.3.0-regex"],
)
def test_samples_equal_speculators_preprocessing(version: str, template: str, tmp_path: Path) -> None:
    data, clean = sharegpt_file(tmp_path / "chat.jsonl", 16, BAD_LINES)
    result = run_cell(
        tmp_path, require_speculators(version), model=str(chat_model(template)), input=str(data),
        reference=str(clean), seed=5, shards=[[0, 1], [1, 2]],
    )  # fmt: skip
    reference = result["reference"]
    whole = result["runs"]["0/1"]
    assert len(reference) == 16
    # one sample per preprocessed row, idx = the row (the i of speculators' script's data_{i}.pt)
    assert [s[0] for s in whole["samples"]] == list(range(16))
    assert [[ids, mask] for _, ids, mask in whole["samples"]] == reference
    assert any(0 < sum(mask) < len(mask) for _, mask in reference)  # assistant-only masks, not all 0 / all 1
    # every bad line, with its 1-based number and a one-line reason
    assert [b[0] for b in whole["bad"]] == sorted(BAD_LINES)
    for line, reason in whole["bad"]:
        assert BAD_LINES[line][1] in reason and "\n" not in reason, (line, reason)
    # a shard is the rows idx % 2 == 1 of the same preprocessing; bad lines of every shard
    assert result["runs"]["1/2"]["samples"] == whole["samples"][1::2]
    assert result["runs"]["1/2"]["bad"] == whole["bad"]
    # token frequencies: speculators' own, in the output directory; nothing in the working directory
    assert result["token_freq"] == result["reference_token_freq"]
    assert result["cwd_files"] == []
    # the regex path truncates to seq_length; 0.4's HF-mask path does not (the generator does, later)
    longest = max(len(ids) for ids, _ in reference)
    regex_path = template == CHAT_TEMPLATE_PLAIN or version == "0.3.0"
    assert longest == MAX_MODEL_LEN if regex_path else longest > MAX_MODEL_LEN


def test_seed_changes_the_order(tmp_path: Path) -> None:
    data, _ = sharegpt_file(tmp_path / "chat.jsonl", 8)
    speculators = require_speculators("0.4.0.1")
    model = str(chat_model(CHAT_TEMPLATE))
    cells = run_cells(
        *((tmp_path / str(seed), speculators, {"model": model, "input": str(data), "seed": seed}) for seed in (0, 1))
    )
    runs = [cell["runs"]["0/1"] for cell in cells]
    assert runs[0]["samples"] != runs[1]["samples"]
    assert sorted(s[1] for s in runs[0]["samples"]) == sorted(s[1] for s in runs[1]["samples"])


def test_openai_messages_equal_sharegpt(tmp_path: Path) -> None:
    data, _ = sharegpt_file(tmp_path / "chat.jsonl", 8)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    with (tmp_path / "messages.jsonl").open("w") as handle:
        for line in filter(None, data.read_text().splitlines()):
            turns = json.loads(line)["conversations"]
            messages = [{"role": roles[t["from"]], "content": t["value"]} for t in turns]
            handle.write(json.dumps({"messages": messages}) + "\n")
    speculators = require_speculators("0.4.0.1")
    model = str(chat_model(CHAT_TEMPLATE))
    sharegpt, openai = (
        cell["runs"]["0/1"]
        for cell in run_cells(
            (tmp_path / "a", speculators, {"model": model, "input": str(data)}),
            (tmp_path / "b", speculators, {"model": model, "input": str(tmp_path / "messages.jsonl")}),
        )
    )
    assert openai == sharegpt and len(openai["samples"]) == 8


def test_bad_input_leaves_nothing_behind(tmp_path: Path) -> None:
    """With bad lines and ``--on-error stop`` extract writes nothing: nor does the preprocessing."""
    data, _ = sharegpt_file(tmp_path / "chat.jsonl", 4, {2: BAD_LINES[3]})
    speculators = require_speculators("0.4.0.1")
    result = run_cell(tmp_path, speculators, model=str(chat_model(CHAT_TEMPLATE)), input=str(data), on_error="stop")
    assert result["runs"]["0/1"]["bad"][0][0] == 2 and len(result["runs"]["0/1"]["samples"]) == 4
    assert result["output_exists"] is False and result["cwd_files"] == []


def test_unusable_speculators_is_one_line_value_error(tmp_path: Path) -> None:
    data, _ = sharegpt_file(tmp_path / "chat.jsonl", 2)
    fake = tmp_path / "fake"
    (fake / "speculators" / "data_generation").mkdir(parents=True)
    (fake / "speculators" / "__init__.py").write_text("")
    (fake / "speculators" / "data_generation" / "__init__.py").write_text("")
    (fake / "speculators" / "data_generation" / "preprocessing.py").write_text(
        "def load_and_preprocess_dataset(path, seq_length):\n    raise AssertionError('not to be called')\n"
    )
    spec = {"model": str(chat_model(CHAT_TEMPLATE)), "input": str(data)}
    missing, unknown = run_cells((tmp_path / "none", None, spec), (tmp_path / "unknown", fake, spec))
    assert "cannot be imported: ModuleNotFoundError: No module named 'speculators'" in missing["error"]
    assert "load_and_preprocess_dataset(path, seq_length) has no target_model_path" in unknown["error"]
    for error in (missing["error"], unknown["error"]):
        assert "\n" not in error


@pytest.mark.engine
def test_extract_conversations_equals_speculators_pipeline(tmp_path: Path) -> None:
    """``spec-compat extract --conversations`` vs speculators' pipeline for the same file: its
    preprocessing (rows, masks) and its generator's hidden states (= HF transformers' layers)."""
    speculators = require_speculators("0.4.0.1")
    model = chat_model(CHAT_TEMPLATE_PLAIN)
    data, clean = sharegpt_file(tmp_path / "chat.jsonl", 6, {3: BAD_LINES[3]})
    max_model_len, layers = SHARED_MAX_MODEL_LEN, list(LAYER_IDS)  # some conversations longer
    reference = run_cell(
        tmp_path / "ref", speculators, model=str(model), input=str(clean), reference=str(clean),
        max_model_len=max_model_len,
    )["reference"]  # fmt: skip
    out = tmp_path / "out"
    env = dict(_env(speculators), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "spec_compat", "extract", "--conversations", "--model", str(model),
         "--input", str(data), "--output", str(out), "--layer-ids", ",".join(map(str, layers)),
         "--max-model-len", str(max_model_len), "--dtype", "float32", "--save-dtype", "float32",
         "--on-error", "skip", "--batch-size", "4"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # the bad line is reported (extract's exit status for skipped lines is its own matter), the good ones extracted
    assert proc.returncode in (0, 1) and "line 3: not JSON" in proc.stderr, proc.stderr[-4000:]
    files = {int(p.stem[len("data_") :]): torch.load(p, weights_only=True) for p in out.glob("data_*.pt")}
    assert sorted(files) == list(range(len(reference)))
    ids = [files[i]["input_ids"].tolist() for i in range(len(reference))]
    want = hf_layer_outputs(model, ids, layers)
    for i, (ref_ids, ref_mask) in enumerate(reference):
        sample = files[i]
        n = min(len(ref_ids), max_model_len - 1)  # the generator keeps max_model_len - 1 prompt tokens
        assert ids[i] == ref_ids[:n]
        assert sample["loss_mask"].tolist() == ref_mask[:n]  # as the script: mask[:len(result input_ids)]
        assert len(sample["hidden_states"]) == len(layers)
        for got, expected in zip(sample["hidden_states"], want[i], strict=True):
            assert torch.allclose(got, expected, atol=2e-3, rtol=1e-3), (i, float((got - expected).abs().max()))
    assert (out / "token_freq.pt").exists() and not (tmp_path / "token_freq.pt").exists()
