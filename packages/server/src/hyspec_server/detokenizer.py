"""Incremental detokenization and stop-string matching across token boundaries."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from hyspec_server.tokenizer import HFTokenizer, Tokenizer


@functools.cache
def _decode_stream_class() -> Any:
    """tokenizers' `DecodeStream` (tokenizers >= 0.21), or None where the installed version lacks it."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return DecodeStream


def stream_backend(tokenizer: Tokenizer) -> Any:
    """The `tokenizers.Tokenizer` behind `tokenizer` when a `DecodeStream` over it gives exactly
    `tokenizer.decode`'s text, else None (then the windowed decode runs).

    That holds for transformers' fast tokenizers (`decode` is the backend's decode) unless they clean up
    tokenization spaces afterwards, which can change text already streamed.
    """
    if not isinstance(tokenizer, HFTokenizer) or _decode_stream_class() is None:
        return None
    hf = tokenizer.hf_tokenizer
    backend = getattr(hf, "_tokenizer", None)
    from tokenizers import Tokenizer as Backend

    if not isinstance(backend, Backend) or getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    return backend


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text one token at a time.

    Decoding token by token breaks multi-byte characters and words that byte-level BPE splits. On a fast
    tokenizer (`stream_backend`) a `tokenizers.decoders.DecodeStream` per request does the incremental work in
    Rust. Otherwise each step decodes a short window `ids[prefix_offset:]` and emits only what extends the
    window's already-emitted text, holding back while the text ends in an incomplete character (U+FFFD).
    Either way the emitted text plus `flush()` is `tokenizer.decode(ids)`.
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    # the fast path: the stream and the backend it steps through (None: the windowed decode)
    stream: Any = field(default=None, init=False)
    backend: Any = field(default=None, init=False)
    # characters the stream emitted, and whether tokens since its last emission are held back
    num_chars: int = field(default=0, init=False)
    held: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.backend = stream_backend(self.tokenizer)
        if self.backend is not None:
            self.stream = _decode_stream_class()(skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Appends one token; returns the new text it completes (possibly "")."""
        self.ids.append(token_id)
        if self.stream is not None:
            try:
                piece = self.stream.step(self.backend, token_id)
            except Exception:
                # the stream refused the sequence (its decoder rewrote text already emitted): the windowed
                # decode takes over from the offsets kept below, for the rest of the request
                self.stream = None
            else:
                if piece is None:  # an incomplete character, or a token with no text
                    self.held = True
                    return ""
                self.held = False
                self.num_chars += len(piece)
                # the windowed decode's offsets, kept current in case it has to take over
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                return str(piece)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.ids))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end of generation)."""
        if self.stream is not None:
            if not self.held:
                return ""
            # rare (generation ended inside a character): the full decode's tail, as `decode` renders it
            self.held = False
            full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
            tail = full[self.num_chars :]
            self.num_chars = len(full)
            self.prefix_offset = self.read_offset = len(self.ids)
            return tail
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
