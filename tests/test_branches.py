"""Branched rollouts of a causal student under step plans (genrl/rollout/branches.py; TempAct's executor, spec
section 4 invariants 1-5): shared prefixes, independent forks, switch locality, and a replay whose velocities and
re-noise log-probs equal the sampled ones bit for bit, on a tiny float64 causal DiT."""

from __future__ import annotations

import pytest
import torch

from genrl.flow.renoise import renoise_log_prob
from genrl.models.causal import CausalConfig
from genrl.models.plans import Plan, Step
from genrl.rollout.autoregressive import ChunkSchedule, ar_rollout
from genrl.rollout.branches import branch_indices, branch_rollout, replay_forks
from genrl.testing.causal import tiny_causal_generator

FRAME = (4, 4, 4)
LAYOUTS = {
    "plain": CausalConfig(2),
    "window_sink": CausalConfig(2, local_window=4, sink_frames=2),
}


def _schedule(causal, context_noise=0.0):
    return ChunkSchedule(causal=causal, timesteps=[1000, 750, 500, 250], shift=1.0, warp=True,
                         kernel="consistency", context_noise=context_noise)


def _plan(texts, spans, num_chunks=4):
    return Plan("global", tuple(Step(t, a, b) for t, (a, b) in zip(texts, spans)))


def _plans():
    return [_plan(["right", "up"], [(0, 2), (2, 4)]), _plan(["left", "down"], [(0, 1), (1, 4)]),
            _plan(["still"], [(0, 4)])]


def _rows(n):
    return torch.arange(10, 10 + n)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", ["swap", "recache"])
def test_branches_share_the_prefix_and_differ_after_the_fork(layout, mode):
    gen, sched, g = tiny_causal_generator(), _schedule(LAYOUTS[layout]), 3
    ro = branch_rollout(gen, _plans(), FRAME, sched, fork_chunk=2, num_branches=g, seed=5, row_indices=_rows(3),
                        switch_mode=mode)
    lat = ro.latents.reshape(3, g, *ro.latents.shape[1:])
    assert lat.shape[2] == 8
    for r in range(3):
        for b in range(g):
            assert torch.equal(lat[r, b, :4], ro.prefix[r])  # the prefix is shared bit for bit
        assert not torch.allclose(lat[r, 0, 4:], lat[r, 1, 4:])  # branches draw their own noise
    assert not torch.allclose(ro.prefix[0], ro.prefix[1])


def test_no_prefix_single_branch_equals_a_straight_rollout_with_the_plans_switches():
    gen, sched = tiny_causal_generator(), _schedule(LAYOUTS["window_sink"])
    plans = _plans()[:2]
    ro = branch_rollout(gen, plans, FRAME, sched, fork_chunk=0, num_branches=1, seed=5, row_indices=_rows(2),
                        branch_seed=99, switch_mode="recache")
    enc = gen.encode_prompts
    switches = {1: (enc(["right", "down"]), "recache"), 2: (enc(["up", "down"]), "recache")}
    straight = ar_rollout(gen, enc(["right", "left"]), 4, FRAME, sched, seed=99,
                          indices=branch_indices(_rows(2), 1)[0], prompt_switches=switches)
    assert torch.equal(ro.latents, straight.latents)


def test_switch_locality_changes_only_chunks_after_the_boundary():
    gen, sched = tiny_causal_generator(), _schedule(LAYOUTS["plain"])
    a = branch_rollout(gen, [_plan(["right", "up"], [(0, 2), (2, 4)])], FRAME, sched, 1, 1, 5, _rows(1))
    b = branch_rollout(gen, [_plan(["right", "down"], [(0, 2), (2, 4)])], FRAME, sched, 1, 1, 5, _rows(1))
    assert torch.equal(a.latents[:, :4], b.latents[:, :4])
    assert not torch.allclose(a.latents[:, 4:6], b.latents[:, 4:6])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout,mode,ctx", [("plain", "swap", 0.0), ("window_sink", "recache", 0.0),
                                             ("window_sink", "recache", 0.1)])
def test_replay_reproduces_the_sampled_velocities_and_log_probs_exactly(dtype, layout, mode, ctx):
    gen, sched = tiny_causal_generator(dtype=dtype), _schedule(LAYOUTS[layout], ctx)
    plans = _plans()
    ro = branch_rollout(gen, plans, FRAME, sched, fork_chunk=1, num_branches=2, seed=3, row_indices=_rows(3),
                        train_chunks=2, switch_mode=mode)
    states = replay_forks(gen, plans, ro, FRAME, sched, switch_mode=mode)
    for g, traces in enumerate(ro.traces):
        assert [t.chunk for t in traces] == [1, 2]
        for c, tr in enumerate(traces):
            st = states[g][c]
            for j in range(tr.num_transitions):
                s = torch.full((3,), float(tr.sigmas[j]), dtype=dtype)
                v = gen.velocity_chunk(tr.x[j], s, st.cond, st.cache).to(tr.v.dtype)
                assert torch.equal(v, tr.v[j]), (g, c, j)
                lp_new = renoise_log_prob(tr.x[j + 1], tr.x[j], v, float(tr.sigmas[j]), float(tr.sigmas[j + 1]))
                lp_old = renoise_log_prob(tr.x[j + 1], tr.x[j], tr.v[j], float(tr.sigmas[j]),
                                          float(tr.sigmas[j + 1]))
                assert torch.equal(lp_new - lp_old, torch.zeros_like(lp_new))


def test_replay_under_changed_weights_changes_the_velocity():
    gen, sched = tiny_causal_generator(), _schedule(LAYOUTS["plain"])
    plans = _plans()
    ro = branch_rollout(gen, plans, FRAME, sched, 2, 2, 3, _rows(3))
    with torch.no_grad():
        for p in gen.transformer.parameters():
            p.add_(0.01)
    st = replay_forks(gen, plans, ro, FRAME, sched)[0][0]
    tr = ro.traces[0][0]
    v = gen.velocity_chunk(tr.x[0], torch.full((3,), float(tr.sigmas[0]), dtype=torch.float64), st.cond, st.cache)
    assert not torch.allclose(v, tr.v[0])


def test_branch_rollout_is_reproducible_and_bad_arguments_are_refused():
    gen, sched = tiny_causal_generator(), _schedule(LAYOUTS["plain"])
    a = branch_rollout(gen, _plans(), FRAME, sched, 2, 2, 3, _rows(3))
    b = branch_rollout(gen, _plans(), FRAME, sched, 2, 2, 3, _rows(3))
    assert torch.equal(a.latents, b.latents)
    with pytest.raises(ValueError, match="fork_chunk 4"):
        branch_rollout(gen, _plans(), FRAME, sched, 4, 2, 3, _rows(3))
    with pytest.raises(ValueError, match="train_chunks 3"):
        branch_rollout(gen, _plans(), FRAME, sched, 2, 2, 3, _rows(3), train_chunks=3)
    with pytest.raises(ValueError, match="covers 2 chunks"):
        branch_rollout(gen, [_plans()[0], _plan(["a"], [(0, 2)])], FRAME, sched, 1, 2, 3, _rows(2))
    with pytest.raises(ValueError, match="num_branches"):
        branch_rollout(gen, _plans(), FRAME, sched, 1, 0, 3, _rows(3))


def test_forks_after_window_eviction_equal_a_straight_rollout_in_any_order():
    """Spec invariant 2 where TempAct's shared-buffer reuse would fail: with a rolling window + sink the prefix has
    evicted frames; each fork continued with the straight rollout's noise equals it, whichever fork runs first."""
    from genrl.rollout.autoregressive import fork

    gen, sched = tiny_causal_generator(rope=8), _schedule(LAYOUTS["window_sink"])
    cond = gen.encode_prompts(["right", "up"])
    straight = ar_rollout(gen, cond, 6, FRAME, sched, seed=4)
    prefix = ar_rollout(gen, cond, 3, FRAME, sched, seed=4)
    assert prefix.state.cache.frames.tolist() == [0, 4]  # the sink kept, chunk 1 already evicted
    a, b = fork(prefix.state, 2)
    late = ar_rollout(gen, None, 3, FRAME, sched, state=b).latents
    early = ar_rollout(gen, None, 3, FRAME, sched, state=a).latents
    assert torch.equal(early, late)
    assert torch.equal(torch.cat([prefix.latents, early], 1), straight.latents)


def test_recache_with_an_unchanged_prompt_reproduces_the_cache_exactly():
    """Spec invariant 4: without a window, re-caching under the same prompt (context noise 0) rebuilds the same K / V
    bit for bit, so a batch-wide switch leaves the rows whose step did not change as they were."""
    from genrl.rollout.autoregressive import switch_prompt

    gen, sched = tiny_causal_generator(rope=8), _schedule(LAYOUTS["plain"])
    cond = gen.encode_prompts(["right", "up"])
    state = ar_rollout(gen, cond, 3, FRAME, sched, seed=1).state
    keys = [k.clone() for k in state.cache.keys]
    values = [v.clone() for v in state.cache.values]
    switch_prompt(gen, state, gen.encode_prompts(["right", "up"]), "recache")
    assert all(torch.equal(k, k2) for k, k2 in zip(keys, state.cache.keys))
    assert all(torch.equal(v, v2) for v, v2 in zip(values, state.cache.values))
