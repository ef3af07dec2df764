"""Layer specs, the speculative shape and `max_draft_tokens`."""

from __future__ import annotations

import pytest
import torch
from hyspec_statepool import (
    AttentionSpec,
    DraftShape,
    GDNSpec,
    LayerStateSpec,
    ModelStateSpecs,
    ShortConvSpec,
    StateDtypes,
    max_draft_tokens,
)


def test_spec_bytes_and_shapes() -> None:
    dtypes = StateDtypes()
    gdn = GDNSpec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16, conv_kernel=4)
    assert gdn.conv_dim == 2 * 2 * 8 + 4 * 16
    assert gdn.state_shapes() == {"conv": (96, 3), "recurrent": (4, 8, 16)}
    assert gdn.bytes_per_slot(dtypes) == 96 * 3 * 2 + 4 * 8 * 16 * 4
    assert gdn.bytes_per_token(dtypes) == 0
    conv = ShortConvSpec(channels=10, conv_kernel=3)
    assert conv.bytes_per_slot(StateDtypes(conv=torch.float32)) == 10 * 2 * 4
    attn = AttentionSpec(num_kv_heads=2, head_dim=8)
    assert attn.bytes_per_token(dtypes) == 2 * 2 * 8 * 2 and attn.bytes_per_slot(dtypes) == 0
    for spec in (gdn, conv, attn):
        assert isinstance(spec, LayerStateSpec)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: GDNSpec(2, 3, 8, 8, 4), "multiple of num_k_heads"),
        (lambda: GDNSpec(2, 4, 8, 8, 1), "conv_kernel: expected >= 2"),
        (lambda: GDNSpec(0, 4, 8, 8, 4), "num_k_heads: expected a positive int"),
        (lambda: ShortConvSpec(8, 1), "conv_kernel"),
        (lambda: AttentionSpec(1, 0), "head_dim"),
        (lambda: StateDtypes(recurrent=torch.float16), "recurrent"),
        (lambda: StateDtypes(kv=torch.int8), "kv"),
        (lambda: ModelStateSpecs(()), "at least one"),
        (lambda: ModelStateSpecs(((1, AttentionSpec(1, 4)), (1, AttentionSpec(1, 4)))), "unique layer ids"),
        (lambda: ModelStateSpecs(((0, "attention"),)), "expected a LayerStateSpec"),  # type: ignore[arg-type]
    ],
)
def test_bad_specs_are_rejected(build: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()  # type: ignore[operator]


def test_model_specs_from_unsorted_pairs() -> None:
    specs = ModelStateSpecs.from_pairs(
        [(2, ShortConvSpec(4, 3)), (0, AttentionSpec(1, 4)), (1, ShortConvSpec(4, 3))]
    )
    assert [i for i, _ in specs.layers] == [0, 1, 2]
    assert [i for i, _ in specs.attention_layers] == [0]
    assert [i for i, _ in specs.linear_layers] == [1, 2]
    with pytest.raises(ValueError, match="layer_id"):
        specs.spec(7)


@pytest.mark.parametrize(
    ("shape", "dmax"),
    [
        (None, 1),
        (DraftShape("chain", 1), 2),
        (DraftShape("chain", 5, num_draft_tokens=6), 6),
        (DraftShape("tree", 3, num_draft_tokens=8), 8),
        (DraftShape("chain", 1, adaptive_candidate_steps=(1, 7)), 8),
        (DraftShape("chain", 3, adaptive_candidate_steps=(1, 3)), 4),
        (DraftShape("tree", 3, num_draft_tokens=16, adaptive_candidate_steps=(3, 5)), 16),
        (DraftShape("tree", 3, num_draft_tokens=5, adaptive_candidate_steps=(3, 5)), 6),
    ],
)
def test_max_draft_tokens(shape: DraftShape | None, dmax: int) -> None:
    assert max_draft_tokens(shape) == dmax


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "beam", "num_steps": 2}, "kind"),
        ({"kind": "chain", "num_steps": 0}, "num_steps"),
        ({"kind": "chain", "num_steps": 3, "num_draft_tokens": 3}, "num_steps \\+ 1 = 4"),
        ({"kind": "tree", "num_steps": 3}, "num_draft_tokens"),
        ({"kind": "tree", "num_steps": 3, "num_draft_tokens": 3}, "needs an int >= 4"),
        ({"kind": "chain", "num_steps": 3, "adaptive_candidate_steps": (5, 3)}, "strictly increasing"),
        ({"kind": "chain", "num_steps": 2, "adaptive_candidate_steps": (1, 3)}, "initial num_steps=2"),
        ({"kind": "chain", "num_steps": 2, "adaptive_candidate_steps": ()}, "non-empty"),
    ],
)
def test_bad_draft_shapes(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DraftShape(**kwargs)  # type: ignore[arg-type]
