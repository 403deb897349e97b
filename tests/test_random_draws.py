"""Every recorded random draw, tested in the component that draws it (docs/architecture.md, Seeds and noise
addressing): the same address gives bitwise the same values whatever the batch composition, order or micro-batching,
and each address component (seed, sample index, step, chunk, stream, iteration, rollout id) changed alone gives
unrelated values (not equal, not a sign flip or a shifted copy: correlation near 0, no shared values)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import genrl.methods.distill as distill_mod
import genrl.rollout.autoregressive as ar_mod
import genrl.rollout.sampler as sampler_mod
import genrl.rollout.tree as tree_mod
from genrl.methods.afd import AFD
from genrl.methods.distill import chunk_noise_levels, paired_instance_noise
from genrl.methods.dmd import DMD
from genrl.methods.pretrain import FlowMatchingPretrain
from genrl.methods.ram import RAM
from genrl.models.causal import CausalConfig, ChunkSchedule, KVCache
from genrl.models.text_encoder import Conditioning
from genrl.noise import mix_seed, rand_per_sample, randn_per_sample, sample_generator
from genrl.rollout import RolloutConfig, rollout, sde_mask
from genrl.rollout.autoregressive import ARState, ar_rollout, chunk_noise, fork, sample_exit_step
from genrl.rollout.tree import TreeConfig, regenerate_leaf, tree_rollout

SHAPE = (2, 4, 8, 8)  # 512 elements per sample: correlation of independent rows ~ N(0, 1 / 512)


def _unrelated(a: torch.Tensor, b: torch.Tensor, shared: bool = True) -> None:
    """Assert two same-shape draws are independent: not equal, |correlation| < 5 / sqrt(n) (a sign flip or an offset
    gives |r| ~ 1) and, with ``shared``, almost no value of one occurs in the other (a shifted or reordered copy of
    the same stream shares all of them)."""
    a, b = a.flatten().double(), b.flatten().double()
    assert a.shape == b.shape and a.numel() >= 64
    assert not torch.equal(a, b)
    a0, b0 = a - a.mean(), b - b.mean()
    r = float(a0 @ b0 / (a0.norm() * b0.norm()))
    assert abs(r) < 5 / math.sqrt(a.numel()), r
    if shared:
        assert float(torch.isin(a, b).double().mean()) < 0.05
    else:  # values from a small set: at most a few positions agree
        assert float((a == b).double().mean()) < 0.05


def _rows_unrelated(a: torch.Tensor, b: torch.Tensor) -> None:
    """Row i of ``a`` and row i of ``b`` are unrelated, for every i."""
    assert a.shape == b.shape
    for x, y in zip(a, b):
        _unrelated(x, y)


def _all_pairs_unrelated(rows: list[torch.Tensor]) -> None:
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            _unrelated(rows[i], rows[j])


# ------------------------------------------------------------------------------------------------ genrl.noise


def test_mix_seed_every_part_its_position_and_count_matter():
    """mix_seed: 2048 addresses hash to 2048 distinct 63-bit seeds; order and count of parts matter; pinned value."""
    seeds = {mix_seed(s, i, k, st) for s in range(4) for i in range(16) for k in range(8) for st in range(4)}
    assert len(seeds) == 4 * 16 * 8 * 4 and all(0 <= v < 2**63 for v in seeds)
    assert mix_seed(1, 2) != mix_seed(2, 1) and mix_seed(3, 0, 0, 0) != mix_seed(0, 3, 0, 0) != mix_seed(0, 0, 3, 0)
    assert mix_seed(5) != mix_seed(5, 0) != mix_seed(5, 0, 0)  # a trailing zero part is still a part
    assert mix_seed(7, torch.tensor(3)) == mix_seed(7, 3)
    # the hash is part of every recorded run: changing it silently changes all noise
    assert mix_seed(0, 0, 0, 0) == 2391539541053276776
    with pytest.raises(TypeError, match="ints"):
        mix_seed(1, 2.0)


@pytest.mark.parametrize("draw", [randn_per_sample, rand_per_sample])
def test_per_sample_row_is_a_pure_function_of_its_address(draw):
    """Row i depends only on (seed, indices[i], step, stream): any order, sub-batch, micro-batch split or global
    RNG state gives bitwise the same row, equal to a draw from sample_generator of that address."""
    idx = [3, 8, 1, 5, 1_000_003]
    full = draw(SHAPE, 11, idx, step=2, stream=4)
    assert full.shape == (5, *SHAPE) and full.dtype == torch.float32
    perm = [4, 0, 3, 1, 2]
    assert torch.equal(draw(SHAPE, 11, [idx[p] for p in perm], step=2, stream=4), full[perm])
    split = torch.cat([draw(SHAPE, 11, idx[:2], step=2, stream=4), draw(SHAPE, 11, idx[2:], step=2, stream=4)])
    assert torch.equal(split, full)
    assert torch.equal(draw(SHAPE, 11, torch.tensor([5]), step=2, stream=4)[0], full[3])
    assert torch.equal(draw(SHAPE, 11, [5, 5], step=2, stream=4)[1], full[3])  # a repeated id repeats its row
    ref = torch.randn if draw is randn_per_sample else torch.rand
    assert torch.equal(ref(SHAPE, generator=sample_generator(11, 5, 2, 4)), full[3])
    torch.manual_seed(0)
    state = torch.get_rng_state()
    again = draw(SHAPE, 11, idx, step=2, stream=4)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is neither used nor advanced
    torch.manual_seed(12345)
    assert torch.equal(again, full) and torch.equal(draw(SHAPE, 11, idx, step=2, stream=4), full)
    f64 = draw(SHAPE, 11, idx, step=2, stream=4, dtype=torch.float64)
    assert f64.dtype == torch.float64 and torch.equal(draw(SHAPE, 11, idx[::-1], step=2, stream=4,
                                                           dtype=torch.float64), f64.flip(0))


@pytest.mark.parametrize("draw", [randn_per_sample, rand_per_sample])
def test_each_address_component_alone_gives_unrelated_rows(draw):
    """Changing only the seed, the sample index, the step or the stream changes every row into an unrelated one;
    (step, stream) are not interchangeable, and rows of different samples are unrelated."""
    idx = torch.arange(8)
    base = draw(SHAPE, 11, idx, step=3, stream=2)
    _rows_unrelated(base, draw(SHAPE, 12, idx, step=3, stream=2))  # seed
    _rows_unrelated(base, draw(SHAPE, 11, idx + 8, step=3, stream=2))  # sample index
    _rows_unrelated(base, draw(SHAPE, 11, idx, step=4, stream=2))  # step
    _rows_unrelated(base, draw(SHAPE, 11, idx, step=3, stream=3))  # stream
    _rows_unrelated(base, draw(SHAPE, 11, idx, step=2, stream=3))  # step and stream swapped
    _rows_unrelated(base, draw(SHAPE, 11, idx, step=3, stream=2).roll(1, 0))  # neighbouring samples
    _all_pairs_unrelated(list(base))


def test_per_sample_draw_distributions():
    """randn_per_sample is N(0, 1) and rand_per_sample U[0, 1) over a large draw, with independent rows."""
    n = randn_per_sample((4096,), 5, range(64), step=1, stream=1).double()
    m = n.numel()
    assert abs(float(n.mean())) < 5 / math.sqrt(m)
    assert abs(float(n.std()) - 1) < 5 / math.sqrt(2 * m)
    # row means of independent rows spread like N(0, 1 / 4096)
    assert float(n.mean(1).std()) == pytest.approx(1 / 64, rel=0.35)
    u = rand_per_sample((4096,), 5, range(64), step=1, stream=1).double()
    assert float(u.min()) >= 0 and float(u.max()) < 1 and float(u.min()) < 1e-3 and float(u.max()) > 1 - 1e-3
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / m)
    assert abs(float(u.var()) - 1 / 12) < 0.002


# ------------------------------------------------------------------------------------------------ flat rollouts


class _StubGenerator:
    """A per-row velocity (v = 0.5 x + c(prompt)): no batch mixing, so trajectories are comparable bitwise."""

    device = torch.device("cpu")

    def encode_prompts(self, prompts):
        h = torch.stack([torch.full((2, 4), float(len(p)) / 10) for p in prompts])
        return Conditioning(h, torch.ones(len(prompts), 2, dtype=torch.bool), list(prompts))

    def velocity(self, x, sigma, cond, **kwargs):
        return 0.5 * x + cond.hidden_states[:, 0, 0].reshape(-1, *([1] * (x.ndim - 1)))


PROMPTS = ["a red circle", "a blue square", "a green triangle moving up", "a cyan square", "a yellow circle"]


def _spy(monkeypatch, module, name="randn_per_sample"):
    """Record every call of ``module.name`` (kwargs and result), without changing what it returns."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args, kwargs, out.clone()))
        return out

    monkeypatch.setattr(module, name, spy)
    return calls


def test_rollout_noise_is_addressed_by_seed_index_and_step(monkeypatch):
    """Flat rollout: initial noise = (seed, i, step 0), SDE step k noise = (seed, i, step k + 1), zero on ODE steps;
    every draw of a rollout unrelated to every other; a permuted sub-batch under another micro-batch size records
    bitwise the same per-sample noises and trajectory."""
    gen = _StubGenerator()
    config = RolloutConfig(num_steps=4, kernel="flow_grpo", micro_batch_size=3)
    idx = [10, 11, 12, 13, 14]
    calls = _spy(monkeypatch, sampler_mod)
    traj = rollout(gen, PROMPTS, SHAPE, seed=7, indices=idx, config=config)
    assert traj.sde_mask.tolist() == [True, True, True, False]
    assert torch.equal(traj.latents[:, 0], randn_per_sample(SHAPE, 7, idx, step=0))
    for k in range(3):
        assert torch.equal(traj.noises[:, k], randn_per_sample(SHAPE, 7, idx, step=k + 1))
    assert not traj.noises[:, 3].any()  # the ODE step draws nothing
    assert [c[1]["step"] for c in calls] == [0, 1, 2, 3]  # one draw per stochastic step, none for the ODE step
    for b in range(5):  # per sample: initial noise and the three step noises are pairwise unrelated
        _all_pairs_unrelated([traj.latents[b, 0]] + [traj.noises[b, k] for k in range(3)])
    _all_pairs_unrelated(list(traj.noises[:, 0]))  # across samples at one step
    sub = [3, 0, 4]
    other = rollout(gen, [PROMPTS[i] for i in sub], SHAPE, seed=7, indices=[idx[i] for i in sub],
                    config=RolloutConfig(num_steps=4, kernel="flow_grpo", micro_batch_size=2))
    assert torch.equal(other.latents, traj.latents[sub]) and torch.equal(other.noises, traj.noises[sub])
    assert torch.equal(other.final, traj.final[sub])
    reseeded = rollout(gen, PROMPTS, SHAPE, seed=8, indices=idx, config=config)
    _rows_unrelated(reseeded.latents[:, 0], traj.latents[:, 0])
    _rows_unrelated(reseeded.noises[:, 1], traj.noises[:, 1])


def test_sde_window_depends_on_seed_and_rollout_id_only():
    """The SDE window start is uniform over its range, changes with the seed and with the rollout id alone, and a
    rollout records exactly that mask (the same for any batch): zero noise outside it."""
    config = RolloutConfig(num_steps=10, sde_steps="window", num_sde_steps=2, window_start=1, window_end=6,
                           skip_last_step=False)
    starts = {s: [int(torch.nonzero(sde_mask(config, s, r))[0]) for r in range(400)] for s in (0, 1)}
    for s in (0, 1):
        counts = torch.bincount(torch.tensor(starts[s]), minlength=5)
        assert counts[0] == 0 and all(abs(int(c) - 100) < 35 for c in counts[1:]), counts  # U{1..4}
    same = sum(a == b for a, b in zip(starts[0], starts[1]))
    assert same < 160  # about 1/4 agree by chance; ignoring the seed would make all 400 agree
    assert sum(a == b for a, b in zip(starts[0], starts[0][1:])) < 160  # the rollout id alone moves it
    gen = _StubGenerator()
    full = rollout(gen, PROMPTS, SHAPE[:1] + (2, 4, 4), seed=1, indices=range(5), config=config, rollout_id=6)
    alone = rollout(gen, PROMPTS[2:3], SHAPE[:1] + (2, 4, 4), seed=1, indices=[2], config=config, rollout_id=6)
    mask = sde_mask(config, 1, 6)
    assert torch.equal(full.sde_mask, mask) and torch.equal(alone.sde_mask, mask) and int(mask.sum()) == 2
    assert full.noises[:, ~mask].abs().sum() == 0 and (full.noises[:, mask] != 0).all()


# ------------------------------------------------------------------------------------------------ tree rollouts


def test_tree_node_noise_is_addressed_by_tree_path_and_step(monkeypatch):
    """Tree rollout: the root is flat sample ``tree index``'s initial noise; every node draw of the rollout (siblings,
    chain steps, other trees) is unrelated to every other; a tree alone, in another batch order, or one leaf
    regenerated as a chain draws bitwise the same noise per (tree, path code, step)."""
    gen = _StubGenerator()
    config = RolloutConfig(num_steps=4, kernel="dance_grpo", noise_level=0.3, micro_batch_size=3)
    tree = TreeConfig(split_steps=[0, 2], branch_factor=2)
    calls = _spy(monkeypatch, tree_mod)

    def node_noise(trees, prompts):
        calls.clear()
        ro = tree_rollout(gen, prompts, SHAPE, seed=3, tree_indices=trees, config=config, tree=tree)
        assert [c[1]["step"] for c in calls] == [0, 1, 2, 3, 4]
        table = {(int(ro.tree_indices[t]), 0, 0): calls[0][2][t] for t in range(len(trees))}
        for k in range(4):
            for row, (t, c) in enumerate(zip(ro.tree[k + 1].tolist(), ro.codes[k + 1].tolist())):
                table[(int(ro.tree_indices[t]), c, k + 1)] = calls[k + 1][2][row]
        return ro, table

    ro, table = node_noise([5, 9], PROMPTS[:2])
    assert len(table) == 2 * (1 + 2 + 2 + 4 + 4)
    assert torch.equal(ro.latents[0], randn_per_sample(SHAPE, 3, [5, 9], step=0))  # = flat samples 5 and 9
    _all_pairs_unrelated(list(table.values()))
    _, swapped = node_noise([9, 5], PROMPTS[1::-1])
    _, alone = node_noise([9], PROMPTS[1:2])
    assert swapped.keys() == table.keys() and all(torch.equal(v, table[key]) for key, v in swapped.items())
    assert all(torch.equal(v, table[key]) for key, v in alone.items()) and len(alone) == 13
    leaf = 6  # regenerate one leaf of tree 9 alone: the chain draws exactly its path's noises
    t, code = int(ro.tree[-1][leaf]), int(ro.codes[-1][leaf])
    calls.clear()
    regenerate_leaf(gen, PROMPTS[t], SHAPE, 3, int(ro.tree_indices[t]), code, config, tree)
    path = [0, code // 2, code // 2, code, code]  # the path code after 0, 1, 1, 2, 2 splits
    assert len(calls) == 5
    for k, (_, _, out) in enumerate(calls):
        assert torch.equal(out[0], table[(int(ro.tree_indices[t]), path[k], k)]), k


def test_tree_node_noise_address_is_pinned(monkeypatch):
    """The pinned address of the noise of a tree node at depth k: run seed, sample index mix_seed(tree index, the
    node's path code, 0x7E2), step k (changing it changes every tree rollout of a resumed run)."""
    calls = _spy(monkeypatch, tree_mod)
    config = RolloutConfig(num_steps=2, kernel="dance_grpo", noise_level=0.3, micro_batch_size=4)
    ro = tree_rollout(_StubGenerator(), PROMPTS[:2], (2, 3), seed=3, tree_indices=[5, 9], config=config,
                      tree=TreeConfig(split_steps=[0], branch_factor=2))
    assert [c[1]["step"] for c in calls] == [0, 1, 2]
    for k in (1, 2):
        address = [mix_seed(int(ro.tree_indices[t]), c, 0x7E2) for t, c in zip(ro.tree[k].tolist(),
                                                                                  ro.codes[k].tolist())]
        assert list(calls[k][0][2]) == address
        assert torch.equal(calls[k][2], randn_per_sample((2, 3), 3, address, step=k)), k


# ------------------------------------------------------------------------------------------------ autoregressive


def _state(seed: int, indices) -> ARState:
    return ARState(cache=None, cond=None, latents=None, chunk_index=0, seed=seed, indices=torch.as_tensor(indices))


FRAME = (4, 8, 8)


def test_chunk_noise_is_addressed_by_seed_sample_chunk_and_step():
    """chunk_noise: (seed, sample, chunk, step) each changed alone gives unrelated noise, chunk and step are not
    interchangeable, the same address is bitwise equal in any batch; float64 is the float32 draw cast."""
    base = chunk_noise(_state(3, [4, 9]), FRAME, 1, 2, 2, "cpu")
    assert base.shape == (2, 2, *FRAME)
    _rows_unrelated(base, chunk_noise(_state(4, [4, 9]), FRAME, 1, 2, 2, "cpu"))  # seed
    _rows_unrelated(base, chunk_noise(_state(3, [5, 10]), FRAME, 1, 2, 2, "cpu"))  # sample
    _rows_unrelated(base, chunk_noise(_state(3, [4, 9]), FRAME, 2, 2, 2, "cpu"))  # chunk
    _rows_unrelated(base, chunk_noise(_state(3, [4, 9]), FRAME, 1, 3, 2, "cpu"))  # step
    _rows_unrelated(base, chunk_noise(_state(3, [4, 9]), FRAME, 2, 1, 2, "cpu"))  # chunk and step swapped
    _rows_unrelated(base, randn_per_sample((2, *FRAME), 3, [4, 9], step=2))  # not the flat rollout's stream 0
    assert torch.equal(chunk_noise(_state(3, [9, 4, 7]), FRAME, 1, 2, 2, "cpu")[[1, 0]], base)
    assert torch.equal(chunk_noise(_state(3, [9]), FRAME, 1, 2, 2, "cpu")[0], base[1])
    f64 = chunk_noise(_state(3, [4, 9]), FRAME, 1, 2, 2, "cpu", torch.float64)
    assert f64.dtype == torch.float64 and torch.equal(f64, base.double())


class _StubCausal(_StubGenerator):
    """A causal generator without a network: per-row chunk velocity, a context pass that only advances the cache."""

    frame_dim = 1

    def init_cache(self, batch_size, causal):
        return KVCache(causal, batch_size)

    def velocity_chunk(self, x, sigma, cond, cache):
        return self.velocity(x, sigma, cond)

    def commit(self, x, sigma, cond, cache):
        cache.end_frame += x.shape[1]


def test_ar_rollout_draws_distinct_noise_per_chunk_step_and_context(monkeypatch):
    """ar_rollout: every draw (initial, each re-noise, context pass, a recache's context pass) of every chunk is
    unrelated to every other; a sample alone draws bitwise its rows of the batch; a fork keeps the address, a fork
    with new ids moves it."""
    sch = ChunkSchedule(causal=CausalConfig(2), timesteps=[1000, 750, 500, 250], shift=3.0, context_noise=0.1)
    causal_gen = _StubCausal()
    calls = _spy(monkeypatch, ar_mod, "chunk_noise")
    prompts = ["a red circle", "a blue square"]
    switch = {2: (causal_gen.encode_prompts(["a green triangle", "a cyan circle"]), "recache")}
    out = ar_rollout(causal_gen, causal_gen.encode_prompts(prompts), 3, FRAME, sch, seed=5, indices=[4, 9],
                     record=True, prompt_switches=switch)
    addresses = [(c[0][2], c[0][3]) for c in calls]  # (chunk, step)
    chunk = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 5)]  # initial, 3 re-noises, context pass (step S + 1)
    assert addresses == chunk + [(1, j) for _, j in chunk] + [(0, 10_000), (1, 10_000)] + [(2, j) for _, j in chunk]
    for b in range(2):
        _all_pairs_unrelated([c[2][b] for c in calls])
    _all_pairs_unrelated([c[2][0] for c in calls[:5]] + [c[2][1] for c in calls[:5]])  # across samples too
    drawn = dict(zip(addresses, (c[2] for c in calls)))
    for k in range(3):  # the recorded trajectory holds the drawn noise of each step
        assert torch.equal(out.trajectory[k]["noise"], torch.stack([drawn[(k, j)] for j in range(4)]))
    calls.clear()
    switch = {2: (causal_gen.encode_prompts(["a cyan circle"]), "recache")}
    ar_rollout(causal_gen, causal_gen.encode_prompts(prompts[1:]), 3, FRAME, sch, seed=5, indices=[9],
               prompt_switches=switch)
    assert [(c[0][2], c[0][3]) for c in calls] == addresses
    assert all(torch.equal(c[2][0], drawn[a][1]) for c, a in zip(calls, addresses))
    same, moved = fork(out.state, 1)[0], fork(out.state, 1, indices=[[100, 101]])[0]
    assert torch.equal(chunk_noise(same, FRAME, 3, 0, 2, "cpu"), chunk_noise(_state(5, [4, 9]), FRAME, 3, 0, 2, "cpu"))
    fresh = chunk_noise(_state(5, [100, 101]), FRAME, 3, 0, 2, "cpu")
    assert torch.equal(chunk_noise(moved, FRAME, 3, 0, 2, "cpu"), fresh)
    _rows_unrelated(fresh, chunk_noise(same, FRAME, 3, 0, 2, "cpu"))


def test_exit_step_is_uniform_and_changes_with_seed_and_iteration():
    """sample_exit_step: U{0..S-1} over iterations, the same value for the same (seed, iteration), and another
    seed gives another sequence."""
    seqs = {s: [sample_exit_step(4, s, it) for it in range(800)] for s in (0, 1)}
    for s in (0, 1):
        counts = torch.bincount(torch.tensor(seqs[s]), minlength=4)
        assert counts.numel() == 4 and all(abs(int(c) - 200) < 50 for c in counts), counts
    assert sum(a == b for a, b in zip(seqs[0], seqs[1])) < 300  # ~200 agree by chance; 800 if the seed were ignored
    assert [sample_exit_step(4, 0, it) for it in range(800)] == seqs[0]
    assert sum(a == b for a, b in zip(seqs[0], seqs[0][1:])) < 300  # consecutive iterations are not tied


# ------------------------------------------------------------------------------------------------ flow / methods


def test_pretrain_sigma_draw_per_sample_and_frame_group():
    """Flow-matching pretraining's TimestepSampler draw, one CPU generator per (seed, sample): per-sample rows equal
    in any batch, frame groups of one sample unrelated, index and seed each change every value; logit-normal."""
    model = FlowMatchingPretrain(seed=5, diffusion_forcing=True)
    model.generator = SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(patch_size=[2, 2, 2])))
    idx = torch.arange(600)
    sig = model._sample_sigma(idx, 8)
    assert sig.shape == (600, 8) and torch.equal(sig[:, 0::2], sig[:, 1::2])  # one sigma per temporal patch
    assert torch.equal(model._sample_sigma(torch.tensor([7, 2, 599]), 8), sig[[7, 2, 599]])
    groups = sig[:, 0::2]
    for a in range(4):
        for b in range(a + 1, 4):
            _unrelated(groups[:, a], groups[:, b])
    _unrelated(groups[:, 0], model._sample_sigma(idx + 600, 8)[:, 0])
    other = FlowMatchingPretrain(seed=6, diffusion_forcing=True)
    other.generator = model.generator
    _unrelated(groups[:, 0], other._sample_sigma(idx, 8)[:, 0])
    assert abs(float(groups.mean()) - 0.5) < 0.03 and 0.15 < float(groups.std()) < 0.25  # sigmoid(N(0, 1))


def test_dmd_noising_per_sample_iteration_and_stream():
    """DMD's critic / generator noising (sigma and eps): bitwise per sample in any sub-batch; the iteration, the
    stream (generator vs critic), the sample and the seed each change sigma and eps; sigma in [0.02, 0.98]."""
    model = DMD(seed=3)
    x = torch.zeros(400, 2, 3, 4, 4)
    idx = torch.arange(400)
    sigma, eps, x_t = model._noised(x, idx, 7, 21)
    assert float(sigma.min()) >= 0.02 - 1e-7 and float(sigma.max()) <= 0.98 + 1e-7  # the clamp [20, 980] / 1000
    assert float(sigma.median()) > 0.75  # shift 5 pushes the draws to high noise
    assert torch.equal(x_t, sigma[:, None, None, None, None] * eps)
    s2, e2, _ = model._noised(x[:3], torch.tensor([399, 5, 12]), 7, 21)
    assert torch.equal(s2, sigma[[399, 5, 12]]) and torch.equal(e2, eps[[399, 5, 12]])
    for other in (model._noised(x, idx, 8, 21), model._noised(x, idx, 7, 22), model._noised(x, idx + 400, 7, 21),
                  DMD(seed=4)._noised(x, idx, 7, 21)):
        _unrelated(sigma, other[0], shared=False)
        _rows_unrelated(eps[:20], other[1][:20])
    _unrelated(sigma, eps[:, 0, 0, 0, 0], shared=False)


def test_dmd_noising_sigma_and_eps_never_share_an_address(monkeypatch):
    """dmd_noised draws sigma and eps of a sample from two distinct (seed, index, step, stream) addresses (one
    generator state feeding both would tie them), under both the generator's and the critic's stream."""
    used = []
    real_gen, real_randn = distill_mod.sample_generator, distill_mod.randn_per_sample

    def gen_spy(seed, index, step=0, stream=0):
        used.append((seed, int(index), step, stream))
        return real_gen(seed, index, step, stream)

    def randn_spy(shape, seed, indices, step=0, stream=0, **kw):
        used.extend((seed, int(i), step, stream) for i in indices)
        return real_randn(shape, seed, indices, step, stream, **kw)

    monkeypatch.setattr(distill_mod, "sample_generator", gen_spy)
    monkeypatch.setattr(distill_mod, "randn_per_sample", randn_spy)
    model = DMD(seed=3)
    x = torch.zeros(4, 2, 3, 4, 4)
    for stream in (21, 22):
        model._noised(x, torch.arange(4), 7, stream)
    assert len(used) == 2 * 2 * 4 and len(set(used)) == len(used)


def _ram_t(model, index, it, draw):
    """RAM's training t for samples ``index`` at (iteration, draw): the t of its shared re-noising phase."""
    from genrl.methods.phases import renoise
    from genrl.methods.ram import _STREAM_EPS, _STREAM_T

    return renoise(torch.zeros(len(index), 1), index, model.hparams.seed, it, draw, _STREAM_T, _STREAM_EPS,
                   **model.timestep_args())[0]


def test_ram_timesteps_per_sample_iteration_and_draw():
    """RAM's t draws (sample_timesteps): bitwise per sample in any micro-batch; iteration, draw number, sample and
    seed each change every t (unrelated over 500 samples)."""
    model = RAM(seed=3, timestep_density="uniform")
    idx = torch.arange(500)
    t = _ram_t(model, idx, 4, 2)
    assert t.shape == (500,) and float(t.min()) >= 0 and float(t.max()) < 1
    assert torch.equal(torch.cat([_ram_t(model, idx[:130], 4, 2), _ram_t(model, idx[130:], 4, 2)]), t)
    assert torch.equal(_ram_t(model, idx.flip(0), 4, 2), t.flip(0))
    for other in (_ram_t(model, idx, 5, 2), _ram_t(model, idx, 4, 3), _ram_t(model, idx + 500, 4, 2),
                  _ram_t(RAM(seed=4, timestep_density="uniform"), idx, 4, 2)):
        _unrelated(t, other)
    assert abs(float(t.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / 500)


def test_chunk_noise_levels_per_chunk_sample_step_and_stream():
    """AFD's per-chunk noise levels: constant inside a chunk, unrelated across chunks; sample, step, stream and seed
    each change them; bitwise per sample in any batch; in (0.02, 0.98) or on the student's schedule."""
    sch = ChunkSchedule(causal=CausalConfig(2), timesteps=[1000, 750, 500, 250], shift=3.0)
    idx = torch.arange(500)
    lv = chunk_noise_levels(sch, idx, 9, 1, 31, 6, per_chunk=True, from_schedule=False)
    assert lv.shape == (500, 6) and torch.equal(lv[:, 0::2], lv[:, 1::2])
    assert float(lv.min()) >= 0.02 and float(lv.max()) <= 0.98
    assert float(lv.min()) < 0.03 and float(lv.max()) > 0.97
    chunks = lv[:, 0::2]
    for a, b in ((0, 1), (1, 2), (0, 2)):
        _unrelated(chunks[:, a], chunks[:, b])
    for other in (chunk_noise_levels(sch, idx + 500, 9, 1, 31, 6, from_schedule=False),
                  chunk_noise_levels(sch, idx, 9, 2, 31, 6, from_schedule=False),
                  chunk_noise_levels(sch, idx, 9, 1, 32, 6, from_schedule=False),
                  chunk_noise_levels(sch, idx, 10, 1, 31, 6, from_schedule=False)):
        _unrelated(chunks[:, 0], other[:, 0])
    assert torch.equal(chunk_noise_levels(sch, torch.tensor([42, 3]), 9, 1, 31, 6, from_schedule=False), lv[[42, 3]])
    video = chunk_noise_levels(sch, idx, 9, 1, 31, 6, per_chunk=False, from_schedule=False)
    assert torch.equal(video, video[:, :1].expand(-1, 6))
    on_grid = chunk_noise_levels(sch, idx, 9, 1, 31, 6)
    levels = sch.sigmas()[:-1].float()
    assert torch.isin(on_grid, levels).all() and torch.isin(levels, on_grid).all()


def test_paired_instance_noise_is_addressed_by_clip_ids():
    """AFD's discriminator instance noise: a teacher clip's sigma and noise and its K students' noises depend only on
    (seed, clip id), not on its batch or rank; clips, students of one clip, seeds are unrelated; sigma shared."""
    teacher = torch.zeros(3, 2, 4, 8, 8)
    student = torch.zeros(6, 2, 4, 8, 8)
    ids = torch.tensor([7, 2, 5])
    sig_t, y, sig_s, x = paired_instance_noise(teacher, student, 2, 0.5, 11, indices=ids)
    assert torch.equal(sig_s, sig_t.repeat_interleave(2)) and float(sig_t.max()) <= 0.5
    s1, y1, _, x1 = paired_instance_noise(teacher[:1], student[:2], 2, 0.5, 11, indices=torch.tensor([2]))
    assert torch.equal(s1, sig_t[1:2]) and torch.equal(y1[0], y[1]) and torch.equal(x1, x[2:4])
    # two ranks with their own clips (ids 0, 1 and 2, 3) draw unrelated noise for their local rows
    rank0 = paired_instance_noise(teacher[:2], student[:4], 2, 0.5, 11, indices=torch.tensor([0, 1]))
    rank1 = paired_instance_noise(teacher[:2], student[:4], 2, 0.5, 11, indices=torch.tensor([2, 3]))
    assert not torch.equal(rank0[0], rank1[0])
    _rows_unrelated(rank0[1], rank1[1])
    _rows_unrelated(rank0[3], rank1[3])
    _all_pairs_unrelated(list(y / sig_t[:, None, None, None, None]) + list(x / sig_s[:, None, None, None, None]))
    reseeded = paired_instance_noise(teacher, student, 2, 0.5, 12, indices=ids)
    _rows_unrelated(y / sig_t[:, None, None, None, None], reseeded[1] / reseeded[0][:, None, None, None, None])
    many = paired_instance_noise(torch.zeros(2000, 1, 1), torch.zeros(2000, 1, 1), 1, 0.5, 11,
                                 indices=torch.arange(2000))
    assert abs(float(many[0].double().mean()) - 0.25) < 5 * 0.5 * math.sqrt(1 / 12 / 2000)  # U[0, 0.5]


class _SumDiscriminator(torch.nn.Module):
    """Scores a latent by its sum and records what it was shown."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def score(self, latents, cond, sigma=None, frame_dim=1, double_backward=None):
        self.seen.append((latents.detach().clone(), sigma))
        return latents.flatten(1).sum(1)


def test_afd_discriminator_loss_noises_pairs_by_iteration_salt_and_clip_ids():
    """AFD's discriminator step shows D the pairs noised at (seed, iteration, salt, clip ids): equal to
    paired_instance_noise at that address; other clip ids (another rank), salt or iteration give unrelated noise."""
    model = AFD(seed=3, disc_noise_max=0.5, samples_per_prompt=2)
    model.discriminator = _SumDiscriminator()
    teacher, student = torch.zeros(2, 2, 4, 8, 8), torch.zeros(4, 2, 4, 8, 8)

    def shown(ids, salt=1):
        model.discriminator.seen.clear()
        model.discriminator_loss(teacher, student, None, None, salt=salt, indices=torch.tensor(ids))
        return list(model.discriminator.seen)

    y, x = shown([0, 1])
    sig_t, y_ref, _, x_ref = paired_instance_noise(teacher, student, 2, 0.5, mix_seed(3, 0, 1),
                                                   indices=torch.tensor([0, 1]))
    assert torch.equal(y[0], y_ref) and torch.equal(x[0], x_ref) and torch.equal(y[1], sig_t)
    for other in (shown([2, 3]), shown([0, 1], salt=2)):
        _rows_unrelated(y[0], other[0][0])
        _rows_unrelated(x[0], other[1][0])
    model.iteration.fill_(1)
    _rows_unrelated(y[0], shown([0, 1])[0][0])


def test_rand_per_sample_defaults_step_and_stream_zero_and_moves_to_device():
    """rand_per_sample's address defaults to step 0, stream 0 (the same draws as passing them; other steps / streams
    differ), and the draws are returned on ``device`` (meta here: shapes only)."""
    from genrl.noise import rand_per_sample

    base = rand_per_sample((3,), 11, [0, 4])
    assert torch.equal(base, rand_per_sample((3,), 11, [0, 4], step=0, stream=0))
    assert not torch.equal(base, rand_per_sample((3,), 11, [0, 4], step=1))
    assert not torch.equal(base, rand_per_sample((3,), 11, [0, 4], stream=1))
    assert bool(((base >= 0) & (base < 1)).all())
    for backend in ("generator", "philox"):
        out = rand_per_sample((3,), 11, [0, 4], device="meta", backend=backend)
        assert out.device.type == "meta" and out.shape == (2, 3)


def _splitmix64_reference(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_mix_seed_is_splitmix64_folded_to_63_bits_and_sample_generator_defaults():
    """mix_seed equals an independent SplitMix64 fold of its parts masked to the low 63 bits (odd values too);
    sample_generator's step and stream default to 0 and seed a CPU generator with mix_seed of the address."""
    results = []
    for parts in [(0,), (1, 2), (7, 3, 0, 0), (2**40 + 5, 11, 4, 1), (-1, 0, 9, 2)]:
        h = 0
        for p in parts:
            h = _splitmix64_reference(h ^ (p & ((1 << 64) - 1)))
        assert mix_seed(*parts) == h & ((1 << 63) - 1)
        results.append(mix_seed(*parts))
    assert any(r % 2 == 1 for r in results)  # the lowest bit is kept
    for seed, index in [(0, 0), (5, 3)]:
        g = sample_generator(seed, index)
        assert g.device.type == "cpu" and g.initial_seed() == mix_seed(seed, index, 0, 0)
