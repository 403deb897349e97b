"""The shared rollout sampler: bitwise regeneration, ratio exactly 1, step masks, ODE front, errors."""

from __future__ import annotations

import pytest
import torch

from genrl.models import DiTGenerator, TextEncoder, VideoDiT
from genrl.rollout import RolloutConfig, rollout, sample_ode, sde_mask, transition_log_prob

SHAPE = (4, 3, 8, 8)
PROMPTS = ["a red circle moving left slowly", "a blue square", "a green triangle moving up quickly",
           "a red circle", "a cyan square staying still", "a yellow circle moving down slowly"]


@pytest.fixture(scope="module")
def gen(tiny_text_encoder) -> DiTGenerator:
    torch.manual_seed(0)
    dit = VideoDiT(hidden_size=32, num_layers=2, num_attention_heads=2, text_dim=16)
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0.0, 0.1)
    return DiTGenerator(dit.eval(), TextEncoder.from_pretrained(tiny_text_encoder))


@pytest.mark.parametrize("kernel,cfg", [("flow_grpo", 1.0), ("dance_grpo", 3.0)])
def test_regenerating_one_sample_alone_is_bitwise(gen, kernel, cfg):
    config = RolloutConfig(num_steps=5, kernel=kernel, noise_level=0.7 if kernel == "flow_grpo" else 0.3,
                           cfg_scale=cfg, micro_batch_size=4)
    indices = [10, 11, 12, 13, 14, 15]
    full = rollout(gen, PROMPTS, SHAPE, seed=7, indices=indices, config=config)
    alone = rollout(gen, PROMPTS[4:5], SHAPE, seed=7, indices=[14], config=config)
    assert torch.equal(full.final[4], alone.final[0])
    assert torch.equal(full.latents[4], alone.latents[0])
    assert torch.equal(full.log_probs[4], alone.log_probs[0])
    # a different seed or index gives a different sample
    other = rollout(gen, PROMPTS[4:5], SHAPE, seed=8, indices=[14], config=config)
    assert not torch.allclose(other.final[0], alone.final[0])


def test_recomputed_log_prob_gives_ratio_exactly_one(gen):
    config = RolloutConfig(num_steps=4, kernel="flow_grpo", cfg_scale=2.0, micro_batch_size=4)
    traj = rollout(gen, PROMPTS, SHAPE, seed=3, config=config)
    assert traj.sde_steps == [0, 1, 2]  # the last step is never stochastic by default
    for k in traj.sde_steps:
        log_prob, _, _ = transition_log_prob(gen, traj, k)
        assert torch.equal(log_prob.detach(), traj.log_probs[:, k])
        assert torch.equal(torch.exp(log_prob.detach() - traj.log_probs[:, k]), torch.ones(len(PROMPTS)))
    # on a sub-batch too (mini-batching the loss)
    sub = traj.select([1, 4])
    assert torch.equal(transition_log_prob(gen, sub, 1)[0].detach(), traj.log_probs[[1, 4], 1])
    # the log-probs are real Gaussian densities: finite and not the ODE's zeros
    assert torch.isfinite(traj.log_probs[:, :3]).all() and (traj.log_probs[:, :3] != 0).all()
    assert (traj.log_probs[:, 3] == 0).all()


def test_ode_kernel_is_deterministic_and_matches_sample_ode(gen):
    config = RolloutConfig(num_steps=3, kernel="ode", cfg_scale=1.5, micro_batch_size=32)
    traj = rollout(gen, PROMPTS, SHAPE, seed=1, config=config)
    assert not traj.sde_mask.any() and (traj.noises == 0).all()
    ode = sample_ode(gen, PROMPTS, SHAPE, seed=1, num_steps=3, cfg_scale=1.5)
    assert torch.equal(ode, traj.final)
    # zero noise level: the SDE kernels walk the ODE path exactly
    zero = rollout(gen, PROMPTS, SHAPE, seed=1, config=RolloutConfig(num_steps=3, kernel="dance_grpo",
                   noise_level=0.0, cfg_scale=1.5, micro_batch_size=32, skip_last_step=False), record=False)
    assert torch.allclose(zero.final, ode, atol=1e-6)


def test_sde_masks():
    assert sde_mask(RolloutConfig(num_steps=5), 0).tolist() == [True, True, True, True, False]
    assert sde_mask(RolloutConfig(num_steps=5, sde_steps="prefix", num_sde_steps=2), 0).tolist() == [
        True, True, False, False, False]
    starts = set()
    for rid in range(30):
        m = sde_mask(RolloutConfig(num_steps=10, sde_steps="window", num_sde_steps=2, window_start=1,
                                   window_end=6), seed=0, rollout_id=rid)
        on = torch.nonzero(m).flatten().tolist()
        assert len(on) == 2 and on[1] == on[0] + 1 and 1 <= on[0] <= 4
        starts.add(on[0])
        assert torch.equal(m, sde_mask(RolloutConfig(num_steps=10, sde_steps="window", num_sde_steps=2,
                                                     window_start=1, window_end=6), seed=0, rollout_id=rid))
    assert len(starts) > 1  # the window moves between rollouts


def test_bad_inputs(gen):
    with pytest.raises(ValueError, match="unknown kernel"):
        RolloutConfig(kernel="euler_maruyama")
    with pytest.raises(ValueError, match="num_steps"):
        RolloutConfig(num_steps=0)
    with pytest.raises(ValueError, match="indices"):
        rollout(gen, PROMPTS, SHAPE, seed=0, indices=[1, 2])
    traj = rollout(gen, PROMPTS[:2], SHAPE, seed=0, config=RolloutConfig(num_steps=3))
    with pytest.raises(ValueError, match="ODE step"):
        transition_log_prob(gen, traj, 2)


def test_sde_mask_ode_kernel_and_default_rollout_id():
    """An ODE kernel has no stochastic step whatever sde_steps says; rollout_id defaults to 0."""
    assert not sde_mask(RolloutConfig(num_steps=5, kernel="ode"), 0).any()
    assert not sde_mask(RolloutConfig(num_steps=5, kernel="ode", sde_steps="window", num_sde_steps=2), 0).any()
    cfg = RolloutConfig(num_steps=10, sde_steps="window", num_sde_steps=2)
    masks = {seed: sde_mask(cfg, seed) for seed in range(6)}
    assert all(torch.equal(m, sde_mask(cfg, s, 0)) for s, m in masks.items())
    assert any(not torch.equal(m, sde_mask(cfg, s, 1)) for s, m in masks.items())  # the default is 0, not 1


def test_sde_window_draw_address_is_pinned_and_a_tight_window_fits():
    """The window start is U{window_start..end - n} drawn from mix_seed(seed, rollout_id, 0, 99) (pinned: a run's
    windows stay reproducible across versions); a window exactly as long as its range is accepted."""
    from genrl.noise import mix_seed

    cfg = RolloutConfig(num_steps=12, sde_steps="window", num_sde_steps=2, window_start=1, window_end=11)
    for seed, rid in [(0, 0), (3, 1), (7, 5), (11, 2)]:
        g = torch.Generator().manual_seed(mix_seed(seed, rid, 0, 99))
        k = int(torch.randint(1, 10, (1,), generator=g))
        assert torch.nonzero(sde_mask(cfg, seed, rid)).flatten().tolist() == [k, k + 1]
    tight = RolloutConfig(num_steps=6, sde_steps="window", num_sde_steps=2, window_start=2, window_end=4)
    assert sde_mask(tight, 0).tolist() == [False, False, True, True, False, False]
