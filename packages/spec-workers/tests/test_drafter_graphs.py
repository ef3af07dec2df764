"""Model drafters' proposal forwards under CUDA graphs (GPU only): graphed proposals equal eager ones.

For each model drafter (MTP chain and tree, chained multi-layer MTP, EAGLE-3, DFlash), a fp32 generation on
CUDA with the drafter's graphs captured proposes, round by round, exactly the blocks the same drafter
proposes eagerly, and every proposal forward replayed a graph. Batches shrink as rows finish, so replays run
padded. For chained multi-layer MTP this is the graph path of bug class 12: step j + 1 must read step j's
output hidden state, which reaches the replay only through the static `features_in` buffer; a stale buffer
changes the proposals of steps >= 2, and the control run shows that those steps do depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyspec_attn_backends import HybridBackend, model_state_specs
from hyspec_models.loader import load_model
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.factory import build_drafter
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.specs import StateDtypes
from hyspec_testing.spec import DRAFTER_CASES, DrafterCase, generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

S = 3
NEW = 24


CASES = DRAFTER_CASES


def _stack(t: Any, model: Any, cfg: SpeculativeConfig | None) -> tuple[HybridBackend, HybridStatePool]:
    """A CUDA target backend + pool (fp32 storage) with one request burnt, so rows and slots differ."""
    layers = model.mixer_layers()
    plan = MemoryPlan(
        specs=model_state_specs(layers),
        max_model_len=80,
        max_num_seqs=len(t.prompts) + 2,
        draft_shape=None if cfg is None else cfg.draft_shape(),
        page_size=4,
        num_state_slots=len(t.prompts) + 3,
        num_kv_pages=512,
        dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
    )
    pool = HybridStatePool(plan, device=torch.device("cuda"))
    pool.alloc(["burn"])
    return HybridBackend(pool, layers=layers, layer_types=model.layer_types), pool


def _plain(t: Any, model: Any) -> list[list[int]]:
    backend, pool = _stack(t, model, None)
    out = generate(model, backend, pool, t.prompts, max_new_tokens=NEW)
    pool.free(["burn"])
    return out


def _generate(
    t: Any, model: Any, spec: dict[str, Any], *, graphs: bool
) -> tuple[list[list[int]], list[tuple[torch.Tensor, ...]], Any]:
    """fp32 CUDA generation with the drafter eager or graphed -> (outputs, proposed blocks, drafter)."""
    cfg = SpeculativeConfig.from_dict(spec)
    drafter: Any = build_drafter(cfg, model, target_path=t.path, memory=t.memory())
    if graphs:
        drafter.capture_graphs([1, 2, 4, 8, t.memory().max_num_seqs])
        assert drafter.graphs.active
    blocks: list[tuple[torch.Tensor, ...]] = []
    propose = drafter.propose

    def keep(batch: Any) -> Any:
        out = propose(batch)
        blocks.append((out.tree.tokens.cpu(), out.tree.parents.cpu(), out.tree.num_nodes.cpu()))
        return out

    drafter.propose = keep
    backend, pool = _stack(t, model, cfg)
    out = generate(model, backend, pool, t.prompts, max_new_tokens=NEW, drafter=drafter, num_steps=S)
    pool.free(["burn"])
    t.assert_no_leak([pool, drafter.kv.pool])
    return out, blocks, drafter


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_graphed_proposals_equal_eager(case: DrafterCase, target: Callable[[str], Any]) -> None:
    t = target(case.arch)
    model = load_model(t.path, device="cuda", dtype=torch.float32, progress=False)
    spec = case.speculative_config(None if case.draft is None else str(getattr(t, case.draft)()))
    eager_out, eager_blocks, eager_drafter = _generate(t, model, spec, graphs=False)
    out, blocks, drafter = _generate(t, model, spec, graphs=True)
    assert eager_drafter.graph_counts.replays == 0 and eager_drafter.graph_counts.eager > 0
    c = drafter.graph_counts
    assert c.replays > 0 and c.eager == 0, c
    assert len(blocks) == len(eager_blocks)
    for r, (a, b) in enumerate(zip(eager_blocks, blocks, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"round {r}: graphed proposal differs from eager"
    assert out == eager_out
    assert out == _plain(t, model)  # and lossless


def test_chained_hidden_states_matter_on_the_graph_path(target: Callable[[str], Any]) -> None:
    """Control: with graphs, chaining changes the drafts of steps >= 2 (so the equality above can fail)."""
    t = target("qwen3_next")
    model = load_model(t.path, device="cuda", dtype=torch.float32, progress=False)
    spec = {"method": "multi_layer_mtp", "num_speculative_tokens": S}
    _, chained, _ = _generate(t, model, {**spec, "chain_hidden_states": True}, graphs=True)
    _, plain, _ = _generate(t, model, {**spec, "chain_hidden_states": False}, graphs=True)
    first_c, first_p = chained[0][0], plain[0][0]  # round 0 starts from the same state
    assert torch.equal(first_c[:, :2], first_p[:, :2])
    assert not torch.equal(first_c[:, 2:], first_p[:, 2:])
