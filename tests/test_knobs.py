"""Configuration reaches computation: every documented scaling knob changes the computation exactly as documented.

Each test changes one knob and checks a closed form (a ratio, a difference, the selected positions), not merely that
the output moved. Knobs whose effect is already pinned exactly elsewhere are not repeated here (cfg_combine's
formula: tests/test_flow.py::test_cfg_combine; the golden shift: test_shift_golden_timesteps; noise level 0 is the
Euler step: tests/test_flow_grpo.py::test_zero_noise_sde_step_is_the_euler_step; TimestepSampler shift + range:
test_sampler_shift_then_range_map; reward scale / shift and zscore_sum: tests/test_reward_manager.py).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from stub_generator_util import StubGen

from genrl.flow import TimestepSampler, clipped_policy_loss, sde_step, shift_sigmas, sigma_schedule, step_mean_std
from genrl.flow.forward_rl import ForwardRLObjective, sample_mse, sample_timesteps
from genrl.flow.sde import step_log_prob
from genrl.flow.tree_advantages import fuse_rewards
from genrl.methods.common import ode_validation_config
from genrl.models.lora import DIT_LORA_TARGETS, LoraSpec
from genrl.rewards import RewardManager, RewardModel, per_reward_advantages, register_reward
from genrl.rollout import RolloutConfig, rollout, sde_mask, transition_log_prob
from genrl.rollout.sampler import encode_cfg, guided_velocity
from genrl.rollout.tree import TreeConfig, tree_rollout

F64 = torch.float64
SHAPE = (1, 2, 2, 2)  # per-sample latent [T, C, H, W]
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _guided_offset(prompts: list[str], null_prompt: str, w: float) -> torch.Tensor:
    """u + w (c - u) per prompt, the prompt-dependent part of the stub's guided velocity (float64 [B, 1, 1, 1, 1])."""
    c = torch.tensor([float(len(p)) for p in prompts], dtype=F64)
    u = float(len(null_prompt))
    return (u + w * (c - u)).reshape(-1, 1, 1, 1, 1)


# ---------------------------------------------------------------------------------------------- LoRA
def _tiny_dit():
    from genrl.models import VideoDiT

    torch.manual_seed(0)
    return VideoDiT(hidden_size=8, num_layers=1, num_attention_heads=1, text_dim=4, timestep_embed_dim=8,
                    mlp_ratio=1.0)


def _lora_delta(rank: int, alpha: float, a_small: torch.Tensor, b_small: torch.Tensor, x: torch.Tensor):
    """(LoRA output - base output) of blocks[0].attn.to_q with A, B = a_small, b_small zero-padded to ``rank``."""
    dit = _tiny_dit()
    LoraSpec(rank=rank, alpha=alpha).add_to(SimpleNamespace(transformer=dit))
    layer = dit.blocks[0].attn.to_q
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert lora_a.shape == (rank, 8) and lora_b.shape == (8, rank)  # the rank reaches peft
    with torch.no_grad():
        layer.base_layer.weight.copy_(torch.arange(64, dtype=torch.float32).reshape(8, 8) % 5 - 2)
        layer.base_layer.bias.copy_(torch.arange(8, dtype=torch.float32) - 3)
        lora_a.zero_()
        lora_b.zero_()
        lora_a[: a_small.shape[0]] = a_small
        lora_b[:, : b_small.shape[1]] = b_small
        return layer(x) - layer.base_layer(x)


def test_lora_alpha_and_rank_scale_the_update_by_alpha_over_rank():
    """LoraSpec alpha / rank: the adapter adds exactly (alpha / rank) B A x; doubling alpha doubles it, doubling the
    rank at fixed alpha (same B A) halves it."""
    # small integers: every product and sum is exact in float32, so the comparisons are bitwise
    a_small = (torch.arange(16, dtype=torch.float32).reshape(2, 8) % 3 - 1)
    b_small = (torch.arange(16, dtype=torch.float32).reshape(8, 2) % 4 - 1)
    x = (torch.arange(24, dtype=torch.float32).reshape(3, 8) % 5 - 2)
    ba_x = x @ a_small.T @ b_small.T
    assert bool((ba_x != 0).any())
    d_r2_a6 = _lora_delta(2, 6.0, a_small, b_small, x)
    d_r2_a12 = _lora_delta(2, 12.0, a_small, b_small, x)
    d_r4_a12 = _lora_delta(4, 12.0, a_small, b_small, x)
    assert torch.equal(d_r2_a6, 3.0 * ba_x)  # alpha / rank = 6 / 2
    assert torch.equal(d_r2_a12, 6.0 * ba_x)  # doubling alpha doubles the update
    assert torch.equal(d_r2_a12, 2.0 * d_r2_a6)
    assert torch.equal(d_r4_a12, 3.0 * ba_x)  # doubling the rank halves the scale
    assert torch.equal(d_r4_a12, 0.5 * d_r2_a12)


def _adapted(dit) -> set[str]:
    return {name for name, module in dit.named_modules() if hasattr(module, "lora_A")}


def test_lora_target_modules_are_exactly_the_adapted_layers():
    """LoraSpec target_modules: exactly the named layers get an adapter (None: the generator's lora_target_modules,
    else DIT_LORA_TARGETS)."""
    attn = ("blocks.0.attn", "blocks.0.cross_attn")
    dit = _tiny_dit()
    LoraSpec(rank=2, alpha=2.0, target_modules=["to_q", "to_v"]).add_to(SimpleNamespace(transformer=dit))
    assert _adapted(dit) == {f"{p}.{t}" for p in attn for t in ("to_q", "to_v")}
    dit = _tiny_dit()
    LoraSpec(rank=2, alpha=2.0).add_to(SimpleNamespace(transformer=dit))
    assert DIT_LORA_TARGETS == ["to_q", "to_k", "to_v", "to_out"]
    assert _adapted(dit) == {f"{p}.{t}" for p in attn for t in DIT_LORA_TARGETS}
    dit = _tiny_dit()
    LoraSpec(rank=2, alpha=2.0).add_to(SimpleNamespace(transformer=dit, lora_target_modules=["proj_out", "to_k"]))
    assert _adapted(dit) == {"proj_out", *(f"{p}.to_k" for p in attn)}


# ---------------------------------------------------------------------------------------------- CFG
PROMPTS = ["ab", "abcd", "abcdefg", "abc", "abcdef"]  # c = 2, 4, 7, 3, 6


def test_guided_velocity_is_uncond_plus_w_times_difference_in_micro_batches():
    """guided_velocity cfg_scale w: v = v_u + w (v_c - v_u), linear in w; w = 1 is the conditional velocity exactly
    (no unconditional call); micro_batch_size: every network call has exactly that many rows (x2 under CFG)."""
    gen = StubGen(a=0.5)
    x = _randn(5, *SHAPE, seed=1).float()
    sigma = torch.full((5,), 0.6)
    cond = gen.encode_prompts(PROMPTS)
    uncond = gen.encode_prompts(["x"] * 5)  # u = 1
    outs = {}
    for w in (0.0, 1.0, 2.5, 4.0):
        gen.calls.clear()
        v = guided_velocity(gen, x, sigma, cond, uncond, w, micro_batch_size=2)
        expected = 0.5 * x.double() + _guided_offset(PROMPTS, "x", w)
        torch.testing.assert_close(v.double(), expected, rtol=1e-6, atol=1e-6)  # float32 velocities
        rows = [n for n, _, _ in gen.calls]
        assert rows == ([2, 2, 2] if w == 1.0 else [4, 4, 4])  # ceil(5 / 2) calls, padded by repetition
        assert any("x" in p for _, _, p in gen.calls) == (w != 1.0)  # w = 1: the unconditional model never runs
        outs[w] = v
    cond_only = 0.5 * x + torch.tensor([2.0, 4.0, 7.0, 3.0, 6.0]).reshape(-1, 1, 1, 1, 1)
    assert torch.equal(outs[1.0], cond_only)
    c_minus_u = torch.tensor([1.0, 3.0, 6.0, 2.0, 5.0], dtype=F64).reshape(-1, 1, 1, 1, 1)
    torch.testing.assert_close((outs[4.0] - outs[2.5]).double(), 1.5 * c_minus_u.expand_as(x), rtol=0, atol=1e-5)


def test_rollout_passes_cfg_scale_and_null_prompt_through():
    """RolloutConfig cfg_scale / null_prompt: the sampled velocity is a x + u + w (c - u) with u the null prompt's;
    with a = 1 one Euler step from sigma 1 to 0 lands exactly on -(u + w (c - u)) whatever the noise."""
    finals = {}
    for w, null in ((1.0, "x"), (2.0, "x"), (3.5, "x"), (3.5, "xyz")):
        gen = StubGen(a=1.0)
        config = RolloutConfig(num_steps=1, kernel="ode", cfg_scale=w, null_prompt=null, micro_batch_size=2)
        traj = rollout(gen, PROMPTS, SHAPE, seed=3, config=config)
        expected = -_guided_offset(PROMPTS, null, w).expand(5, *SHAPE)
        torch.testing.assert_close(traj.final.double(), expected, rtol=1e-6, atol=1e-5)
        # w = 1 never encodes nor evaluates the null prompt; w != 1 encodes config.null_prompt once per prompt
        assert gen.encoded == ([PROMPTS] if w == 1.0 else [PROMPTS, [null] * 5])
        finals[(w, null)] = traj.final.double()
    torch.testing.assert_close(finals[(3.5, "x")] - finals[(2.0, "x")],
                               -1.5 * (_guided_offset(PROMPTS, "", 1.0) - 1.0).expand(5, *SHAPE), rtol=0, atol=1e-5)


def test_transition_log_prob_uses_the_rollouts_cfg_scale_unless_overridden():
    """transition_log_prob cfg_scale: default is the rollout's w, an explicit cfg_scale replaces it (closed form)."""
    gen = StubGen(a=0.5)
    config = RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.4, cfg_scale=3.0, null_prompt="x",
                           micro_batch_size=4)
    traj = rollout(gen, PROMPTS, SHAPE, seed=5, config=config)
    x = traj.latents[:, 1].double()
    lp, v, _ = transition_log_prob(gen, traj, 1)
    torch.testing.assert_close(v.double(), 0.5 * x + _guided_offset(PROMPTS, "x", 3.0), rtol=0, atol=1e-5)
    assert torch.equal(lp.detach(), traj.log_probs[:, 1])
    _, v2, _ = transition_log_prob(gen, traj, 1, cfg_scale=1.5)
    torch.testing.assert_close(v2.double(), 0.5 * x + _guided_offset(PROMPTS, "x", 1.5), rtol=0, atol=1e-5)


def test_validation_sampler_carries_the_rollouts_shift_cfg_and_micro_batch():
    """ode_validation_config: the ODE validation sampler keeps the rollout's shift, cfg_scale and micro_batch_size."""
    base = RolloutConfig(num_steps=7, shift=3.5, kernel="flow_grpo", cfg_scale=4.5, micro_batch_size=3)
    val = ode_validation_config(base, num_steps=20)
    assert (val.kernel, val.num_steps, val.shift, val.cfg_scale, val.micro_batch_size) == ("ode", 20, 3.5, 4.5, 3)
    assert ode_validation_config(base).num_steps == 7
    torch.testing.assert_close(val.sigmas(), sigma_schedule(20, shift=3.5), rtol=0, atol=0)


def test_validation_sampler_carries_the_null_prompt_and_a_same_length_schedule():
    """ode_validation_config: the rollout's null prompt (the CFG unconditional branch) and its explicit sigma schedule
    reach validation; a schedule of another step count cannot apply, so the shift's schedule is used then."""
    sched = [1.0, 0.6, 0.3, 0.0]
    base = RolloutConfig(num_steps=3, cfg_scale=3.0, null_prompt="blurry", schedule=sched)
    val = ode_validation_config(base)
    assert val.null_prompt == "blurry" and val.schedule == sched
    torch.testing.assert_close(val.sigmas(), torch.tensor(sched, dtype=F64), rtol=0, atol=0)
    longer = ode_validation_config(base, num_steps=5)
    assert longer.null_prompt == "blurry" and longer.schedule is None
    torch.testing.assert_close(longer.sigmas(), sigma_schedule(5, shift=1.0), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- shift
def _shifted(n: int, s: float) -> torch.Tensor:
    grid = torch.tensor([1.0 - k / n for k in range(n + 1)], dtype=F64)
    return s * grid / (1 + (s - 1) * grid)


def test_rollout_sigmas_and_steps_follow_the_config_shift():
    """RolloutConfig shift: sigma_k = s t_k / (1 + (s - 1) t_k), t_k = 1 - k / S; the network sees those sigmas and
    each Euler step moves by (sigma_{k+1} - sigma_k) v; shift 1 is the plain linspace; ``schedule`` replaces it."""
    for s in (1.0, 3.0, 0.4):
        gen = StubGen(a=1.0)
        config = RolloutConfig(num_steps=4, shift=s, kernel="ode", micro_batch_size=8)
        traj = rollout(gen, PROMPTS[:2], SHAPE, seed=1, config=config)
        torch.testing.assert_close(traj.sigmas, _shifted(4, s), rtol=0, atol=1e-15)
        for k, (_, sig, _) in enumerate(gen.calls):
            assert torch.equal(sig, traj.sigmas[k].float().expand(8))
        sig32 = traj.sigmas.float()
        for k in range(4):
            xk = traj.latents[:, k]
            v = xk + _guided_offset(PROMPTS[:2], "", 1.0).float()
            torch.testing.assert_close(traj.latents[:, k + 1], xk + (sig32[k + 1] - sig32[k]) * v, rtol=0, atol=1e-6)
    assert torch.equal(RolloutConfig(num_steps=4).sigmas(), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=F64))
    explicit = [0.9, 0.6, 0.2, 0.0]
    assert torch.equal(RolloutConfig(num_steps=3, shift=5.0, schedule=explicit).sigmas(),
                       torch.tensor(explicit, dtype=F64))
    tree = tree_rollout(StubGen(), PROMPTS[:1], SHAPE, seed=0, config=RolloutConfig(num_steps=3, shift=2.0,
                        kernel="dance_grpo", noise_level=0.3), tree=TreeConfig(split_steps=[0]))
    torch.testing.assert_close(tree.sigmas, _shifted(3, 2.0), rtol=0, atol=1e-15)


def test_sigma_schedule_range_knobs_space_the_grid():
    """sigma_schedule sigma_max / sigma_min: entry i < S is shift(sigma_max + i / S (sigma_min - sigma_max)), the
    last is exactly 0."""
    for s, hi, lo in ((1.0, 0.9, 0.1), (3.0, 1.0, 0.2), (0.5, 0.8, 0.0)):
        sched = sigma_schedule(5, shift=s, sigma_max=hi, sigma_min=lo)
        grid = torch.tensor([hi + i / 5 * (lo - hi) for i in range(5)], dtype=F64)
        torch.testing.assert_close(sched[:5], s * grid / (1 + (s - 1) * grid), rtol=0, atol=1e-15)
        assert float(sched[5]) == 0.0


# ---------------------------------------------------------------------------------------------- noise level
def test_sde_std_is_linear_and_drift_quadratic_in_the_noise_level():
    """noise_level (flow_grpo a, dance_grpo eta): std = g sqrt(|Delta|) with g = a sqrt(sigma / (1 - sigma)) or eta,
    so std is linear in the level and the mean's correction to the Euler step, Delta g^2 / (2 sigma) eps_hat, is
    quadratic in it."""
    x, v = _randn(3, 6, seed=2), _randn(3, 6, seed=3)
    s = torch.tensor([0.9, 0.5, 0.25], dtype=F64)
    sn = torch.tensor([0.8, 0.3, 0.05], dtype=F64)
    sc, d = s[:, None], (sn - s)[:, None]
    euler = x + d * v
    eps_hat = x + (1 - sc) * v
    for kind, unit_g in (("flow_grpo", (sc / (1 - sc)).sqrt()), ("dance_grpo", torch.ones_like(sc))):
        for level in (0.2, 0.7, 1.3):
            mean, std = step_mean_std(kind, x, v, s, sn, noise_level=level)
            g = level * unit_g
            torch.testing.assert_close(std, g * d.abs().sqrt(), rtol=1e-14, atol=0)
            torch.testing.assert_close(mean - euler, d * g * g / (2 * sc) * eps_hat, rtol=1e-10, atol=1e-14)
        m1, s1 = step_mean_std(kind, x, v, s, sn, noise_level=0.5)
        m2, s2 = step_mean_std(kind, x, v, s, sn, noise_level=1.5)
        torch.testing.assert_close(s2, 3.0 * s1, rtol=1e-14, atol=0)
        torch.testing.assert_close(m2 - euler, 9.0 * (m1 - euler), rtol=1e-10, atol=1e-14)


def test_rollout_passes_the_noise_level_to_every_stochastic_step():
    """RolloutConfig noise_level: each recorded SDE step has std = g sqrt(|Delta|) at the config's level, and the
    sample is mean + std * the recorded noise."""
    for kind, level in (("dance_grpo", 0.45), ("flow_grpo", 1.1)):
        config = RolloutConfig(num_steps=4, shift=2.0, kernel=kind, noise_level=level, micro_batch_size=4)
        traj = rollout(StubGen(a=0.5), PROMPTS[:3], SHAPE, seed=2, config=config, record_moments=True)
        sig = traj.sigmas.float().double()
        for k in range(4):
            if not bool(traj.sde_mask[k]):
                assert float(traj.stds[k]) == 0.0
                continue
            if kind == "dance_grpo":
                g = level
            else:  # at sigma = 1 the denominator is 1 - sigma_1
                g = level * math.sqrt(float(sig[k]) / (1 - float(sig[k] if sig[k] < 1 else traj.sigmas[1])))
            assert float(traj.stds[k]) == pytest.approx(g * math.sqrt(float(sig[k] - sig[k + 1])), rel=1e-6)
            torch.testing.assert_close(traj.latents[:, k + 1], traj.means[:, k] + traj.stds[k] * traj.noises[:, k],
                                       rtol=0, atol=1e-6)
        assert traj.sde_steps == [0, 1, 2]


def test_std_scale_multiplies_the_std_and_shifts_the_log_prob_by_minus_log_kappa():
    """sde_step std_scale kappa: sample - mean = kappa std noise, the returned std is kappa std, and (same noise) the
    log-prob is that of the scaled Gaussian: log_prob(kappa) = log_prob(1) - log kappa exactly."""
    x, v, noise = _randn(2, 5, seed=4), _randn(2, 5, seed=5), _randn(2, 5, seed=6)
    base = sde_step("dance_grpo", x, v, 0.7, 0.5, noise, noise_level=0.3)
    for kappa in (0.5, 4.0):
        out = sde_step("dance_grpo", x, v, 0.7, 0.5, noise, noise_level=0.3, std_scale=kappa)
        assert torch.equal(out.mean, base.mean)
        torch.testing.assert_close(out.std, kappa * base.std, rtol=1e-15, atol=0)
        torch.testing.assert_close(out.sample - out.mean, kappa * base.std * noise, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(out.log_prob, base.log_prob - math.log(kappa), rtol=0, atol=1e-13)
        lp, _, _ = step_log_prob("dance_grpo", x, v, 0.7, 0.5, out.sample, noise_level=0.3, std_scale=kappa)
        assert torch.equal(lp, out.log_prob)


def test_tree_split_noise_scale_scales_the_split_deviation():
    """TreeConfig split_noise_scale kappa: at a split the children deviate from the shared mean by exactly kappa times
    the kappa = 1 deviation; the stored log-prob is lower by log kappa, or under reference_split_log_prob it is the
    unscaled density, lower by (kappa^2 - 1) / 2 mean(noise^2)."""
    config = RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.5, micro_batch_size=4)

    def grow(**kw):
        return tree_rollout(StubGen(a=1.0), ["abc"], SHAPE, seed=4, config=config,
                            tree=TreeConfig(split_steps=[0], branch_factor=2, **kw))

    one, three, ref3 = grow(), grow(split_noise_scale=3.0), grow(split_noise_scale=3.0, reference_split_log_prob=True)
    root = one.latents[0][[0, 0]].double()
    sig = one.sigmas.float().double()
    mean, std = step_mean_std("dance_grpo", root, root + 3.0, float(sig[0]), float(sig[1]), noise_level=0.5)
    dev1 = one.latents[1].double() - mean
    torch.testing.assert_close(three.latents[1].double() - mean, 3.0 * dev1, rtol=0, atol=1e-5)
    torch.testing.assert_close(ref3.latents[1], three.latents[1], rtol=0, atol=1e-6)  # same draw, other density
    torch.testing.assert_close(three.log_probs[1].double(), one.log_probs[1].double() - math.log(3.0), rtol=0,
                               atol=1e-5)
    n2 = (dev1 / std).pow(2).reshape(2, -1).mean(dim=1)
    torch.testing.assert_close(ref3.log_probs[1].double(), one.log_probs[1].double() - 4.0 * n2, rtol=0, atol=1e-4)
    assert one.std_scales == [1.0, 1.0, 1.0] and three.std_scales == [3.0, 1.0, 1.0] and ref3.std_scales[0] == 1.0


# ---------------------------------------------------------------------------------------------- clip range
def _clip_closed_form(r: torch.Tensor, a: torch.Tensor, lo: float, hi: float, amax: float) -> torch.Tensor:
    a = a.clamp(-amax, amax)
    out = -a * r
    out = torch.where((a > 0) & (r > 1 + hi), -a * (1 + hi), out)
    return torch.where((a < 0) & (r < 1 - lo), -a * (1 - lo), out)


@pytest.mark.parametrize("eps", [0.1, 0.25])
def test_clip_range_bounds_the_ratio_on_both_sides(eps):
    """clipped_policy_loss clip_range eps (and clip_range_high, adv_clip_max): loss = -A r inside [1 - eps, 1 + eps],
    -A (1 + eps) above for A > 0, -A (1 - eps) below for A < 0; clipfrac counts the ratios outside."""
    r = torch.tensor([1 - 2 * eps, 1 - eps / 2, 1.0, 1 + eps / 2, 1 + 2 * eps], dtype=F64).repeat(2)
    adv = torch.tensor([1.5] * 5 + [-2.0] * 5, dtype=F64)
    lp = torch.log(r)
    old = torch.zeros(10, dtype=F64)
    loss, stats = clipped_policy_loss(lp, old, adv, clip_range=eps)
    torch.testing.assert_close(loss, _clip_closed_form(r, adv, eps, eps, 5.0), rtol=1e-14, atol=0)
    # the clipped entries by hand: A > 0 above the range, A < 0 below it
    assert float(loss[4]) == pytest.approx(-1.5 * (1 + eps), rel=1e-14)
    assert float(loss[5]) == pytest.approx(2.0 * (1 - eps), rel=1e-14)
    assert float(loss[0]) == pytest.approx(-1.5 * (1 - 2 * eps), rel=1e-14)  # unclipped side: -A r
    assert float(loss[9]) == pytest.approx(2.0 * (1 + 2 * eps), rel=1e-14)
    assert float(stats["clipfrac"]) == pytest.approx(0.4, abs=1e-15)  # r = 1 +- 2 eps, both signs
    assert float(stats["clipfrac_high"]) == pytest.approx(0.2, abs=1e-15)
    assert float(stats["clipfrac_low"]) == pytest.approx(0.2, abs=1e-15)
    # an asymmetric upper range and a smaller advantage clamp
    loss_h, stats_h = clipped_policy_loss(lp, old, adv, clip_range=eps, clip_range_high=3 * eps, adv_clip_max=1.0)
    torch.testing.assert_close(loss_h, _clip_closed_form(r, adv, eps, 3 * eps, 1.0), rtol=1e-14, atol=0)
    assert float(loss_h[4]) == pytest.approx(-1.0 * (1 + 2 * eps), rel=1e-14)  # r = 1 + 2 eps now inside
    assert float(stats_h["clipfrac_high"]) == 0.0 and float(stats_h["clipfrac_low"]) == pytest.approx(0.2)
    assert float(stats_h["adv_abs_mean"]) == 1.0


# ---------------------------------------------------------------------------------------------- KL weights
def _grpo_setup(kind: str, betas: tuple[float, ...]):
    from genrl.methods.grpo import GRPO

    config = RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.4, cfg_scale=2.0, null_prompt="x",
                           micro_batch_size=4)
    gen = StubGen(a=1.0)
    methods = []
    for beta in betas:
        m = GRPO(rollout=config, kl_beta=beta, kl_kind=kind, clip_range=0.02, clip_range_high=0.05, adv_clip_max=1.5)
        m.roles.trainable("generator", gen)
        if beta > 0:
            m.roles.reference_copy(gen)  # the reference keeps a = 1
        methods.append(m)
    traj = rollout(gen, PROMPTS, SHAPE, seed=9, config=config)
    with torch.no_grad():
        gen.transformer.a.fill_(0.95)  # the policy moves away from the reference and the rollout
    cond, uncond = encode_cfg(gen, traj.prompts, config)
    return gen, methods, traj, cond, uncond


@pytest.mark.parametrize("kind", ["velocity_mse", "gaussian"])
def test_grpo_kl_beta_adds_exactly_beta_times_the_kl(kind):
    """GRPO kl_beta: loss(beta) - loss(0) = beta KL, with KL the closed form of kl_kind (v - v_ref = (a - a_ref) x);
    clip_range / clip_range_high / adv_clip_max reach the clipped surrogate (ratios here: 1.03, 0.92, 1.07, 0.95,
    0.85, so each knob matters)."""
    gen, (m0, m1, m2), traj, cond, uncond = _grpo_setup(kind, (0.0, 0.1, 0.35))
    adv = torch.tensor([3.0, -0.5, 1.0, -2.0, 0.25])
    k = 1
    (loss0, st0), (loss1, st1), (loss2, st2) = (m.step_loss(traj, k, cond, uncond, adv) for m in (m0, m1, m2))
    loss0, loss1, loss2 = loss0.detach(), loss1.detach(), loss2.detach()
    assert "kl" not in st0
    # the surrogate: the method's clip knobs, not the defaults (they differ on this data)
    lp = transition_log_prob(gen, traj, k, cond, uncond)[0].detach()
    old = traj.log_probs[:, k]
    surrogate = clipped_policy_loss(lp, old, adv, clip_range=0.02, clip_range_high=0.05, adv_clip_max=1.5)[0].mean()
    torch.testing.assert_close(loss0, surrogate, rtol=1e-6, atol=1e-7)
    knobs = dict(clip_range=0.02, clip_range_high=0.05, adv_clip_max=1.5)
    for name in knobs:  # each knob matters on this data: dropping it alone changes the surrogate
        other = {key: value for key, value in knobs.items() if key != name}
        assert abs(float(clipped_policy_loss(lp, old, adv, **other)[0].mean() - surrogate)) > 1e-4, name
    # the KL by hand
    x = traj.latents[:, k].double()
    dv = -0.05 * x
    if kind == "velocity_mse":
        kl = dv.pow(2).reshape(5, -1).mean(dim=1).mean()
    else:
        sig = traj.sigmas.float().double()
        s, d, eta = sig[k], sig[k + 1] - sig[k], 0.4
        fac = d * (1 + eta**2 * (1 - s) / (2 * s))
        kl = ((fac * dv).pow(2) / (2 * eta**2 * d.abs())).reshape(5, -1).mean(dim=1).mean()
    assert float(st1["kl"]) == pytest.approx(float(kl), rel=1e-5)
    assert float(st2["kl"]) == pytest.approx(float(kl), rel=1e-5)
    assert float(loss1 - loss0) == pytest.approx(0.1 * float(kl), rel=1e-4)
    assert float(loss2 - loss0) == pytest.approx(0.35 * float(kl), rel=1e-4)


def _forward_rl_inputs(b: int = 4):
    shape = (b, 2, 3, 2, 2)
    v, v_old, v_ref, x0, eps = (_randn(*shape, seed=s) for s in (30, 31, 32, 33, 34))
    t = torch.tensor([0.2, 0.5, 0.7, 0.9], dtype=F64)[:b]
    x_t = (1 - t.reshape(-1, 1, 1, 1, 1)) * x0 + t.reshape(-1, 1, 1, 1, 1) * eps
    adv = torch.tensor([2.0, -7.0, 0.5, 9.0], dtype=F64)[:b]
    return v, v_old, v_ref, eps - x0, x_t, x0, t, adv


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_forward_rl_kl_beta_adds_exactly_beta_times_the_reference_mse(objective):
    """ForwardRLObjective kl_beta (NFT / AWM) and ema_kl_beta (AWM): loss(beta2) - loss(beta1) = (beta2 - beta1)
    mean_b sample_mse(v, v_ref) (resp. v_old)."""
    v, v_old, v_ref, u, x_t, x0, t, adv = _forward_rl_inputs()

    def loss(**kw):
        return ForwardRLObjective(objective, **kw).loss(v, v_old, v_ref, u, x_t, x0, t, adv)[0]

    kl_ref = float(sample_mse(v, v_ref).mean())
    kl_old = float(sample_mse(v, v_old).mean())
    assert kl_ref > 0.5 and kl_old > 0.5
    assert float(loss(kl_beta=0.3) - loss(kl_beta=0.1)) == pytest.approx(0.2 * kl_ref, rel=1e-12)
    assert float(loss(kl_beta=0.3) - loss()) == pytest.approx(0.3 * kl_ref, rel=1e-12)
    if objective == "awm":
        assert float(loss(ema_kl_beta=0.5) - loss()) == pytest.approx(0.5 * kl_old, rel=1e-12)
        both = float(loss(kl_beta=0.3, ema_kl_beta=0.5) - loss())
        assert both == pytest.approx(0.3 * kl_ref + 0.5 * kl_old, rel=1e-12)
    else:  # NFT has no anchor to v_old
        assert float(loss(ema_kl_beta=0.5)) == float(loss())


def test_forward_rl_multiplier_and_awm_advantage_clip():
    """ForwardRLObjective multiplier m: RAM's loss is mean_b sample_mse(v, v_ref + m A (u - v_old)) (kl_beta does not
    apply); awm_adv_clip C: at v_old = v (ratio 1) AWM's policy loss is -mean_b clip(A, -C, C) / C."""
    v, v_old, v_ref, u, x_t, x0, t, adv = _forward_rl_inputs()
    a = adv.reshape(-1, 1, 1, 1, 1)
    for m in (10.0, 100.0):
        got = ForwardRLObjective("ram", multiplier=m).loss(v, v_old, v_ref, u, x_t, x0, t, adv)[0]
        target = v_ref + m * a * (u - v_old)
        assert float(got) == pytest.approx(float(((v - target) ** 2).mean()), rel=1e-12)
        same = ForwardRLObjective("ram", multiplier=m, kl_beta=0.5).loss(v, v_old, v_ref, u, x_t, x0, t, adv)[0]
        assert float(same) == float(got)
    for c in (1.0, 5.0):
        obj = ForwardRLObjective("awm", awm_adv_clip=c, awm_weighting="uniform")
        got, stats = obj.loss(v, v.detach().clone(), None, u, x_t, x0, t, adv)
        expected = -float((adv.clamp(-c, c) / c).mean())
        assert float(got) == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert float(stats["adv_abs_mean"]) == pytest.approx(float((adv.clamp(-c, c) / c).abs().mean()), rel=1e-12)


def _ram_t(model, index, it, draw):
    """RAM's training t for samples ``index`` at (iteration, draw): the t of its shared re-noising phase."""
    from genrl.methods.phases import renoise
    from genrl.methods.ram import _STREAM_EPS, _STREAM_T

    return renoise(torch.zeros(len(index), 1), index, model.hparams.seed, it, draw, _STREAM_T, _STREAM_EPS,
                   **model.timestep_args())[0]


def test_ram_method_wires_every_objective_knob_and_the_timestep_range():
    """RAM's constructor knobs reach ForwardRLObjective field by field, and t_min / t_max / timestep_shift reach its
    timestep draws: uniform on the range is t_min + (t_max - t_min) U for the same U as the full-range draw."""
    from genrl.methods.ram import RAM

    kw = dict(multiplier=7.0, nft_beta=0.3, nft_clip=2.5, nft_adaptive=False, awm_weighting="t", awm_p=0.5,
              awm_clip_range=0.2, awm_adv_clip=3.0, kl_beta=0.01, ema_kl_beta=0.02)
    assert RAM(objective="awm", **kw).objective == ForwardRLObjective(objective="awm", **kw)
    index = torch.arange(6) + 40
    full = _ram_t(RAM(timestep_density="uniform"), index, it=3, draw=2).double()
    part = _ram_t(RAM(timestep_density="uniform", t_min=0.2, t_max=0.6), index, it=3, draw=2).double()
    torch.testing.assert_close(part, 0.2 + 0.4 * full, rtol=0, atol=1e-7)
    shifted = _ram_t(RAM(timestep_density="uniform", timestep_shift=3.0), index, it=3, draw=2).double()
    torch.testing.assert_close(shifted, shift_sigmas(full, 3.0), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- reward weights
@register_reward("test_knobs_mean")
class _MeanReward(RewardModel):
    """reward = mean pixel intensity."""

    def score(self, pixels, prompts, **meta):
        return {"reward": pixels.float().mean(dim=(1, 2, 3, 4))}


@register_reward("test_knobs_max")
class _MaxReward(RewardModel):
    """reward = max pixel intensity."""

    def score(self, pixels, prompts, **meta):
        return {"reward": pixels.float().amax(dim=(1, 2, 3, 4))}


def test_reward_weight_change_moves_the_total_by_delta_times_that_reward():
    """RewardManager weights: total = sum_i w_i r_i, so raising one weight by delta adds delta r_i to the total and
    delta times that reward's group advantage to the per-reward advantages."""
    x = torch.rand(6, 1, 3, 4, 4, generator=torch.Generator().manual_seed(7))
    groups = torch.tensor([0, 0, 0, 1, 1, 1])

    def run(w_mean, w_max):
        mgr = RewardManager([{"name": "test_knobs_mean", "weight": w_mean}, {"name": "test_knobs_max", "weight": w_max,
                                                                            "scale": 2.0}])
        res = mgr(x, ["p"] * 6)
        return res, per_reward_advantages(res, groups, return_details=True)

    r1, (a1, per1, _) = run(0.5, -1.0)
    r2, (a2, per2, _) = run(1.25, -1.0)
    r3, (a3, _, _) = run(0.5, 2.0)
    mean, mx = r1.rewards["test_knobs_mean"].double(), r1.rewards["test_knobs_max"].double()
    torch.testing.assert_close(r1.total.double(), 0.5 * mean - 1.0 * mx, rtol=0, atol=1e-6)
    torch.testing.assert_close(r2.total.double() - r1.total.double(), 0.75 * mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(r3.total.double() - r1.total.double(), 3.0 * mx, rtol=0, atol=1e-6)
    torch.testing.assert_close(a2 - a1, 0.75 * per1["test_knobs_mean"], rtol=0, atol=1e-5)
    torch.testing.assert_close(a3 - a1, 3.0 * per1["test_knobs_max"], rtol=0, atol=1e-5)
    assert torch.equal(per1["test_knobs_mean"], per2["test_knobs_mean"])  # the weight scales, never normalises


# ---------------------------------------------------------------------------------------------- step windows
def test_prefix_and_all_select_exactly_the_documented_steps():
    """RolloutConfig sde_steps "prefix" / "all" + skip_last_step: the first num_sde_steps steps (all steps), minus
    the last step when skip_last_step; the "ode" kernel selects none."""
    s = 6
    for n in range(1, s + 1):
        for skip in (False, True):
            m = sde_mask(RolloutConfig(num_steps=s, sde_steps="prefix", num_sde_steps=n, skip_last_step=skip), 0)
            expected = [k < n and not (skip and k == s - 1) for k in range(s)]
            assert m.tolist() == expected, (n, skip)
    assert sde_mask(RolloutConfig(num_steps=s, skip_last_step=False), 0).tolist() == [True] * s
    assert sde_mask(RolloutConfig(num_steps=s), 0).tolist() == [True] * (s - 1) + [False]
    assert not sde_mask(RolloutConfig(num_steps=s, kernel="ode", skip_last_step=False), 0).any()


def test_window_starts_cover_exactly_the_documented_range():
    """RolloutConfig "window": num_sde_steps consecutive steps starting in [window_start, window_end - n] (every start
    reached, none outside; window_end None = num_steps), and the rollout trains exactly those steps."""
    config = RolloutConfig(num_steps=10, sde_steps="window", num_sde_steps=3, window_start=2, window_end=8,
                           skip_last_step=False)
    starts = set()
    for rid in range(80):
        on = torch.nonzero(sde_mask(config, seed=1, rollout_id=rid)).flatten().tolist()
        assert on == list(range(on[0], on[0] + 3))
        starts.add(on[0])
    assert starts == {2, 3, 4, 5}
    open_end = RolloutConfig(num_steps=6, sde_steps="window", num_sde_steps=2, window_start=1)
    starts, counts = set(), set()
    for rid in range(60):
        on = torch.nonzero(sde_mask(open_end, seed=2, rollout_id=rid)).flatten().tolist()
        starts.add(on[0])
        counts.add((on[0], len(on)))
    assert starts == {1, 2, 3, 4}
    assert counts == {(1, 2), (2, 2), (3, 2), (4, 1)}  # the window over the last step loses it (skip_last_step)
    small = RolloutConfig(num_steps=5, kernel="dance_grpo", noise_level=0.3, sde_steps="window", num_sde_steps=2,
                          window_start=0, window_end=4)
    seen = set()
    for rid in range(6):
        traj = rollout(StubGen(), PROMPTS[:2], SHAPE, seed=1, config=small, rollout_id=rid)
        mask = sde_mask(small, 1, rid)
        seen.add(tuple(mask.tolist()))
        assert torch.equal(traj.sde_mask, mask)
        assert torch.equal((traj.log_probs != 0).all(dim=0), mask)
        assert torch.equal((traj.noises != 0).flatten(2).any(dim=2).any(dim=0), mask)
    assert len(seen) > 1


def test_tree_mix_window_and_stride_select_k_mod_stride_below_window_plus_splits():
    """TreeConfig mix_window / mix_stride: step k is stochastic iff k % mix_stride < mix_window or k is a split
    step; mix_window 0 makes every step stochastic."""
    tree = TreeConfig(split_steps=[3, 6], mix_window=2, mix_stride=4)
    assert tree.sde_mask(10).tolist() == [k % 4 < 2 or k in (3, 6) for k in range(10)]
    assert TreeConfig(split_steps=[2], mix_window=1, mix_stride=3).sde_mask(7).tolist() == [
        True, False, True, True, False, False, True]
    assert TreeConfig(split_steps=[2]).sde_mask(7).tolist() == [True] * 7


def test_timestep_range_restriction_is_the_exact_conditional_draw():
    """sample_timesteps t_min / t_max / shift: the restricted draw maps the same U through the restricted inverse CDF:
    uniform t_min + U (t_max - t_min); power (lo^k + U (hi^k - lo^k))^(1/k); with a shift the bounds are un-shifted
    first, t = shift(lo' + U (hi' - lo')), lo' = shift^-1(t_min)."""
    idx = list(range(100, 164))
    u = sample_timesteps(64, 5, idx, density="uniform").double()
    lo, hi = 0.3, 0.7
    t = sample_timesteps(64, 5, idx, density="uniform", t_min=lo, t_max=hi).double()
    torch.testing.assert_close(t, lo + u * (hi - lo), rtol=0, atol=1e-7)
    k = 3.0  # power alpha = 2
    t = sample_timesteps(64, 5, idx, density="power", alpha=2.0, t_min=lo, t_max=hi).double()
    torch.testing.assert_close(t, (lo**k + u * (hi**k - lo**k)) ** (1 / k), rtol=0, atol=1e-6)
    s = 3.0
    t = sample_timesteps(64, 5, idx, density="uniform", t_min=lo, t_max=hi, shift=s).double()
    lo_b, hi_b = shift_sigmas(lo, 1 / s), shift_sigmas(hi, 1 / s)
    torch.testing.assert_close(t, shift_sigmas(lo_b + u * (hi_b - lo_b), s), rtol=0, atol=1e-6)
    assert float(t.min()) >= lo and float(t.max()) <= hi


def test_timestep_sampler_logit_mean_and_std_are_the_normal_before_the_sigmoid():
    """TimestepSampler logit_mean / logit_std: sigma = sigmoid(logit_mean + logit_std n) with n the generator's normal
    draw, so logit(sigma) is affine in both knobs."""
    n = torch.randn(500, generator=torch.Generator().manual_seed(11)).double()
    for mean, std in ((0.0, 1.0), (0.7, 0.5), (-1.2, 2.0)):
        got = TimestepSampler("logit_normal", logit_mean=mean, logit_std=std)(500, torch.Generator().manual_seed(11))
        torch.testing.assert_close(got.double(), torch.sigmoid(mean + std * n), rtol=0, atol=1e-6)


def test_path_prob_fusion_alpha_is_the_softmax_temperature():
    """fuse_rewards path_prob alpha: R(parent) = sum_c softmax(alpha l_c) R(c); alpha 0 is the plain mean."""
    parent = [torch.zeros(0, dtype=torch.long), torch.tensor([0, 0, 0])]
    lp = [torch.zeros(1), torch.tensor([0.3, -0.5, 1.1])]
    r = torch.tensor([1.0, 3.0, -2.0], dtype=F64)
    for alpha in (0.0, 1.0, 2.5):
        fused, _ = fuse_rewards(parent, r, log_probs=lp, weighting="path_prob", alpha=alpha)
        w = torch.softmax(alpha * lp[1].double(), dim=0)
        assert float(fused[0][0]) == pytest.approx(float((w * r).sum()), rel=1e-12, abs=1e-15)
    assert float(fuse_rewards(parent, r, log_probs=lp, weighting="path_prob", alpha=0.0)[0][0][0]) == pytest.approx(
        float(r.mean()), rel=1e-12)


def test_forward_rl_nft_beta_and_clip_reach_the_velocity_form_loss():
    """ForwardRLObjective nft_beta / nft_clip (velocity form): L = (C / beta) mean_b mean_e [r (v+ - u)^2 +
    (1 - r) (v- - u)^2], v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v,
    r = 1/2 + clip(A, -C, C) / 2C."""
    v, v_old, _, u, x_t, x0, t, adv = _forward_rl_inputs()
    for beta, c in ((1.0, 5.0), (0.4, 5.0), (0.4, 1.0)):
        obj = ForwardRLObjective("nft", nft_beta=beta, nft_clip=c, nft_adaptive=False)
        got = obj.loss(v, v_old, None, u, x_t, x0, t, adv)[0]
        r = (0.5 + adv.clamp(-c, c) / (2 * c)).reshape(-1, 1, 1, 1, 1)
        v_pos, v_neg = beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v
        per = (r * (v_pos - u) ** 2 + (1 - r) * (v_neg - u) ** 2).reshape(4, -1).mean(dim=1)
        assert float(got) == pytest.approx(c / beta * float(per.mean()), rel=1e-12)


@pytest.mark.parametrize("weighting", ["t", "t2"])
def test_forward_rl_awm_weighting_and_clip_range_reach_the_ratio(weighting):
    """ForwardRLObjective awm_weighting / awm_clip_range e: log p = -w(t, l) (w = t l or t^2 l), ratio =
    exp(w(t, l_old) - w(t, l)), policy = mean_b max(-A r, -A clip(r, 1 - e, 1 + e)) with A = clip(A, -5, 5) / 5."""
    v, v_old, _, u, x_t, x0, t, adv = _forward_rl_inputs()
    tw = t if weighting == "t" else t * t
    ratio = torch.exp(tw * (sample_mse(v_old, u) - sample_mse(v, u)))
    a = adv.clamp(-5, 5) / 5
    assert bool((ratio > 1.25).any())  # a positive-advantage ratio above 1 + e: the clip binds for both e
    for e in (None, 0.2, 0.05):
        got, stats = ForwardRLObjective("awm", awm_weighting=weighting, awm_clip_range=e).loss(
            v, v_old, None, u, x_t, x0, t, adv)
        clipped = -a * ratio if e is None else torch.maximum(-a * ratio, -a * ratio.clamp(1 - e, 1 + e))
        assert float(got) == pytest.approx(float(clipped.mean()), rel=1e-12)
        assert e is None or float(clipped.mean()) > float((-a * ratio).mean()) + 1e-3
        frac = 0.0 if e is None else float(((ratio - 1).abs() > e).double().mean())
        assert float(stats["clip_frac"]) == frac


def test_lora_empty_target_list_is_an_error_not_the_default():
    """LoraSpec(target_modules=[]) would adapt nothing: a clear error, not a silent fall-back to the default targets."""
    with pytest.raises(ValueError, match="target_modules is an empty list"):
        LoraSpec(target_modules=[])
