"""Draft vocabulary: the subset of the target's tokens a drafter proposes from.

A drafter over a whole-vocabulary head (MTP, multi-layer MTP and DFlash share the target's; an EAGLE-3 draft
uses the target's or a whole-vocabulary head of its own) reads the whole head matrix at every draft step:
[V, H] bf16 is 2 GB for Qwen3.5's 248k-token vocabulary at H = 4096, so three MTP drafts read as much as a
third of a 9B target's decode step. With a draft vocabulary of the K most frequent tokens (FR-Spec; SGLang's
`speculative_token_map`, llama.cpp's `--spec-draft-vocab`) each draft step computes logits for those K rows
only, from a gathered copy of them.

Lossless by construction: the target verifies every draft against its full vocabulary, so a draft
vocabulary only changes which tokens are proposed (and so how many are accepted), never the output. A
drafter proposes greedily (argmax, or the top-k of a tree) over the draft vocabulary; its logits are over
the draft vocabulary ([.., K]) and `to_target` maps indices back to target token ids.

Files (`speculative_config.draft_vocab`): `.json` (a list of token ids), `.pt` (a 1-D integer tensor, as
SGLang's token maps) or `.bin` (little-endian int32 ids, llama.cpp's format); a list of ids is also taken.
Ids are deduplicated and sorted; the target config's `eos_token_id` ids are always added, so a draft can end
a run. `hyspec draft-vocab` builds one from a text corpus and the model's tokenizer.

The copy is of a plain [V, H] weight on one device. A vocabulary-parallel head (tensor parallelism) would
gather each rank's rows of its own shard, and a quantized head its rows' scales with them: not built yet.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from hyspec_kernels import linear
from torch import Tensor

from hyspec_spec_workers.config import SpeculativeConfig

FIELD = "speculative_config.draft_vocab"


def _err(msg: str) -> ValueError:
    return ValueError(f"{FIELD}: {msg}")


def _read_ids(path: Path) -> list[int]:
    """The raw ids of a draft-vocabulary file (any order, duplicates allowed)."""
    if not path.is_file():
        raise _err(f"no such file: {path}")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise _err(f"{path} is not valid JSON ({e})") from None
        if not isinstance(raw, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
            raise _err(f"{path}: expected a JSON list of integer token ids")
        return [int(v) for v in raw]
    if suffix == ".pt":
        try:
            t = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise _err(f"{path} is not a readable torch file ({type(e).__name__}: {e})") from None
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise _err(f"{path}: expected a 1-D integer tensor of token ids")
        return [int(v) for v in t.tolist()]
    if suffix == ".bin":
        data = path.read_bytes()
        if len(data) % 4:
            raise _err(f"{path}: expected little-endian int32 ids, got {len(data)} bytes (not 4 per id)")
        return [int(v) for v in torch.frombuffer(bytearray(data), dtype=torch.int32).tolist()]
    raise _err(f"{path}: expected a .json, .pt or .bin file, got suffix {suffix!r}")


def read_draft_vocab(
    value: str | Path | Sequence[int], *, vocab_size: int, always: Sequence[int] = ()
) -> Tensor:
    """The sorted, unique token ids [K] int64 of a draft vocabulary (file path or ids) plus `always`.

    Raises ValueError naming `speculative_config.draft_vocab` for a missing or malformed file, an empty set
    or an id outside [0, vocab_size).
    """
    ids = _read_ids(Path(value)) if isinstance(value, str | Path) else [int(v) for v in value]
    if not ids:
        raise _err("the draft vocabulary is empty")
    bad = [v for v in ids if not 0 <= v < vocab_size]
    if bad:
        raise _err(f"token ids must be in [0, {vocab_size}) (the target's vocab_size), got {bad[:5]}")
    extra = [v for v in always if 0 <= v < vocab_size]
    return torch.tensor(sorted({*ids, *extra}), dtype=torch.int64)


def eos_ids(config: Any) -> tuple[int, ...]:
    """The EOS ids of a model config (`eos_token_id`: an int, a list or absent)."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(v) for v in eos)


def head_weight(module: Any, *, what: str) -> Tensor:
    """The [V, H] weight of an lm_head-like `nn.Linear` (`what` names it in the error)."""
    weight = getattr(getattr(module, "lm_head", None), "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise _err(f"{what} has no lm_head.weight [V, H] to take the draft vocabulary's rows from")
    return weight


class DraftVocab:
    """Logits over a draft vocabulary, from a gathered copy of the head's rows.

    Args:
        ids: [K] int64 sorted unique target token ids.
        weight: [V, H] the full head; its rows `ids` are copied (K·H, on the head's device and dtype).
    """

    def __init__(self, ids: Tensor, weight: Tensor) -> None:
        if ids.dim() != 1 or ids.numel() == 0 or int(ids.max()) >= weight.shape[0] or int(ids.min()) < 0:
            raise _err(f"expected 1-D ids in [0, {weight.shape[0]}), got shape {list(ids.shape)}")
        self.ids = ids.to(device=weight.device, dtype=torch.int64)  # [K]
        self.weight = weight.detach()[self.ids].contiguous()  # [K, H]

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def logits(self, normed: Tensor) -> Tensor:
        """[.., H] -> [.., K] logits of the draft vocabulary's tokens (the head's dtype)."""
        return linear(normed.to(self.weight.dtype), self.weight)  # few rows on CUDA: the GEMV kernel

    def to_target(self, index: Tensor) -> Tensor:
        """Indices into the draft vocabulary (any shape, int64) -> target token ids (same shape)."""
        return self.ids[index]


def draft_vocab_of(config: SpeculativeConfig, head: Tensor, model_config: Any) -> DraftVocab | None:
    """The draft vocabulary `config.draft_vocab` asks for over the head weight `head` [V, H] (None: none).

    `model_config` is the target's (its EOS ids join the vocabulary)."""
    if config.draft_vocab is None:
        return None
    ids = read_draft_vocab(config.draft_vocab, vocab_size=int(head.shape[0]), always=eos_ids(model_config))
    if ids.numel() < config.topk:
        raise _err(f"a tree of topk {config.topk} needs at least {config.topk} tokens, got {ids.numel()}")
    return DraftVocab(ids, head)
