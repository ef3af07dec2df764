"""Per-layer hybrid routing (full attention, GDN, short conv), forward-mode metadata, the commit after verify.

Owns: the weightless mixer cores a model places in its layers, the `ForwardBatch` metadata built once per
batch from the statepool, kernel dispatch per layer and mode, and `commit_after_verify`. Never owns weights or
allocates pools.
"""

from hyspec_attn_backends.backend import (
    HybridBackend,
    RoutingError,
    check_routing,
    model_state_specs,
    state_spec_of,
)
from hyspec_attn_backends.batch import BatchBuffers, ForwardBatch, MixedBatch, StepBatch, tree_ancestor_mask
from hyspec_attn_backends.graph_capture import ForwardFn, VerifyTail
from hyspec_attn_backends.graph_keys import GraphCounts, GraphKey, batch_pointers, capture_sizes
from hyspec_attn_backends.graphs import CudaGraphRunner
from hyspec_attn_backends.launch_graphs import LaunchGraphs, tensor_key
from hyspec_attn_backends.layers import (
    LAYER_TYPE_KINDS,
    AttentionLayer,
    GDNLayer,
    MixerKind,
    MixerLayer,
    ShortConvLayer,
)
from hyspec_attn_backends.modes import ForwardMode

__version__ = "0.1.0"

__all__ = [
    "LAYER_TYPE_KINDS",
    "AttentionLayer",
    "BatchBuffers",
    "CudaGraphRunner",
    "ForwardBatch",
    "ForwardFn",
    "ForwardMode",
    "GDNLayer",
    "GraphCounts",
    "GraphKey",
    "HybridBackend",
    "LaunchGraphs",
    "MixedBatch",
    "MixerKind",
    "MixerLayer",
    "RoutingError",
    "ShortConvLayer",
    "StepBatch",
    "VerifyTail",
    "batch_pointers",
    "capture_sizes",
    "check_routing",
    "model_state_specs",
    "state_spec_of",
    "tensor_key",
    "tree_ancestor_mask",
]
