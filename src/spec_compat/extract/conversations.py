"""``spec-compat extract --conversations``: conversations -> samples, by speculators' own preprocessing.

The token ids and loss masks are whatever the installed speculators' ``load_and_preprocess_dataset``
makes of the file (its chat template handling, its assistant-only loss mask, its shuffle), called
as speculators' ``scripts/data_generation_offline.py`` calls it: the same seed, ``seq_length`` =
the engine's ``max_model_len``. That script writes the preprocessed dataset's row ``i`` to
``data_{i}.pt`` (a fresh output directory, ``--start-idx`` 0), so a sample's ``idx`` is its row in
the preprocessed dataset: extract's files then equal the script's for the same input. Nothing is
re-implemented here, so a speculators release that masks differently is followed as it is.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import BadLine, ExtractConfig, Sample

# The record fields a conversation is read from: ShareGPT ``conversations`` ([{from, value}]) and
# OpenAI ``messages`` ([{role, content}]). speculators' preprocessing reads only ``conversations``
# (its turn normalisation takes either key pair), so ``messages`` is handed over under that name.
CONVERSATION_FIELDS = ("conversations", "messages")
TOKEN_FREQ = "token_freq.pt"  # speculators' token frequencies (its vocabulary mapping for the draft model)
# The parameters of speculators' load_and_preprocess_dataset this module passes (0.3.0 and 0.4.0.1)
_NEEDED = ["target_model_path", "train_data_path", "seq_length", "build_dataset_num_proc", "seed"]
_NEEDED += ["token_freq_path", "cache_dir"]


def speculators_preprocessing() -> Callable[..., Any]:
    """speculators' ``load_and_preprocess_dataset``, or a one-line ValueError saying why not
    (extract prefixes it with ``--conversations:``).

    ``speculators.data_generation`` imports the generator module, which needs spec_compat's
    import-side adapters on this vLLM first (idempotent; a later apply() keeps them)."""
    import spec_compat

    spec_compat.apply_before_import()
    try:
        from speculators.data_generation.preprocessing import load_and_preprocess_dataset
    except Exception as exc:  # any import failure (no speculators, no datasets, a vLLM it cannot import)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(
            "needs speculators' preprocessing (speculators.data_generation.preprocessing, with the 'datasets' "
            f"package), which cannot be imported: {type(exc).__name__}: {first}"
        ) from exc
    try:
        signature = inspect.signature(load_and_preprocess_dataset)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot read the signature of speculators' load_and_preprocess_dataset: {exc}") from exc
    missing = [name for name in _NEEDED if name not in signature.parameters]
    if missing:
        raise ValueError(
            f"speculators' load_and_preprocess_dataset{signature} has no {', '.join(missing)}: "
            "a signature spec-compat does not know (it knows speculators 0.3.0 and 0.4.0.1)"
        )
    return load_and_preprocess_dataset  # type: ignore[no-any-return]


def _line_problem(line: str) -> tuple[list[Any] | None, str | None]:
    """(the line's conversation, None) or (None, why it is not one)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(record, dict):
        return None, f"not a JSON object (a {type(record).__name__})"
    field = next((name for name in CONVERSATION_FIELDS if name in record), None)
    if field is None:
        return None, f"no {' or '.join(map(repr, CONVERSATION_FIELDS))} field (keys: {sorted(record)[:8]})"
    turns = record[field]
    if not isinstance(turns, list) or not turns:
        return None, f"{field!r} is not a non-empty list of turns"
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or not ("from" in turn or "role" in turn):
            return None, f"{field!r} turn {number} is not an object with 'from' or 'role'"
    return turns, None


def read_conversations(path: Path) -> tuple[list[list[Any]], list[BadLine]]:
    """The conversations of the file's good lines, in file order, and its bad lines (1-based).

    Checked here, line by line, because speculators hands the file to HF ``datasets``, where one
    malformed line aborts the whole load with a pyarrow traceback and no line number. Blank lines
    are skipped, as extract's other readers do."""
    conversations: list[list[Any]] = []
    bad: list[BadLine] = []
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise ValueError(f"--input {path}: {exc.strerror or exc}") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad.append(BadLine(number, f"not UTF-8 ({exc.reason} at byte {exc.start})"))
                continue
            turns, problem = _line_problem(line)
            if turns is None:
                bad.append(BadLine(number, problem or "not a conversation"))
            else:
                conversations.append(turns)
    return conversations, bad


def conversation_samples(config: ExtractConfig) -> tuple[list[Sample], list[BadLine]]:
    """This shard's samples (``idx % N == i``, as read_samples) made by speculators' own
    preprocessing of ``config.input``, and the input's bad lines (all shards).

    ``idx`` is the row of speculators' preprocessed dataset, the ``i`` of the ``data_{i}.pt`` its
    offline script writes for the same file with the bad lines removed (they are left out before
    speculators sees the file; the shuffle is over the good lines). Conversations speculators
    itself drops (no known role, a chat-template error) have no row, as in its script.

    Nothing is written to the working directory: speculators' preprocessing writes
    ``./token_freq.pt`` and an HF datasets cache by default; here both go to a temporary directory
    (also a fresh cache, never a stale one from an earlier file of the same name), and the token
    frequencies are then moved to ``config.output / token_freq.pt`` (speculators' training builds
    its draft vocabulary mapping from them; every shard writes the same whole-file counts), but
    only when extract goes on to write (no bad lines, or ``--on-error skip``): bad input leaves
    nothing behind."""
    preprocess = speculators_preprocessing()
    conversations, bad = read_conversations(config.input)
    if not conversations:
        return [], bad
    shard_index, shard_count = config.shard
    with tempfile.TemporaryDirectory(prefix="spec-compat-conversations-") as tmp:
        work = Path(tmp)
        data = work / "conversations.jsonl"  # .jsonl: speculators loads it as a local JSON-lines file
        with data.open("w") as handle:
            for turns in conversations:
                handle.write(json.dumps({"conversations": turns}) + "\n")
        dataset, _ = preprocess(
            target_model_path=str(config.model),
            train_data_path=str(data),
            seq_length=config.max_model_len,
            build_dataset_num_proc=max(1, min(8, os.cpu_count() or 1)),  # the script's default 8; no effect on rows
            seed=config.seed,
            token_freq_path=str(work / TOKEN_FREQ),
            cache_dir=str(work / "datasets"),
        )
        rows = dataset.with_format(None)
        samples = [
            Sample(idx, [int(t) for t in ids], [int(m) for m in mask])
            for idx, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True))
            if idx % shard_count == shard_index
        ]
        del dataset, rows  # memory-mapped from the temporary directory
        if (work / TOKEN_FREQ).exists() and (not bad or config.on_error == "skip"):
            config.output.mkdir(parents=True, exist_ok=True)
            partial = config.output / (TOKEN_FREQ + ".tmp")
            shutil.copyfile(work / TOKEN_FREQ, partial)
            os.replace(partial, config.output / TOKEN_FREQ)
    return samples, bad
