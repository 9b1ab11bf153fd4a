"""Incremental detokenization against a real byte-level tokenizer: streamed deltas never split
a character and join to the full decode."""

from __future__ import annotations

import pytest
from tiny_tokenizer import load_tokenizer

from splash.detokenize import REPLACEMENT, IncrementalDetokenizer


@pytest.mark.parametrize("text", ["中文", "hello 中文 world", "the 🦊 quick", "中"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_are_whole_characters(text: str, step: int) -> None:
    tok = load_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("hi there"))
    pieces = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.finish())
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces), pieces


def test_incomplete_character_at_the_end_is_released_by_finish() -> None:
    tok = load_tokenizer()
    ids = tok.encode("ab中", add_special_tokens=False)[:-1]  # last byte of 中 missing
    detok = IncrementalDetokenizer(tok)
    held = "".join(detok.push([t]) for t in ids)
    assert REPLACEMENT not in held
    assert held + detok.finish() == tok.decode(ids)
    assert tok.decode(ids).endswith(REPLACEMENT)


def test_special_tokens_are_skipped() -> None:
    tok = load_tokenizer()
    ids = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([t]) for t in ids) + detok.finish() == "hello"
