"""The shared rollout sampler: bitwise regeneration, ratio exactly 1, step masks, ODE front, errors."""

from __future__ import annotations

import pytest
import torch

from genrl.models import DiTGenerator
from genrl.rollout import RolloutConfig, Trajectory, rollout, sample_ode, sde_mask, transition_log_prob

SHAPE = (4, 3, 8, 8)
PROMPTS = ["a red circle moving left slowly", "a blue square", "a green triangle moving up quickly",
           "a red circle", "a cyan square staying still", "a yellow circle moving down slowly"]


@pytest.fixture(scope="module")
def gen(tiny_dit_generator) -> DiTGenerator:
    return tiny_dit_generator


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


# ----------------------------------------------------------------------------------------------------- a fast stub
STUB_PROMPTS = ["a", "bb", "ccc"]
STUB_SHAPE = (2, 3)


class _Stub:
    """A per-row velocity v = a x + sigma c(prompt) on a declared device, with one trainable weight ``a``."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.a = torch.tensor(0.5, requires_grad=True)

    def encode_prompts(self, prompts):
        from genrl.models.text_encoder import Conditioning

        h = torch.stack([torch.full((2, 4), float(len(p)) / 10) for p in prompts])
        return Conditioning(h, torch.ones(len(prompts), 2, dtype=torch.bool), list(prompts))

    def velocity(self, x, sigma, cond, **kwargs):
        c = cond.hidden_states[:, 0, 0].to(x.device).reshape(-1, *([1] * (x.ndim - 1)))
        return self.a * x + sigma.reshape(-1, *([1] * (x.ndim - 1))) * c


def test_rollout_default_id_grad_policies_and_progress(monkeypatch):
    """rollout: rollout_id defaults to 0 (the SDE window of sde_mask(config, seed, 0)); grad="full" keeps the graph
    into the velocity's weight with the values of grad="none"; another grad is a ValueError naming it; progress is
    off by default and progress=True wraps the steps in rich's track without changing the rollout."""
    import rich.progress

    cfg = RolloutConfig(num_steps=8, sde_steps="window", num_sde_steps=2, micro_batch_size=2, cfg_scale=2.0)
    seed = next(s for s in range(20) if not torch.equal(sde_mask(cfg, s, 0), sde_mask(cfg, s, 1)))
    tracked = []
    monkeypatch.setattr(rich.progress, "track", lambda steps, **kw: tracked.append(kw) or steps)
    traj = rollout(_Stub(), STUB_PROMPTS, STUB_SHAPE, seed=seed, config=cfg)
    assert torch.equal(traj.sde_mask, sde_mask(cfg, seed, 0)) and not traj.final.requires_grad
    assert tracked == []
    shown = rollout(_Stub(), STUB_PROMPTS, STUB_SHAPE, seed=seed, config=cfg, progress=True)
    assert len(tracked) == 1 and torch.equal(shown.final, traj.final) and torch.equal(shown.latents, traj.latents)
    stub = _Stub()
    full = rollout(stub, STUB_PROMPTS, STUB_SHAPE, seed=seed, config=cfg, grad="full")
    assert torch.equal(full.final.detach(), traj.final)
    (grad_a,) = torch.autograd.grad(full.final.sum(), stub.a)
    assert torch.isfinite(grad_a) and grad_a != 0
    with pytest.raises(ValueError, match=r"^grad must be 'none', 'full' or 'sde', got 'partial'$"):
        rollout(_Stub(), STUB_PROMPTS, STUB_SHAPE, seed=seed, config=cfg, grad="partial")


def test_rollout_grad_sde_keeps_each_stochastic_steps_graph_and_nothing_else(gen):
    """grad="sde": the rollout's values are those of grad="none" bit for bit (latents, log-probs, final); live holds
    exactly the stochastic steps, each log-prob equal to the recorded one and to transition_log_prob's, and its
    gradient into the weights equals the recomputed one's; the states between steps carry no graph (the gradient of
    a step does not flow into the steps before it)."""
    config = RolloutConfig(num_steps=5, kernel="flow_grpo", cfg_scale=2.0, micro_batch_size=4, sde_steps="window",
                           num_sde_steps=2, window_start=0, window_end=4)
    plain = rollout(gen, PROMPTS, SHAPE, seed=5, config=config, rollout_id=3)
    kept = rollout(gen, PROMPTS, SHAPE, seed=5, config=config, rollout_id=3, grad="sde")
    assert plain.live == {} and sorted(kept.live) == kept.sde_steps == plain.sde_steps and len(kept.sde_steps) == 2
    for name in ("latents", "log_probs", "noises", "final"):
        assert torch.equal(getattr(kept, name), getattr(plain, name)), name
    assert not kept.final.requires_grad and kept.select([0]).live == {}
    params = [p for p in gen.parameters() if p.requires_grad]
    for k in kept.sde_steps:
        lp, v, mean = kept.live[k]
        assert lp.requires_grad and v.requires_grad and mean.requires_grad
        assert torch.equal(lp.detach(), plain.log_probs[:, k])
        ref, ref_v, _ = transition_log_prob(gen, plain, k)
        assert torch.equal(v.detach(), ref_v.detach())
        got = torch.autograd.grad(lp.sum(), params, allow_unused=True, retain_graph=True)
        want = torch.autograd.grad(ref.sum(), params, allow_unused=True)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None) and (g is None or torch.allclose(g, w, rtol=1e-5, atol=1e-7))
    # the graph of one step stops at the state entering it: no path into the velocity of an earlier step
    k0, k1 = kept.sde_steps
    (gv,) = torch.autograd.grad(kept.live[k1][0].sum(), kept.live[k0][1], allow_unused=True)
    assert gv is None


def test_transition_log_prob_refuses_an_unrecorded_trajectory():
    """transition_log_prob on a record=False trajectory (empty latents) is a ValueError saying so."""
    traj = rollout(_Stub(), STUB_PROMPTS, STUB_SHAPE, seed=0, config=RolloutConfig(num_steps=3), record=False)
    assert traj.latents.numel() == 0 and bool(traj.sde_mask[0])
    with pytest.raises(ValueError, match=r"^the trajectory was sampled with record=False"):
        transition_log_prob(_Stub(), traj, 0)


def test_trajectory_select_keeps_every_field_of_the_chosen_rows():
    """Trajectory.select(rows) keeps the chosen rows of every per-sample field (latents, log_probs, noises, final,
    indices, prompts, means) in the given order, the shared fields as they are (sigmas, sde_mask, seed, config,
    stds) and a copy of extras; a list, a tuple and a tensor of rows select alike, and no row gives an empty one."""
    b, s = 3, 2
    gen = torch.Generator().manual_seed(0)
    traj = Trajectory(
        latents=torch.randn(b, s + 1, 2, generator=gen), sigmas=torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64),
        sde_mask=torch.tensor([True, False]), log_probs=torch.randn(b, s, generator=gen),
        noises=torch.randn(b, s, 2, generator=gen), final=torch.randn(b, 2, generator=gen), seed=7,
        indices=torch.tensor([10, 11, 12]), prompts=["a", "b", "c"], config=RolloutConfig(num_steps=2),
        means=torch.randn(b, s, 2, generator=gen), stds=torch.tensor([0.3, 0.0]), extras={"k": 1},
    )
    for rows in ([2, 0], (2, 0), torch.tensor([2, 0])):
        sub = traj.select(rows)
        for name in ("latents", "log_probs", "noises", "final", "indices", "means"):
            assert torch.equal(getattr(sub, name), getattr(traj, name)[[2, 0]]), name
        assert sub.prompts == ["c", "a"] and sub.seed == 7 and sub.config is traj.config
        assert torch.equal(sub.sigmas, traj.sigmas) and torch.equal(sub.sde_mask, traj.sde_mask)
        assert torch.equal(sub.stds, traj.stds)
        assert sub.extras == {"k": 1} and sub.extras is not traj.extras
    empty = traj.select([])
    assert empty.latents.shape == (0, s + 1, 2) and empty.final.shape == (0, 2) and empty.means.shape == (0, s, 2)
    assert empty.indices.dtype == torch.long and empty.indices.shape == (0,) and empty.prompts == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device next to the CPU")
def test_transition_log_prob_moves_a_cpu_trajectory_to_the_generators_device():
    """A trajectory recorded on the CPU is re-scored by a CUDA generator: its sigmas, states and recorded samples
    move to the generator's device, the outputs are on CUDA and the log-prob equals the recorded one."""
    cfg = RolloutConfig(num_steps=3, kernel="flow_grpo", micro_batch_size=2, cfg_scale=2.0)
    traj = rollout(_Stub(), STUB_PROMPTS, STUB_SHAPE, seed=1, config=cfg)
    for k in traj.sde_steps:
        log_prob, v, mean = transition_log_prob(_Stub("cuda"), traj, k)
        assert log_prob.device.type == v.device.type == mean.device.type == "cuda"
        torch.testing.assert_close(log_prob.detach().cpu(), traj.log_probs[:, k], rtol=1e-5, atol=1e-5)
class _Cond:
    def select(self, rows):
        return self


class _LinearGen:
    """A stub generator: v = w x + sigma (w a trainable scalar); prompts are ignored."""

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.w = torch.nn.Parameter(torch.tensor(-0.5))

    def encode_prompts(self, prompts):
        return _Cond()

    def velocity(self, x, sigma, cond):
        return self.w * x + sigma.reshape(-1, *([1] * (x.ndim - 1)))


def _reference_rollout(config: RolloutConfig, n: int, shape, seed: int, indices):
    """The rollout of _LinearGen written out step by step: noise addresses, masks, kernels, sigma_at_one."""
    from genrl.flow.sde import sde_step
    from genrl.noise import randn_per_sample

    sig = config.sigmas()
    s32 = sig.float()
    mask = sde_mask(config, seed)
    at_one = float(sig[1]) if config.num_steps > 1 else None
    x = randn_per_sample(shape, seed, indices, step=0)
    lat, noi, lps, means, stds = [x], [], [], [], []
    for k in range(config.num_steps):
        v = -0.5 * x + s32[k]
        noise = randn_per_sample(shape, seed, indices, step=k + 1) if mask[k] else torch.zeros_like(x)
        out = sde_step(config.kernel if mask[k] else "ode", x, v, s32[k], s32[k + 1], noise,
                       noise_level=config.noise_level, sigma_at_one=at_one)
        x = out.sample
        lat.append(x), noi.append(noise), lps.append(out.log_prob), means.append(out.mean)
        stds.append(float(out.std))
    return {"latents": torch.stack(lat, 1), "noises": torch.stack(noi, 1), "log_probs": torch.stack(lps, 1),
            "means": torch.stack(means, 1), "stds": torch.tensor(stds), "final": x, "mask": mask}


@pytest.mark.parametrize("config", [
    RolloutConfig(num_steps=3, kernel="flow_grpo", micro_batch_size=2),
    RolloutConfig(num_steps=4, kernel="dance_grpo", noise_level=0.3, skip_last_step=False, micro_batch_size=3),
    RolloutConfig(num_steps=2, kernel="ode", micro_batch_size=5),
    RolloutConfig(num_steps=1, kernel="dance_grpo", skip_last_step=False),
    RolloutConfig(num_steps=3, shift=3.0, sde_steps="prefix", num_sde_steps=1),
    RolloutConfig(num_steps=3, schedule=[0.9, 0.5, 0.2, 0.0]),
], ids=["flow_grpo", "dance_grpo", "ode", "one_step", "prefix_shift", "schedule"])
def test_rollout_matches_a_step_by_step_reference(config):
    """rollout (any kernel, mask, schedule) equals the step-by-step reference bitwise in every recorded field, with
    record_moments; record=False keeps only final and log_probs (latents / noises empty [0], moments None)."""
    gen, indices, shape = _LinearGen(), [4, 9, 2], (2, 3)
    ref = _reference_rollout(config, 3, shape, 11, torch.tensor(indices))
    traj = rollout(gen, ["a", "b", "c"], shape, seed=11, indices=indices, config=config, record_moments=True)
    for key in ("latents", "noises", "log_probs", "means", "stds", "final"):
        assert torch.equal(getattr(traj, key), ref[key]), key
    assert torch.equal(traj.sde_mask, ref["mask"]) and torch.equal(traj.sigmas, config.sigmas())
    assert traj.seed == 11 and traj.indices.dtype == torch.long and traj.indices.tolist() == indices
    assert traj.prompts == ["a", "b", "c"] and traj.config is config
    assert not traj.final.requires_grad
    lean = rollout(gen, ["a", "b", "c"], shape, seed=11, indices=indices, config=config, record=False)
    assert torch.equal(lean.final, ref["final"]) and torch.equal(lean.log_probs, ref["log_probs"])
    for empty in (lean.latents, lean.noises):
        assert isinstance(empty, torch.Tensor) and empty.shape == (0,)
    assert lean.means is None and lean.stds is None


def test_rollout_grad_full_backpropagates_and_progress_bar_runs():
    """grad="full" keeps the graph through every step (final depends on w); the progress bar leaves results alone."""
    gen, config = _LinearGen(), RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.3)
    full = rollout(gen, ["a", "b"], (3,), seed=2, config=config, grad="full")
    assert full.final.requires_grad
    (g,) = torch.autograd.grad(full.final.sum(), gen.w)
    assert torch.isfinite(g) and g != 0
    plain = rollout(gen, ["a", "b"], (3,), seed=2, config=config)
    bar = rollout(gen, ["a", "b"], (3,), seed=2, config=config, progress=True)
    assert torch.equal(bar.final, plain.final) and torch.equal(bar.latents, plain.latents)
    assert torch.equal(full.final.detach(), plain.final)


def test_rollout_draws_noise_and_sigmas_on_the_generators_device(monkeypatch):
    """rollout draws every noise on generator.device with the config's noise backend and hands the network and the
    kernel sigmas on it (meta here; spies stand in for the noise draw and the step kernel, which record the devices)."""
    import importlib
    from types import SimpleNamespace

    sampler = importlib.import_module("genrl.rollout.sampler")
    seen = {"noise": [], "velocity": [], "step": []}

    def fake_randn(shape, seed, indices, step=0, stream=0, device="cpu", backend="generator"):
        seen["noise"].append((None if device is None else torch.device(device).type, backend))
        return torch.zeros(len(indices), *shape)

    def fake_step(kind, x, v, sigma, sigma_next, noise, **kw):
        seen["step"].append((sigma.device.type, sigma_next.device.type))
        return SimpleNamespace(sample=x, mean=x, std=torch.zeros(()), log_prob=torch.zeros(x.shape[0]))

    class _Spy(_LinearGen):
        def velocity(self, x, sigma, cond):
            seen["velocity"].append(sigma.device.type)
            return torch.zeros_like(x)

    monkeypatch.setattr(sampler, "randn_per_sample", fake_randn)
    monkeypatch.setattr(sampler, "sde_step", fake_step)
    rollout(_Spy("meta"), ["a", "b"], (3,), seed=0, config=RolloutConfig(num_steps=3))
    assert seen == {"noise": [("meta", "generator")] * 3, "velocity": ["meta"] * 3, "step": [("meta", "meta")] * 3}
    seen["noise"].clear()
    rollout(_Spy("meta"), ["a", "b"], (3,), seed=0, config=RolloutConfig(num_steps=3, noise_backend="philox"))
    assert seen["noise"] == [("meta", "philox")] * 3


def test_rollout_config_validates_schedule_and_scales():
    """RolloutConfig rejects a schedule that starts above 1, does not end at 0 or is not strictly descending, and a
    negative noise_level or cfg_scale, each alone; cfg_scale in [0, 1) is valid."""
    for bad in ([1.5, 0.5, 0.0], [1.2, 1.1, 0.0], [1.0, 0.5, 0.2], [1.0, 0.4, 0.6, 0.0], [1.0, 0.5, 0.5, 0.0]):
        with pytest.raises(ValueError, match="schedule must descend strictly"):
            RolloutConfig(num_steps=len(bad) - 1, schedule=bad)
    assert RolloutConfig(num_steps=2, schedule=[1, 0.5, 0]).schedule == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="noise_level and cfg_scale must be >= 0, got -0.1, 1.0"):
        RolloutConfig(noise_level=-0.1)
    with pytest.raises(ValueError, match="noise_level and cfg_scale must be >= 0, got 0.7, -1.0"):
        RolloutConfig(cfg_scale=-1.0)
    for w in (0.0, 0.5):
        assert RolloutConfig(cfg_scale=w).cfg_scale == w


def test_rollout_config_sigma_at_one_and_defaults():
    """sigma_at_one is the schedule's second entry for >= 2 steps and None for one step; documented defaults hold."""
    for steps in (1, 2, 3):
        cfg = RolloutConfig(num_steps=steps, shift=3.0)
        expected = float(cfg.sigmas()[1]) if steps > 1 else None
        assert cfg.sigma_at_one(cfg.sigmas()) == expected
    d = RolloutConfig()
    assert (d.num_steps, d.shift, d.kernel, d.noise_level, d.cfg_scale, d.sde_steps, d.num_sde_steps) == (
        10, 1.0, "flow_grpo", 0.7, 1.0, "all", 2)
    assert (d.window_start, d.window_end, d.skip_last_step, d.micro_batch_size, d.null_prompt, d.schedule) == (
        0, None, True, 8, "", None)


def test_step_moments_are_the_sampled_transition(gen):
    """record_moments keeps each step's mean and std: the recorded sample is mean + std x the recorded noise, and the
    current policy's recomputed mean equals it; asking without them, or for an ODE step, names the fix."""
    config = RolloutConfig(num_steps=4, kernel="flow_grpo", sde_steps="prefix", num_sde_steps=2)
    traj = rollout(gen, PROMPTS[:3], SHAPE, seed=2, config=config, record_moments=True)
    for k in traj.sde_steps:
        mean, std = traj.step_moments(k)
        assert std > 0 and mean.shape == traj.latents[:, k].shape
        assert torch.allclose(traj.latents[:, k + 1], mean + std * traj.noises[:, k], rtol=0, atol=1e-6)
        _, _, now = transition_log_prob(gen, traj, k)
        assert torch.allclose(now.detach().cpu(), mean, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"step 3 is not a stochastic step .*\[0, 1\]"):
        traj.step_moments(3)
    with pytest.raises(ValueError, match="record_moments=True"):
        rollout(gen, PROMPTS[:3], SHAPE, seed=2, config=config).step_moments(0)
