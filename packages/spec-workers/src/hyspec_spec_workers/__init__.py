"""Speculative decoding on hybrid models: the speculative round, drafters, verification, the sampler.

Owns: the one speculative round (`SpeculativeRound`, behind the `VerifyTarget` seam a runner implements),
the one sampler (plain decoding and verification draw from the same filtered distribution), the speculative
config, verify blocks (chains and top-k trees), greedy and distribution-preserving sampling verification
with consistent stop truncation, the drafters (MTP, EAGLE-3, DFlash, n-gram) and their lazy draft extend,
and the adaptive draft-length controller. Never does: talk HTTP, schedule, allocate target pool memory or
own target weights.
"""

from hyspec_spec_workers.adaptive import AdaptiveController, AdaptiveDraftLength
from hyspec_spec_workers.config import METHODS, AdaptiveConfig, Method, SpeculativeConfig
from hyspec_spec_workers.costs import BatchCosts, CostEstimate, CostModel, CostTracker
from hyspec_spec_workers.dflash import DFlashDraft, DFlashDrafter, build_dflash_drafter, load_dflash_draft
from hyspec_spec_workers.draft_feed import DraftFeed
from hyspec_spec_workers.draft_kv import DraftKV, DraftMemory
from hyspec_spec_workers.drafter import (
    ChainsAfterVerify,
    CommittedTokens,
    DraftBatch,
    Drafter,
    DraftOutput,
    GraphedDrafter,
    HiddenStateDraftModel,
    ModelDrafter,
    NgramDrafter,
    VerifiedChain,
)
from hyspec_spec_workers.eagle3 import Eagle3Draft, build_eagle3_drafter, load_eagle3_draft
from hyspec_spec_workers.factory import build_drafter
from hyspec_spec_workers.greedy_tail import GreedyTail, GreedyTailTarget
from hyspec_spec_workers.hidden_state_drafter import HiddenStateDrafter
from hyspec_spec_workers.mtp_drafter import MTPDraftModel, build_mtp_drafter, mtp_drafter
from hyspec_spec_workers.ngram import NgramProposer
from hyspec_spec_workers.penalties import PenaltyTensors
from hyspec_spec_workers.round import SpeculativeRound
from hyspec_spec_workers.round_types import RoundRequest, RoundRow, VerifiedTokens, VerifyTarget
from hyspec_spec_workers.sampling import (
    SampledToken,
    Sampler,
    SamplerOutput,
    SamplingKnobs,
    SamplingRequest,
    SamplingTensors,
    filtered_probs,
    sample_rows,
)
from hyspec_spec_workers.tree import TreeDraftBuilder, VerifyTree
from hyspec_spec_workers.verify import (
    VerifyResult,
    commit_steps_from_flat,
    dflash_correct_drafts,
    truncate_at_stop,
    verify_greedy,
    verify_sampling,
)

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "AdaptiveConfig",
    "AdaptiveController",
    "AdaptiveDraftLength",
    "BatchCosts",
    "ChainsAfterVerify",
    "CommittedTokens",
    "CostEstimate",
    "CostModel",
    "CostTracker",
    "DFlashDraft",
    "DFlashDrafter",
    "DraftBatch",
    "DraftFeed",
    "DraftKV",
    "DraftMemory",
    "DraftOutput",
    "Drafter",
    "Eagle3Draft",
    "GraphedDrafter",
    "GreedyTail",
    "GreedyTailTarget",
    "HiddenStateDraftModel",
    "HiddenStateDrafter",
    "MTPDraftModel",
    "Method",
    "ModelDrafter",
    "NgramDrafter",
    "NgramProposer",
    "PenaltyTensors",
    "RoundRequest",
    "RoundRow",
    "SampledToken",
    "Sampler",
    "SamplerOutput",
    "SamplingKnobs",
    "SamplingRequest",
    "SamplingTensors",
    "SpeculativeConfig",
    "SpeculativeRound",
    "TreeDraftBuilder",
    "VerifiedChain",
    "VerifiedTokens",
    "VerifyResult",
    "VerifyTarget",
    "VerifyTree",
    "__version__",
    "build_dflash_drafter",
    "build_drafter",
    "build_eagle3_drafter",
    "build_mtp_drafter",
    "commit_steps_from_flat",
    "dflash_correct_drafts",
    "filtered_probs",
    "load_dflash_draft",
    "load_eagle3_draft",
    "mtp_drafter",
    "sample_rows",
    "truncate_at_stop",
    "verify_greedy",
    "verify_sampling",
]
