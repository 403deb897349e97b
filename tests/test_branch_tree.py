"""BranchGRPO tree rollouts: counts, bitwise leaves, exact first-update ratios, fusion, depth-wise advantages,
pruning, and the single-split reduction to flat GRPO."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow.policy import clipped_policy_loss, group_advantages
from genrl.flow.tree_advantages import (
    depthwise_advantages,
    fuse_rewards,
    prune_edges,
    pruning_active,
    sliding_prune_depths,
)
from genrl.models import DiTGenerator, TextEncoder, VideoDiT
from genrl.rollout import RolloutConfig, Trajectory, transition_log_prob
from genrl.rollout.tree import TreeConfig, edge_log_prob, regenerate_leaf, tree_rollout

SHAPE = (2, 3, 4, 4)
PROMPTS = ["a red circle moving left slowly", "a blue square staying still"]


@pytest.fixture(scope="module")
def gen(tiny_text_encoder) -> DiTGenerator:
    torch.manual_seed(0)
    dit = VideoDiT(hidden_size=32, num_layers=2, num_attention_heads=2, text_dim=16, patch_size=[2, 2, 2])
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0.0, 0.1)
    return DiTGenerator(dit.eval(), TextEncoder.from_pretrained(tiny_text_encoder))


def test_reference_counts():
    tree = TreeConfig(split_steps=[0, 3, 6, 9], branch_factor=2)
    assert tree.leaves == 16 and tree.denoiser_evals(20) == 203 and tree.num_edges(20) == 218
    assert TreeConfig(split_steps=[0, 2], branch_factor=3).leaves == 9
    with pytest.raises(ValueError, match=r"split steps \[20\] are outside the schedule: valid steps are 0..19"):
        TreeConfig(split_steps=[0, 20]).check(20)
    with pytest.raises(ValueError, match="over the declared budget max_frontier=64"):
        TreeConfig(split_steps=[0, 3, 6, 9], max_frontier=64).check(20, trees=8)
    with pytest.raises(ValueError, match="branch_factor must be >= 2"):
        TreeConfig(branch_factor=1)


def _small(**kw) -> tuple[RolloutConfig, TreeConfig]:
    config = RolloutConfig(num_steps=6, kernel="dance_grpo", noise_level=0.3, micro_batch_size=4, cfg_scale=2.0)
    return config, TreeConfig(split_steps=[0, 2, 4], branch_factor=2, **kw)


def test_rollout_counts_bitwise_leaves_and_exact_ratios(gen):
    config, tree = _small(split_noise_scale=4.0)
    ro = tree_rollout(gen, PROMPTS, SHAPE, seed=3, tree_indices=[5, 9], config=config, tree=tree)
    assert ro.leaves.shape == (2 * 8, *SHAPE)
    assert ro.denoiser_evals == 2 * tree.denoiser_evals(6)
    edges = ro.edges()
    assert edges["step"].numel() == 2 * tree.num_edges(6)
    for leaf in (0, 7, 11):  # any leaf, regenerated alone from its seed and path, is bitwise equal
        t = int(ro.tree[-1][leaf])
        alone = regenerate_leaf(gen, PROMPTS[t], SHAPE, 3, int(ro.tree_indices[t]), int(ro.codes[-1][leaf]), config,
                                tree)
        assert torch.equal(alone.cpu(), ro.leaves[leaf])
    for k in range(6):  # the loss side recomputes every edge's log-prob exactly (ratio 1 on the first update)
        children = torch.arange(ro.latents[k + 1].shape[0])
        lp, _ = edge_log_prob(gen, ro, k, children)
        assert torch.equal(lp.detach().cpu(), ro.log_probs[k + 1]), k
    # siblings share their parent and differ at the split; the stored split log-prob is the scaled density
    assert torch.equal(ro.parent[1], torch.tensor([0, 0, 1, 1]))
    assert ro.std_scales == [4.0, 1.0, 4.0, 1.0, 4.0, 1.0]
    # mean log-prob of a draw from N(mu, s^2): about -1/2 - log s - log(2 pi)/2 whatever kappa is
    scaled = ro.log_probs[1].mean()
    compat = tree_rollout(gen, PROMPTS, SHAPE, seed=3, tree_indices=[5, 9], config=config,
                          tree=TreeConfig(split_steps=[0, 2, 4], split_noise_scale=4.0, reference_split_log_prob=True))
    assert torch.equal(compat.leaves, ro.leaves)  # same samples, only the stored density differs
    assert compat.log_probs[1].mean() < scaled - 5  # the reference's unscaled density: E[l] lower by ~(k^2-1)/2


def test_mix_windows_and_deterministic_steps(gen):
    tree = TreeConfig(split_steps=[0, 3], mix_window=2, mix_stride=30)
    assert tree.sde_mask(6).tolist() == [True, True, False, True, False, False]
    config = RolloutConfig(num_steps=6, kernel="dance_grpo", noise_level=0.3, micro_batch_size=4)
    ro = tree_rollout(gen, PROMPTS[:1], SHAPE, seed=0, config=config, tree=tree)
    assert set(ro.edges()["step"].tolist()) == {0, 1, 3}
    assert ro.log_probs[3].abs().sum() == 0  # step 2 is an Euler step
    with pytest.raises(ValueError, match="deterministic"):
        edge_log_prob(gen, ro, 2, torch.arange(2))


def test_fusion_and_depthwise_advantages():
    # one tree, splits at steps 0 and 1 (factor 2), 3 steps: leaves r = [1, 2, 3, 5]
    parent = [torch.zeros(0, dtype=torch.long), torch.tensor([0, 0]), torch.tensor([0, 0, 1, 1]),
              torch.tensor([0, 1, 2, 3])]
    tree = [torch.zeros(n, dtype=torch.long) for n in (1, 2, 4, 4)]
    r, ok = fuse_rewards(parent, torch.tensor([1.0, 2.0, 3.0, 5.0]))
    assert r[0].tolist() == [2.75] and r[1].tolist() == [1.5, 4.0] and r[2].tolist() == [1.0, 2.0, 3.0, 5.0]
    adv = depthwise_advantages(r, ok, tree)
    assert adv[0].tolist() == [0.0]  # a depth with one node
    half = 2**-0.5
    torch.testing.assert_close(adv[1], torch.tensor([-half, half]), atol=1e-6, rtol=0)  # 2 nodes: always +-1/sqrt 2
    torch.testing.assert_close(adv[3], group_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0]),
                                                        torch.zeros(4, dtype=torch.long), eps=1e-8, ddof=1))
    # an invalid leaf is left out of its ancestors' means and gets advantage 0
    r2, ok2 = fuse_rewards(parent, torch.tensor([1.0, float("nan"), 3.0, 5.0]), torch.tensor([True, False, True, True]))
    assert r2[1].tolist() == [1.0, 4.0] and not bool(ok2[3][1])
    assert depthwise_advantages(r2, ok2, tree)[3][1] == 0
    # path-probability weighting: equal log-probs = the mean; a dominant child takes over its parent
    lp = [torch.zeros(0), torch.zeros(2), torch.zeros(4), torch.zeros(4)]
    fused = fuse_rewards(parent, torch.tensor([1.0, 2.0, 3.0, 5.0]), log_probs=lp, weighting="path_prob")
    assert fused[0][1].tolist() == [1.5, 4.0]
    lp[2] = torch.tensor([50.0, 0.0, 0.0, 0.0])
    fused = fuse_rewards(parent, torch.tensor([1.0, 2.0, 3.0, 5.0]), log_probs=lp, weighting="path_prob")
    assert fused[0][1][0] == pytest.approx(1.0)


def test_pruning_cuts_218_edges_to_138_both_ways():
    """The reference tree without a network: 20 steps, splits {0, 3, 6, 9}, structure from the counts."""
    tree = TreeConfig(split_steps=[0, 3, 6, 9])
    sizes = tree.frontier_sizes(20) + [16]
    steps = torch.cat([torch.full((sizes[k + 1],), k) for k in range(20)])
    child = torch.cat([torch.arange(sizes[k + 1]) for k in range(20)])
    edges = {"step": steps, "child": child, "tree": torch.zeros_like(steps)}
    assert steps.numel() == 218
    adv = torch.randn(218)
    adv[steps > 9] = torch.randn(16)[child[steps > 9]]  # chains below the last split share their leaf's advantage
    depth = prune_edges(edges, adv, tree.split_steps, 20, depths=[16, 17, 18, 19, 20])
    chain = prune_edges(edges, adv, tree.split_steps, 20, width_ratio=0.5, width_mode="chain", chain_id=child)
    extremes = prune_edges(edges, adv, tree.split_steps, 20, width_ratio=0.5, width_mode="extremes")
    assert int(depth.sum()) == int(chain.sum()) == int(extremes.sum()) == 138
    assert torch.equal(depth, chain)  # under mean fusion chain ties keep the shallow half: the same edges
    kept_last = adv[(steps > 9) & extremes]
    assert kept_last.numel() == 80 and kept_last.min() <= adv[steps > 9].quantile(0.25) + 1e-6
    with pytest.raises(ValueError, match="no edge to train"):
        prune_edges(edges, adv, tree.split_steps, 20, depths=list(range(1, 21)))


# the 3-step tree of test_fusion_and_depthwise_advantages: splits at steps 0 and 1 (factor 2), leaves r = [1, 2, 3, 5]
_PARENT = [torch.zeros(0, dtype=torch.long), torch.tensor([0, 0]), torch.tensor([0, 0, 1, 1]),
           torch.tensor([0, 1, 2, 3])]
_LEAF_R = torch.tensor([1.0, 2.0, 3.0, 5.0])


def test_fuse_rewards_path_prob_without_log_probs_names_log_probs():
    """path_prob fusion without log_probs raises ValueError naming log_probs (not a TypeError from indexing None)."""
    with pytest.raises(ValueError, match="log_probs"):
        fuse_rewards(_PARENT, _LEAF_R, weighting="path_prob")


def test_fuse_rewards_path_prob_default_alpha_one_and_extreme_log_probs():
    """path_prob with the default alpha = 1 is softmax(l) per parent (float64, closed form), also for log-probs of
    +-800 whose plain exp over/underflows; one float64 [N_k] reward and one all-True valid per step 0..S."""
    ln3, ln2 = math.log(3.0), math.log(2.0)
    lp = [torch.zeros(0, dtype=torch.float64), torch.tensor([300.0 + ln2, 300.0], dtype=torch.float64),
          torch.tensor([-800.0, -800.0 + ln3, 700.0, 700.0 - ln3], dtype=torch.float64),
          torch.tensor([-800.0, 800.0, 0.0, 0.0], dtype=torch.float64)]
    rewards, valid = fuse_rewards(_PARENT, _LEAF_R, log_probs=lp, weighting="path_prob")
    assert len(rewards) == len(valid) == 4
    assert [r.dtype for r in rewards] == [torch.float64] * 4 and [v.dtype for v in valid] == [torch.bool] * 4
    assert [tuple(r.shape) for r in rewards] == [(1,), (2,), (4,), (4,)]
    assert all(bool(v.all()) for v in valid)
    f64 = torch.float64
    torch.testing.assert_close(rewards[2], torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=f64), rtol=0, atol=1e-12)
    # children weights 1/4, 3/4 under node 0 and 3/4, 1/4 under node 1; then 2/3, 1/3 at the root
    torch.testing.assert_close(rewards[1], torch.tensor([1.75, 3.5], dtype=f64), rtol=0, atol=1e-12)
    torch.testing.assert_close(rewards[0], torch.tensor([7.0 / 3.0], dtype=f64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("weighting", ["mean", "path_prob"])
def test_fuse_rewards_childless_node_is_invalid_and_counted(weighting):
    """A node without children (the last one of step 1) keeps its slot: rewards / valid are [N_k] for every step,
    the childless node is NaN and invalid, and the others are fused as without it (float64 closed form)."""
    parent = [torch.zeros(0, dtype=torch.long), torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1, 1]),
              torch.tensor([0, 1, 2, 3])]
    lp = [torch.zeros(0), torch.zeros(3), torch.zeros(4), torch.zeros(4)]
    rewards, valid = fuse_rewards(parent, _LEAF_R, log_probs=lp, weighting=weighting)
    assert len(rewards) == len(valid) == 4
    assert [tuple(r.shape) for r in rewards] == [(1,), (3,), (4,), (4,)]
    assert [tuple(v.shape) for v in valid] == [(1,), (3,), (4,), (4,)]
    assert valid[1].tolist() == [True, True, False] and bool(torch.isnan(rewards[1][2]))
    torch.testing.assert_close(rewards[1][:2], torch.tensor([1.5, 4.0], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(rewards[0], torch.tensor([2.75], dtype=torch.float64), rtol=0, atol=1e-12)


def _one_split_tree(n_chains: int = 4, num_steps: int = 20) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Edges of one tree split once at step 0 into n_chains chains (edge order: step-major, then chain)."""
    steps = torch.arange(num_steps).repeat_interleave(n_chains)
    return {"step": steps, "tree": torch.zeros_like(steps)}, torch.arange(n_chains).repeat(num_steps)


@pytest.mark.parametrize("ratio", [1.0, 1.5, -0.25])
def test_prune_edges_width_ratio_outside_0_1_names_width_ratio(ratio):
    """width_ratio outside [0, 1) raises ValueError naming width_ratio, even where edges above the split would
    remain to train (so it is the range check that raises, not the empty-result check)."""
    edges, chain = _one_split_tree()
    adv = torch.zeros(edges["step"].shape[0])
    for mode in ("chain", "extremes"):
        with pytest.raises(ValueError, match=r"width_ratio must be in \[0, 1\)"):
            prune_edges(edges, adv, [0], 20, width_ratio=ratio, width_mode=mode, chain_id=chain)


def test_prune_edges_chain_ties_keep_the_shallow_edges_of_a_long_chain():
    """Chain width pruning with all advantages tied keeps exactly the shallowest ceil(19 / 2) = 10 edges of each
    19-edge chain (steps 1..10; stable sort, long enough for an unstable sort to reorder ties)."""
    edges, chain = _one_split_tree()
    steps = edges["step"]
    keep = prune_edges(edges, torch.zeros(steps.shape[0]), [0], 20, width_ratio=0.5, width_mode="chain",
                       chain_id=chain)
    assert torch.equal(keep, steps <= 10)


def test_prune_edges_extremes_ties_follow_the_reference_depth_first_order():
    """Extremes width pruning with all advantages tied ranks the 76 last-layer edges in the BranchGRPO code's
    depth-first order (chain, then depth): the 19 best are the earliest (the whole chain 0), the 19 worst the
    latest (the whole chain 3), plus the 4 edges at the split. (genrl before issue 48 broke these ties by depth:
    steps 1-4 and 16-19 of every chain.) Without a chain id (none given, no ``edges["child"]``) it is refused."""
    edges, chain = _one_split_tree()
    steps = edges["step"]
    keep = prune_edges(edges, torch.zeros(steps.shape[0]), [0], 20, width_ratio=0.5, width_mode="extremes",
                       chain_id=chain)
    assert torch.equal(keep, (steps == 0) | (chain == 0) | (chain == 3))
    assert torch.equal(prune_edges({**edges, "child": chain}, torch.zeros(steps.shape[0]), [0], 20, width_ratio=0.5,
                                   width_mode="extremes"), keep)
    with pytest.raises(ValueError, match=r"extremes' needs chain_id or edges\['child'\]"):
        prune_edges(edges, torch.zeros(steps.shape[0]), [0], 20, width_ratio=0.5, width_mode="extremes")


def test_single_split_at_step_zero_is_flat_grpo(gen):
    """Split once at step 0 into K children (kappa 1): the depth-wise advantages and the loss over all edges equal
    flat GRPO's group advantages (ddof 1, eps 1e-8) and clipped loss on the same K trajectories."""
    k_children = 4
    config = RolloutConfig(num_steps=4, kernel="dance_grpo", noise_level=0.3, micro_batch_size=4, skip_last_step=False)
    tree = TreeConfig(split_steps=[0], branch_factor=k_children)
    ro = tree_rollout(gen, PROMPTS[:1], SHAPE, seed=1, config=config, tree=tree)
    rewards = torch.tensor([0.3, 0.9, 0.1, 0.5])
    fused, ok = fuse_rewards(ro.parent, rewards)
    adv_nodes = depthwise_advantages(fused, ok, ro.tree)
    edges = ro.edges()
    adv_edges = torch.cat([adv_nodes[k + 1] for k in range(4)])
    flat_adv = group_advantages(rewards, torch.zeros(4, dtype=torch.long), std="group", eps=1e-8, ddof=1)
    for k in range(1, 5):
        torch.testing.assert_close(adv_nodes[k], flat_adv, atol=0, rtol=0)
    # flat view of the same four trajectories
    states = [ro.latents[0][torch.zeros(4, dtype=torch.long)]] + [ro.latents[k] for k in range(1, 5)]
    traj = Trajectory(latents=torch.stack(states, dim=1), sigmas=ro.sigmas, sde_mask=torch.ones(4, dtype=torch.bool),
                      log_probs=torch.stack(ro.log_probs[1:], dim=1), noises=torch.zeros(4, 4, *SHAPE),
                      final=ro.leaves, seed=1, indices=torch.arange(4), prompts=PROMPTS[:1] * 4, config=config)
    flat_losses, tree_losses = [], []
    for k in range(4):
        lp_flat, _, _ = transition_log_prob(gen, traj, k)
        flat_losses.append(clipped_policy_loss(lp_flat, traj.log_probs[:, k], flat_adv, clip_range=1e-3)[0])
        lp_tree, _ = edge_log_prob(gen, ro, k, torch.arange(4))
        sel = edges["step"] == k
        tree_losses.append(clipped_policy_loss(lp_tree, ro.log_probs[k + 1], adv_edges[sel], clip_range=1e-3)[0])
    assert torch.equal(torch.cat(flat_losses), torch.cat(tree_losses))


class _RowStub:
    """A per-row velocity v = 0.5 x + c(prompt) on a declared device; records the device of every input it sees."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.seen: list[torch.device] = []

    def encode_prompts(self, prompts):
        from genrl.models.text_encoder import Conditioning

        h = torch.stack([torch.full((2, 4), float(len(p)) / 10) for p in prompts])
        return Conditioning(h, torch.ones(len(prompts), 2, dtype=torch.bool), list(prompts))

    def velocity(self, x, sigma, cond, **kwargs):
        self.seen += [x.device, sigma.device]
        c = cond.hidden_states[:, 0, 0].to(x.device).reshape(-1, *([1] * (x.ndim - 1)))
        return 0.5 * x + c


def test_regenerate_leaf_flow_grpo_uses_the_schedules_sigma_at_one():
    """regenerate_leaf under the flow_grpo kernel (sigma_0 = 1 needs sigma_at_one) equals its leaf of the tree."""
    config = RolloutConfig(num_steps=3, kernel="flow_grpo", noise_level=0.7, micro_batch_size=2)
    tree = TreeConfig(split_steps=[0, 1], split_noise_scale=2.0)
    ro = tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=4, tree_indices=[3, 8], config=config, tree=tree)
    assert ro.sigmas[0] == 1.0
    for leaf in (1, 6):
        t = int(ro.tree[-1][leaf])
        alone = regenerate_leaf(_RowStub(), PROMPTS[t], (2, 3), 4, int(ro.tree_indices[t]), int(ro.codes[-1][leaf]),
                                config, tree)
        assert torch.equal(alone, ro.leaves[leaf])


def test_regenerate_leaf_runs_on_the_generators_device(monkeypatch):
    """regenerate_leaf feeds the network its initial noise and its sigma on the generator's device (a meta device
    here: the spy stops the chain at the first network call, before any value is needed)."""
    import genrl.rollout.tree as tree_mod

    class _Stop(Exception):
        pass

    seen = []

    def spy(generator, x, sigma, *args):
        seen.append((x.device.type, sigma.device.type, tuple(x.shape), tuple(sigma.shape)))
        raise _Stop

    monkeypatch.setattr(tree_mod, "guided_velocity", spy)
    config = RolloutConfig(num_steps=2, kernel="dance_grpo", noise_level=0.3, micro_batch_size=2)
    with pytest.raises(_Stop):
        regenerate_leaf(_RowStub("meta"), PROMPTS[0], (2, 3), 1, 0, 3, config, TreeConfig(split_steps=[0, 1]))
    assert seen == [("meta", "meta", (1, 2, 3), (1,))]


def test_regenerate_leaf_path_codes_are_exact_integers_in_a_wide_tree():
    """Leaf path codes above 2^53 are split into per-depth codes exactly (integer division): two sibling leaves of a
    2^56-leaf tree differ at their last split (float division would round both to 2^56)."""
    config = RolloutConfig(num_steps=2, kernel="dance_grpo", noise_level=0.3, micro_batch_size=1)
    tree = TreeConfig(split_steps=[0, 1], branch_factor=2**28, max_frontier=2**60)
    a = regenerate_leaf(_RowStub(), PROMPTS[0], (2, 3), 1, 0, 2**56 - 1, config, tree)
    b = regenerate_leaf(_RowStub(), PROMPTS[0], (2, 3), 1, 0, 2**56 - 2, config, tree)
    assert not torch.equal(a, b)


def _flow_grpo_tree():
    """Two trees of a 3-step flow_grpo schedule (sigma_0 = 1), splits at steps 0 and 1 (factor 2), on _RowStub."""
    config = RolloutConfig(num_steps=3, kernel="flow_grpo", noise_level=0.7, micro_batch_size=2)
    tree = TreeConfig(split_steps=[0, 1], split_noise_scale=2.0)
    return tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=4, tree_indices=[3, 8], config=config, tree=tree)


def test_edges_list_every_edge_as_int64_by_step_then_child():
    """edges(): step, child, parent (index one step up) and tree of every edge, int64, by step then child; Mix
    (deterministic) steps left out unless stochastic_only=False; no stochastic step gives four empty int64 tensors."""
    import dataclasses

    ro = _flow_grpo_tree()
    par = {0: [0, 0, 1, 1], 1: [0, 0, 1, 1, 2, 2, 3, 3], 2: list(range(8))}
    trees = {0: [0, 0, 1, 1], 1: [0, 0, 0, 0, 1, 1, 1, 1], 2: [0, 0, 0, 0, 1, 1, 1, 1]}

    def expected(steps):
        n = {0: 4, 1: 8, 2: 8}
        return {"step": [k for k in steps for _ in range(n[k])], "child": [c for k in steps for c in range(n[k])],
                "parent": [p for k in steps for p in par[k]], "tree": [t for k in steps for t in trees[k]]}

    def listed(edges):
        assert {key: (e.dtype, e.ndim) for key, e in edges.items()} == {key: (torch.long, 1) for key in expected([])}
        return {key: e.tolist() for key, e in edges.items()}

    assert listed(ro.edges()) == expected([0, 1, 2])
    mixed = dataclasses.replace(ro, sde_mask=torch.tensor([True, False, True]))
    assert listed(mixed.edges()) == expected([0, 2])
    assert listed(mixed.edges(stochastic_only=False)) == expected([0, 1, 2])
    assert listed(dataclasses.replace(ro, sde_mask=torch.zeros(3, dtype=torch.bool)).edges()) == expected([])


def test_edge_log_prob_recomputes_flow_grpo_edges_exactly_with_sigma_at_one():
    """Under flow_grpo (sigma_0 = 1, which needs the schedule's sigma_at_one) every edge's recomputed log-prob equals
    the stored one bitwise, float32; child indices in uint8 are indices (not a mask) like int64 ones."""
    ro = _flow_grpo_tree()
    for k in range(3):
        lp, v = edge_log_prob(_RowStub(), ro, k, torch.arange(ro.latents[k + 1].shape[0]))
        assert lp.dtype == torch.float32 and torch.equal(lp, ro.log_probs[k + 1]), k
    lp, v = edge_log_prob(_RowStub(), ro, 1, torch.tensor([7, 0], dtype=torch.uint8))
    assert torch.equal(lp, ro.log_probs[2][[7, 0]]) and v.shape == (2, 2, 3)


def test_edge_log_prob_runs_on_the_generators_device(monkeypatch):
    """edge_log_prob moves the parents, the children and the sigmas onto the generator's device (meta here: spies
    stand in for the network and the density, which need values)."""
    import genrl.rollout.tree as tree_mod

    ro = _flow_grpo_tree()
    seen = {}

    def velocity_spy(generator, x, sigma, *args):
        seen["velocity"] = (x.device.type, sigma.device.type)
        return torch.zeros_like(x)

    def log_prob_spy(kind, x, v, sigma, sigma_next, sample, **kw):
        seen["log_prob"] = tuple(t.device.type for t in (x, v, sigma, sigma_next, sample))
        return torch.zeros(x.shape[0], device=x.device), None, None

    monkeypatch.setattr(tree_mod, "guided_velocity", velocity_spy)
    monkeypatch.setattr(tree_mod, "step_log_prob", log_prob_spy)
    edge_log_prob(_RowStub("meta"), ro, 1, torch.tensor([3, 4]))
    assert seen == {"velocity": ("meta", "meta"), "log_prob": ("meta",) * 5}


def test_tree_rollout_records_its_inputs_x0_and_int64_structure():
    """tree_rollout records seed, configs, an empty int64 parent[0], int64 path codes at every depth and x0 = x - sigma
    v of each leaf's parent at the last step (v = 0.5 x + c(prompt) here); a progress bar changes nothing."""
    config = RolloutConfig(num_steps=3, kernel="flow_grpo", noise_level=0.7, micro_batch_size=2)
    tree = TreeConfig(split_steps=[0, 1], split_noise_scale=2.0)
    ro = tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=4, tree_indices=[3, 8], config=config, tree=tree)
    assert ro.seed == 4 and ro.config is config and ro.tree_config is tree
    assert ro.parent[0].dtype == torch.long and ro.parent[0].shape == (0,)
    assert [c.dtype for c in ro.codes] == [torch.long] * 4 and ro.codes[-1].tolist() == [0, 1, 2, 3] * 2
    xp = ro.latents[2][ro.parent[3]]
    c = torch.tensor([len(PROMPTS[t]) / 10 for t in ro.tree[3].tolist()], dtype=torch.float32)[:, None, None]
    ref = xp - ro.sigmas[2].float() * (0.5 * xp + c)
    assert ro.x0.dtype == torch.float32 and ro.x0.shape == (8, 2, 3)
    torch.testing.assert_close(ro.x0, ref, rtol=0, atol=1e-6)
    shown = tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=4, tree_indices=[3, 8], config=config, tree=tree,
                         progress=True)
    assert all(torch.equal(a, b) for a, b in zip(shown.latents, ro.latents, strict=True))
    assert torch.equal(shown.x0, ro.x0)


def test_tree_rollout_rejects_an_ode_kernel_and_a_batch_over_the_frontier_budget():
    """An "ode" kernel is refused (a tree needs stochastic splits); the frontier budget counts every tree of the
    batch: 2 trees x 4 leaves over max_frontier=4 is refused though one tree fits."""
    ode = RolloutConfig(num_steps=3, kernel="ode", micro_batch_size=2)
    with pytest.raises(ValueError, match="kernel='ode'"):
        tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=0, config=ode, tree=TreeConfig(split_steps=[0, 1]))
    config = RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.3, micro_batch_size=2)
    tree = TreeConfig(split_steps=[0, 1], max_frontier=4)
    assert tree_rollout(_RowStub(), PROMPTS[:1], (2, 3), seed=0, config=config, tree=tree).leaves.shape == (4, 2, 3)
    with pytest.raises(ValueError, match="2 trees x 4 leaves .* max_frontier=4"):
        tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=0, config=config, tree=tree)


def test_tree_mix_steps_are_euler_steps_with_scale_one():
    """A deterministic (Mix) step moves every node by Euler, x + (sigma_{k+1} - sigma_k) v, with log-prob 0 and std
    scale 1; split steps record kappa, other stochastic steps 1."""
    config = RolloutConfig(num_steps=5, kernel="dance_grpo", noise_level=0.3, micro_batch_size=2)
    tree = TreeConfig(split_steps=[0, 3], split_noise_scale=2.0, mix_window=1, mix_stride=30)
    ro = tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=1, config=config, tree=tree)
    assert ro.sde_mask.tolist() == [True, False, False, True, False]
    assert ro.std_scales == [2.0, 1.0, 1.0, 2.0, 1.0]
    sig = ro.sigmas.float()
    for k in (1, 2, 4):
        x = ro.latents[k][ro.parent[k + 1]]
        c = torch.tensor([len(PROMPTS[t]) / 10 for t in ro.tree[k + 1].tolist()])[:, None, None]
        torch.testing.assert_close(ro.latents[k + 1], x + (sig[k + 1] - sig[k]) * (0.5 * x + c), rtol=0, atol=1e-6)
        assert ro.log_probs[k + 1].abs().sum() == 0


def test_reference_split_log_prob_under_flow_grpo_is_recomputed_exactly():
    """reference_split_log_prob under flow_grpo (a split at sigma_0 = 1, which needs sigma_at_one): the stored
    log-prob of every edge is recomputed bitwise by edge_log_prob, whose split-step scale is 1."""
    config = RolloutConfig(num_steps=3, kernel="flow_grpo", noise_level=0.7, micro_batch_size=2)
    tree = TreeConfig(split_steps=[0, 1], split_noise_scale=2.0, reference_split_log_prob=True)
    ro = tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=4, tree_indices=[3, 8], config=config, tree=tree)
    assert ro.sigmas[0] == 1.0 and ro.std_scales == [1.0, 1.0, 1.0]
    assert all(bool(torch.isfinite(x).all()) for x in ro.latents)
    for k in range(3):
        lp, _ = edge_log_prob(_RowStub(), ro, k, torch.arange(ro.latents[k + 1].shape[0]))
        assert torch.equal(lp, ro.log_probs[k + 1]), k


def test_regenerate_leaf_draws_node_noise_on_the_generators_device(monkeypatch):
    """Every node's step noise is drawn on the device of the nodes (the generator's: meta here, spies stand in for
    the network and the step, which need values), as are the sigmas of the step."""
    import genrl.rollout.tree as tree_mod

    class _Stop(Exception):
        pass

    seen = []

    def step_spy(kind, x, v, sigma, sigma_next, noise, **kw):
        seen.append(tuple(t.device.type for t in (x, v, sigma, sigma_next, noise)) + tuple(noise.shape))
        raise _Stop

    monkeypatch.setattr(tree_mod, "guided_velocity", lambda generator, x, *args: torch.zeros_like(x))
    monkeypatch.setattr(tree_mod, "sde_step", step_spy)
    config = RolloutConfig(num_steps=2, kernel="dance_grpo", noise_level=0.3, micro_batch_size=2)
    with pytest.raises(_Stop):
        regenerate_leaf(_RowStub("meta"), PROMPTS[0], (2, 3), 1, 0, 1, config, TreeConfig(split_steps=[0]))
    assert seen == [("meta",) * 5 + (1, 2, 3)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device next to the CPU")
def test_tree_rollout_on_cuda_feeds_the_network_there_and_equals_the_cpu_rollout():
    """A generator on CUDA gets its initial noise, nodes and sigmas there (all 7 micro-batch calls, x and sigma, on
    CUDA); the recorded rollout (CPU tensors) equals the all-CPU rollout under the Philox noise backend (the same
    integer stream on both devices; CUDA and CPU torch.Generators give different noise)."""
    config = RolloutConfig(num_steps=3, kernel="flow_grpo", noise_level=0.7, micro_batch_size=2,
                           noise_backend="philox")
    tree = TreeConfig(split_steps=[0, 1], split_noise_scale=2.0)
    gpu = _RowStub("cuda")
    ro = tree_rollout(gpu, PROMPTS, (2, 3), seed=4, tree_indices=[3, 8], config=config, tree=tree)
    ref = tree_rollout(_RowStub(), PROMPTS, (2, 3), seed=4, tree_indices=[3, 8], config=config, tree=tree)
    assert len(gpu.seen) == 14 and {d.type for d in gpu.seen} == {"cuda"}
    for a, b in zip(ro.latents + ro.log_probs + [ro.x0], ref.latents + ref.log_probs + [ref.x0], strict=True):
        assert a.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_sde_mask_is_bool_and_ignores_splits_past_the_schedule():
    """sde_mask is bool [num_steps] (all True without Mix); under Mix a split step at or past num_steps (checked
    elsewhere by TreeConfig.check) is left out instead of indexing past the mask."""
    plain = TreeConfig(split_steps=[0, 2]).sde_mask(4)
    assert plain.dtype == torch.bool and plain.tolist() == [True] * 4
    mask = TreeConfig(split_steps=[1, 4], mix_window=1, mix_stride=3).sde_mask(4)
    assert mask.dtype == torch.bool and mask.tolist() == [True, True, False, True]


def test_tree_config_bounds_name_the_bad_value():
    """TreeConfig refuses split_noise_scale 0, a negative mix_window or a mix_stride of 0 (each alone) and
    max_frontier 0, naming the field; the boundary values (a tiny scale, max_frontier 1) are accepted."""
    with pytest.raises(ValueError, match="split_noise_scale must be > 0, got 0.0"):
        TreeConfig(split_noise_scale=0.0)
    with pytest.raises(ValueError, match="mix_window >= 0 .* got -1, 1"):
        TreeConfig(mix_window=-1)
    with pytest.raises(ValueError, match="mix_stride >= 1, got 0, 0"):
        TreeConfig(mix_stride=0)
    with pytest.raises(ValueError, match="max_frontier must be >= 1, got 0"):
        TreeConfig(max_frontier=0)
    ok = TreeConfig(split_steps=[0], split_noise_scale=1e-3, max_frontier=1)
    assert ok.split_noise_scale == 1e-3 and ok.max_frontier == 1


# ================================================================================================ pruning schedule
# (issue 48): the sliding depth window and the pruning step ratio, pure functions of (options, iteration), checked
# on hand-built trees; width pruning's ratio and ties against a transcription of the BranchGRPO code's formulas


def _hand_tree(split_steps: list[int], num_steps: int, leaf_rewards: torch.Tensor | None = None, trees: int = 1,
               factor: int = 2):
    """The edges of ``trees`` trees of a TreeConfig (branch factor ``factor``) built by hand, as
    TreeRollout.edges() lists them (by step, then child; children ordered by tree, then path), and, given leaf
    rewards [trees * leaves], each edge's depth-wise advantage under mean fusion (the advantage of its child)."""
    cfg = TreeConfig(split_steps=split_steps, branch_factor=factor)
    sizes = [n * trees for n in cfg.frontier_sizes(num_steps)] + [cfg.leaves * trees]
    parent = [torch.zeros(0, dtype=torch.long)]
    tree = [torch.arange(trees)]
    for k in range(num_steps):
        parent.append(torch.arange(sizes[k]).repeat_interleave(cfg.children(k)))
        tree.append(tree[k][parent[k + 1]])
    steps = torch.cat([torch.full((sizes[k + 1],), k) for k in range(num_steps)])
    child = torch.cat([torch.arange(sizes[k + 1]) for k in range(num_steps)])
    edges = {"step": steps, "child": child, "tree": torch.cat(tree[1:])}
    if leaf_rewards is None:
        return edges, None
    fused, ok = fuse_rewards(parent, leaf_rewards)
    node_adv = depthwise_advantages(fused, ok, tree)
    return edges, torch.cat(node_adv[1:])


def _windows(iterations, *args, **kw) -> list[list[int]]:
    return [sliding_prune_depths(*args[:1], i, *args[1:], **kw) for i in iterations]


def test_sliding_depth_window_trains_these_edges_at_each_iteration():
    """6 steps, splits {0, 2}, one tree: 2, 2, 4, 4, 4, 4 edges into depths 1..6 (20 edges). The window [5, 6]
    slides one depth every 2 iterations down to the last split step 2 (the BranchGRPO default stop): with s the
    1-based iteration, shift = min(floor(s / 2), 5 - 2), so iterations 0..8 prune [5, 6], [4, 5], [4, 5], [3, 4],
    [3, 4], [2, 3], [2, 3], ... and it ends there (no wrap): 12, 12, 12, 12, 12, 14, 14, 14, 14 edges trained."""
    edges, _ = _hand_tree([0, 2], 6)
    assert edges["step"].numel() == 20
    windows = _windows(range(9), [6, 5], 2, stop_depth=2)  # any order in, ascending out
    assert windows == [[5, 6], [4, 5], [4, 5], [3, 4], [3, 4], [2, 3], [2, 3], [2, 3], [2, 3]]
    trained = []
    for w in windows:
        keep = prune_edges(edges, torch.zeros(20), [0, 2], 6, depths=w)
        assert torch.equal(keep, ~torch.isin(edges["step"] + 1, torch.tensor(w)))
        trained.append(int(keep.sum()))
    assert trained == [12, 12, 12, 12, 12, 14, 14, 14, 14]
    assert sliding_prune_depths([5, 6], 10**6, 2, 2) == [2, 3]  # the end holds for good
    # a fixed window (no interval) never moves; an explicit stop ends the slide earlier
    assert _windows([0, 5, 99], [5, 6]) == [[5, 6]] * 3
    assert _windows([0, 1, 3, 99], [5, 6], 2, stop_depth=4) == [[5, 6], [4, 5], [4, 5], [4, 5]]
    # interval 1: the window has moved at the first iteration already (s = 1), as in the BranchGRPO code
    assert _windows([0, 1, 2], [5, 6], 1, stop_depth=2) == [[4, 5], [3, 4], [2, 3]]


def test_sliding_depth_window_of_the_reference_launcher():
    """The released launcher's sliding setting (window 15..18, interval 30, stop depth 9): the first position
    holds for iterations 0..28 (s = 1..29), the window then moves at s = 30, 60, ..., and reaches 9..12 at s = 180
    (iteration 179) after 6 moves, where it stays."""
    got = _windows([0, 28, 29, 58, 59, 178, 179, 299], [15, 16, 17, 18], 30, stop_depth=9)
    assert got == [[15, 16, 17, 18]] * 2 + [[14, 15, 16, 17]] * 2 + [[13, 14, 15, 16]] + [[10, 11, 12, 13]] + \
        [[9, 10, 11, 12]] * 2


@pytest.mark.parametrize("call, match", [
    (lambda: sliding_prune_depths([0, 3], 0), "pruned depths must be >= 1"),
    (lambda: sliding_prune_depths([3], -1), "iteration must be >= 0"),
    (lambda: sliding_prune_depths([3], 0, 0, 1), "slide interval must be >= 1"),
    (lambda: sliding_prune_depths([3], 0, 2), "needs a stop depth"),
    (lambda: sliding_prune_depths([3, 4], 0, 2, 3), r"stop depth 3 for the window \[3, 4\]: it could never move"),
    (lambda: sliding_prune_depths([3, 4], 0, 2, 0), "1 <= stop depth"),
    (lambda: pruning_active(0, 1.5), r"pruning step ratio must be in \[0, 1\]"),
    (lambda: pruning_active(0, 0.5), "needs the training length total_iterations >= 1"),
    (lambda: pruning_active(-2, 0.5, 10), "iteration must be >= 0"),
])
def test_pruning_schedule_bad_values_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_pruning_step_ratio_prunes_the_first_floor_of_the_total():
    """Pruning is on at iteration i iff i + 1 <= floor(total * ratio) (the BranchGRPO code's 1-based step <= the
    cut-off step): 10 iterations at ratio 0.5 prune 0..4; at 0.35, floor(3.5) = 3 iterations; ratio 1 always
    (no total needed, past the total too); ratio 0 never. On the hand tree, a pruned iteration trains 12 edges and
    a later one all 20."""
    assert [pruning_active(i, 0.5, 10) for i in range(10)] == [True] * 5 + [False] * 5
    assert [pruning_active(i, 0.35, 10) for i in range(5)] == [True] * 3 + [False] * 2
    assert pruning_active(10**6, 1.0) and not any(pruning_active(i, 0.0, 10) for i in range(10))
    edges, _ = _hand_tree([0, 2], 6)
    trained = [int(prune_edges(edges, torch.zeros(20), [0, 2], 6,
                               depths=[5, 6] if pruning_active(i, 0.2, 10) else None).sum()) for i in range(4)]
    assert trained == [12, 12, 20, 20]


def _reference_width(adv: torch.Tensor, edges: dict[str, torch.Tensor], last_split: int, kept: float,
                     mode: int) -> torch.Tensor:
    """The BranchGRPO code's width pruning, transcribed as formulas: its edge list is depth-first (chain, then
    depth, over the device's trees); mode 1 keeps per chain the max(1, floor(n * kept)) first of a stable
    descending sort by advantage, mode 2 pools the list and keeps the first b and the last w of that sort, with
    m = max(2, floor(n * kept)), b = floor(m / 2), w = m - b. Returns the bool keep mask over all edges."""
    a, step, chain, tree = adv.tolist(), edges["step"].tolist(), edges["child"].tolist(), edges["tree"].tolist()
    last = [e for e in range(len(a)) if step[e] > last_split]
    dfs = sorted(last, key=lambda e: (tree[e], chain[e], step[e]))
    keep = torch.ones(len(a), dtype=torch.bool)
    keep[last] = False
    if mode == 1:
        for c in sorted({chain[e] for e in dfs}):
            group = [e for e in dfs if chain[e] == c]
            keep[sorted(group, key=lambda e: a[e], reverse=True)[: max(1, math.floor(len(group) * kept))]] = True
    else:
        ranked = sorted(dfs, key=lambda e: a[e], reverse=True)
        m = max(2, math.floor(len(ranked) * kept))
        b = m // 2
        keep[ranked[:b] + ranked[len(ranked) - (m - b):]] = True
    return keep


@pytest.mark.parametrize("kept", [0.5, 0.33, 0.35, 0.05])
@pytest.mark.parametrize("rewards", ["binary_one", "binary_all", "random"])
def test_width_ratio_converted_from_the_reference_keeps_its_edges(kept, rewards):
    """The reference tree (20 steps, splits {0, 3, 6, 9}, one tree: 16 chains of 10 last-layer edges, 160 in all).
    The reference's width_pruning_ratio is the fraction KEPT, rounded down (per chain in mode 1, pooled over the
    device's trees in mode 2); genrl's width_ratio is the fraction PRUNED, rounded up, per group. Converted as
    width_ratio = 1 - m / n, with m the reference's kept count of a group of n, genrl keeps exactly the
    reference's edges (ties included: binary leaf rewards make whole chains tie). The naive 1 - kept differs
    where n * kept is fractional: kept 0.33 -> the reference keeps 3 of 10 and 52 of 160, 1 - 0.33 keeps 4 and 53."""
    g = torch.Generator().manual_seed(3)
    leaf = {"binary_one": (torch.arange(16) == 5).double(), "binary_all": torch.ones(16, dtype=torch.float64),
            "random": torch.rand(16, generator=g, dtype=torch.float64)}[rewards]
    edges, adv = _hand_tree([0, 3, 6, 9], 20, leaf)
    last = edges["step"] > 9
    assert int(last.sum()) == 160
    for mode, n, floor_ in ((1, 10, 1), (2, 160, 2)):
        m = max(floor_, math.floor(n * kept))
        width_mode = "chain" if mode == 1 else "extremes"
        keep = prune_edges(edges, adv, [0, 3, 6, 9], 20, width_ratio=1 - m / n, width_mode=width_mode,
                           chain_id=edges["child"])
        ref = _reference_width(adv, edges, 9, kept, mode)
        assert torch.equal(keep, ref), (mode, kept, rewards)
        assert int((keep & last).sum()) == m * (16 if mode == 1 else 1)
    if kept == 0.33:
        naive = [int((prune_edges(edges, adv, [0, 3, 6, 9], 20, width_ratio=1 - kept, width_mode=wm,
                                  chain_id=edges["child"]) & last).sum()) for wm in ("chain", "extremes")]
        assert naive == [16 * 4, 53]


def test_width_pruning_ties_under_binary_rewards_by_hand():
    """One split at step 0 into 4 chains (factor 4), 4 steps: 4 split edges and 12 last-layer edges (steps 1-3).
    Width ratio 0.5: extremes keeps the 3 best and 3 worst of the tree, chain the 2 shallowest of each chain
    (chains tie along their length under mean fusion; the reference's kept ratio 0.5 keeps 1, as width_ratio 2/3
    does). Leaf rewards all 0 or all 1: every advantage is 0; the best are chain 0's edges (the earliest in
    depth-first order) and the worst chain 3's, never an edge in both. One 1 at leaf 2: chain 2 is the best and
    chain 3 (the latest of the tied zeros) the worst. One 0 at leaf 1: chain 1 is the worst and chain 0 (the
    earliest of the tied ones) the best. Each equals the BranchGRPO code's choice."""
    cases = {"all 0": ([0, 0, 0, 0], {0, 3}), "all 1": ([1, 1, 1, 1], {0, 3}), "one 1": ([0, 0, 1, 0], {2, 3}),
             "one 0": ([1, 0, 1, 1], {0, 1})}
    for name, (leaf, chains) in cases.items():
        edges, adv = _hand_tree([0], 4, torch.tensor(leaf, dtype=torch.float64), factor=4)
        step, chain = edges["step"], edges["child"]
        keep = prune_edges(edges, adv, [0], 4, width_ratio=0.5, width_mode="extremes", chain_id=chain)
        expected = (step == 0) | torch.isin(chain, torch.tensor(sorted(chains)))
        assert torch.equal(keep, expected), name
        assert int((keep & (step > 0)).sum()) == 6, name  # 3 best + 3 worst, all distinct
        assert torch.equal(keep, _reference_width(adv, edges, 0, 0.5, 2)), name
        by_chain = prune_edges(edges, adv, [0], 4, width_ratio=0.5, width_mode="chain", chain_id=chain)
        assert torch.equal(by_chain, step <= 2), name  # ceil(3 * 0.5) = 2 per chain
        # the reference's kept 0.5 keeps floor(1.5) = 1 per chain: width_ratio 1 - 1/3 keeps the same edge
        converted = prune_edges(edges, adv, [0], 4, width_ratio=1 - 1 / 3, width_mode="chain", chain_id=chain)
        assert torch.equal(converted, step <= 1) and torch.equal(converted, _reference_width(adv, edges, 0, 0.5, 1))
