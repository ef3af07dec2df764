"""The tiny checkpoints' tokenizer: 256 byte tokens (id == byte value), a few BPE merges, then the special
tokens of Qwen's chat format, with a ChatML template; the same for every architecture."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

MODEL_MAX_LENGTH: Final = 2048  # the tiny configs' max_position_embeddings
VOCAB_SIZE: Final = 300  # the tiny models' vocabulary: the tokenizer's tokens and unused ids above them

_MERGES: Final[tuple[tuple[str, str], ...]] = (
    ("Ġ", "t"), ("Ġ", "a"), ("h", "e"), ("i", "n"), ("r", "e"), ("o", "n"), ("e", "r"), ("a", "n"),
    ("Ġt", "he"), ("Ġ", "s"), ("Ġ", "w"), ("a", "t"), ("e", "n"), ("o", "r"), ("Ġ", "o"), ("Ġ", "c"),
    ("i", "s"), ("Ġ", "i"), ("e", "s"), ("i", "t"), ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "p"), ("in", "g"),
    ("Ġ", "m"), ("Ġ", "d"), ("o", "u"), ("l", "l"), ("Ġa", "n"), ("Ġan", "d"), ("e", "d"), ("Ġ", "h"),
    ("a", "r"), ("Ġ", "l"), ("Ġo", "f"), ("Ġ", "n"),
)  # fmt: skip
SPECIAL_TOKENS: Final[tuple[str, ...]] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyVocab:
    """Token ids of the tiny tokenizer (the same for every architecture)."""

    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int
    tokenizer_size: int

    def __post_init__(self) -> None:
        if self.tokenizer_size > VOCAB_SIZE:
            raise ValueError(
                f"tokenizer_size must be <= {VOCAB_SIZE} (the models' vocab), got {self.tokenizer_size}"
            )

    @property
    def bos(self) -> int:
        return self.endoftext

    @property
    def pad(self) -> int:
        return self.endoftext

    @property
    def eos(self) -> int:
        """The chat end-of-turn token, as in Qwen instruct checkpoints."""
        return self.im_end


def tiny_vocab() -> TinyVocab:
    first = 256 + len(_MERGES)
    ids = {name: first + i for i, name in enumerate(SPECIAL_TOKENS)}
    return TinyVocab(
        endoftext=ids["<|endoftext|>"],
        im_start=ids["<|im_start|>"],
        im_end=ids["<|im_end|>"],
        vision_start=ids["<|vision_start|>"],
        vision_end=ids["<|vision_end|>"],
        image_pad=ids["<|image_pad|>"],
        video_pad=ids["<|video_pad|>"],
        tokenizer_size=first + len(SPECIAL_TOKENS),
    )


def _byte_symbols() -> list[str]:
    """The printable stand-in character of each byte used by byte-level BPE (index = byte value).

    Printable Latin-1 bytes stand for themselves; the others are shifted past 255 in byte order.
    """
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    direct_set = set(direct)
    symbols: list[str] = []
    shifted = 0
    for b in range(256):
        if b in direct_set:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def build_tokenizer() -> Any:
    """The tiny byte-level BPE as a ``tokenizers.Tokenizer`` (specials added as special tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    for a, b in _MERGES:
        if a not in vocab or b not in vocab:
            raise AssertionError(f"merge ({a!r}, {b!r}) uses a token that is not in the vocab yet")
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES), fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size() != tiny_vocab().tokenizer_size:
        raise AssertionError(f"tokenizer size {tok.get_vocab_size()} != {tiny_vocab().tokenizer_size}")
    return tok


def write_tokenizer(out_dir: Path, *, model_max_length: int = MODEL_MAX_LENGTH) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML template) into ``out_dir``."""
    build_tokenizer().save(str(out_dir / "tokenizer.json"), pretty=True)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
