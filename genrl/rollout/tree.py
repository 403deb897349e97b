"""Tree rollouts (BranchGRPO; Li et al. 2025, "BranchGRPO: Stable and Efficient GRPO with Structured
Branching in Diffusion Models"): a mode of the shared sampler.

One tree per prompt. The root is the initial noise x_0 (addressed by (seed, tree index, step 0), the same noise
as flat rollout sample ``tree index``). At every step k the whole frontier of every tree (all nodes alive at
step k) is evaluated in one batched, fixed-micro-batch guided-velocity call, so nodes at the same depth share
the computation of their common prefix; a node splits into ``branch_factor`` children at the steps in
``split_steps`` and continues as a chain elsewhere. Siblings share the parent's mean and differ only in their
noise, drawn from (seed, tree, node path code, step k + 1), so any leaf can be regenerated alone, bitwise.
At split steps the noise is scaled by ``split_noise_scale`` (kappa); the stored log-prob is the density of the
noise actually drawn (std kappa s). ``reference_split_log_prob=True`` reproduces the BranchGRPO code, which
samples with kappa s but scores with s - a compatibility option, off by default.

Mix (BranchGRPO-Mix): only steps with ``k mod mix_stride < mix_window`` and the split steps are stochastic; the
others are deterministic Euler steps (no density, not trained).

Counting (one tree, ``num_steps`` S): the frontier at step k holds f^(number of splits before k) nodes; the
denoiser evaluations are the sum of the frontier sizes and the edges (transitions) the sum of the children
sizes. Factor 2, splits {0, 3, 6, 9}, S = 20: 16 leaves, 203 evaluations, 218 edges
(docs/methods/grpo.md, Tree rollouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from genrl.flow.sde import StepOutput, sde_step, step_log_prob
from genrl.noise import mix_seed, randn_per_sample, stream_id
from genrl.rollout.sampler import RolloutConfig, _encode, fixed_latents, guided_velocity

#: a tree's noise stream (the flat rollout's) and the salt of its node indices (genrl.noise.STREAMS).
_FLAT, _NODE_SALT = stream_id("rollout.flat"), stream_id("rollout.tree_node")

__all__ = ["TreeConfig", "TreeRollout", "tree_rollout", "edge_log_prob", "regenerate_leaf"]


@dataclass
class TreeConfig:
    """The branching structure of a tree rollout.

    Attributes:
        split_steps: step indices (0-based, < num_steps) at which every node splits.
        branch_factor: children per split (any integer >= 2).
        split_noise_scale: kappa, the std multiplier of the split steps' noise (1 = the plain kernel; the
            BranchGRPO launcher uses 4).
        reference_split_log_prob: store the split steps' log-prob with the unscaled std, as the reference code
            does (not the density of the noise drawn); off by default.
        mix_window, mix_stride: BranchGRPO-Mix: a step k is stochastic iff ``k % mix_stride < mix_window`` or k is a
            split step; ``mix_window = 0`` (default) makes every step stochastic.
        max_frontier: the memory budget: the most nodes alive at one step over all trees of a rollout batch
            (each holds a latent and its velocity); a configuration that exceeds it is refused before sampling.
    """

    split_steps: list[int] = field(default_factory=lambda: [0, 3, 6, 9])
    branch_factor: int = 2
    split_noise_scale: float = 1.0
    reference_split_log_prob: bool = False
    mix_window: int = 0
    mix_stride: int = 1
    max_frontier: int = 4096

    def __post_init__(self) -> None:
        if self.branch_factor < 2:
            raise ValueError(f"branch_factor must be >= 2, got {self.branch_factor}")
        if not self.split_steps:
            raise ValueError("split_steps is empty: a tree needs at least one split (use GRPO for plain groups)")
        if len(set(self.split_steps)) != len(self.split_steps):
            raise ValueError(f"split_steps has duplicates: {self.split_steps}")
        self.split_steps = sorted(int(k) for k in self.split_steps)
        if not self.split_noise_scale > 0:
            raise ValueError(f"split_noise_scale must be > 0, got {self.split_noise_scale}")
        if self.mix_window < 0 or self.mix_stride < 1:
            raise ValueError(f"need mix_window >= 0 and mix_stride >= 1, got {self.mix_window}, {self.mix_stride}")
        if self.max_frontier < 1:
            raise ValueError(f"max_frontier must be >= 1, got {self.max_frontier}")

    def check(self, num_steps: int, trees: int = 1) -> None:
        """Validate against a schedule of ``num_steps`` steps and a batch of ``trees`` trees.

        Raises:
            ValueError: a split step outside [0, num_steps) (names it and the valid range), or a frontier
                larger than ``max_frontier`` (names the step, the size and the fix).
        """
        bad = [k for k in self.split_steps if not 0 <= k < num_steps]
        if bad:
            raise ValueError(f"split steps {bad} are outside the schedule: valid steps are 0..{num_steps - 1} "
                             f"(num_steps={num_steps})")
        peak = self.leaves * trees
        if peak > self.max_frontier:
            raise ValueError(
                f"{trees} trees x {self.leaves} leaves (branch_factor {self.branch_factor} ^ {len(self.split_steps)} "
                f"splits) = {peak} nodes alive at the last steps, over the declared budget max_frontier="
                f"{self.max_frontier}; use fewer splits, a smaller branch_factor or fewer prompts per batch, or raise "
                f"max_frontier if the memory allows"
            )

    @property
    def leaves(self) -> int:
        """Leaves per tree: branch_factor ^ len(split_steps)."""
        return self.branch_factor ** len(self.split_steps)

    def frontier_sizes(self, num_steps: int) -> list[int]:
        """Nodes evaluated at each step k of one tree (= denoiser evaluations of step k)."""
        self.check(num_steps)
        sizes, n = [], 1
        for k in range(num_steps):
            sizes.append(n)
            if k in self.split_steps:
                n *= self.branch_factor
        return sizes

    def children(self, k: int) -> int:
        return self.branch_factor if k in self.split_steps else 1

    def denoiser_evals(self, num_steps: int) -> int:
        """Denoiser evaluations per tree (without CFG's doubling)."""
        return sum(self.frontier_sizes(num_steps))

    def num_edges(self, num_steps: int) -> int:
        """Transitions (edges) per tree, stochastic or not."""
        return sum(n * self.children(k) for k, n in enumerate(self.frontier_sizes(num_steps)))

    def sde_mask(self, num_steps: int) -> torch.Tensor:
        """bool [num_steps]: stochastic steps (every step, or Mix windows + split steps)."""
        mask = torch.ones(num_steps, dtype=torch.bool)
        if self.mix_window > 0:
            mask = torch.tensor([(k % self.mix_stride) < self.mix_window for k in range(num_steps)])
            mask[[k for k in self.split_steps if k < num_steps]] = True
        return mask


@dataclass
class TreeRollout:
    """What a tree rollout recorded; per-step lists, index k = step (CPU tensors).

    Attributes:
        latents: ``latents[k]`` [N_k, *latent], the nodes alive before step k (k = 0..S; k = S are the leaves).
        parent: ``parent[k]`` int64 [N_k], for k >= 1 the index in ``latents[k - 1]`` of each node's parent
            (``parent[0]`` is empty).
        tree: ``tree[k]`` int64 [N_k], the tree (prompt) of each node (0..P-1).
        codes: ``codes[k]`` int64 [N_k], the node's path code (its child choices at the splits so far, in base
            branch_factor), which with (seed, tree index, step) addresses its noise.
        log_probs: ``log_probs[k]`` float32 [N_k], for k >= 1 the log-prob of the edge into each node (mean over
            latent elements; 0 on deterministic steps).
        x0: [N_S, *latent] each leaf's clean-sample prediction x - sigma v at the last step.
        sigmas: float64 [S + 1]; sde_mask: bool [S]; std_scales: float [S] (kappa at split steps, else 1; the
            log-prob's scale, i.e. 1 at split steps under ``reference_split_log_prob``).
        prompts: the P prompts (one per tree); tree_indices: int64 [P] their global indices; seed.
        config, tree_config: the configs used.
    """

    latents: list[torch.Tensor]
    parent: list[torch.Tensor]
    tree: list[torch.Tensor]
    codes: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    x0: torch.Tensor
    sigmas: torch.Tensor
    sde_mask: torch.Tensor
    std_scales: list[float]
    prompts: list[str]
    tree_indices: torch.Tensor
    seed: int
    config: RolloutConfig
    tree_config: TreeConfig

    @property
    def num_steps(self) -> int:
        return len(self.latents) - 1

    @property
    def leaves(self) -> torch.Tensor:
        return self.latents[-1]

    @property
    def denoiser_evals(self) -> int:
        """Frontier nodes evaluated over all steps and trees (CFG doubles the network calls)."""
        return sum(int(x.shape[0]) for x in self.latents[:-1])

    def edges(self, stochastic_only: bool = True) -> dict[str, torch.Tensor]:
        """All edges as flat int64 tensors: ``step`` (k), ``child`` (index in ``latents[k + 1]``), ``parent``
        (index in ``latents[k]``), ``tree``; ordered by step then child. Deterministic (Mix) steps are
        left out when ``stochastic_only``."""
        steps, child, parent, tree = [], [], [], []
        for k in range(self.num_steps):
            if stochastic_only and not bool(self.sde_mask[k]):
                continue
            n = self.latents[k + 1].shape[0]
            steps.append(torch.full((n,), k, dtype=torch.long))
            child.append(torch.arange(n))
            parent.append(self.parent[k + 1])
            tree.append(self.tree[k + 1])
        cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long))  # noqa: E731
        return {"step": cat(steps), "child": cat(child), "parent": cat(parent), "tree": cat(tree)}


def _node_index(tree_index: torch.Tensor, codes: torch.Tensor) -> list[int]:
    return [mix_seed(int(t), int(c), _NODE_SALT) for t, c in zip(tree_index.tolist(), codes.tolist())]


def _tree_step(config: RolloutConfig, tree: TreeConfig, k: int, stochastic: bool, x: torch.Tensor,
               v: torch.Tensor, sig32: torch.Tensor, sigma_at_one: float | None, latent_shape: Sequence[int],
               seed: int, tree_index: torch.Tensor, codes: torch.Tensor,
               keep: torch.Tensor | None = None) -> tuple[StepOutput, float]:
    """Step k of the nodes x [N, *latent] (velocities v, the parents' rows repeated per child) into their
    children, whose noise is addressed by (seed, tree_index [N], codes [N], step k + 1); shared by
    :func:`tree_rollout` and :func:`regenerate_leaf` so both draw and scale the noise alike. ``keep``: the sampled
    elements per row (None: all; a given conditioning frame stays as it is, :func:`~genrl.rollout.sampler.
    fixed_latents`).

    Returns:
        (the step's output, the std scale of its log-prob: kappa at split steps, 1 on other steps, on
        deterministic steps and at split steps under ``reference_split_log_prob``).
    """
    if not stochastic:
        return sde_step("ode", x, v, sig32[k], sig32[k + 1], None, keep=keep), 1.0
    noise = randn_per_sample(latent_shape, seed, _node_index(tree_index, codes), step=k + 1, stream=_FLAT,
                            device=x.device,
                             backend=config.noise_backend)
    split = k in tree.split_steps
    scale = tree.split_noise_scale if split else 1.0
    if split and tree.reference_split_log_prob:  # the reference code: sample with kappa s, score with s
        return sde_step(config.kernel, x, v, sig32[k], sig32[k + 1], noise * scale, noise_level=config.noise_level,
                        sigma_at_one=sigma_at_one, keep=keep), 1.0
    return sde_step(config.kernel, x, v, sig32[k], sig32[k + 1], noise, noise_level=config.noise_level,
                    sigma_at_one=sigma_at_one, std_scale=scale, keep=keep), scale


def tree_rollout(
    generator,
    prompts: list[str],
    latent_shape: Sequence[int],
    seed: int,
    tree_indices: Sequence[int] | torch.Tensor | None = None,
    config: RolloutConfig | None = None,
    tree: TreeConfig | None = None,
    progress: bool = False,
) -> TreeRollout:
    """Sample one tree per prompt (no gradients).

    Args:
        generator: any :class:`~genrl.models.generator.Generator`.
        prompts: P prompts (one tree each; do not repeat prompts for groups: the tree is the group).
        latent_shape: per-sample latent shape.
        seed: run seed; tree_indices: global ids of the trees (default 0..P-1); together they address the noise.
        config: the :class:`RolloutConfig` (kernel, noise level, steps, CFG, micro-batch size); its ``sde_steps``
            is ignored (the tree's Mix settings decide) and every step can be trained, the last one included.
        tree: the :class:`TreeConfig`.
        progress: a progress bar over steps.
    Returns:
        :class:`TreeRollout`.
    Raises:
        ValueError: see :meth:`TreeConfig.check`; an ``"ode"`` kernel (a tree needs stochastic splits); a
            tree_indices length other than P.
    """
    config = config or RolloutConfig()
    tree = tree or TreeConfig()
    if config.kernel == "ode":
        raise ValueError("a tree rollout needs a stochastic kernel (flow_grpo or dance_grpo), got kernel='ode'")
    p = len(prompts)
    tree.check(config.num_steps, trees=p)
    idx = torch.arange(p) if tree_indices is None else torch.as_tensor(list(map(int, tree_indices)), dtype=torch.long)
    if len(idx) != p:
        raise ValueError(f"{len(idx)} tree indices for {p} prompts")
    device = generator.device
    sigmas = config.sigmas()
    sig32 = sigmas.to(device=device, dtype=torch.float32)
    sigma_at_one = config.sigma_at_one(sigmas)
    mask = tree.sde_mask(config.num_steps)
    with torch.no_grad():
        cond_t, uncond_t = _encode(generator, list(prompts), config)
        x = randn_per_sample(latent_shape, seed, idx, step=0, stream=_FLAT, device=device,
                             backend=config.noise_backend)
        fixed = fixed_latents(generator, cond_t)  # a given first frame (image-to-video): per tree
        keep_t = None
        if fixed is not None:
            keep_t = fixed[1]
            x = torch.where(keep_t, x, fixed[0].to(x.dtype))
        node_tree = torch.arange(p)
        codes = torch.zeros(p, dtype=torch.long)
        latents, parents, trees, all_codes, log_probs = [x.cpu()], [torch.zeros(0, dtype=torch.long)], [node_tree], \
            [codes], [torch.zeros(p)]
        std_scales: list[float] = []
        steps = range(config.num_steps)
        if progress:
            from rich.progress import track

            steps = track(steps, description="tree rollout")
        x0 = None
        for k in steps:
            n = x.shape[0]
            cond = cond_t.select(node_tree)
            uncond = uncond_t.select(node_tree) if uncond_t is not None else None
            v = guided_velocity(generator, x, sig32[k].expand(n), cond, uncond, config.cfg_scale,
                                config.micro_batch_size, config.batching)
            f = tree.children(k)
            par = torch.arange(n).repeat_interleave(f)
            child_tree = node_tree.repeat_interleave(f)
            child_codes = codes.repeat_interleave(f) * f + torch.arange(f).repeat(n) if f > 1 else codes.clone()
            xp, vp = x[par.to(device)], v[par.to(device)]
            out, std_scale = _tree_step(config, tree, k, bool(mask[k]), xp, vp, sig32, sigma_at_one, latent_shape,
                                        seed, idx[child_tree], child_codes,
                                        None if keep_t is None else keep_t[child_tree.to(keep_t.device)])
            std_scales.append(std_scale)
            if k == config.num_steps - 1:
                x0 = (xp - sig32[k] * vp).float().cpu()
            x = out.sample
            node_tree, codes = child_tree, child_codes
            latents.append(x.detach().cpu())
            parents.append(par)
            trees.append(child_tree)
            all_codes.append(child_codes)
            log_probs.append(out.log_prob.detach().float().cpu())
    return TreeRollout(latents=latents, parent=parents, tree=trees, codes=all_codes, log_probs=log_probs, x0=x0,
                       sigmas=sigmas, sde_mask=mask, std_scales=std_scales, prompts=list(prompts), tree_indices=idx,
                       seed=seed, config=config, tree_config=tree)


def edge_log_prob(
    generator, rollout: TreeRollout, step: int, child: torch.Tensor, cond=None, uncond=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob under the current weights of the edges into nodes ``child`` (indices in ``latents[step + 1]``)
    of one stochastic step; the same guided velocity (micro-batches, CFG) and kernel as :func:`tree_rollout`, so
    with unchanged weights it equals ``rollout.log_probs[step + 1][child]`` exactly.

    Args:
        cond, uncond: encodings of the edges' prompts (one row per edge; computed when None).
    Returns:
        (log_prob float32 [E] with grad, velocity [E, *latent]).
    Raises:
        ValueError: ``step`` is a deterministic (Mix) step.
    """
    if not bool(rollout.sde_mask[step]):
        raise ValueError(f"step {step} is a deterministic (Mix) step of this tree rollout; it has no density")
    config = rollout.config
    device = generator.device
    child = torch.as_tensor(child, dtype=torch.long)
    par = rollout.parent[step + 1][child]
    x = rollout.latents[step][par].to(device)
    sample = rollout.latents[step + 1][child].to(device)
    if cond is None:
        prompts = [rollout.prompts[int(t)] for t in rollout.tree[step + 1][child]]
        cond, uncond = _encode(generator, prompts, config)
    sig32 = rollout.sigmas.to(device=device, dtype=torch.float32)
    v = guided_velocity(generator, x, sig32[step].expand(x.shape[0]), cond, uncond, config.cfg_scale,
                        config.micro_batch_size, config.batching)
    sigma_at_one = config.sigma_at_one(rollout.sigmas)
    fixed = fixed_latents(generator, cond)
    lp, _, _ = step_log_prob(config.kernel, x, v, sig32[step], sig32[step + 1], sample,
                             noise_level=config.noise_level, sigma_at_one=sigma_at_one,
                             std_scale=rollout.std_scales[step], keep=None if fixed is None else fixed[1])
    return lp, v



def regenerate_leaf(
    generator, prompt: str, latent_shape: Sequence[int], seed: int, tree_index: int, leaf_code: int,
    config: RolloutConfig, tree: TreeConfig,
) -> torch.Tensor:
    """Sample one leaf of a tree alone, as a chain: the same noise addresses (seed, tree index, path code, step)
    and the same kernel and scales as :func:`tree_rollout`, so the result equals that leaf of the full tree
    bitwise under ``batching="fixed"`` (fixed micro-batches make each row independent of its batch; with ``"fast"``
    the chain's one-row calls match the tree's frontier calls only up to float rounding).

    Args:
        prompt: the tree's prompt; tree_index: its global index; leaf_code: the leaf's path code
            (``rollout.codes[-1][leaf]``).
    Returns:
        the leaf latent [*latent] (on the generator's device).
    """
    tree.check(config.num_steps)
    device = generator.device
    sigmas = config.sigmas()
    sig32 = sigmas.to(device=device, dtype=torch.float32)
    sigma_at_one = config.sigma_at_one(sigmas)
    mask = tree.sde_mask(config.num_steps)
    f, n_splits = tree.branch_factor, len(tree.split_steps)
    with torch.no_grad():
        cond, uncond = _encode(generator, [prompt], config)
        x = randn_per_sample(latent_shape, seed, [tree_index], step=0, stream=_FLAT, device=device,
                             backend=config.noise_backend)
        fixed = fixed_latents(generator, cond)
        keep = None if fixed is None else fixed[1]
        if fixed is not None:
            x = torch.where(keep, x, fixed[0].to(x.dtype))
        for k in range(config.num_steps):
            v = guided_velocity(generator, x, sig32[k].expand(1), cond, uncond, config.cfg_scale,
                                config.micro_batch_size, config.batching)
            done = sum(1 for s in tree.split_steps if s <= k)
            code = int(leaf_code) // f ** (n_splits - done)
            x = _tree_step(config, tree, k, bool(mask[k]), x, v, sig32, sigma_at_one, latent_shape, seed,
                           torch.tensor([tree_index]), torch.tensor([code]), keep)[0].sample
    return x[0]
