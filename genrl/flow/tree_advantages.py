"""Tree credit assignment for BranchGRPO (Li et al. 2025; docs/methods/grpo.md, BranchGRPO): reward fusion from
leaves to internal nodes, depth-wise advantages, edge pruning and its schedule over training. Pure functions over
the tree structure of a :class:`~genrl.rollout.tree.TreeRollout` (``parent[k]``, ``tree[k]``, ``log_probs[k]``
per step k) and the training iteration.

Nodes live at steps k = 0..S (step S are the leaves); a node at step k has depth k. The edge into a node at step
k + 1 is the transition of step k; it gets that child's advantage.
"""

from __future__ import annotations

import math
import operator
from typing import Literal

import torch

from genrl.flow.policy import group_advantages
from genrl.flow.selection import bottom_top

__all__ = ["fuse_rewards", "depthwise_advantages", "prune_edges", "sliding_prune_depths", "pruning_active"]


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

    * Depth pruning: drop edges whose child depth (step + 1) is in ``depths`` (for a window that slides over
      training, pass :func:`sliding_prune_depths`' depths of the iteration).
    * Width pruning (``width_ratio`` > 0, the fraction PRUNED), on the "last-layer" edges only (step > the last
      split step), group by group, a group of n such edges keeping m = ceil(n (1 - width_ratio)) >= 1 of them:
      ``"chain"`` groups per chain below the last split (``chain_id``: the leaf each such edge leads to) and keeps
      the m best by advantage; ``"extremes"`` groups per tree and keeps the floor(m / 2) best and the ceil(m / 2)
      worst. (The BranchGRPO code's ``width_pruning_ratio`` is the fraction KEPT, rounded down, and its extremes
      mode pools the trees of a device: docs/methods/grpo.md, Pruning, converts.)

    Ties follow the tie rule of :mod:`genrl.flow.selection` (:func:`~genrl.flow.selection.bottom_top`: one stable
    ascending sort by (advantage, position), worst = first, best = last, no edge both) applied to the group's
    edges listed in REVERSED depth-first order, the depth-first order being the BranchGRPO code's edge list: by
    chain (``chain_id``, which follows the tree's path order), then by depth. So among tied advantages the edge
    earlier in depth-first order ranks higher, exactly as the code's stable descending sort of that list ranks
    them, and a ported configuration keeps the same edges. Under mean fusion a chain's edges all tie: ``"chain"``
    keeps each chain's shallowest m edges, and ``"extremes"`` with tied chains takes the best edges from the
    earliest tied chains and the worst from the latest, whole chains first.

    Args:
        edges: from :meth:`TreeRollout.edges` (``step``, ``tree``, ...); advantages: float [E] per edge.
        chain_id: int64 [E], an id shared by the edges of one chain below the last split, increasing with the
            chain's path (the child index :meth:`TreeRollout.edges` gives: ``edges["child"]``); required for
            ``"chain"``, defaults to ``edges["child"]`` for ``"extremes"``.
    Returns:
        bool [E], True = train the edge.
    Raises:
        ValueError: a ratio outside [0, 1), an unknown mode, ``chain`` without ``chain_id``, ``extremes`` without
            ``chain_id`` or ``edges["child"]``, or no edge left.
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
        if width_mode == "chain" and chain_id is None:
            raise ValueError("width_mode 'chain' needs chain_id (the leaf each last-layer edge leads to)")
        chain_id = chain_id if chain_id is not None else edges.get("child")
        if chain_id is None:
            raise ValueError("width_mode 'extremes' needs chain_id or edges['child'] (the leaf each last-layer edge "
                             "leads to), which order its ties")
        groups = chain_id if width_mode == "chain" else edges["tree"]
        for g in torch.unique(groups[last]):
            members = torch.nonzero(last & (groups == g)).flatten()
            members = members[torch.argsort(step[members], stable=True)]
            dfs = members[torch.argsort(chain_id[members], stable=True)]  # by chain, then depth
            listed = dfs.flip(0)  # the tie rule ranks the later-listed of tied edges higher
            n_keep = math.ceil(len(listed) * (1 - width_ratio) - 1e-9)  # keep at least one edge of a group
            n_top = n_keep if width_mode == "chain" else n_keep // 2
            worst, best = bottom_top(advantages[listed].detach().cpu(), n_keep - n_top, n_top)
            dropped = torch.ones(len(listed), dtype=torch.bool)
            dropped[worst] = False
            dropped[best] = False
            keep[listed[dropped]] = False
    if not bool(keep.any()):
        raise ValueError(f"pruning left no edge to train (depths={depths}, width_ratio={width_ratio}); "
                         f"prune less")
    return keep


def _as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError as e:
        raise ValueError(f"{name} must be an integer, got {value!r}") from e


def sliding_prune_depths(depths: list[int], iteration: int, interval: int | None = None,
                         stop_depth: int | None = None) -> list[int]:
    """The depth-pruning window at a training iteration: BranchGRPO's sliding window (``--depth_pruning_slide``).

    The window (child depths whose edges are dropped from the gradient step, :func:`prune_edges`) starts at
    ``depths`` and moves one depth shallower (every listed depth minus 1) each ``interval`` iterations, until its
    shallowest depth reaches ``stop_depth``; it then stays there (it does not wrap). With s = ``iteration`` + 1
    (the 1-based iteration number, which genrl logs as ``train/iteration`` at the end of the iteration and the
    BranchGRPO code calls its step):

        shift(s) = min(floor(s / interval), min(depths) - stop_depth),
        window(s) = {d - shift(s) : d in depths},

    exactly the BranchGRPO code's formula, so the same options give the same windows at the same iterations. Note
    that the first position lasts ``interval - 1`` iterations (s = 1 .. interval - 1) and every later one
    ``interval``; with ``interval = 1`` the window has already moved once at the first iteration.

    Args:
        depths: the starting window, child depths >= 1 (any order, duplicates ignored); empty: no depth pruning.
        iteration: the 0-based training iteration (the method's ``iteration`` counter before it advances).
        interval: iterations per one-depth move, >= 1; None: the window is fixed at ``depths``.
        stop_depth: the shallowest depth the window may reach, >= 1; required when sliding (BranchGRPO's default,
            which :class:`~genrl.methods.BranchGRPO` applies, is the last split step: the depth of the last split's
            parents).

    Returns:
        the window's depths at this iteration, ascending (a new list).

    Raises:
        ValueError: a depth < 1; a negative or non-integer iteration; an interval < 1; a sliding window without a
            ``stop_depth``, or whose ``stop_depth`` is < 1 or not shallower than ``min(depths)`` (it could never
            move; the message names both).

    Source: Li et al. 2025, BranchGRPO (depth pruning; the sliding window of its released trainer).
    """
    window = sorted({_as_int("a pruned depth", d) for d in depths})
    if window and window[0] < 1:
        raise ValueError(f"pruned depths must be >= 1 (the child depth of an edge, step + 1), got {window}")
    iteration = _as_int("iteration", iteration)
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if interval is None or not window:
        return window
    interval = _as_int("the slide interval", interval)
    if stop_depth is None:
        raise ValueError(f"a sliding depth window needs a stop depth (BranchGRPO: the last split step); got None "
                         f"for the window {window}")
    stop_depth = _as_int("the slide stop depth", stop_depth)
    if interval < 1:
        raise ValueError(f"the slide interval must be >= 1 iteration, got {interval}")
    if not 1 <= stop_depth < window[0]:
        raise ValueError(f"a sliding depth window needs 1 <= stop depth < its shallowest depth; got stop depth "
                         f"{stop_depth} for the window {window}: it could never move")
    shift = min((iteration + 1) // interval, window[0] - stop_depth)
    return [d - shift for d in window]


def pruning_active(iteration: int, step_ratio: float = 1.0, total_iterations: int | None = None) -> bool:
    """Whether pruning (depth and width alike) applies at a training iteration: BranchGRPO's
    ``--pruning_step_ratio``, pruning only in the first part of training.

    With s = ``iteration`` + 1 (1-based, as the BranchGRPO code counts its steps), pruning is on iff
    s <= floor(total_iterations * step_ratio), i.e. for the first floor(total_iterations * step_ratio) iterations;
    afterwards every edge is trained. ``step_ratio = 1`` prunes throughout (also past ``total_iterations``, and
    ``total_iterations`` may then be None); ``step_ratio = 0`` never prunes.

    Args:
        iteration: the 0-based training iteration.
        step_ratio: the fraction of training that prunes, in [0, 1].
        total_iterations: the length of training in iterations (the BranchGRPO code's ``max_train_steps``), >= 1;
            required when ``step_ratio < 1``.

    Returns:
        True when this iteration prunes.

    Raises:
        ValueError: a step_ratio outside [0, 1]; ``step_ratio < 1`` without ``total_iterations >= 1``; a negative
            or non-integer iteration.

    Source: Li et al. 2025, BranchGRPO (its released trainer's pruning step ratio).
    """
    if not 0.0 <= step_ratio <= 1.0:
        raise ValueError(f"the pruning step ratio must be in [0, 1], got {step_ratio}")
    iteration = _as_int("iteration", iteration)
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if step_ratio == 1.0:
        return True
    if total_iterations is None or _as_int("total_iterations", total_iterations) < 1:
        raise ValueError(f"a pruning step ratio {step_ratio} < 1 needs the training length total_iterations >= 1 "
                         f"(the iterations it is a fraction of), got {total_iterations}")
    return iteration + 1 <= math.floor(total_iterations * step_ratio)
