"""The dataset, checked before an engine loads: the model's facts, every line, the layer ids."""

from __future__ import annotations

import json
import sys
from typing import Any

from . import formats
from .config import BadLine, ExtractConfig, ExtractError, ModelFacts, Sample
from .conversations import conversation_samples


def model_facts(model: str) -> ModelFacts:
    """Vocabulary size and decoder layer count from the model's config (no weights, no engine)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    except Exception as exc:  # noqa: BLE001 - any failure here is the user's model path
        raise ExtractError(f"--model {model}: cannot read its config ({type(exc).__name__}: {exc})") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
    layers = getattr(text, "num_hidden_layers", None) or getattr(config, "num_hidden_layers", None)
    return ModelFacts(int(vocab) if vocab else None, int(layers) if layers else None)


def _token_ids_problem(ids: Any, field_name: str, vocab_size: int | None) -> str | None:
    if not isinstance(ids, list):
        return f"{field_name!r} must be a list of token ids, got {type(ids).__name__}"
    if not ids:
        return f"{field_name!r} is empty"
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            return f"{field_name!r}[{position}] = {token!r} is not an integer token id"
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            return f"token id {token} at position {position} is outside the vocabulary (size {vocab_size})"
    return None


def _loss_mask_problem(mask: Any, length: int) -> str | None:
    if not isinstance(mask, list) or any(isinstance(x, bool) or x not in (0, 1) for x in mask):
        return "'loss_mask' must be a list of 0 / 1"
    if len(mask) != length:
        return f"'loss_mask' has {len(mask)} entries for {length} tokens"
    return None


def parse_line(
    line: str, config: ExtractConfig, tokenizer: Any | None, vocab_size: int | None
) -> tuple[list[int], list[int] | None]:
    """(token ids, loss mask) of one JSONL line, or ValueError with a one-line reason."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        where = "at the end of the line" if exc.pos >= len(line.rstrip()) else f"at column {exc.colno}"
        raise ValueError(f"not JSON ({exc.msg} {where})") from None
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object (a {type(record).__name__})")
    if config.ids_field in record:
        ids = record[config.ids_field]
        field_name = config.ids_field
    elif config.text_field and config.text_field in record:
        text = record[config.text_field]
        if not isinstance(text, str):
            raise ValueError(f"{config.text_field!r} must be a string, got {type(text).__name__}")
        assert tokenizer is not None
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        field_name = f"{config.text_field} (tokenized)"
    else:
        wanted = f"{config.ids_field!r}" + (f" or {config.text_field!r}" if config.text_field else "")
        raise ValueError(f"no {wanted} field (it has {sorted(record)[:8]})")
    problem = _token_ids_problem(ids, field_name, vocab_size)
    if problem:
        raise ValueError(problem)
    mask = record.get("loss_mask")
    if mask is not None:
        problem = _loss_mask_problem(mask, len(ids))
        if problem:
            raise ValueError(problem)
    return ids, mask


def read_samples(
    config: ExtractConfig, tokenizer: Any | None, vocab_size: int | None = None
) -> tuple[list[Sample], list[BadLine]]:
    """Every sample of this shard, each line checked (JSON, field, token ids in the vocabulary,
    loss mask), before anything is loaded; idx is the 0-based line number of the input file."""
    shard_index, shard_count = config.shard
    samples: list[Sample] = []
    bad: list[BadLine] = []
    try:
        handle = config.input.open("rb")
    except OSError as exc:
        raise ExtractError(f"--input {config.input}: {exc.strerror or exc}") from None
    with handle:
        for idx, raw in enumerate(handle):
            if idx % shard_count != shard_index or not raw.strip():
                continue
            try:
                ids, mask = parse_line(raw.decode("utf-8"), config, tokenizer, vocab_size)
            except UnicodeDecodeError as exc:
                bad.append(BadLine(idx + 1, f"not UTF-8 ({exc.reason} at byte {exc.start})"))
                continue
            except ValueError as exc:
                bad.append(BadLine(idx + 1, str(exc)))
                continue
            samples.append(Sample(idx, ids, mask))
    return samples, bad


def load_dataset(config: ExtractConfig, facts: ModelFacts) -> tuple[list[Sample], list[BadLine]]:
    """The shard's samples and its bad lines, from token ids / text, or conversations through
    speculators' own preprocessing (whose token ids are checked against the vocabulary too)."""
    if config.conversations:
        try:
            samples, bad = conversation_samples(config)
        except ValueError as exc:
            raise ExtractError(f"--conversations: {exc}") from None
        for sample in samples:
            problem = _token_ids_problem(sample.input_ids, "input_ids", facts.vocab_size)
            if problem:  # the tokenizer made it: tokenizer and model do not belong together
                raise ExtractError(
                    f"--conversations: sample {sample.idx}: {problem}; does the tokenizer match the model?"
                )
        return samples, bad
    tokenizer = None
    if config.text_field:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(config.model)
        except Exception as exc:  # noqa: BLE001 - the user's model path
            raise ExtractError(
                f"--model {config.model}: cannot load its tokenizer ({type(exc).__name__}: {exc})"
            ) from None
    return read_samples(config, tokenizer, facts.vocab_size)


def check_layer_ids(layer_ids: list[int], facts: ModelFacts) -> None:
    duplicates = sorted({x for x in layer_ids if layer_ids.count(x) > 1})
    if duplicates:
        raise ExtractError(f"--layer-ids {layer_ids} repeat {duplicates}: each layer is captured once")
    if facts.num_layers is not None:
        outside = [x for x in layer_ids if not 0 <= x < facts.num_layers]
        if outside:
            raise ExtractError(f"--layer-ids {outside} outside the model's decoder layers 0..{facts.num_layers - 1}")


def _report_bad_lines(bad: list[BadLine], config: ExtractConfig) -> None:
    for item in bad:
        print(f"spec-compat extract: {config.input}: {item}", file=sys.stderr)


def checked_samples(config: ExtractConfig) -> tuple[list[Sample], list[BadLine]] | None:
    """Everything checked before an engine loads (model config, layer ids, every line); the
    samples and the bad lines, or None when bad lines stop the run (they are printed); the
    output directory exists afterwards."""
    facts = model_facts(config.model)
    check_layer_ids(config.layer_ids, facts)
    formats.get(config).check(config, facts)
    todo_all, bad = load_dataset(config, facts)
    for row, sample in enumerate(todo_all):  # speculators-hs numbers its files by it (formats/hs.py)
        sample.row = row
    if bad:
        _report_bad_lines(bad, config)
        if config.on_error == "stop":
            print(
                f"spec-compat extract: {len(bad)} bad line(s) in {config.input}; nothing was written "
                "(fix them, or --on-error skip to extract every good sample and list these in the manifest)",
                file=sys.stderr,
            )
            return None
    try:
        config.output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExtractError(f"--output {config.output}: {exc.strerror or exc}") from None
    return todo_all, bad
