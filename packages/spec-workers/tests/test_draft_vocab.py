"""Draft vocabularies (`speculative_config.draft_vocab`): files, validation, and drafts over the subset.

A drafter with a draft vocabulary computes logits for its K tokens only and proposes from them; the output
stays the plain greedy output. Round by round over a batched generation, its proposals equal those of the
same drafter over the whole vocabulary with every token outside the subset masked to -inf (the reference:
the general path through the `draft_logits` hook), for MTP chains (the one-token chain path) and trees,
multi-layer MTP, EAGLE-3 over the target's head and DFlash.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.draft_vocab import DraftVocab, eos_ids, read_draft_vocab
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.spec import generate, track_proposals

S = 3


# ------------------------------------------------------------------ files and validation


def test_the_three_file_formats_read_the_same_sorted_unique_ids(tmp_path: Path) -> None:
    ids = [7, 3, 3, 99, 0, 42]
    (tmp_path / "v.json").write_text(json.dumps(ids))
    torch.save(torch.tensor(ids, dtype=torch.int32), tmp_path / "v.pt")
    (tmp_path / "v.bin").write_bytes(torch.tensor(ids, dtype=torch.int32).numpy().astype("<i4").tobytes())
    want = torch.tensor([0, 3, 7, 42, 99])
    for name in ("v.json", "v.pt", "v.bin"):
        got = read_draft_vocab(str(tmp_path / name), vocab_size=100)
        assert got.dtype == torch.int64 and torch.equal(got, want), name
    # ids given directly, and EOS ids always joining
    assert read_draft_vocab([5, 1], vocab_size=10, always=(9, 1)).tolist() == [1, 5, 9]


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("missing.json", None, "no such file"),
        ("v.txt", b"1 2 3", "suffix"),
        ("v.json", b"{not json", "not valid JSON"),
        ("v.json", b'{"ids": [1]}', "list of integer"),
        ("v.json", b"[1, 2.5]", "list of integer"),
        ("v.json", b"[]", "empty"),
        ("v.json", b"[1, 100]", r"\[0, 100\)"),
        ("v.json", b"[-1]", r"\[0, 100\)"),
        ("v.bin", b"\x01\x00\x00", "4 per id"),
        ("v.pt", b"not a torch file", "readable torch file"),
    ],
)
def test_a_bad_file_is_a_value_error_naming_the_field(
    tmp_path: Path, name: str, content: bytes | None, match: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match="speculative_config.draft_vocab: .*" + match):
        read_draft_vocab(str(path), vocab_size=100)


def test_a_float_tensor_file_is_refused(tmp_path: Path) -> None:
    torch.save(torch.tensor([1.0, 2.0]), tmp_path / "v.pt")
    with pytest.raises(ValueError, match=r"speculative_config\.draft_vocab: .*integer tensor"):
        read_draft_vocab(str(tmp_path / "v.pt"), vocab_size=100)


def test_config_takes_a_path_or_ids_and_refuses_the_rest() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "mtp", "draft_vocab": [3, 1, 2]})
    assert cfg.draft_vocab == (3, 1, 2)
    assert SpeculativeConfig.from_dict({"method": "mtp", "draft_vocab": "v.json"}).draft_vocab == "v.json"
    assert SpeculativeConfig.from_dict({"method": "mtp"}).draft_vocab is None
    # a list or a path given to the dataclass itself is normalised
    assert SpeculativeConfig(method="mtp", draft_vocab=[2, 1]).draft_vocab == (2, 1)  # type: ignore[arg-type]
    assert (
        SpeculativeConfig.from_dict({"method": "mtp", "draft_vocab": Path("v.json")}).draft_vocab == "v.json"
    )
    # kept out of the repr (a log line): 32k ids would fill it
    assert "draft_vocab" not in repr(SpeculativeConfig.from_dict({"method": "mtp", "draft_vocab": [1, 2]}))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"method": "ngram", "draft_vocab": [1]}, "ngram"),
        ({"method": "mtp", "draft_vocab": 5}, "file path"),
        ({"method": "mtp", "draft_vocab": ""}, "empty string"),
        ({"method": "mtp", "draft_vocab": []}, "non-empty"),
        ({"method": "mtp", "draft_vocab": [1, True]}, "integer token ids >= 0"),
        ({"method": "mtp", "draft_vocab": [1, -2]}, "integer token ids >= 0"),
        ({"method": "mtp", "draft_vocab": ["1"]}, "integer token ids >= 0"),
    ]
    for d, match in bad:
        with pytest.raises(ValueError, match="speculative_config.draft_vocab: .*" + match):
            SpeculativeConfig.from_dict(d)


def test_draft_vocab_logits_are_the_heads_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen)
    ids = torch.tensor([2, 9, 31, 49])
    vocab = DraftVocab(ids, weight)
    x = torch.randn(3, 5, 8, generator=gen)
    full = x @ weight.T  # [3, 5, 50]
    torch.testing.assert_close(vocab.logits(x), full[..., ids])
    assert torch.equal(vocab.to_target(torch.tensor([[0, 3], [1, 2]])), torch.tensor([[2, 49], [9, 31]]))
    with pytest.raises(ValueError, match="draft_vocab"):
        DraftVocab(torch.tensor([50]), weight)
    assert eos_ids(type("C", (), {"eos_token_id": [4, 5]})()) == (4, 5)
    assert eos_ids(type("C", (), {"eos_token_id": 4})()) == (4,)
    assert eos_ids(object()) == ()


# ------------------------------------------------------------------ drafting over the subset

CASES = [
    ("qwen3_5", "mtp", "chain"),
    ("qwen3_next", "mtp", "tree"),
    ("qwen3_5", "multi_layer_mtp", "chain"),
    ("lfm2", "eagle3", "chain"),
    ("qwen3_5", "dflash", "chain"),
]


def _spec(t: Any, method: str, variant: str, vocab: list[int] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": S}
    if variant == "tree":
        spec.update(topk=2, num_draft_tokens=6)
    if method == "eagle3":
        spec["model"] = str(t.eagle3())  # no head of its own: the target's lm_head
    if method == "dflash":
        spec["model"] = str(t.dflash())
    if vocab is not None:
        spec["draft_vocab"] = vocab
    return spec


def _proposals(
    t: Any,
    spec: dict[str, Any],
    *,
    mask: torch.Tensor | None,
    hook: Callable[[Any], None] | None = None,
) -> tuple[list[torch.Tensor], Any]:
    """Every proposed block of a greedy generation (`mask`: the reference, whole-vocabulary logits with the
    tokens outside `mask` at -inf, through the `draft_logits` hook; `hook`: called with the drafter first)."""
    cfg = SpeculativeConfig.from_dict(spec)
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    if hook is not None:
        hook(drafter)
    if mask is not None:
        inner = drafter.draft_logits

        def masked(normed: torch.Tensor, **kw: Any) -> torch.Tensor:
            logits: torch.Tensor = inner(normed, **kw)
            out = torch.full_like(logits, float("-inf"))
            out[..., mask] = logits[..., mask]
            return out

        drafter.draft_logits = masked
    blocks = track_proposals(drafter)
    vocab = getattr(drafter, "vocab", None) or getattr(getattr(drafter, "model", None), "vocab", None)
    if vocab is not None:
        # every draft step's logits are over the K tokens of the draft vocabulary
        drafter.logit_widths = widths = []
        drafter.logit_shapes = []
        real = vocab.logits

        def spy(x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = real(x)
            widths.append(out.shape[-1])
            drafter.logit_shapes.append(tuple(out.shape))
            return out

        vocab.logits = spy
    backend, pool = t.stack(cfg.draft_shape())
    out = generate(
        t.model, backend, pool, t.prompts, max_new_tokens=t.new_tokens, drafter=drafter, num_steps=S
    )
    assert out == t.reference()  # lossless
    return blocks, drafter


def _same_drafts_from(got: list[torch.Tensor], want: list[torch.Tensor], allowed: torch.Tensor) -> None:
    """Round by round the same blocks, some drafts among them, every draft a token of `allowed`."""
    assert len(got) == len(want) > 0
    drafted = 0
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
        drafts = a[:, 1:].reshape(-1)
        drafts = drafts[drafts >= 0]
        drafted += drafts.numel()
        assert torch.isin(drafts, allowed).all()
    assert drafted > 0


@pytest.mark.parametrize(("arch", "method", "variant"), CASES, ids=["-".join(c) for c in CASES])
def test_drafts_come_from_the_draft_vocabulary_and_match_masked_full_logits(
    target: Callable[[str], Any], arch: str, method: str, variant: str
) -> None:
    t = target(arch)
    vocab_size = int(t.model.config.vocab_size)
    gen = torch.Generator().manual_seed(11)
    # half the vocabulary, the greedy continuations' tokens at random in or out of it
    subset = torch.randperm(vocab_size, generator=gen)[: vocab_size // 2].tolist()
    got, drafter = _proposals(t, _spec(t, method, variant, subset), mask=None)
    vocab = drafter.vocab if method == "dflash" else drafter.model.vocab
    assert isinstance(vocab, DraftVocab) and vocab.size >= len(subset)
    allowed = vocab.ids
    assert set(allowed.tolist()) >= set(subset)
    assert drafter.logit_widths and set(drafter.logit_widths) == {vocab.size}
    want, _ = _proposals(t, _spec(t, method, variant, None), mask=allowed)
    _same_drafts_from(got, want, allowed)


def test_eagle3_with_a_reduced_head_maps_through_d2t_and_refuses_a_draft_vocabulary(
    target: Callable[[str], Any],
) -> None:
    """An EAGLE-3 draft with its own reduced head (`d2t`): the one-token chain path (captured in a CUDA graph
    on a GPU) and the general path propose the same drafts, every one a token of the draft's vocabulary
    (`arange(V_d) + d2t`); a draft vocabulary on top of it is refused, naming the field."""
    t = target("lfm2")
    spec: dict[str, Any] = {"method": "eagle3", "num_speculative_tokens": S, "model": str(t.eagle3(200))}
    fast, drafter = _proposals(t, spec, mask=None)
    assert drafter.chain is not None
    d2t = drafter.model.draft.get_buffer("d2t")
    allowed = torch.arange(d2t.numel()) + d2t
    general_drafter: Any = None

    def general(d: Any) -> None:
        nonlocal general_drafter
        general_drafter = d
        d.draft_logits = d.draft_logits  # an instance-level hook: the general path

    slow, _ = _proposals(t, spec, mask=None, hook=general)
    assert general_drafter is not None
    _same_drafts_from(fast, slow, allowed)
    with pytest.raises(ValueError, match=r"speculative_config\.draft_vocab: .*reduced vocabulary"):
        build_drafter(
            SpeculativeConfig.from_dict({**spec, "draft_vocab": [1, 2, 3]}),
            t.model,
            target_path=t.path,
            memory=t.memory(),
        )


def test_a_tree_needs_topk_tokens_in_its_draft_vocabulary(target: Callable[[str], Any]) -> None:
    t = target("qwen3_5")
    spec = {**_spec(t, "mtp", "tree", [5]), "topk": 2}
    cfg = SpeculativeConfig.from_dict(spec)
    if t.model.config.eos_token_id is None:
        with pytest.raises(ValueError, match=r"speculative_config\.draft_vocab: a tree of topk 2"):
            build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    else:  # EOS joins the vocabulary: two tokens are enough
        drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
        assert drafter.model.vocab.size == 2


def test_dflash_computes_logits_for_the_drafted_positions_only(target: Callable[[str], Any]) -> None:
    """A DFlash block of 4 drafting at most 2 tokens: the head's rows are the drafted positions of each row,
    not the block's 3 mask positions (the head's GEMM grows with its rows)."""
    t = target("qwen3_5")
    spec = {
        **_spec(t, "dflash", "chain", list(range(0, int(t.model.config.vocab_size), 3))),
        "num_speculative_tokens": 2,
    }
    _, drafter = _proposals(t, spec, mask=None)
    # 2 per row, or 1 where every row is within one token of its budget: never the block's 3
    assert drafter.logit_shapes and max(s[1] for s in drafter.logit_shapes) == 2
