"""Speculative decoding on hybrid models: drafters, verification, adaptive draft length.

Owns: the speculative config, verify blocks (chains and top-k trees), greedy and distribution-preserving
sampling verification with consistent stop truncation, the n-gram proposer, the adaptive draft-length
controller and the `Drafter` seam. Never does: talk HTTP, allocate pool memory or own target weights.
"""

from hyspec_spec_workers.adaptive import (
    AdaptiveController,
    AdaptiveDraftLength,
    CostEstimate,
    CostModel,
    CostTracker,
)
from hyspec_spec_workers.config import METHODS, AdaptiveConfig, Method, SpeculativeConfig
from hyspec_spec_workers.dflash import DFlashDraft, DFlashDrafter, build_dflash_drafter, load_dflash_draft
from hyspec_spec_workers.draft_graphs import DraftGraphCounts, DraftGraphs, GraphedDrafter
from hyspec_spec_workers.draft_kv import DraftKV, DraftMemory
from hyspec_spec_workers.drafter import (
    CommittedTokens,
    DraftBatch,
    Drafter,
    DraftOutput,
    ModelDrafter,
    NgramDrafter,
)
from hyspec_spec_workers.eagle3 import Eagle3Draft, build_eagle3_drafter, load_eagle3_draft
from hyspec_spec_workers.factory import build_drafter
from hyspec_spec_workers.hidden_state_drafter import HiddenStateDrafter, HiddenStateDraftModel
from hyspec_spec_workers.mtp_drafter import MTPDraftModel, build_mtp_drafter, mtp_drafter
from hyspec_spec_workers.ngram import NgramProposer
from hyspec_spec_workers.sampling import SamplingTensors, target_probs
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
    "CommittedTokens",
    "CostEstimate",
    "CostModel",
    "CostTracker",
    "DFlashDraft",
    "DFlashDrafter",
    "DraftBatch",
    "DraftGraphCounts",
    "DraftGraphs",
    "DraftKV",
    "DraftMemory",
    "DraftOutput",
    "Drafter",
    "Eagle3Draft",
    "GraphedDrafter",
    "HiddenStateDraftModel",
    "HiddenStateDrafter",
    "MTPDraftModel",
    "Method",
    "ModelDrafter",
    "NgramDrafter",
    "NgramProposer",
    "SamplingTensors",
    "SpeculativeConfig",
    "TreeDraftBuilder",
    "VerifyResult",
    "VerifyTree",
    "__version__",
    "build_dflash_drafter",
    "build_drafter",
    "build_eagle3_drafter",
    "build_mtp_drafter",
    "commit_steps_from_flat",
    "dflash_correct_drafts",
    "load_dflash_draft",
    "load_eagle3_draft",
    "mtp_drafter",
    "target_probs",
    "truncate_at_stop",
    "verify_greedy",
    "verify_sampling",
]
