"""Session fixtures for the drafter tests: tiny targets (with MTP layers), tiny EAGLE-3 / DFlash drafts, pools
and the non-speculative greedy references, each built once per session in tmp dirs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_attn_backends import HybridBackend, model_state_specs
from hyspec_models.loader import load_model
from hyspec_spec_workers import SpeculativeConfig
from hyspec_spec_workers.draft_kv import DraftMemory
from hyspec_statepool.draft_shape import DraftShape
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.specs import StateDtypes
from hyspec_testing.spec import LOSSLESS_NEW_TOKENS, LOSSLESS_PROMPTS, generate
from hyspec_testing.tiny import MTP_ARCHS, build_tiny_checkpoint
from hyspec_testing.tiny_drafts import build_tiny_dflash, build_tiny_eagle3

PROMPTS: list[list[int]] = [list(p) for p in LOSSLESS_PROMPTS]
NEW_TOKENS = LOSSLESS_NEW_TOKENS
MAX_CONTEXT = 80


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # tiny matmuls on a shared 2-core machine run much slower when torch spins up a second thread
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass
class Target:
    """A tiny target checkpoint, its model, lazily built draft checkpoints and cached greedy references."""

    arch: str
    path: Path
    model: Any
    drafts: Path
    refs: dict[int | None, list[list[int]]] = field(default_factory=dict)
    prompts: list[list[int]] = field(default_factory=lambda: [list(p) for p in PROMPTS])
    new_tokens: int = NEW_TOKENS

    def eagle3(self, draft_vocab_size: int | None = None) -> Path:
        out = self.drafts / f"eagle3-{draft_vocab_size}"
        if not (out / "config.json").is_file():
            build_tiny_eagle3(out, self.path, seed=1, draft_vocab_size=draft_vocab_size)
        return out

    def dflash(self) -> Path:
        out = self.drafts / "dflash"
        if not (out / "config.json").is_file():
            build_tiny_dflash(out, self.path, seed=2, block_size=4)
        return out

    def speculative_config(self, spec: dict[str, Any], num_speculative_tokens: int) -> SpeculativeConfig:
        """`spec` (a method and its options) with S drafts and the draft checkpoint it needs, if any."""
        d = {"num_speculative_tokens": num_speculative_tokens, **spec}
        if spec["method"] == "eagle3":
            d["model"] = str(self.eagle3())
        if spec["method"] == "dflash":
            d["model"] = str(self.dflash())
        return SpeculativeConfig.from_dict(d)

    def stack(self, shape: DraftShape | None) -> tuple[HybridBackend, HybridStatePool]:
        """Target backend + pool (fp32 storage, debug), with one request burnt so rows and slots differ."""
        layers = self.model.mixer_layers()
        plan = MemoryPlan(
            specs=model_state_specs(layers),
            max_model_len=MAX_CONTEXT,
            max_num_seqs=len(PROMPTS) + 2,
            draft_shape=shape,
            page_size=4,
            num_state_slots=len(PROMPTS) + 3,
            num_kv_pages=512,
            dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
        )
        pool = HybridStatePool(plan, debug=True)
        pool.alloc(["burn"])
        # commits deferred to the next forward, as a speculative engine runs them (a plain stack: none)
        defer = shape is not None
        backend = HybridBackend(pool, layers=layers, layer_types=self.model.layer_types, defer_commit=defer)
        return backend, pool

    def run(self, shape: DraftShape | None, *, eos: int | None = None, **kw: Any) -> list[list[int]]:
        backend, pool = self.stack(shape)
        out = generate(self.model, backend, pool, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos, **kw)
        pool.free(["burn"])
        self.assert_no_leak([pool])
        return out

    @staticmethod
    def memory() -> DraftMemory:
        """Sizing of a draft's own KV pool for these prompts."""
        return DraftMemory(max_num_seqs=len(PROMPTS) + 2, max_model_len=MAX_CONTEXT, page_size=4)

    @staticmethod
    def assert_no_leak(pools: Sequence[HybridStatePool]) -> None:
        for pool in pools:
            report = pool.leak_check()
            assert report.live_requests == 0 and not (
                report.leaked_rows or report.leaked_slots or report.leaked_pages
            ), report

    def reference(self, eos: int | None = None) -> list[list[int]]:
        if eos not in self.refs:
            self.refs[eos] = self.run(None, eos=eos)
        return self.refs[eos]


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Target]:
    """arch -> Target; the Qwen families carry 3 MTP layers (mtp uses layer 0, multi_layer_mtp all)."""
    cache: dict[str, Target] = {}

    def get(arch: str) -> Target:
        if arch not in cache:
            root = tmp_path_factory.mktemp(arch)
            mtp = 3 if arch in MTP_ARCHS else 0
            path = build_tiny_checkpoint(root / "target", arch, seed=0, mtp_layers=mtp)
            cache[arch] = Target(arch, path, load_model(path, progress=False), root)
        return cache[arch]

    return get


@pytest.fixture(params=[True, False], ids=["stop-early", "full-walk"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Tree walks as on the CPU (stop once no row has a candidate) or as on CUDA (all D - 1 visits)."""
    from hyspec_spec_workers import verify

    stops: bool = request.param
    monkeypatch.setattr(verify, "_stops_early", lambda device: stops)
    return stops
