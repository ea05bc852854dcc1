"""The tiny models' tokenizer: a wrapper's special tokens hold their fixed ids and tokenize back
to them (vLLM's multimodal processors build their profiling prompt from the placeholder text)."""

from __future__ import annotations

import pytest

from tiny_models import VOCAB_SIZE, WRAPPER_FAMILIES, _build_tokenizer


def test_kimi_media_tokens_round_trip() -> None:
    specials = WRAPPER_FAMILIES["kimi_k25"].special_tokens
    assert specials["<|media_pad|>"] == WRAPPER_FAMILIES["kimi_k25"].config["media_placeholder_token_id"]
    tokenizer = _build_tokenizer(specials)
    assert len(tokenizer) == VOCAB_SIZE
    for text, token_id in specials.items():
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == [token_id]
        assert tokenizer.convert_tokens_to_ids(text) == token_id
        assert tokenizer.decode([token_id]) == text
    assert tokenizer("<|media_pad|>" * 3, add_special_tokens=False)["input_ids"] == [specials["<|media_pad|>"]] * 3


def test_plain_text_tokenizes_as_without_specials() -> None:
    plain, kimi = _build_tokenizer(), _build_tokenizer(WRAPPER_FAMILIES["kimi_k25"].special_tokens)
    text = "the quick brown fox jumps over the lazy dog"
    assert kimi(text)["input_ids"] == plain(text)["input_ids"]


def test_special_ids_must_not_replace_the_byte_alphabet() -> None:
    with pytest.raises(ValueError, match="special token ids"):
        _build_tokenizer({"<|x|>": 5})
