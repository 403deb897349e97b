"""Tree credit assignment for BranchGRPO (Li et al. 2025; docs/methods/grpo.md, BranchGRPO): reward fusion from
leaves to internal nodes, depth-wise advantages, and edge pruning. Pure functions over the tree structure
of a :class:`~genrl.rollout.tree.TreeRollout` (``parent[k]``, ``tree[k]``, ``log_probs[k]`` per step k).

Nodes live at steps k = 0..S (step S are the leaves); a node at step k has depth k. The edge into a node at step
k + 1 is the transition of step k; it gets that child's advantage.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from genrl.flow.policy import group_advantages

__all__ = ["fuse_rewards", "depthwise_advantages", "prune_edges"]


def fuse_rewards(
    parent: list[torch.Tensor], leaf_rewards: torch.Tensor, leaf_valid: torch.Tensor | None = None,
    log_probs: list[torch.Tensor] | None = None, weighting: Literal["mean", "path_prob"] = "mean", alpha: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rewards of every node from its leaves.

    ``"mean"`` (BranchGRPO default): R(n) = mean reward of the valid leaves below n. ``"path_prob"``: recursively
    R(n) = sum_c softmax_c(alpha l_c) R(c) over n's valid children c, with l_c the child edge's log-prob (mean over
    latent elements, so the weights are near uniform for large latents).

    Args:
        parent: ``parent[k]`` int64 [N_k] (k >= 1), the parent index of each node in step k - 1.
        leaf_rewards: float [N_S]; leaf_valid: bool [N_S] (default all valid; invalid leaves may be NaN).
        log_probs: ``log_probs[k]`` [N_k], needed for ``"path_prob"``.
    Returns:
        (rewards, valid): per step k, float64 [N_k] and bool [N_k]; a node is invalid when no valid leaf is below it.
    Raises:
        ValueError: unknown weighting, ``path_prob`` without log-probs, or a leaf count other than N_S.
    """
    if weighting not in ("mean", "path_prob"):
        raise ValueError(f"unknown reward fusion {weighting!r}; use 'mean' or 'path_prob'")
    if weighting == "path_prob" and log_probs is None:
        raise ValueError("path_prob fusion needs the edges' log_probs")
    s = len(parent) - 1
    n_leaves = leaf_rewards.shape[0]
    if parent[s].shape[0] != n_leaves:
        raise ValueError(f"{n_leaves} leaf rewards for {parent[s].shape[0]} leaves")
    valid = torch.ones(n_leaves, dtype=torch.bool) if leaf_valid is None else leaf_valid.cpu().bool()
    r = torch.where(valid, leaf_rewards.detach().cpu().double(), torch.zeros(n_leaves, dtype=torch.float64))
    rewards, valids = [None] * (s + 1), [None] * (s + 1)
    rewards[s], valids[s] = torch.where(valid, r, torch.full_like(r, float("nan"))), valid
    count = valid.double()  # valid leaves below each node
    total = r * count
    for k in range(s, 0, -1):
        n_par = parent[k - 1].shape[0] if k - 1 > 0 else int(parent[k].max()) + 1
        idx = parent[k]
        if weighting == "mean":
            pc = torch.zeros(n_par, dtype=torch.float64).index_add_(0, idx, count)
            pt = torch.zeros(n_par, dtype=torch.float64).index_add_(0, idx, total)
            ok = pc > 0
            rewards[k - 1] = torch.where(ok, pt / pc.clamp_min(1), torch.full_like(pt, float("nan")))
            count, total = pc, pt
        else:
            ok_child = valids[k]
            lp = log_probs[k].detach().cpu().double()
            logits = torch.where(ok_child, alpha * lp, torch.full_like(lp, float("-inf")))
            mx = torch.full((n_par,), float("-inf"), dtype=torch.float64).scatter_reduce(0, idx, logits, "amax")
            w = torch.exp(logits - mx[idx])
            w = torch.where(ok_child, w, torch.zeros_like(w))
            z = torch.zeros(n_par, dtype=torch.float64).index_add_(0, idx, w)
            num = torch.zeros(n_par, dtype=torch.float64).index_add_(0, idx, w * torch.nan_to_num(rewards[k]))
            ok = z > 0
            rewards[k - 1] = torch.where(ok, num / z.clamp_min(1e-300), torch.full_like(num, float("nan")))
        valids[k - 1] = ok
    return rewards, valids


def depthwise_advantages(
    rewards: list[torch.Tensor], valid: list[torch.Tensor], tree: list[torch.Tensor], eps: float = 1e-8,
) -> list[torch.Tensor]:
    """BranchGRPO's depth-wise advantage: within each tree, the nodes of one depth are a group,
    A(n) = (R(n) - mean_d R) / (std_d R + eps) with the unbiased std (ddof 1); 0 for a depth with one node, a
    constant depth (std < 1e-6) or an invalid node (docs/methods/grpo.md, Reward fusion and depth-wise advantages).

    Returns:
        per step k, float32 [N_k] advantages (the edge into a node at step k gets its node's advantage).
    """
    out = []
    for r, ok, t in zip(rewards, valid, tree):
        out.append(group_advantages(torch.nan_to_num(r), t, std="group", eps=eps, ddof=1, valid=ok).float())
    return out


def prune_edges(
    edges: dict[str, torch.Tensor], advantages: torch.Tensor, split_steps: list[int], num_steps: int,
    depths: list[int] | None = None, width_ratio: float = 0.0, width_mode: Literal["chain", "extremes"] = "chain",
    chain_id: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which edges the gradient step keeps (rollouts, rewards and advantages are untouched).

    * Depth pruning: drop edges whose child depth (step + 1) is in ``depths``.
    * Width pruning (``width_ratio`` > 0), on the "last-layer" edges only (step > the last split step):
      ``"chain"`` keeps, per chain below the last split (``chain_id``: the leaf each such edge leads to), the top
      ``1 - width_ratio`` of its edges by advantage (ties: the shallower edges first, BranchGRPO's stable sort);
      ``"extremes"`` keeps, per tree, the edges with the best and the worst ``(1 - width_ratio) / 2`` advantages.

    Args:
        edges: from :meth:`TreeRollout.edges` (``step``, ``tree``, ...); advantages: float [E] per edge.
        chain_id: int64 [E], for width mode ``"chain"``: an id shared by the edges of one chain.
    Returns:
        bool [E], True = train the edge.
    Raises:
        ValueError: a ratio outside [0, 1), an unknown mode, ``chain`` without ``chain_id``, or no edge left.
    """
    if not 0.0 <= width_ratio < 1.0:
        raise ValueError(f"width_ratio must be in [0, 1), got {width_ratio}")
    if width_mode not in ("chain", "extremes"):
        raise ValueError(f"unknown width pruning mode {width_mode!r}; use 'chain' or 'extremes'")
    step = edges["step"]
    keep = torch.ones(step.shape[0], dtype=torch.bool)
    if depths:
        keep &= ~torch.isin(step + 1, torch.tensor(sorted(depths), dtype=torch.long))
    if width_ratio > 0:
        last = step > max(split_steps)
        if width_mode == "chain":
            if chain_id is None:
                raise ValueError("width_mode 'chain' needs chain_id (the leaf each last-layer edge leads to)")
            groups = chain_id
        else:
            groups = edges["tree"]
        for g in torch.unique(groups[last]):
            members = torch.nonzero(last & (groups == g)).flatten()
            order = members[torch.argsort(step[members], stable=True)]  # shallow first
            ranked = order[torch.argsort(-advantages[order], stable=True)]  # best first
            n_keep = math.ceil(len(order) * (1 - width_ratio) - 1e-9)  # keep at least one edge of a group
            if width_mode == "chain":
                drop = ranked[n_keep:]
            else:
                top = n_keep // 2
                bottom = n_keep - top
                drop = ranked[top : len(ranked) - bottom]
            keep[drop] = False
    if not bool(keep.any()):
        raise ValueError(f"pruning left no edge to train (depths={depths}, width_ratio={width_ratio}); "
                         f"prune less")
    return keep
