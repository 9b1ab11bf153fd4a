"""Incremental detokenization for streams: text deltas that never split a character.

Byte-level BPE and byte-fallback tokenizers spread one character over several tokens (a CJK
character is three UTF-8 bytes); decoding a prefix that ends inside such a character gives
U+FFFD. The detokenizer decodes only a short window of recent tokens each step and holds the
window's text back while it ends in U+FFFD, releasing it once the character completes.
``finish()`` releases what is still held (an incomplete character at the very end stays
U+FFFD, as in a full decode). The deltas joined equal a full decode of the tokens.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output (spacing of the first word)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_ids or [])[-CONTEXT_TOKENS:]
        self.prefix_offset = 0  # window start: decoded only as context for what follows
        self.read_offset = len(self.tokens)  # text of tokens before this has been released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int]) -> str:
        """Add output tokens; return the text they complete ("" while a character is split)."""
        self.tokens += new_ids
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text[len(prefix):]

    def finish(self) -> str:
        """The text still held back at the end of the stream."""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return text[len(prefix):]
