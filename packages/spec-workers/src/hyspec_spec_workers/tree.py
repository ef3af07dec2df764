"""Verify blocks: the D tokens a target checks in one forward, as a batched tree.

Node 0 of every row is the root (the current token, last round's bonus); nodes 1.. are drafts; every
node's parent has a smaller index, so kernels can process a block in index order. A chain is the tree whose
node j has parent j - 1. Rows with fewer than D real nodes are padded: padded nodes continue the chain
from the previous node (a well-formed tree for kernels) but are absent from `first_child`/`next_sibling`,
so verification never reaches them.

`TreeDraftBuilder` turns per-step top-k draft outputs into such a block: the best D - 1 candidates by
cumulative path probability, sorted by candidate order so that parents precede children.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from hyspec_kernels import tree_grids, value_checks
from hyspec_statepool.transfer import to_device


def _check(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected shape {list(shape)}, got {got}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    return t


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """int64 host copies of small tensors; those on a device are read back in one transfer (one sync)."""
    out = [t.to(torch.int64).clone() if t.device.type == "cpu" else t for t in tensors]
    away = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    if away:
        flat = torch.cat([tensors[i].reshape(-1).to(torch.int64) for i in away]).cpu()
        parts = torch.split(flat, [tensors[i].numel() for i in away])
        for i, part in zip(away, parts, strict=True):
            out[i] = part.view(tensors[i].shape)
    return out


def _tree_grids(
    tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, *, check: bool
) -> VerifyTree:
    """The tree of `from_parents` where its inputs are (`hyspec_kernels.tree_grids`: one launch on CUDA); the
    parents' and counts' values are checked when `check` (a read on a device). `is_chain` False."""
    g = tree_grids(parents=parents, num_nodes=num_nodes, check_values=check)
    return VerifyTree(tokens, g.parents, num_nodes, g.depth, g.mask, g.first_child, g.next_sibling, False)


@dataclass(frozen=True, slots=True)
class VerifyTree:
    """A batch of verify blocks, N rows of D nodes (int64 on one device).

    Attributes:
        tokens: [N, D] token ids; column 0 is the current token.
        parents: [N, D] parent node index, -1 for the root; parents[n, j] < j.
        num_nodes: [N] real nodes per row (1..D); nodes >= num_nodes[n] are padding.
        depth: [N, D] root = 0.
        tree_mask: [N, D, D] bool, tree_mask[n, i, j] = node j is node i or an ancestor of it.
        first_child: [N, D] first real child of a node, -1 if none.
        next_sibling: [N, D] next real sibling (increasing index), -1 if none.
        is_chain: every row is a chain (kernels may pass `parents=None`).
        host_num_nodes: `num_nodes` on the host, when known there at construction (a device tree built from
            host counts), so that the engine's bookkeeping reads it without waiting for the device.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    depth: torch.Tensor
    tree_mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    is_chain: bool
    host_num_nodes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n, d = (self.tokens.shape[0], self.tokens.shape[1]) if self.tokens.dim() == 2 else (-1, -1)
        _check("tokens", self.tokens, (n, d), torch.int64)
        for name in ("parents", "depth", "first_child", "next_sibling"):
            _check(name, getattr(self, name), (n, d), torch.int64)
        _check("num_nodes", self.num_nodes, (n,), torch.int64)
        _check("tree_mask", self.tree_mask, (n, d, d), torch.bool)
        if self.host_num_nodes is not None and len(self.host_num_nodes) != n:
            raise ValueError(f"host_num_nodes: expected {n} counts, got {len(self.host_num_nodes)}")

    def node_counts(self) -> list[int]:
        """Real nodes per row as Python ints: free when known on the host, else one device read."""
        if self.host_num_nodes is not None:
            return list(self.host_num_nodes)
        return [int(k) for k in self.num_nodes.tolist()]

    def to(self, device: torch.device | str) -> VerifyTree:
        """The same tree on `device` (self when already there)."""
        device = torch.device(device)
        if self.tokens.device == device:
            return self
        if self.tokens.device.type == "cpu" and device.type == "cuda":
            return self._to_cuda(device)
        return VerifyTree(
            tokens=self.tokens.to(device),
            parents=self.parents.to(device),
            num_nodes=self.num_nodes.to(device),
            depth=self.depth.to(device),
            tree_mask=self.tree_mask.to(device),
            first_child=self.first_child.to(device),
            next_sibling=self.next_sibling.to(device),
            is_chain=self.is_chain,
            host_num_nodes=self.host_num_nodes,
        )

    def _to_cuda(self, device: torch.device) -> VerifyTree:
        """A host tree on CUDA in one non-blocking copy of every array packed together (no sync)."""
        n, d = self.batch_size, self.block_size
        grids = torch.stack([self.tokens, self.parents, self.depth, self.first_child, self.next_sibling])
        flat = torch.cat([grids.reshape(-1), self.num_nodes, self.tree_mask.reshape(-1).long()])  # int64
        on_device = to_device(flat, dtype=torch.int64, device=device)
        grid, num_nodes, mask = torch.split(on_device, [5 * n * d, n, n * d * d])
        tokens, parents, depth, first_child, next_sibling = grid.view(5, n, d).unbind(0)  # each [N, D]
        tree_mask = mask.view(n, d, d).bool()
        return VerifyTree(
            tokens,
            parents,
            num_nodes,
            depth,
            tree_mask,
            first_child,
            next_sibling,
            self.is_chain,
            host_num_nodes=tuple(int(k) for k in self.num_nodes.tolist()),
        )

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.tokens.shape[1])

    @staticmethod
    def from_parents(
        tokens: torch.Tensor,
        parents: torch.Tensor,
        num_nodes: torch.Tensor | Sequence[int],
        *,
        device: torch.device | str | None = None,
    ) -> VerifyTree:
        """Derive depth, mask and child/sibling arrays; padded nodes are re-parented as a chain.

        Built where `tokens` are, without a device read, when they are on a device and the node counts on
        the host (a drafter's tree on its way to the verify: the host runs ahead of the drafting); the
        parents' values are then not read on CUDA (`hyspec_kernels.value_checks`: a drafter's trees are well
        formed by construction, `TreeDraftBuilder.build`), and `is_chain` is False (a chain-shaped block is
        still a valid tree). Otherwise on the host, checked, one transfer each way.

        Args:
            tokens: [N, D] int64.
            parents: [N, D] int; parents[n, 0] = -1 and 0 <= parents[n, j] < j for real nodes j >= 1.
            num_nodes: [N] int in [1, D]: a tensor, or host ints.
            device: where the tree goes (default: `tokens`' device).
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected shape [N, D], got {list(tokens.shape)}")
        n, d = tokens.shape
        out_dev = tokens.device if device is None else torch.device(device)
        _check("tokens", tokens, (n, d))
        _check("parents", parents, (n, d))
        if not isinstance(num_nodes, torch.Tensor):
            num_nodes = torch.tensor(list(num_nodes), dtype=torch.int64)
        _check("num_nodes", num_nodes, (n,))
        on_device = (
            tokens.device.type != "cpu"
            and num_nodes.device.type == "cpu"
            and out_dev.type == tokens.device.type
            and out_dev.index in (None, tokens.device.index)  # "cuda" is where cuda:0 tokens are
        )
        if not on_device:  # N x D bookkeeping on the host: one transfer each way
            tokens, parents, num_nodes = _to_host(tokens, parents, num_nodes)
        counts = tuple(int(k) for k in num_nodes.tolist())  # host values
        if counts and (min(counts) < 1 or max(counts) > d):
            raise ValueError(f"num_nodes: expected values in [1, {d}], got {list(counts)}")
        if on_device:
            dev = tokens.device
            nodes = to_device(num_nodes, dtype=torch.int64, device=dev)
            tree = _tree_grids(tokens.to(torch.int64), parents.to(dev), nodes, check=value_checks(dev))
            return replace(tree, host_num_nodes=counts)
        tree = _tree_grids(tokens, parents, num_nodes, check=True)
        is_chain = bool((tree.parents == torch.arange(d) - 1).all())
        return replace(tree, is_chain=is_chain, host_num_nodes=counts).to(out_dev)

    @staticmethod
    def chain(
        root: torch.Tensor,
        drafts: torch.Tensor,
        num_drafts: torch.Tensor | None = None,
        *,
        layouts: ChainLayouts | None = None,
    ) -> VerifyTree:
        """A chain block: [root, drafts...]; `num_drafts` [N] (default all) limits the real drafts per row.

        Built on `root`'s device without a device read when `num_drafts` is on the host or None (checked
        there), so a drafter's device output becomes a verify block while the device still drafts.

        Args:
            root: [N] current tokens.
            drafts: [N, D - 1] draft tokens (padding values are ignored).
            num_drafts: [N] in [0, D - 1] or None.
            layouts: keeps the grids of host-counted chains on the device (a drafter's, reused round after
                round); None uploads them every call.
        """
        if root.dim() != 1:
            raise ValueError(f"root: expected shape [N], got {list(root.shape)}")
        n = root.shape[0]
        if drafts.dim() != 2 or drafts.shape[0] != n:
            raise ValueError(f"drafts: expected shape [{n}, D - 1], got {list(drafts.shape)}")
        tokens = torch.cat([root[:, None], drafts.to(root.device)], dim=1)  # [N, D]
        return VerifyTree.chain_block(tokens, num_drafts, layouts=layouts)

    @staticmethod
    def chain_block(
        tokens: torch.Tensor, num_drafts: torch.Tensor | None = None, *, layouts: ChainLayouts | None = None
    ) -> VerifyTree:
        """`chain` of a block given whole: `tokens` [N, D] each row's root token then its drafts (padding
        values are ignored), on the device the tree is built on (a drafter that writes its blocks so)."""
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens: expected shape [N, D >= 1], got {list(tokens.shape)}")
        (n, d), dev = tokens.shape, tokens.device
        tokens = tokens.to(torch.int64)
        if num_drafts is not None:
            _check("num_drafts", num_drafts, (n,))
            if num_drafts.device.type != "cpu":
                return VerifyTree._chain_on_device(tokens, num_drafts)
        host = [d] * n if num_drafts is None else [int(k) + 1 for k in num_drafts.tolist()]
        if n and (min(host) < 1 or max(host) > d):
            raise ValueError(f"num_drafts: expected values in [0, {d - 1}], got {[k - 1 for k in host]}")
        par, num_nodes, depth, mask, fc, sib = (
            ChainLayouts(capacity=1) if layouts is None else layouts
        ).grids(tuple(host), d, dev)
        return VerifyTree(tokens, par, num_nodes, depth, mask, fc, sib, True, tuple(host))

    @staticmethod
    def _chain_on_device(tokens: torch.Tensor, num_drafts: torch.Tensor) -> VerifyTree:
        """`chain` with node counts on the device: the same grids, computed there (no read back)."""
        (n, d), dev = tokens.shape, tokens.device
        num_nodes = num_drafts.to(dev, torch.int64) + 1  # [N] where the tokens are
        if n and (int(num_nodes.min()) < 1 or int(num_nodes.max()) > d):  # (a read back: a sync on CUDA)
            raise ValueError(f"num_drafts: expected values in [0, {d - 1}], got {(num_nodes - 1).tolist()}")
        col = torch.arange(d, device=dev)
        parents = (col - 1).expand(n, d)
        depth = col.expand(n, d)
        mask = (col[None, :] <= col[:, None]).expand(n, d, d)  # lower triangle
        first_child = torch.where(col[None, 1:] < num_nodes[:, None], col[None, 1:], -1)
        first_child = torch.cat([first_child, torch.full((n, 1), -1, dtype=torch.int64, device=dev)], dim=1)
        next_sibling = torch.full((n, d), -1, dtype=torch.int64, device=dev)
        return VerifyTree(tokens, parents, num_nodes, depth, mask, first_child, next_sibling, True)


# a chain's grids in `VerifyTree`'s field order: parents, num_nodes, depth, mask, first_child, next_sibling
_Grids = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class ChainLayouts:
    """The grids of chain blocks counted on the host (`VerifyTree.chain`), kept on the device per (node
    counts, D, device): a drafter's rounds verify the same rows at the same lengths again and again, so the
    grids go up once instead of in a copy per round. A `VerifyTree`'s arrays are read, never written, so one
    upload serves every tree built from it. Holds at most `capacity` layouts, the least recently used
    dropped first.
    """

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1, got {capacity}")
        self.capacity = capacity
        self._kept: OrderedDict[tuple[tuple[int, ...], int, torch.device], _Grids] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def grids(self, host: tuple[int, ...], d: int, device: torch.device) -> _Grids:
        """(parents [N, D], num_nodes [N], depth [N, D], mask [N, D, D] bool, first_child [N, D],
        next_sibling [N, D]) int64 of a chain of D nodes per row with `host` real nodes each (checked by the
        caller), on `device`: `VerifyTree`'s fields in its order."""
        key = (host, d, device)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept
        # closed form of `from_parents` for a chain (no per-node loop): node j's parent is j - 1, its only
        # child j + 1 when that node is real; padded nodes continue the chain. Every grid is built on the
        # host and goes up in one copy; those every row shares are expanded views of one row
        n, col = len(host), range(d)
        first_child = [j + 1 if j + 1 < k else -1 for k in host for j in col]  # [N * D]
        lower = [int(j <= i) for i in col for j in col]  # [D * D] the ancestor mask: lower triangle
        flat = [j - 1 for j in col] + list(col) + [-1] * d + lower + first_child + list(host)
        up = to_device(flat, dtype=torch.int64, device=device)
        par, depth, sib, mask, fc, num_nodes = torch.split(up, [d, d, d, d * d, n * d, n])
        kept = (
            par.expand(n, d),
            num_nodes,
            depth.expand(n, d),
            mask.view(d, d).bool().expand(n, d, d),
            fc.view(n, d),
            sib.expand(n, d),
        )
        self._kept[key] = kept
        if len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
        return kept


class TreeDraftBuilder:
    """Accumulates top-k draft steps and selects the best D - 1 nodes by cumulative path probability.

    Step 0 expands the root: `add_step(tokens [N, 1, K], probs [N, 1, K])`. Every later step expands the K
    nodes `add_step` returned last (`expand` [N, K] candidate indices, in that order):
    `add_step(tokens [N, K, K], probs [N, K, K])`. Every child of an expanded node becomes a candidate with
    score = parent score * prob; the K best candidates of a step are the next step's expanded nodes
    (ties go to the lower candidate index). A chain is topk = 1.
    """

    def __init__(self, root: torch.Tensor, topk: int) -> None:
        if root.dim() != 1:
            raise ValueError(f"root: expected shape [N], got {list(root.shape)}")
        if topk < 1:
            raise ValueError(f"topk: expected >= 1, got {topk}")
        self.root = root.to(torch.int64)  # [N]
        self.topk = topk
        n, dev = root.shape[0], root.device
        self._tokens: list[torch.Tensor] = []  # each [N, M_step] int64
        self._scores: list[torch.Tensor] = []  # each [N, M_step] fp32
        self._parents: list[torch.Tensor] = []  # each [N, M_step] int64, candidate index (-1 = root)
        self._num_candidates = 0
        # expanded nodes of the last step as candidate indices (root = -1) and their path scores
        self._expand = torch.full((n, 1), -1, dtype=torch.int64, device=dev)
        self._expand_scores = torch.ones(n, 1, dtype=torch.float32, device=dev)

    @property
    def num_candidates(self) -> int:
        return self._num_candidates

    def add_step(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Add one draft step's top-k children; returns `expand` [N, K], the nodes to expand next.

        Args:
            tokens: [N, E, K] child tokens of the E nodes expanded now (E = 1 at step 0, else K).
            probs: [N, E, K] their draft probabilities (conditional on the parent).
        """
        n, e = self._expand.shape
        k = self.topk
        _check("tokens", tokens, (n, e, k))
        _check("probs", probs, (n, e, k))
        scores = (self._expand_scores[:, :, None] * probs.float()).reshape(n, e * k)  # [N, E*K]
        parents = self._expand[:, :, None].expand(n, e, k).reshape(n, e * k)
        base = self._num_candidates
        self._tokens.append(tokens.reshape(n, e * k).to(torch.int64))
        self._scores.append(scores)
        self._parents.append(parents)
        self._num_candidates += e * k
        # stable sort keeps the lower index first on equal scores
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]  # [N, K]
        self._expand = order + base
        self._expand_scores = torch.gather(scores, 1, order)
        return self._expand

    def chain_drafts(self) -> torch.Tensor:
        """topk 1: the drafts of every step so far, [N, steps] (what `build` would lay out, without the
        tree bookkeeping)."""
        if self.topk != 1:
            raise ValueError(f"chain_drafts: only for topk 1, got topk {self.topk}")
        n = self.root.shape[0]
        if not self._tokens:
            return torch.zeros(n, 0, dtype=torch.int64, device=self.root.device)
        return torch.cat(self._tokens, dim=1)

    def build(
        self,
        num_draft_tokens: int,
        *,
        num_nodes: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> VerifyTree:
        """Select the best `num_draft_tokens - 1` candidates and lay them out as a verify block.

        Candidates are numbered step by step, so a parent's index is below its children's; a child's score
        never exceeds its parent's, and ties prefer the lower index, so every selected node's parent is
        selected too (`VerifyTree.from_parents` checks it on the host: a lost parent would be a -1).
        Sorting the selection by candidate index then puts parents before children. `num_nodes` [N]
        (default all) keeps fewer real nodes per row; `device` as in `from_parents`.
        """
        d = num_draft_tokens
        if d < 1 or d - 1 > self._num_candidates:
            raise ValueError(f"num_draft_tokens: expected in [1, {self._num_candidates + 1}], got {d}")
        n, dev = self.root.shape[0], self.root.device
        if d == 1:
            root_only = VerifyTree.chain(self.root, torch.zeros(n, 0, dtype=torch.int64, device=dev))
            return root_only if device is None else root_only.to(device)
        tree_tokens, tree_parents = self.select(d)
        if num_nodes is None:
            num_nodes = torch.full((n,), d, dtype=torch.int64)
        return VerifyTree.from_parents(tree_tokens, tree_parents, num_nodes, device=device)

    def select(self, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`build`'s layout alone, device ops only (a CUDA graph may run it): the root and the best
        `num_draft_tokens - 1` candidates as a block's (tokens [N, D], parents [N, D]) int64, parents before
        their children. D >= 2."""
        d = num_draft_tokens
        n, dev = self.root.shape[0], self.root.device
        tokens = torch.cat(self._tokens, dim=1)  # [N, M]
        scores = torch.cat(self._scores, dim=1)  # [N, M]
        parents = torch.cat(self._parents, dim=1)  # [N, M]
        top = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : d - 1]
        sel = torch.sort(top, dim=1).values  # [N, D-1] candidate indices, increasing
        # block position of every candidate: root 0, selected candidates 1.., others unused
        m = tokens.shape[1]
        pos = torch.full((n, m + 1), -1, dtype=torch.int64, device=dev)
        pos[:, 0] = 0
        pos.scatter_(1, sel + 1, torch.arange(1, d, device=dev).expand(n, d - 1).contiguous())
        sel_parents = torch.gather(parents, 1, sel)  # [N, D-1], candidate index or -1
        block_parents = torch.gather(pos, 1, sel_parents + 1)
        tree_tokens = torch.cat([self.root[:, None], torch.gather(tokens, 1, sel)], dim=1)
        tree_parents = torch.cat(
            [torch.full((n, 1), -1, dtype=torch.int64, device=dev), block_parents], dim=1
        )
        return tree_tokens, tree_parents


def pad_block(
    tree: VerifyTree, draft_probs: torch.Tensor | None, d: int
) -> tuple[VerifyTree, torch.Tensor | None]:
    """The same blocks as d-node blocks (a captured graph's D): the extra nodes continue each row's chain
    after its last node, so no real node sees them, verification never reaches them (num_nodes unchanged)
    and no commit step points at them."""
    n, d0 = tree.batch_size, tree.block_size
    dev = tree.tokens.device
    if tree.is_chain:
        padded = resized_chain(tree, d)
    else:
        tokens = torch.cat([tree.tokens, torch.zeros(n, d - d0, dtype=torch.int64, device=dev)], dim=1)
        tail = (torch.arange(d0, d, dtype=torch.int64, device=dev) - 1).expand(n, d - d0)
        # host node counts: a tree on a device stays there, unread
        padded = VerifyTree.from_parents(tokens, torch.cat([tree.parents, tail], dim=1), tree.node_counts())
    if draft_probs is not None:
        v = draft_probs.shape[-1]
        draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(n, d - d0, v)], dim=1)  # [N, d, V]
    return padded, draft_probs


def resized_chain(tree: VerifyTree, d: int) -> VerifyTree:
    """The same chains as d-node blocks (cut, or padded with nodes that continue each chain), built on the
    tree's device from the host's node counts: no device read."""
    n, d0 = tree.batch_size, tree.block_size
    drafts = tree.tokens[:, 1:d]  # [N, <= d - 1]
    if d > d0:
        pad = torch.zeros(n, d - d0, dtype=torch.int64, device=tree.tokens.device)
        drafts = torch.cat([drafts, pad], dim=1)  # [N, d - 1]
    num_drafts = torch.tensor([k - 1 for k in tree.node_counts()], dtype=torch.int64)
    return VerifyTree.chain(tree.tokens[:, 0], drafts, num_drafts)
