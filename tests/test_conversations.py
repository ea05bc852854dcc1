"""``spec-compat extract --conversations``: samples equal speculators' own preprocessing (both releases),
bad lines with their line numbers, unusable speculators refused in one line; and, with a real engine,
``data_{i}.pt`` equal to what speculators' pipeline writes (its preprocessing + hidden states)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_constants import LAYER_IDS
from shared_constants import MAX_MODEL_LEN as SHARED_MAX_MODEL_LEN

from engine_harness import BUILD_LOCK, CACHE, CellPool, model_dir, require_speculators
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
    base = model_dir("dense")
    with BUILD_LOCK:  # the pool's jobs call this from two threads
        return build_chat_model(base, CACHE / "models" / name, template)


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


def as_openai_messages(sharegpt: Path, path: Path) -> Path:
    """The ShareGPT file's conversations written as OpenAI messages, line for line."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    with path.open("w") as handle:
        for line in filter(None, sharegpt.read_text().splitlines()):
            turns = json.loads(line)["conversations"]
            messages = [{"role": roles[t["from"]], "content": t["value"]} for t in turns]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


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


@dataclass(frozen=True)
class Preprocess:
    """conversations_cell.py on a ShareGPT file of ``count`` conversations, ``bad``: (line, the
    BAD_LINES entry written there), with ``speculators`` and ``template``'s chat model, in the job's
    directory (a pool job: one core); ``reference``: speculators' preprocessing of the good lines too."""

    label: str
    speculators: str
    template: str
    count: int
    bad: tuple[tuple[int, int], ...]
    reference: bool = False
    seed: int = 0
    shards: tuple[tuple[int, int], ...] = ((0, 1),)
    on_error: str = "skip"
    messages: bool = False  # the file's conversations as OpenAI messages ({"messages": [{role, content}]})
    cores = 1

    @property
    def name(self) -> str:
        return f"preprocess-{self.label}"

    def run(self, work: Path, core: str | None) -> dict[str, Any]:
        data, clean = sharegpt_file(work / "chat.jsonl", self.count, {line: BAD_LINES[k] for line, k in self.bad})
        if self.messages:
            data = as_openai_messages(data, work / "messages.jsonl")
        spec: dict[str, Any] = {"model": str(chat_model(self.template)), "input": str(data), "seed": self.seed}
        spec |= {"shards": [list(shard) for shard in self.shards], "on_error": self.on_error}
        if self.reference:
            spec["reference"] = str(clean)
        return run_cell(work, require_speculators(self.speculators), **spec)


EVERY_BAD_LINE = tuple((line, line) for line in BAD_LINES)
PREPROCESSING = [
    Preprocess(f"spec{version}-{kind}", version, template, 16, EVERY_BAD_LINE, True, 5, ((0, 1), (1, 2)))
    for version, template, kind in [
        ("0.4.0.1", CHAT_TEMPLATE, "hf-mask"),
        ("0.4.0.1", CHAT_TEMPLATE_PLAIN, "regex"),
        ("0.3.0", CHAT_TEMPLATE, "regex"),
    ]
]


@pytest.mark.parametrize("job", PREPROCESSING, ids=[job.label for job in PREPROCESSING])
def test_samples_equal_speculators_preprocessing(job: Preprocess, engine_cells: CellPool) -> None:
    version, template = job.speculators, job.template
    result = engine_cells.result(job)
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


# eight conversations with the chat template: in the file's order (seed 0), shuffled by seed 1, as OpenAI messages
CHAT_8 = Preprocess("chat8", "0.4.0.1", CHAT_TEMPLATE, 8, ())
CHAT_8_SEED_1 = Preprocess("chat8-seed1", "0.4.0.1", CHAT_TEMPLATE, 8, (), seed=1)
CHAT_8_MESSAGES = Preprocess("chat8-messages", "0.4.0.1", CHAT_TEMPLATE, 8, (), messages=True)


@pytest.mark.reads(CHAT_8, CHAT_8_SEED_1)
def test_seed_changes_the_order(engine_cells: CellPool) -> None:
    runs = [engine_cells.result(job)["runs"]["0/1"] for job in (CHAT_8, CHAT_8_SEED_1)]
    assert runs[0]["samples"] != runs[1]["samples"]
    assert sorted(s[1] for s in runs[0]["samples"]) == sorted(s[1] for s in runs[1]["samples"])


@pytest.mark.reads(CHAT_8, CHAT_8_MESSAGES)
def test_openai_messages_equal_sharegpt(engine_cells: CellPool) -> None:
    sharegpt, openai = (engine_cells.result(job)["runs"]["0/1"] for job in (CHAT_8, CHAT_8_MESSAGES))
    assert openai == sharegpt and len(openai["samples"]) == 8


BAD_INPUT = Preprocess("bad-input-stop", "0.4.0.1", CHAT_TEMPLATE, 4, ((2, 3),), on_error="stop")


@pytest.mark.parametrize("job", [BAD_INPUT], ids=["stop"])
def test_bad_input_leaves_nothing_behind(job: Preprocess, engine_cells: CellPool) -> None:
    """With bad lines and ``--on-error stop`` extract writes nothing: nor does the preprocessing."""
    result = engine_cells.result(job)
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


@dataclass
class ConversationsExtracted:
    reference: list[list[list[int]]]  # speculators' preprocessing of the good lines: [input_ids, loss_mask]
    proc: subprocess.CompletedProcess[str]
    out: Path
    cwd: Path


@dataclass(frozen=True)
class ConversationsExtract:
    """speculators' preprocessing of a ShareGPT file's good lines (conversations_cell.py), then
    ``spec-compat extract --conversations`` of the file with a bad line 3, ``--on-error skip``, in
    ``format`` (its save dtype float32), in the job's directory (a pool job: one core)."""

    format: str
    cores = 1

    @property
    def name(self) -> str:
        return f"extract-conversations-{self.format}"

    def run(self, work: Path, core: str | None) -> ConversationsExtracted:
        speculators = require_speculators("0.4.0.1")
        model = chat_model(CHAT_TEMPLATE_PLAIN)
        data, clean = sharegpt_file(work / "chat.jsonl", 6, {3: BAD_LINES[3]})
        reference = run_cell(
            work / "ref", speculators, model=str(model), input=str(clean), reference=str(clean),
            max_model_len=SHARED_MAX_MODEL_LEN,
        )["reference"]  # fmt: skip
        out = work / "out"
        env = dict(_env(speculators), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        env["VLLM_CPU_OMP_THREADS_BIND"] = core or "0"
        proc = subprocess.run(
            [sys.executable, "-m", "spec_compat", "extract", "--conversations", "--model", str(model),
             "--input", str(data), "--output", str(out), "--layer-ids", ",".join(map(str, LAYER_IDS)),
             "--max-model-len", str(SHARED_MAX_MODEL_LEN), "--dtype", "float32", "--save-dtype", "float32",
             "--on-error", "skip", "--batch-size", "4", "--format", self.format],
            env=env, cwd=work, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        return ConversationsExtracted(reference, proc, out, work)


CONVERSATIONS_V1 = ConversationsExtract("speculators-v1")
CONVERSATIONS_HS = ConversationsExtract("speculators-hs")


@pytest.mark.engine
@pytest.mark.parametrize("job", [CONVERSATIONS_V1], ids=["speculators-v1"])
def test_extract_conversations_equals_speculators_pipeline(job: ConversationsExtract, engine_cells: CellPool) -> None:
    """``spec-compat extract --conversations`` vs speculators' pipeline for the same file: its
    preprocessing (rows, masks) and its generator's hidden states (= HF transformers' layers)."""
    run = engine_cells.result(job)
    model = chat_model(CHAT_TEMPLATE_PLAIN)
    max_model_len, layers = SHARED_MAX_MODEL_LEN, list(LAYER_IDS)  # some conversations longer
    reference, proc, out = run.reference, run.proc, run.out

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
    assert (out / "token_freq.pt").exists() and not (run.cwd / "token_freq.pt").exists()


@pytest.mark.engine
@pytest.mark.parametrize(("job", "v1"), [(CONVERSATIONS_HS, CONVERSATIONS_V1)], ids=["speculators-hs"])
def test_extract_conversations_as_speculators_hs_holds_the_v1_samples(
    job: ConversationsExtract, v1: ConversationsExtract, engine_cells: CellPool
) -> None:
    """issue 29: ``--conversations`` in ``--format speculators-hs``: the rows, masks and states of
    the speculators-v1 run of the same file (which test_extract_conversations_equals_speculators_pipeline
    checks against speculators' pipeline and HF), layers in ascending order, bad line reported."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    run, base = engine_cells.result(job), engine_cells.result(v1)
    assert run.proc.returncode in (0, 1) and "line 3: not JSON" in run.proc.stderr, run.proc.stderr[-4000:]
    assert base.proc.returncode in (0, 1), base.proc.stderr[-4000:]
    v1_files = {int(p.stem[len("data_") :]): torch.load(p, weights_only=True) for p in base.out.glob("data_*.pt")}
    assert sorted(v1_files) == list(range(len(run.reference))) and run.reference == base.reference
    rows = load_from_disk(str(run.out)).with_format(None)
    assert len(rows) == len(v1_files)
    order = sorted(range(len(LAYER_IDS)), key=LAYER_IDS.__getitem__)  # an hs file's layers: ascending ids
    for i, sample in v1_files.items():
        ids = sample["input_ids"].tolist()
        assert rows[i]["input_ids"] == ids and rows[i]["seq_len"] == len(ids), i
        assert rows[i]["loss_mask"] == sample["loss_mask"].tolist(), i
        states = load_file(str(run.out / "hidden_states" / f"hs_{i}.safetensors"))
        assert states["token_ids"].tolist() == ids, i
        want = torch.stack([sample["hidden_states"][k] for k in order], dim=1)
        assert states["hidden_states"].shape == want.shape and torch.equal(states["hidden_states"], want), i
    assert (run.out / "token_freq.pt").exists() and not (run.cwd / "token_freq.pt").exists()
