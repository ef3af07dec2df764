import re
from typing import Any

import pytest
from hyspec_spec_workers import AdaptiveConfig, SpeculativeConfig
from hyspec_statepool.draft_shape import max_draft_tokens

BAD: list[tuple[dict[str, Any], str]] = [
    ({}, "method"),
    ({"method": "medusa"}, "method"),
    ({"method": "mtp", "bogus": 1}, "bogus"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "mtp", "topk": 0}, "topk"),
    ({"method": "dflash", "model": "d", "topk": 2}, "topk"),
    ({"method": "ngram", "topk": 2}, "topk"),
    ({"method": "multi_layer_mtp", "topk": 4}, "topk"),
    ({"method": "mtp", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 8}, "num_draft_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 3}, "num_draft_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 3, "num_draft_tokens": 5}, "num_draft_tokens"),
    ({"method": "mtp", "num_draft_tokens": 1}, "num_draft_tokens"),
    ({"method": "eagle3"}, "model"),
    ({"method": "dflash"}, "model"),
    ({"method": "dflash", "model": ""}, "model"),
    ({"method": "mtp", "model": "/x"}, "model"),
    ({"method": "eagle3", "model": 3}, "model"),
    ({"method": "mtp", "chain_hidden_states": True}, "chain_hidden_states"),
    ({"method": "multi_layer_mtp", "chain_hidden_states": "yes"}, "chain_hidden_states"),
    ({"method": "mtp", "prompt_lookup_min": 2}, "prompt_lookup_min"),
    ({"method": "eagle3", "model": "d", "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "mtp", "topk": 2, "adaptive": True}, "adaptive"),
    ({"method": "mtp", "adaptive": "yes"}, "adaptive"),
    ({"method": "mtp", "adaptive": {"foo": 1}}, "adaptive.foo"),
    ({"method": "mtp", "adaptive": {"ema_alpha": 0.0}}, "adaptive.ema_alpha"),
    ({"method": "mtp", "adaptive": {"candidate_steps": [0, 2]}}, "adaptive.candidate_steps"),
    ({"method": "mtp", "adaptive": {"candidate_steps": "137"}}, "adaptive.candidate_steps"),
    ({"method": "mtp", "adaptive": {"candidate_steps": []}}, "adaptive.candidate_steps"),
    ({"method": "mtp", "adaptive": {"warmup_batches": -1}}, "adaptive.warmup_batches"),
    ({"method": "mtp", "adaptive": {"update_interval": 0}}, "adaptive.update_interval"),
    ({"method": "mtp", "adaptive": {"up_hysteresis": float("nan")}}, "adaptive.up_hysteresis"),
    ({"method": "mtp", "adaptive": {"probe_budget": 0.0}}, "adaptive.probe_budget"),
    ({"method": "mtp", "adaptive": {"probe_budget": 1.5}}, "adaptive.probe_budget"),
    ({"method": "mtp", "adaptive": {"probe_budget": True}}, "adaptive.probe_budget"),
]


@pytest.mark.parametrize(("d", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_from_dict_rejects_bad_field_by_name(d: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^speculative_config\.{re.escape(field)}:"):
        SpeculativeConfig.from_dict(d)


def test_defaults_chain_tree_and_ngram() -> None:
    c = SpeculativeConfig.from_dict({"method": "mtp"})
    assert (c.num_speculative_tokens, c.topk, c.num_draft_tokens, c.adaptive) == (3, 1, 4, None)
    assert not c.is_tree and c.max_draft_tokens == 4
    t = SpeculativeConfig.from_dict(
        {"method": "eagle3", "model": "/d", "num_speculative_tokens": 2, "topk": 3}
    )
    assert t.is_tree and t.num_draft_tokens == 7
    n = SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 5})
    assert (n.prompt_lookup_min, n.prompt_lookup_max) == (5, 5)
    n2 = SpeculativeConfig.from_dict({"method": "ngram"})
    assert (n2.prompt_lookup_min, n2.prompt_lookup_max) == (1, 3)
    m = SpeculativeConfig.from_dict({"method": "multi_layer_mtp", "chain_hidden_states": True})
    assert m.chain_hidden_states


def test_adaptive_candidates_insert_sort_dedup_and_sizing() -> None:
    c = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2, "adaptive": True})
    assert c.adaptive is not None and c.adaptive.candidate_steps == (1, 2, 3, 7)
    assert c.max_draft_tokens == 8 and c.num_draft_tokens == 3
    c2 = SpeculativeConfig.from_dict(
        {
            "method": "mtp",
            "num_speculative_tokens": 3,
            "adaptive": {"candidate_steps": [7, 3, 3], "ema_alpha": 0.5},
        }
    )
    assert c2.adaptive is not None
    assert c2.adaptive.candidate_steps == (3, 7) and c2.adaptive.ema_alpha == 0.5
    assert SpeculativeConfig.from_dict({"method": "mtp", "adaptive": False}).adaptive is None
    with pytest.raises(ValueError, match="candidate_steps"):
        AdaptiveConfig(candidate_steps=(3, 1))


def test_multi_layer_mtp_adaptive_defaults_stop_at_the_steps_asked_for() -> None:
    """multi_layer_mtp runs MTP layer j at step j: `adaptive: true` must work on a checkpoint with as many
    layers as `num_speculative_tokens` (a released Qwen3-Next has one), so its default candidates stop
    there; candidates given explicitly are kept (the drafter checks them against the checkpoint)."""
    for s, want in ((3, (1, 3)), (1, (1,)), (2, (1, 2))):
        c = SpeculativeConfig.from_dict(
            {"method": "multi_layer_mtp", "num_speculative_tokens": s, "adaptive": True}
        )
        assert c.adaptive is not None and c.adaptive.candidate_steps == want
        assert c.max_num_speculative_tokens == s
    c = SpeculativeConfig.from_dict(
        {"method": "multi_layer_mtp", "num_speculative_tokens": 1, "adaptive": {"candidate_steps": [1, 7]}}
    )
    assert c.adaptive is not None and c.adaptive.candidate_steps == (1, 7)


@pytest.mark.parametrize(
    "d",
    [
        {"method": "mtp", "num_speculative_tokens": 5},
        {"method": "mtp", "num_speculative_tokens": 3, "topk": 4, "num_draft_tokens": 9},
        {"method": "mtp", "num_speculative_tokens": 1, "adaptive": {"candidate_steps": [2, 6]}},
        {"method": "dflash", "model": "/d", "num_speculative_tokens": 15},
    ],
)
def test_draft_shape_matches_statepool_sizing(d: dict[str, Any]) -> None:
    c = SpeculativeConfig.from_dict(d)
    shape = c.draft_shape()
    assert max_draft_tokens(shape) == c.max_draft_tokens
    assert shape.kind == ("tree" if c.is_tree else "chain")


def test_config_is_frozen() -> None:
    c = SpeculativeConfig.from_dict({"method": "mtp"})
    with pytest.raises(AttributeError):
        c.topk = 2  # type: ignore[misc]


def test_shared_drafter_cases_are_valid_configs() -> None:
    from hyspec_testing.spec import DRAFTER_CASES

    methods = set()
    for case in DRAFTER_CASES:
        draft = None if case.draft is None else f"/drafts/{case.draft}"
        cfg = SpeculativeConfig.from_dict(case.speculative_config(draft))
        assert cfg.model == draft
        methods.add(cfg.method)
        with pytest.raises(ValueError, match="draft_dir"):
            case.speculative_config("/elsewhere" if case.draft is None else None)
    assert methods == {"mtp", "multi_layer_mtp", "eagle3", "dflash"}
