"""Incremental detokenization and stop-string matching across token boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field

from hyspec_server.tokenizer import Tokenizer


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text one token at a time.

    Decoding token by token breaks multi-byte characters and words that byte-level BPE splits, so each step
    decodes a short window `ids[prefix_offset:]` and emits only what extends the window's already-emitted
    text, holding back while the text ends in an incomplete character (U+FFFD).
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_id: int) -> str:
        """Appends one token; returns the new text it completes (possibly "")."""
        self.ids.append(token_id)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.ids))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end of generation)."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.ids))
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)


def find_stop(text: str, old_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends after `old_len` (i.e. that the newest text completed).

    Returns (start index of the match, the stop string), or None.
    """
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(0, old_len - len(s) + 1))
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
