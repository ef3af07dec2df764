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
from hyspec_spec_workers.drafter import DraftBatch, Drafter, DraftOutput, NgramDrafter
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
    "CostEstimate",
    "CostModel",
    "CostTracker",
    "DraftBatch",
    "DraftOutput",
    "Drafter",
    "Method",
    "NgramDrafter",
    "NgramProposer",
    "SamplingTensors",
    "SpeculativeConfig",
    "TreeDraftBuilder",
    "VerifyResult",
    "VerifyTree",
    "__version__",
    "commit_steps_from_flat",
    "dflash_correct_drafts",
    "target_probs",
    "truncate_at_stop",
    "verify_greedy",
    "verify_sampling",
]
