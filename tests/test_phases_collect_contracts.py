"""Contracts of genrl/methods/phases.py that its mutation survivors showed unpinned (issue 51): the global means of the
update statistics (one all-reduce of every sum and weight, per data-parallel slice), the best / worst pair phase (its
tie rule and validity, the round-robin deal of the pairs to the ranks with zero-weight padding, its logged metrics),
the collect phases (each forwards its sampler arguments: config, noise addresses, SDE window id, grad / moments
policies, group-addressed starting noise, the policy context; leaves decoded on the generator's device) and caption
dropout (strict draw threshold, default null text, aligned index). Everything runs in process on the CPU: a stub
generator, fake trainers and strategies in place of a process group."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import ReduceOp

import genrl.methods.phases as phases
from genrl.methods.phases import (
    Pairs,
    Scores,
    _global_means,
    best_worst_pairs_of,
    caption_dropout,
    collect_endpoints,
    collect_flat,
    collect_tree,
)
from genrl.models.conditions import Prompt
from genrl.models.text_encoder import Conditioning
from genrl.noise import rand_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout, sde_mask
from genrl.rollout.tree import TreeConfig, tree_rollout

# ------------------------------------------------------------------------------------------- fake trainers / ranks


class _TwoProcessStrategy:
    """Lightning's DDP / ModelParallel ``strategy.reduce`` (``_sync_ddp``) over 1 + len(``others``) processes of which
    this is one: the others hold ``others`` (float64 vectors). The op is resolved as ``_sync_ddp`` does: "mean"
    (the default) and "avg" average, another string is ``getattr(ReduceOp, op.upper())``, None fails in
    ``torch.distributed.all_reduce`` (TypeError). ``distributed_sampler_kwargs`` gives the data-parallel coordinate."""

    def __init__(self, rank: int, world: int, others: list[torch.Tensor]) -> None:
        self.distributed_sampler_kwargs = {"rank": rank, "num_replicas": world}
        self.others = others
        self.calls: list[tuple[torch.dtype, torch.device, object]] = []

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(reduce_op, str):
            reduce_op = "avg" if reduce_op == "mean" else reduce_op
            op = "avg" if reduce_op.lower() == "avg" else getattr(ReduceOp, reduce_op.upper())
        elif reduce_op is None:
            raise TypeError("all_reduce(): incompatible function arguments (op=None)")
        else:
            op = reduce_op
        self.calls.append((tensor.dtype, tensor.device, op))
        if tensor.device.type == "meta":  # only the placement is checked; no values to reduce
            return torch.zeros(tensor.shape, dtype=tensor.dtype)
        total = tensor + sum(o.to(tensor.dtype) for o in self.others)
        if op == "avg":
            return total / (1 + len(self.others))
        assert op == ReduceOp.SUM
        return total


def _module(strategy=None, device="cpu"):
    """A module as the phases see it: ``trainer.strategy`` (reduce, the data-parallel coordinate), ``device`` and a
    recorded ``log``."""
    logs: list[tuple[str, float]] = []
    trainer = SimpleNamespace(strategy=strategy, global_rank=0, world_size=1)
    mod = SimpleNamespace(trainer=trainer, device=torch.device(device), logs=logs)
    mod.log = lambda name, value, **kw: logs.append((name, value))
    return mod


# ------------------------------------------------------------------------------------------------- _global_means


def test_global_means_one_slice_is_sum_over_max_weight_one():
    """On one data-parallel slice: {stat: sum / max(weight, 1)} of every group, no collective issued (the strategy's
    reduce is not called): a weight of 1.5 divides, a weight of 1 divides by 1 and a weight below 1 by 1."""
    strat = _TwoProcessStrategy(0, 1, [])
    mod = _module(strat)
    got = _global_means(mod, [({"a": 3.0, "b": -1.5}, 1.0), ({"c": 4.5}, 1.5), ({"d": 0.25}, 0.5)])
    assert got == {"a": 3.0, "b": -1.5, "c": 3.0, "d": 0.25}
    assert strat.calls == []


def test_global_means_context_parallel_copies_count_once():
    """Under context parallelism the data-parallel world is 1 although several processes hold the same rows: no
    all-reduce runs, so the copies' sums and weights are not counted twice (a weight of 0.5 keeps sum / 1)."""
    strat = _TwoProcessStrategy(0, 1, [torch.tensor([0.5, 3.0], dtype=torch.float64)])  # the CP twin: same values
    got = _global_means(_module(strat), [({"loss": 3.0}, 0.5)])
    assert got == {"loss": 3.0} and strat.calls == []


def test_global_means_two_ranks_reduce_every_sum_and_weight_exactly():
    """On 2 ranks: one all-reduce (op "sum", float64, on the module's device) of [weight, sums in sorted key order]
    per group; each stat is (sum over ranks) / max(total weight, 1), exact in float64 (0.1 + 0.2 is not rounded
    through float32), with the groups' slices kept apart."""
    groups = [({"b": 0.1, "a": 1.0}, 1.0), ({"z": 7.0}, 2.0), ({"y": 0.2, "x": -3.0}, 0.25)]
    # the other rank's packed vector: [w0, a, b, w1, z, w2, x, y]
    other = torch.tensor([0.5, 2.0, 0.2, 4.0, 5.0, 0.25, 1.0, 0.1], dtype=torch.float64)
    strat = _TwoProcessStrategy(0, 2, [other])
    got = _global_means(_module(strat), groups)
    want = {"a": 3.0 / 1.5, "b": (0.1 + 0.2) / 1.5, "z": 12.0 / 6.0, "x": -2.0 / 1.0, "y": 0.2 + 0.1}
    assert got == want
    assert strat.calls == [(torch.float64, torch.device("cpu"), ReduceOp.SUM)]


def test_global_means_three_ranks_and_the_device_of_the_reduced_tensor():
    """On 3 ranks (world > 2 too) the sums of all ranks enter; the packed tensor is made on ``module.device`` (NCCL
    reduces device tensors only: a meta module gets a meta tensor)."""
    strat = _TwoProcessStrategy(1, 3, [torch.tensor([1.0, 2.0], dtype=torch.float64)] * 2)
    assert _global_means(_module(strat), [({"k": 1.0}, 1.0)]) == {"k": 5.0 / 3.0}
    meta = _TwoProcessStrategy(0, 2, [])
    _global_means(_module(meta, device="meta"), [({"k": 1.0}, 1.0)])
    assert meta.calls == [(torch.float64, torch.device("meta"), ReduceOp.SUM)]


# --------------------------------------------------------------------------------------------- best_worst_pairs_of


def _scores(total, group, valid=None) -> Scores:
    total = torch.tensor(total, dtype=torch.float32)
    valid = torch.ones(len(total), dtype=torch.bool) if valid is None else torch.tensor(valid)
    return Scores(None, total, valid, torch.tensor(group), len(total))


def _ranks(monkeypatch, rank: int, world: int, all_x0: torch.Tensor, all_prompts: list[str]):
    """Fake the data-parallel coordinate and the gathers of this rank (the global batch's endpoints and prompts)."""
    monkeypatch.setattr(phases, "world_of", lambda m: (rank, world))
    monkeypatch.setattr(phases, "gather_batch", lambda m, t: all_x0.clone())
    monkeypatch.setattr(phases, "gather_objects", lambda m, items: list(all_prompts))


def test_pairs_one_rank_best_worst_per_group_with_validity_and_logs():
    """One rank: one (best, worst) pair per group in first-appearance order, endpoints / prompts / keys / margins of
    the chosen and rejected rows, weights 1; a sample marked invalid is never paired even with a finite reward; the
    default tie rule skips an all-equal group (counted in ``pairs/tied`` with the < 2-valid group); the three
    metrics are logged (names and values)."""
    total = [0.2, 0.9, 0.5, 3.0, 1.0, 1.0, 7.0, 0.0, 0.4, 0.4]
    group = [5, 5, 5, 2, 2, 2, 9, 9, 4, 4]
    valid = [True, True, True, False, True, True, True, False, True, True]  # sample 3: best of group 2, invalid
    x0 = torch.arange(10, dtype=torch.float32)[:, None, None] * torch.ones(10, 2, 3)
    prompts = [f"p{i}" for i in range(10)]
    mod = _module()
    out = best_worst_pairs_of(mod, _scores(total, group, valid), x0, prompts)
    assert isinstance(out, Pairs) and out.count == 1
    assert torch.equal(out.chosen, x0[[1]]) and torch.equal(out.rejected, x0[[0]])
    assert out.prompts == ["p1"] and out.keys.dtype == torch.long and out.keys.tolist() == [5]
    assert out.weight.tolist() == [1.0]
    torch.testing.assert_close(out.margin, torch.tensor([0.9 - 0.2]))
    # group 2 (1.0, 1.0 valid) is all-tied, group 9 has one valid member, group 4 is all-tied: 4 groups, 1 pair
    assert mod.logs == [("pairs/count", 1.0), ("pairs/tied", 3.0), ("pairs/reward_margin", pytest.approx(0.7))]
    arb = best_worst_pairs_of(_module(), _scores(total, group, valid), x0, prompts, tie="arbitrary")
    assert arb.count == 3 and arb.prompts == ["p1", "p5", "p9"] and arb.keys.tolist() == [5, 2, 4]
    assert torch.equal(arb.rejected, x0[[0, 4, 8]]) and arb.margin.tolist() == [pytest.approx(0.7), 0.0, 0.0]


def test_pairs_two_real_pairs_sum_margin_logs_and_need_group_ids():
    """Two pairs: the margin is reward(chosen) - reward(rejected) per pair (float32) and ``pairs/reward_margin`` its
    mean; ``pairs/tied`` = groups - pairs; a Scores without group ids is refused."""
    mod = _module()
    out = best_worst_pairs_of(mod, _scores([1.0, 4.0, -2.0, 0.5], [0, 0, 1, 1]), torch.zeros(4, 1), list("abcd"))
    assert out.count == 2 and out.margin.dtype == torch.float32 and out.margin.tolist() == [3.0, 2.5]
    assert mod.logs == [("pairs/count", 2.0), ("pairs/tied", 0.0), ("pairs/reward_margin", 2.75)]
    with pytest.raises(ValueError, match="group ids"):
        best_worst_pairs_of(mod, Scores(None, torch.zeros(2), torch.ones(2, dtype=torch.bool), None, 2),
                            torch.zeros(2, 1), ["a", "b"])


def test_pairs_no_pair_gives_empty_typed_slots():
    """No group gives a pair: count 0, endpoints [0, *latent] (x0's trailing shape, on the CPU), no prompt, int64
    keys and float32 weight / margin of length 0; the margin metric is 0 and every group counts as tied."""
    mod = _module()
    out = best_worst_pairs_of(mod, _scores([1.0, 1.0, 2.0], [0, 0, 1]), torch.ones(3, 2, 3), ["a", "b", "c"])
    assert out.count == 0 and out.prompts == []
    for t in (out.chosen, out.rejected):
        assert t.shape == (0, 2, 3) and t.device.type == "cpu"
    assert out.keys.dtype == torch.long and out.keys.shape == (0,)
    assert out.weight.dtype == out.margin.dtype == torch.float32 and out.weight.shape == out.margin.shape == (0,)
    assert mod.logs == [("pairs/count", 0.0), ("pairs/tied", 2.0), ("pairs/reward_margin", 0.0)]


@pytest.mark.parametrize("rank", [0, 1])
def test_pairs_are_dealt_round_robin_with_zero_weight_padding(monkeypatch, rank):
    """2 ranks, 3 pairs of the gathered batch: pair j goes to rank j mod 2; every rank gets ceil(3 / 2) = 2 slots,
    rank 1's second slot padding (a copy of pair 0 with weight 0 and margin 0); endpoints and prompts come from the
    gathered batch, so a pair may use another rank's samples; count is the global number of pairs."""
    total = [1.0, 3.0, 10.0, 4.0, 0.0, 2.5]  # groups 7: (1, 0), 3: (2, 3), 8: (5, 4)
    group = [7, 7, 3, 3, 8, 8]
    all_x0 = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 4)
    all_prompts = [f"q{i}" for i in range(6)]
    _ranks(monkeypatch, rank, 2, all_x0, all_prompts)
    local = all_x0[3 * rank : 3 * rank + 3]
    out = best_worst_pairs_of(_module(), _scores(total, group), local, all_prompts[3 * rank : 3 * rank + 3])
    want = {0: ([1, 5], [0, 4], [1.0, 1.0], [2.0, 2.5], [7, 8]), 1: ([2, 1], [3, 0], [1.0, 0.0], [6.0, 0.0], [3, 7])}
    c, r, w, m, k = want[rank]
    assert out.count == 3
    assert torch.equal(out.chosen, all_x0[c]) and torch.equal(out.rejected, all_x0[r])
    assert out.prompts == [f"q{i}" for i in c] and out.keys.tolist() == k
    assert out.weight.tolist() == w and out.margin.tolist() == m


def test_pairs_three_ranks_pad_every_rank_to_the_same_slots(monkeypatch):
    """3 ranks, 4 pairs: ceil(4 / 3) = 2 slots each: rank 2 holds pair 2 and a padding copy of pair 0 (weight 0,
    margin 0), rank 0 pairs 0 and 3."""
    total = [0.0, 1.0, 0.0, 2.0, 0.0, 3.0, 0.0, 4.0]
    group = [0, 0, 1, 1, 2, 2, 3, 3]
    all_x0 = torch.arange(8, dtype=torch.float32)[:, None]
    prompts = [f"s{i}" for i in range(8)]
    for rank, (c, w) in enumerate([([1, 7], [1.0, 1.0]), ([3, 1], [1.0, 0.0]), ([5, 1], [1.0, 0.0])]):
        _ranks(monkeypatch, rank, 3, all_x0, prompts)
        out = best_worst_pairs_of(_module(), _scores(total, group), all_x0[:3], prompts[:3])
        assert out.chosen[:, 0].tolist() == c and out.weight.tolist() == w
        assert out.margin.tolist() == [float(i + 1) // 2 * wi for i, wi in zip(c, w, strict=True)]


# ---------------------------------------------------------------------------------------------- collect phases


class _Gen:
    """A stub generator: v = a x + sigma c(prompt) (``a`` a settable weight), decode(x) = 2 x + 1 recorded with its
    input device; train / eval flags like an nn.Module."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.a = 0.5
        self.training = True
        self.decoded: list[torch.device] = []

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def encode_prompts(self, prompts):
        h = torch.stack([torch.full((2, 4), float(len(p)) / 10) for p in prompts])
        return Conditioning(h, torch.ones(len(prompts), 2, dtype=torch.bool), list(prompts))

    def velocity(self, x, sigma, cond, **kwargs):
        c = cond.hidden_states[:, 0, 0].to(x.device).reshape(-1, *([1] * (x.ndim - 1)))
        return self.a * x + sigma.reshape(-1, *([1] * (x.ndim - 1))) * c

    def decode(self, x):
        self.decoded.append(x.device)
        return 2 * x + 1


PROMPTS, SHAPE, SEED = ["a", "bb", "ccc"], (2, 3), 3
INDEX = torch.tensor([7, 2, 11])


def _window_config(**kw) -> RolloutConfig:
    return RolloutConfig(num_steps=5, sde_steps="window", num_sde_steps=2, **kw)


def _iteration(cfg: RolloutConfig) -> int:
    """An iteration whose SDE window differs from iteration 0's (so the window id is observable)."""
    return next(i for i in range(1, 50) if not torch.equal(sde_mask(cfg, SEED, i), sde_mask(cfg, SEED, 0)))


def test_collect_flat_forwards_config_addresses_and_window_with_lean_defaults():
    """collect_flat = rollout(config, sample indices, rollout_id = iteration) decoded, the generator's mode restored;
    by default no live graphs (Trajectory.live empty) and no step moments."""
    cfg = _window_config(kernel="dance_grpo", noise_level=0.7)
    it = _iteration(cfg)
    gen = _Gen()
    ro = collect_flat(gen, PROMPTS, SHAPE, SEED, INDEX, cfg, it)
    ref = rollout(_Gen(), PROMPTS, SHAPE, SEED, INDEX, cfg, rollout_id=it)
    traj = ro.samples
    assert torch.equal(traj.sde_mask, sde_mask(cfg, SEED, it)) and traj.config is cfg
    assert torch.equal(traj.final, ref.final) and torch.equal(traj.latents, ref.latents)
    assert traj.indices.tolist() == INDEX.tolist()
    assert torch.equal(ro.pixels, 2 * ref.final + 1) and ro.prompts == PROMPTS and gen.training
    assert traj.live == {} and traj.means is None and traj.stds is None


def test_collect_flat_keep_graph_and_record_moments_and_group_noise():
    """keep_graph=True keeps each stochastic step's graph (live: exactly the SDE steps, with grad); record_moments
    keeps the moments (equal to rollout's); under initial_noise "group" the starting noise is addressed by ``group``
    (members of a group start equal), as rollout(initial_keys=group) does."""
    cfg = _window_config(kernel="flow_grpo", initial_noise="group")
    group = torch.tensor([4, 9, 4])
    gen = _Gen()
    gen.a = torch.tensor(0.5, requires_grad=True)
    ro = collect_flat(gen, PROMPTS, SHAPE, SEED, INDEX, cfg, 0, keep_graph=True, record_moments=True, group=group)
    traj = ro.samples
    mask = sde_mask(cfg, SEED, 0)
    assert sorted(traj.live) == mask.nonzero().flatten().tolist()
    assert all(lp.requires_grad for lp, _, _ in traj.live.values())
    ref = rollout(_Gen(), PROMPTS, SHAPE, SEED, INDEX, cfg, record_moments=True, initial_keys=group)
    assert torch.equal(traj.means, ref.means) and torch.equal(traj.stds, ref.stds)
    assert torch.equal(traj.latents[0, 0], traj.latents[2, 0]) and not torch.equal(traj.latents[0, 0],
                                                                                   traj.latents[1, 0])
    assert torch.equal(traj.final, ref.final)


def test_collect_endpoints_live_policy_forwards_every_sampler_argument():
    """collect_endpoints without a policy: the final latents of rollout(config, indices, rollout_id = iteration)
    under the live weights, decoded; an SDE config's window follows the iteration."""
    cfg = _window_config(kernel="flow_grpo")
    it = _iteration(cfg)
    ro = collect_endpoints(_Gen(), PROMPTS, SHAPE, SEED, INDEX, cfg, it)
    ref = rollout(_Gen(), PROMPTS, SHAPE, SEED, INDEX, cfg, rollout_id=it).final
    assert torch.equal(ro.samples, ref) and torch.equal(ro.pixels, 2 * ref + 1) and ro.prompts == PROMPTS
    assert not torch.equal(ref, rollout(_Gen(), PROMPTS, SHAPE, SEED, INDEX, cfg).final)


def test_collect_endpoints_policy_context_selects_the_sampling_weights():
    """With ``policy`` the rollout runs inside its context (here: weight a = -0.25 swapped in), with the same sampler
    arguments (config, indices, window id); the live weights are back afterwards."""
    cfg = _window_config(kernel="flow_grpo")
    it = _iteration(cfg)
    gen = _Gen()

    @contextlib.contextmanager
    def swap():
        gen.a = -0.25
        try:
            yield
        finally:
            gen.a = 0.5

    ro = collect_endpoints(gen, PROMPTS, SHAPE, SEED, INDEX, cfg, it, policy=swap)
    old = _Gen()
    old.a = -0.25
    ref = rollout(old, PROMPTS, SHAPE, SEED, INDEX, cfg, rollout_id=it).final
    assert torch.equal(ro.samples, ref) and gen.a == 0.5 and gen.training
    assert not torch.equal(ref, rollout(_Gen(), PROMPTS, SHAPE, SEED, INDEX, cfg, rollout_id=it).final)


TREE = TreeConfig(split_steps=[0, 2], branch_factor=2)


def test_collect_tree_scores_x0_by_default_with_one_prompt_per_leaf():
    """collect_tree: tree_rollout at the trees' indices; by default (reward_on="x0") the leaves' last x0 predictions
    are decoded, one prompt per leaf (the leaf's tree, ro.tree[-1], after a split at the last step); "final" decodes
    the final leaf latents."""
    cfg = RolloutConfig(num_steps=3, kernel="flow_grpo")
    prompts = ["a", "bb"]
    idx = torch.tensor([5, 1])
    ro = collect_tree(_Gen(), prompts, SHAPE, SEED, idx, cfg, TREE)
    ref = tree_rollout(_Gen(), prompts, SHAPE, SEED, idx, cfg, TREE)
    assert ro.prompts == ["a"] * 4 + ["bb"] * 4
    assert torch.equal(ro.pixels, 2 * ref.x0 + 1) and torch.equal(ro.samples.x0, ref.x0)
    explicit = collect_tree(_Gen(), prompts, SHAPE, SEED, idx, cfg, TREE, reward_on="x0")
    assert torch.equal(explicit.pixels, ro.pixels)
    final = collect_tree(_Gen(), prompts, SHAPE, SEED, idx, cfg, TREE, reward_on="final")
    assert torch.equal(final.pixels, 2 * ref.latents[-1] + 1) and not torch.equal(final.pixels, ro.pixels)


def test_collect_tree_decodes_on_the_generators_device(monkeypatch):
    """The leaves (CPU tensors of the TreeRollout) are moved to ``generator.device`` before decoding (a meta
    generator decodes meta tensors)."""
    cfg = RolloutConfig(num_steps=3, kernel="flow_grpo")
    ref = tree_rollout(_Gen(), ["a"], SHAPE, SEED, None, cfg, TREE)
    monkeypatch.setattr(phases, "tree_rollout", lambda *a, **k: ref)
    gen = _Gen("meta")
    collect_tree(gen, ["a"], SHAPE, SEED, torch.tensor([0]), cfg, TREE)
    assert gen.decoded == [torch.device("meta")]


# --------------------------------------------------------------------------------------------- caption dropout


def test_caption_dropout_threshold_is_strict_default_null_is_empty_and_index_is_aligned():
    """A draw equal to the probability is kept (dropped iff rand < p, strictly); the default null prompt is "" and an
    image prompt keeps its image; an index whose length is not the prompts' is refused."""
    idx = torch.tensor([3, 8, 13])
    u = rand_per_sample((), 1, idx, stream=4)
    p = float(u[1])
    out = caption_dropout(["x", "y", "z"], p, 1, idx, 4)
    assert out == ["" if float(v) < p else t for v, t in zip(u, "xyz", strict=True)] and out[1] == "y"
    img = Prompt("cat", torch.zeros(3, 2, 2))
    dropped = caption_dropout([img], 1.0, 1, idx[:1], 4)
    assert str(dropped[0]) == "" and dropped[0].image is img.image
    with pytest.raises(ValueError):
        caption_dropout(["x", "y"], 0.5, 1, idx, 4)
