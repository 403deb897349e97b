"""SDE step masks that depend on the rollout / iteration: MixGRPO's progressive window, random SDE steps, and the
rollouts they drive (log-probs only on mask steps, ODE parity, the bitwise ODE prefix before a window)."""

from __future__ import annotations

import pytest
import torch

from genrl.noise import mix_seed
from genrl.rollout import RolloutConfig, rollout, sample_ode, sde_mask, transition_log_prob

SHAPE = (4, 3, 8, 8)
PROMPTS = ["a red circle moving left slowly", "a blue square", "a green triangle moving up quickly"]


def on(config: RolloutConfig, rollout_id: int, seed: int = 0) -> list[int]:
    return torch.nonzero(sde_mask(config, seed, rollout_id)).flatten().tolist()


# ------------------------------------------------------------------------------------------------- progressive window
def test_progressive_window_is_mixgrpo_schedule_without_the_empty_window():
    """T = 25, W = 4, 25 iterations per position, stride 1, skip_last_step: window_end defaults to 24, so the starts
    are 0..20 (21 positions, every window 4 steps) and the schedule wraps after 21 * 25 = 525 iterations."""
    cfg = RolloutConfig(num_steps=25, sde_steps="progressive", num_sde_steps=4, window_iterations=25, window_stride=1)
    assert cfg.sde_range() == (0, 24)
    expected = {0: [0, 1, 2, 3], 24: [0, 1, 2, 3], 25: [1, 2, 3, 4], 49: [1, 2, 3, 4], 50: [2, 3, 4, 5],
                499: [19, 20, 21, 22], 500: [20, 21, 22, 23], 524: [20, 21, 22, 23],
                525: [0, 1, 2, 3], 550: [1, 2, 3, 4], 1050: [0, 1, 2, 3]}
    for k, steps in expected.items():
        assert on(cfg, k) == steps, k
    starts = set()
    for k in range(0, 1100):
        steps = on(cfg, k)
        assert len(steps) == 4 and steps == list(range(steps[0], steps[0] + 4)), (k, steps)
        assert steps[-1] <= 23  # the last step (24) is never stochastic
        starts.add(steps[0])
    assert starts == set(range(21))


def test_progressive_window_start_offset_and_stride_two():
    """window_start 2, T 12 (window_end defaults to 11), W 3: starts 2..8, P = 7; stride 2 every 5 iterations gives
    s = 2 + (2 * (k // 5)) mod 7 = 2, 4, 6, 8, 3, 5, 7, 2, ... (the remainder carries over the wrap)."""
    cfg = RolloutConfig(num_steps=12, sde_steps="progressive", num_sde_steps=3, window_start=2, window_iterations=5,
                        window_stride=2)
    starts = [2, 4, 6, 8, 3, 5, 7, 2, 4]
    for block, s in enumerate(starts):
        for k in (5 * block, 5 * block + 4):
            assert on(cfg, k) == [s, s + 1, s + 2], (k, on(cfg, k))
    for k in range(300):
        steps = on(cfg, k)
        assert len(steps) == 3 and 2 <= steps[0] and steps[-1] <= 10


def test_progressive_window_ignores_the_seed_and_reaches_the_last_step_without_skip():
    cfg = RolloutConfig(num_steps=25, sde_steps="progressive", num_sde_steps=4)
    for k in (0, 30, 333):
        assert all(torch.equal(sde_mask(cfg, 0, k), sde_mask(cfg, seed, k)) for seed in (1, 7, 12345))
    full = RolloutConfig(num_steps=6, sde_steps="progressive", num_sde_steps=2, window_iterations=3,
                         skip_last_step=False)
    assert full.sde_range() == (0, 6)  # no skip: the default range is every step, starts 0..4
    assert [on(full, k) for k in (0, 3, 6, 9, 12, 14, 15)] == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [4, 5],
                                                               [0, 1]]
    one = RolloutConfig(num_steps=4, sde_steps="progressive", num_sde_steps=3, window_stride=5)  # one position
    assert [on(one, k) for k in (0, 25, 999)] == [[0, 1, 2]] * 3


def test_window_mode_keeps_its_historical_default_end():
    """"window" still defaults window_end to num_steps, so a window drawn at the end loses the last step (pinned)."""
    cfg = RolloutConfig(num_steps=4, sde_steps="window", num_sde_steps=2)
    seen = set()
    for rid in range(40):
        g = torch.Generator().manual_seed(mix_seed(0, rid, 0, 99))
        k = int(torch.randint(0, 3, (1,), generator=g))
        expected = [s for s in (k, k + 1) if s != 3]
        assert on(cfg, rid) == expected
        seen.add(k)
    assert seen == {0, 1, 2}  # including the start 2 whose window is cut to [2]


# ------------------------------------------------------------------------------------------------------ random steps
def test_random_steps_from_candidates():
    cfg = RolloutConfig(num_steps=10, sde_steps="random_steps", num_sde_steps=2, sde_candidates=[7, 1, 4, 3])
    assert cfg.sde_candidates == [1, 3, 4, 7]
    masks = {}
    for rid in range(200):
        steps = on(cfg, rid, seed=5)
        assert len(steps) == 2 and set(steps) <= {1, 3, 4, 7}
        torch.manual_seed(rid)  # the global RNG (which differs across ranks) plays no part
        assert on(cfg, rid, seed=5) == steps
        masks[rid] = tuple(steps)
    assert len(set(masks.values())) > 1  # the steps are redrawn per rollout
    assert {s for m in masks.values() for s in m} == {1, 3, 4, 7}
    # pinned address: a permutation of the sorted candidates drawn from mix_seed(seed, rollout_id, 0, 98)
    for seed, rid in [(5, 0), (5, 3), (2, 11)]:
        g = torch.Generator().manual_seed(mix_seed(seed, rid, 0, 98))
        pick = torch.randperm(4, generator=g)[:2].tolist()
        assert on(cfg, rid, seed=seed) == sorted([1, 3, 4, 7][i] for i in pick)
    assert any(on(cfg, 0, seed=s) != on(cfg, 0, seed=5) for s in range(6))  # the seed enters the draw too


def test_random_steps_default_candidates_are_the_range():
    cfg = RolloutConfig(num_steps=8, sde_steps="random_steps", num_sde_steps=3, window_start=2)
    assert cfg.sde_range() == (2, 7)
    seen = set()
    for rid in range(150):
        steps = on(cfg, rid)
        assert len(steps) == 3 and set(steps) <= {2, 3, 4, 5, 6}
        seen |= set(steps)
    assert seen == {2, 3, 4, 5, 6}
    last = RolloutConfig(num_steps=4, sde_steps="random_steps", num_sde_steps=1, sde_candidates=[3],
                         skip_last_step=False)
    assert on(last, 0) == [3]


# ------------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,match", [
    ({"sde_steps": "sliding"}, "unknown sde_steps 'sliding'"),
    ({"sde_steps": "progressive", "window_iterations": 0}, "window_iterations must be an integer >= 1, got 0"),
    ({"sde_steps": "progressive", "window_stride": -1}, "window_stride must be an integer >= 1, got -1"),
    ({"sde_steps": "progressive", "num_steps": 6, "window_stride": 4}, r"window_stride=4 .* \[1, 3\]"),
    ({"sde_steps": "progressive", "window_start": -1}, "window_start must be an integer >= 0, got -1"),
    ({"sde_steps": "progressive", "num_steps": 6, "window_end": 7}, "window_end=7 is past num_steps=6"),
    ({"sde_steps": "progressive", "num_steps": 6, "window_end": 6}, r"window_end=6 includes the last step 5.*<= 5"),
    ({"sde_steps": "random_steps", "num_steps": 6, "window_end": 6}, "window_end=6 includes the last step 5"),
    ({"sde_steps": "progressive", "num_steps": 6, "num_sde_steps": 3, "window_start": 3},
     r"num_sde_steps=3 steps do not fit in \[window_start=3, window_end=5\)"),
    ({"sde_steps": "random_steps", "num_steps": 6, "num_sde_steps": 3, "window_start": 3},
     r"num_sde_steps=3 steps do not fit"),
    ({"sde_steps": "window", "sde_candidates": [1, 2]}, r"sde_candidates=\[1, 2\] is only used by"),
    ({"sde_steps": "random_steps", "num_steps": 10, "sde_candidates": [1, 12]}, r"step 12, outside \[0, 9\]"),
    ({"sde_steps": "random_steps", "num_steps": 10, "sde_candidates": [-1, 2]}, r"step -1, outside \[0, 9\]"),
    ({"sde_steps": "random_steps", "num_steps": 10, "sde_candidates": [2, 9]}, "the last step 9.*skip_last_step"),
    ({"sde_steps": "random_steps", "sde_candidates": [1, 1, 2]}, r"repeats step\(s\) \[1\]"),
    ({"sde_steps": "random_steps", "num_sde_steps": 2, "sde_candidates": [4]}, "fewer than num_sde_steps=2"),
    ({"sde_steps": "random_steps", "sde_candidates": [1, 1.5]}, "holds 1.5, not a step index"),
])
def test_bad_values_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kwargs)


def test_edge_values_are_accepted():
    RolloutConfig(sde_steps="progressive", num_steps=6, window_end=6, skip_last_step=False)
    RolloutConfig(sde_steps="random_steps", num_steps=10, sde_candidates=[2, 9], skip_last_step=False)
    RolloutConfig(sde_steps="progressive", num_steps=6, window_stride=3)  # P = 4: stride 3 is the largest
    RolloutConfig(sde_steps="window", num_steps=6, window_end=6)  # "window" is unchanged: no new range checks
    cfg = RolloutConfig(sde_steps="progressive", num_steps=6)
    with pytest.raises(ValueError, match="rollout_id .* >= 0, got -1"):
        sde_mask(cfg, 0, -1)


# ---------------------------------------------------------------------------------------------------------- rollouts
@pytest.fixture(scope="module")
def gen(tiny_dit_generator):
    return tiny_dit_generator


MODES = {
    "progressive": dict(sde_steps="progressive", num_sde_steps=2, window_iterations=2),
    "random_steps": dict(sde_steps="random_steps", num_sde_steps=2, sde_candidates=[0, 2, 3, 4]),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_rollout_log_probs_exactly_on_the_mask(gen, mode):
    cfg = RolloutConfig(num_steps=6, kernel="flow_grpo", micro_batch_size=4, **MODES[mode])
    masks = []
    for rid in (3, 7):
        traj = rollout(gen, PROMPTS, SHAPE, seed=4, config=cfg, rollout_id=rid)
        mask = sde_mask(cfg, 4, rid)
        masks.append(mask)
        assert torch.equal(traj.sde_mask, mask) and traj.sde_steps == torch.nonzero(mask).flatten().tolist()
        assert len(traj.sde_steps) == 2
        assert (traj.log_probs[:, mask] != 0).all() and torch.isfinite(traj.log_probs[:, mask]).all()
        assert (traj.log_probs[:, ~mask] == 0).all()
        assert (traj.noises[:, ~mask] == 0).all() and (traj.noises[:, mask] != 0).any()
        k = traj.sde_steps[0]
        assert torch.equal(transition_log_prob(gen, traj, k)[0].detach(), traj.log_probs[:, k])  # ratio exactly 1
    assert not torch.equal(masks[0], masks[1])  # progressive: starts 1 and 3; random: two different draws


@pytest.mark.parametrize("mode", list(MODES))
def test_ode_kernel_with_a_window_mode_is_the_ode_sampler(gen, mode):
    cfg = RolloutConfig(num_steps=6, kernel="ode", micro_batch_size=32, **MODES[mode])
    traj = rollout(gen, PROMPTS, SHAPE, seed=2, config=cfg, rollout_id=5)
    assert not traj.sde_mask.any() and (traj.log_probs == 0).all()
    assert torch.equal(traj.final, sample_ode(gen, PROMPTS, SHAPE, seed=2, num_steps=6, micro_batch_size=32))


def test_progressive_steps_before_the_window_are_the_ode_path(gen):
    """Iteration 6 with 2 iterations per position: window [3, 5). The states entering steps 0..3 are the pure ODE
    rollout's bit for bit; the window's noise then moves the sample off it."""
    cfg = RolloutConfig(num_steps=6, kernel="flow_grpo", micro_batch_size=4, **MODES["progressive"])
    traj = rollout(gen, PROMPTS, SHAPE, seed=9, config=cfg, rollout_id=6)
    assert traj.sde_steps == [3, 4]
    ode = rollout(gen, PROMPTS, SHAPE, seed=9, config=RolloutConfig(num_steps=6, kernel="ode", micro_batch_size=4))
    assert torch.equal(traj.latents[:, :4], ode.latents[:, :4])
    assert not torch.allclose(traj.latents[:, 4], ode.latents[:, 4])
    assert not torch.allclose(traj.final.cpu(), ode.final.cpu())


def test_tempflow_branch_group_members_share_the_prefix_and_differ_only_through_the_branch_step(gen):
    """initial_noise: group with a one-step window (TempFlow's single branch step): the members of a group (same
    prompt) enter the branch step in the same state bit for bit, their samples differ from the next state on only by
    that step's per-sample noise, and another group (other key) starts elsewhere; without the keys it is an error."""
    cfg = RolloutConfig(num_steps=6, kernel="flow_grpo", micro_batch_size=4, sde_steps="window", num_sde_steps=1,
                        window_start=2, window_end=3, initial_noise="group")
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    group = torch.tensor([5, 5, 5, 9, 9, 9])
    traj = rollout(gen, prompts, SHAPE, seed=3, indices=torch.arange(10, 16), config=cfg, initial_keys=group)
    assert traj.sde_steps == [2]
    for rows in ((0, 1, 2), (3, 4, 5)):
        for k in range(3):  # steps 0..2: one state per group
            assert all(torch.equal(traj.latents[rows[0], k], traj.latents[r, k]) for r in rows[1:])
        assert not torch.allclose(traj.latents[rows[0], 3], traj.latents[rows[1], 3])  # the branch step's noise
        # the difference after the branch step is that step's noise, scaled by its std, exactly
        drift = traj.latents[rows[0], 3] - traj.latents[rows[1], 3]
        scale = drift.flatten().norm() / (traj.noises[rows[0], 2] - traj.noises[rows[1], 2]).flatten().norm()
        torch.testing.assert_close(drift, scale * (traj.noises[rows[0], 2] - traj.noises[rows[1], 2]))
    assert not torch.allclose(traj.latents[0, 0], traj.latents[3, 0])  # another group, another start
    # the per-sample default gives every member its own start
    own = rollout(gen, prompts, SHAPE, seed=3, indices=torch.arange(10, 16),
                  config=RolloutConfig(**{**vars(cfg), "initial_noise": "sample"}))
    assert not torch.equal(own.latents[0, 0], own.latents[1, 0])
    with pytest.raises(ValueError, match="initial_keys"):
        rollout(gen, prompts, SHAPE, seed=3, config=cfg)
    with pytest.raises(ValueError, match="initial_noise"):
        RolloutConfig(initial_noise="prompt")
