"""multi_layer_mtp: step j runs MTP layer j; with chain_hidden_states step j + 1 reads step j's output hidden
state through the drafter's static feature input buffer (what a CUDA graph would read). Both variants are
lossless on every MTP target in test_drafter_lossless.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.factory import build_drafter
from hyspec_testing.spec import generate, track_proposals

S = 3


def _first_round(t: Any, chain: bool) -> tuple[torch.Tensor, list[dict[str, Any]], Any]:
    """Prefill, then the first proposal of a multi_layer_mtp drafter; records every draft forward."""
    cfg = SpeculativeConfig.from_dict(
        {"method": "multi_layer_mtp", "num_speculative_tokens": S, "chain_hidden_states": chain}
    )
    drafter: Any = build_drafter(cfg, t.model, target_path=t.path, memory=t.memory())
    calls: list[dict[str, Any]] = []
    run = drafter.model.run

    def spy(
        batch: Any, backend: Any, *, features: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, out = run(batch, backend, features=features, step=step)
        calls.append(
            {
                "mode": batch.mode.value,
                "step": step,
                "ptr": features.untyped_storage().data_ptr(),
                "features": features.clone(),
                "out": out.clone(),
                "n": batch.num_seqs,
            }
        )
        return normed, out

    drafter.model.run = spy
    trees = track_proposals(drafter)
    backend, pool = t.stack(cfg.draft_shape())
    generate(t.model, backend, pool, t.prompts, max_new_tokens=S + 2, drafter=drafter, num_steps=S)
    verify_calls = [c for c in calls if c["mode"] == "target_verify"][:S]
    return trees[0], verify_calls, drafter


def test_chained_hidden_states_change_drafts_and_flow_through_the_static_buffer(
    target: Callable[[str], Any],
) -> None:
    t = target("qwen3_5")
    plain, plain_calls, _ = _first_round(t, chain=False)
    chained, calls, drafter = _first_round(t, chain=True)
    # step 0 (layer 0 on the target's hidden state) is the same; later steps read different features
    assert torch.equal(plain[:, :2], chained[:, :2])
    assert not torch.equal(plain[:, 2:], chained[:, 2:])
    assert [c["step"] for c in calls] == [0, 1, 2] and [c["step"] for c in plain_calls] == [0, 1, 2]
    buf = drafter.features_in.untyped_storage().data_ptr()
    n = calls[0]["n"]
    for j, c in enumerate(calls):
        # every draft-step forward reads its features from the one persistent input buffer
        assert c["ptr"] == buf
        block = j + 1
        feats = c["features"].view(n, block, -1)
        if j:
            prev = calls[j - 1]["out"].view(n, j, -1)
            # node j's feature is step j - 1's output at node j - 1 (the chained hidden state)
            assert torch.equal(feats[:, j], prev[:, j - 1])
            assert torch.equal(feats[:, :j], calls[j - 1]["features"].view(n, j, -1))
    for j, c in enumerate(plain_calls):
        feats = c["features"].view(n, j + 1, -1)
        # non-chained: every node reads the root's target hidden state
        assert torch.equal(feats, feats[:, :1].expand_as(feats))
        assert not torch.equal(feats, calls[j]["features"].view(n, j + 1, -1)) or j == 0
