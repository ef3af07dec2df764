"""Per-request memory of a hybrid model.

Typed index spaces, request table, paged KV pool, recurrent-state pools, verify scratch, commit math and pool
sizing.

Owns: every tensor that lives across forwards for a request (KV pages, conv windows, GDN states, verify
scratch), the mapping between the four index spaces, and the choice of which verify step to commit.
Never: runs a model, chooses tokens or schedules requests.
"""

from hyspec_statepool.commit import CommitIndices, commit_accepted_states
from hyspec_statepool.commit_math import accept_paths_from_flat, commit_steps, track_steps
from hyspec_statepool.draft_shape import DraftKind, DraftShape, max_draft_tokens
from hyspec_statepool.errors import DoubleFreeError, LeakError, PoolExhaustedError, UseAfterFreeError
from hyspec_statepool.indices import BatchRows, KVSlots, ReqRows, StateSlots
from hyspec_statepool.layout import TensorSpec
from hyspec_statepool.leak import LeakReport
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.positions import packed_positions
from hyspec_statepool.sizing import MemoryPlan, plan_memory
from hyspec_statepool.specs import (
    AttentionSpec,
    GDNSpec,
    LayerStateSpec,
    ModelStateSpecs,
    ShortConvSpec,
    StateDtypes,
)
from hyspec_statepool.state_pool import LinearLayerState
from hyspec_statepool.transfer import host_staging, to_device, upload, write_into

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "BatchRows",
    "CommitIndices",
    "DoubleFreeError",
    "DraftKind",
    "DraftShape",
    "GDNSpec",
    "HybridStatePool",
    "KVSlots",
    "LayerStateSpec",
    "LeakError",
    "LeakReport",
    "LinearLayerState",
    "MemoryPlan",
    "ModelStateSpecs",
    "PoolExhaustedError",
    "ReqRows",
    "ShortConvSpec",
    "StateDtypes",
    "StateSlots",
    "TensorSpec",
    "UseAfterFreeError",
    "__version__",
    "accept_paths_from_flat",
    "commit_accepted_states",
    "commit_steps",
    "host_staging",
    "max_draft_tokens",
    "packed_positions",
    "plan_memory",
    "to_device",
    "track_steps",
    "upload",
    "write_into",
]
