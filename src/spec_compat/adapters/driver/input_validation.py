"""Adapter ``input-validation``: generate()'s inputs checked before vLLM is touched."""

from __future__ import annotations

import warnings
from array import array
from typing import Any

from ...options import Context
from ...patching import AdapterPatcher
from ..contract import known_input_keys
from ..probe import Probe
from ..support import Run, max_prompt_len, wrap_generate
from ..unit import Adapter


def _vocab_size(generator: Any) -> int | None:
    model_config = generator.vllm_config.model_config
    getter = getattr(model_config, "get_vocab_size", None)
    try:
        return int(getter()) if getter is not None else int(model_config.hf_text_config.vocab_size)
    except Exception:  # noqa: BLE001 - unknown vocabulary: skip the range check, not the others
        return None


def validated_rows(token_ids: Any, vocab_size: int | None) -> tuple[list[list[int]], list[bytes | None]]:
    """The batch as lists of ints and each list's int64 bytes (None where a row took the slow path),
    or a ValueError/TypeError that names the bad element."""
    import numpy as np
    import torch

    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids tensor must be 2-D [batch, tokens], got shape {list(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids tensor must have an integer dtype, got {token_ids.dtype}")
        rows: list[Any] = token_ids.tolist()
    elif isinstance(token_ids, (list, tuple)):
        rows = list(token_ids)
    else:
        raise TypeError(
            f"token_ids must be a list of token-id sequences or a 2-D tensor, got {type(token_ids).__name__}"
        )
    if not rows:
        raise ValueError("token_ids is empty: pass at least one sequence")
    batch: list[list[int]] = []
    keys: list[bytes | None] = []
    for i, row in enumerate(rows):
        if isinstance(row, torch.Tensor):
            if row.ndim != 1 or row.dtype.is_floating_point or row.dtype == torch.bool:
                raise TypeError(f"token_ids[{i}] must be a 1-D integer tensor, got {row.dtype} shape {list(row.shape)}")
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise TypeError(f"token_ids[{i}] must be a sequence of ints, got {type(row).__name__}")
        if len(row) == 0:
            raise ValueError(f"token_ids[{i}] is empty: every sequence needs at least one token")
        if set(map(type, row)) == {int}:  # the common case, checked in C loops (bool is a type of its own)
            try:
                key = array("q", row)
            except OverflowError:
                key = None  # beyond int64: the loop below names it
            if key is not None:
                values = np.frombuffer(key, dtype=np.int64)
                if values.min() >= 0 and (vocab_size is None or values.max() < vocab_size):
                    batch.append(list(row))
                    keys.append(key.tobytes())
                    continue
        for j, token in enumerate(row):
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"token_ids[{i}][{j}] = {token!r} is not an int")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"token_ids[{i}][{j}] = {token} is outside the vocabulary [0, {vocab_size})")
        batch.append(list(row))
        keys.append(None)
    return batch, keys


def _refuse_unschedulable(generator: Any, lengths: list[int]) -> None:
    """Without chunked prefill a prompt longer than one step's token budget is never scheduled:
    the generator would stop with its states missing. vLLM turns chunked prefill off by itself
    for some models (MLA on CPU), so this is checked per call."""
    scheduler = getattr(generator, "scheduler", None)
    config = getattr(scheduler, "scheduler_config", None)
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    if config is None or budget is None or getattr(config, "enable_chunked_prefill", True):
        return
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise ValueError(
            f"sequences {too_long[:10]} are longer than one scheduler step ({budget} tokens) and vLLM "
            "has chunked prefill off for this model: they would never be scheduled. Raise "
            "max_num_batched_tokens to at least the longest prompt"
        )


def probe_input_validation(ctx: Context) -> Probe:
    return Probe(True, "generate() would send malformed or out-of-vocabulary ids into the engine")


def apply_input_validation(ctx: Context, patcher: AdapterPatcher) -> None:
    def validated(generator: Any, token_ids: Any, run: Run) -> Any:
        batch, keys = validated_rows(token_ids, _vocab_size(generator))
        limit = max_prompt_len(generator)
        _refuse_unschedulable(generator, [min(len(ids), limit) for ids in batch])
        too_long = [i for i, ids in enumerate(batch) if len(ids) > limit]
        if too_long:
            warnings.warn(
                f"{len(too_long)} sequence(s) (indices {too_long[:10]}) are longer than "
                f"max_model_len - 1 = {limit} tokens and are truncated to it, as speculators does",
                stacklevel=2,
            )
        with known_input_keys(batch, keys):
            return run(batch)

    wrap_generate(ctx, patcher, validated)


INPUT_VALIDATION = Adapter(
    id="input-validation",
    patches=("speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator.generate",),
    how="input checks before vLLM is touched",
    why="empty, negative, non-integer or out-of-vocabulary ids fail deep inside the engine or not at all",
    vllm_change="none: a guard",
    detect="always",
    delete_when="never",
    side="driver",
    probe=probe_input_validation,
    apply=apply_input_validation,
    # outside every other generate wrapper: they all take the lists of ints it makes of token_ids
    after=("single-step-batches", "sequence-limit", "input-order", "layer-ids", "results-contract"),
)
