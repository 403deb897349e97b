"""History-conditioned sampling (genrl.rollout.history): DFoT's sampler invariants on the tiny random DiT."""

from __future__ import annotations

import pytest
import torch

from genrl.flow import HistoryGuidance
from genrl.flow.sde import sde_step
from genrl.noise import randn_per_sample
from genrl.rollout import RolloutConfig, rollout
from genrl.rollout.history import WINDOW_STREAM, history_rollout, noised_history, sample_window

FRAME = (3, 8, 8)
PROMPTS = ["a red circle moving left slowly", "a blue square", "a green triangle moving up quickly"]
ODE = RolloutConfig(num_steps=3, kernel="ode", micro_batch_size=16)


@pytest.fixture(scope="module")
def gen(tiny_dit_generator):
    return tiny_dit_generator


def _history(n=3, frames=2, seed=5):
    return torch.randn(n, frames, *FRAME, generator=torch.Generator().manual_seed(seed))


def _window(gen, hist, rule, config=ODE, seed=1, num_new=2, prompts=PROMPTS, indices=None, window=0):
    idx = torch.arange(len(prompts)) if indices is None else torch.tensor(indices)
    cond = gen.encode_prompts(prompts)
    null = gen.encode_prompts([""] * len(prompts))
    compiled = rule.compile(hist.shape[1])
    with torch.no_grad():
        return sample_window(gen, hist, num_new, cond, null, compiled, seed, idx, config, window)


def test_equal_per_frame_sigmas_are_the_standard_model_bit_for_bit(gen):
    x = torch.randn(3, 4, *FRAME, generator=torch.Generator().manual_seed(0))
    cond = gen.encode_prompts(PROMPTS)
    sigma = torch.tensor([0.9, 0.4, 0.1])
    with torch.no_grad():
        assert torch.equal(gen.velocity(x, sigma[:, None].expand(3, 4).contiguous(), cond), gen.velocity(x, sigma,
                                                                                                          cond))


def test_first_window_without_history_is_the_ordinary_rollout(gen):
    new, log_probs = _window(gen, torch.empty(3, 0, *FRAME), HistoryGuidance(), num_new=4)
    ref = rollout(gen, PROMPTS, (4, *FRAME), seed=1, config=ODE, record=False).final
    assert torch.equal(new, ref) and (log_probs == 0).all()


def test_scale_one_is_the_conditional_sample_and_guidance_changes_it(gen):
    hist = _history()
    cond, _ = _window(gen, hist, HistoryGuidance())
    one, _ = _window(gen, hist, HistoryGuidance("vanilla", scale=1.0))
    two, _ = _window(gen, hist, HistoryGuidance("vanilla", scale=2.0))
    frac, _ = _window(gen, hist, HistoryGuidance("fractional", scale=2.0, fractional_sigma=0.5))
    assert torch.equal(one, cond)
    assert (two - cond).abs().max() > 1e-3 and (frac - two).abs().max() > 1e-3


def test_the_history_conditions_the_sample_and_a_masked_history_does_not(gen):
    a, b = _history(seed=5), _history(seed=6)
    assert (_window(gen, a, HistoryGuidance())[0] - _window(gen, b, HistoryGuidance())[0]).abs().max() > 1e-3
    # scale 0: only the empty view (every history frame at sigma 1, pure noise) -> history content is irrelevant
    empty = HistoryGuidance("vanilla", scale=0.0)
    assert empty.compile(2).nfe == 1
    assert torch.equal(_window(gen, a, empty)[0], _window(gen, b, empty)[0])


def test_noised_history_keeps_clean_frames_bitwise_and_masks_with_noise():
    h = _history(n=2, frames=3)
    eps = torch.randn_like(h)
    sig = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, 1.0]])
    out = noised_history(h, sig, eps)
    assert torch.equal(out[0], h) and torch.equal(out[1, :, 0], h[:, 0])
    torch.testing.assert_close(out[1, :, 1], 0.5 * h[:, 1] + 0.5 * eps[:, 1], rtol=0, atol=1e-7)
    assert torch.equal(out[1, :, 2], eps[:, 2])


def test_combine_then_step_draws_the_step_noise_once(gen):
    """One SDE step of fractional guidance equals the documented formula: the views' velocities combined, then one
    kernel step with the noise of (seed, i, step 1): the increment keeps the kernel's variance (stepping each view
    with its own noise and combining the states would scale it by sum w_i^2)."""
    config = RolloutConfig(num_steps=1, kernel="dance_grpo", noise_level=0.3, skip_last_step=False,
                           micro_batch_size=16)
    hist = _history()
    rule = HistoryGuidance("fractional", scale=3.0, fractional_sigma=0.5)
    new, log_probs = _window(gen, hist, rule, config=config)
    compiled = rule.compile(2)
    idx = torch.arange(3)
    x = randn_per_sample((2, *FRAME), 1, idx, step=0)
    eps_h = randn_per_sample((2, *FRAME), 1, idx, step=0, stream=WINDOW_STREAM + 1)
    views = noised_history(hist, compiled.history_sigmas(), eps_h)
    cond, null = gen.encode_prompts(PROMPTS), gen.encode_prompts([""] * 3)
    preds = []
    with torch.no_grad():
        for view, sig, drop in zip(views, compiled.history_sigmas(), compiled.drop_text()):
            s = torch.cat([sig.expand(3, 2), torch.ones(3, 2)], dim=1)
            preds.append(gen.velocity(torch.cat([view, x], dim=1), s, null if drop else cond)[:, 2:].float())
    v = sum(w * p for w, p in zip(compiled.weights, preds))
    noise = randn_per_sample((2, *FRAME), 1, idx, step=1)
    want = sde_step("dance_grpo", x, v, torch.tensor(1.0), torch.tensor(0.0), noise, noise_level=0.3)
    torch.testing.assert_close(new, want.sample, rtol=0, atol=1e-5)
    torch.testing.assert_close(log_probs[:, 0], want.log_prob.float(), rtol=0, atol=1e-4)
    # the residual is exactly the one drawn noise: unit variance, whatever the weights
    torch.testing.assert_close((new - want.mean) / want.std, noise, rtol=0, atol=1e-4)


def test_a_sample_does_not_depend_on_its_batch(gen):
    rule = HistoryGuidance("vanilla", scale=2.0, stabilization=0.02)
    full = history_rollout(gen, PROMPTS, FRAME, 8, seed=3, history=_history(), guidance=rule, config=ODE, window=4,
                           indices=[7, 8, 9])
    alone = history_rollout(gen, PROMPTS[1:2], FRAME, 8, seed=3, history=_history()[1:2], guidance=rule, config=ODE,
                            window=4, indices=[8])
    assert torch.equal(full.video[1], alone.video[0])
    again = history_rollout(gen, PROMPTS, FRAME, 8, seed=3, history=_history(), guidance=rule, config=ODE, window=4,
                            indices=[7, 8, 9])
    assert torch.equal(again.video, full.video)
    other = history_rollout(gen, PROMPTS, FRAME, 8, seed=4, history=_history(), guidance=rule, config=ODE, window=4,
                            indices=[7, 8, 9])
    assert (other.video[:, 2:] - full.video[:, 2:]).abs().max() > 1e-3


def test_sliding_window_lengths_history_and_cost(gen):
    hist = _history()
    rule = HistoryGuidance("fractional", scale=2.0)
    out = history_rollout(gen, PROMPTS, FRAME, 11, seed=2, history=hist, guidance=rule, config=ODE, window=6,
                          context=2)
    assert out.video.shape == (3, 11, *FRAME)
    assert torch.equal(out.video[:, :2], hist)  # the given frames come back bit for bit
    assert out.generated.tolist() == [False] * 2 + [True] * 9
    assert out.windows == [{"start": 0, "history": 2, "keyframes": 0, "new": 4, "nfe": 3},
                           {"start": 4, "history": 2, "keyframes": 0, "new": 4, "nfe": 3},
                           {"start": 8, "history": 2, "keyframes": 0, "new": 1, "nfe": 3}]
    assert out.network_calls == 3 * 3 * 3 and out.calls_per_frame == pytest.approx(27 / 9)
    # without history the first window generates a whole window
    fresh = history_rollout(gen, PROMPTS, FRAME, 8, seed=2, guidance=HistoryGuidance(), config=ODE, window=4)
    assert [w["history"] for w in fresh.windows] == [0, 2, 2] and fresh.video.shape[1] == 8
    assert fresh.network_calls == 3 * 3


def test_later_windows_see_their_generated_history_at_the_stabilization_level(gen, monkeypatch):
    seen = []
    real = gen.velocity

    def spy(x, sigma, cond, **kw):
        seen.append(sigma.clone())
        return real(x, sigma, cond, **kw)

    monkeypatch.setattr(gen, "velocity", spy)
    rule = HistoryGuidance("vanilla", scale=2.0, stabilization=0.02)
    history_rollout(gen, PROMPTS, FRAME, 6, seed=0, history=_history(), guidance=rule,
                    config=RolloutConfig(num_steps=1, kernel="ode", micro_batch_size=16), window=4)
    first, second = (s[:6] for s in seen)  # one call per window: 2 views x 3 samples, padded to the micro-batch
    assert len(seen) == 2 and seen[0].shape == (16, 4)
    assert (first[:3, :2] == 0).all() and (first[3:, :2] == 1).all()  # ground-truth history: clean / masked
    assert torch.allclose(second[:3, :2], torch.tensor(0.02)) and (second[3:, :2] == 1).all()
    assert (first[:, 2:] == 1).all()  # generated frames at the schedule's first sigma


def test_bad_inputs_name_the_value(gen):
    with pytest.raises(ValueError, match="cfg_scale must be 1"):
        _window(gen, _history(), HistoryGuidance(), config=RolloutConfig(cfg_scale=3.0))
    with pytest.raises(ValueError, match="compiled for 2 history frames, the history has 4"):
        cond = gen.encode_prompts(PROMPTS)
        sample_window(gen, _history(frames=4), 2, cond, cond, HistoryGuidance().compile(2), 0, torch.arange(3), ODE)
    with pytest.raises(ValueError, match="context must be in"):
        history_rollout(gen, PROMPTS, FRAME, 8, seed=0, window=4, context=4)
    with pytest.raises(ValueError, match="needs room for new ones"):
        history_rollout(gen, PROMPTS, FRAME, 8, seed=0, history=_history(frames=4), window=4)
    with pytest.raises(ValueError, match="must exceed the history's 2 frames"):
        history_rollout(gen, PROMPTS, FRAME, 2, seed=0, history=_history(), window=4)


class _FramesOnAxis2:
    """The tiny DiT seen through Wan's layout [B, C, F, H, W] (``frame_dim = 2``)."""

    frame_dim = 2

    def __init__(self, gen):
        self.gen, self.device = gen, gen.device

    def encode_prompts(self, prompts):
        return self.gen.encode_prompts(prompts)

    def velocity(self, x, sigma, cond, **kwargs):
        assert x.shape[2] == sigma.shape[1]  # the frames are on axis 2 here
        return self.gen.velocity(x.movedim(2, 1), sigma, cond, **kwargs).movedim(1, 2)


def test_a_generator_with_frames_on_axis_2_gets_the_same_rollout_in_its_layout(gen):
    """history_rollout takes and returns latents in the generator's layout; the computation is the same."""
    hist = _history()
    rule = HistoryGuidance("vanilla", scale=2.0)
    ref = history_rollout(gen, PROMPTS, FRAME, 7, seed=2, history=hist, guidance=rule, config=ODE, window=4, context=2)
    out = history_rollout(_FramesOnAxis2(gen), PROMPTS, FRAME, 7, seed=2, history=hist.movedim(1, 2), guidance=rule,
                          config=ODE, window=4, context=2)
    assert out.video.shape == (3, FRAME[0], 7, *FRAME[1:])
    assert torch.equal(out.video.movedim(2, 1), ref.video) and out.windows == ref.windows


def test_history_positions_put_known_frames_where_the_model_sees_them(gen):
    """A keyframe after the generated frames: one Euler step is x - v with v the model's velocity on [x, keyframe]
    at per-frame sigma [1, 1, 0, 0]; positions [0, 1] are the default prefix, bit for bit."""
    one = RolloutConfig(num_steps=1, kernel="ode", micro_batch_size=16, skip_last_step=False)
    hist = _history()
    cond = gen.encode_prompts(PROMPTS)
    compiled = HistoryGuidance().compile(2)
    idx = torch.arange(3)
    with torch.no_grad():
        new, _ = sample_window(gen, hist, 2, cond, None, compiled, 1, idx, one, 0, history_positions=[2, 3])
        x = randn_per_sample((2, *FRAME), 1, idx, step=0)
        v = gen.velocity(torch.cat([x, hist], dim=1), torch.tensor([[1.0, 1.0, 0.0, 0.0]]).expand(3, 4), cond)
        torch.testing.assert_close(new, x - v[:, :2].float(), rtol=0, atol=1e-6)
        prefix, _ = sample_window(gen, hist, 2, cond, None, compiled, 1, idx, one, 0, history_positions=[0, 1])
        default, _ = sample_window(gen, hist, 2, cond, None, compiled, 1, idx, one, 0)
    assert torch.equal(prefix, default) and (prefix - new).abs().max() > 1e-3


@pytest.mark.parametrize("positions", [[0], [1, 0], [0, 0], [0, 4], [-1, 0]])
def test_history_positions_are_checked(gen, positions):
    with pytest.raises(ValueError, match="history_positions must be 2 distinct increasing"):
        sample_window(gen, _history(), 2, gen.encode_prompts(PROMPTS), None, HistoryGuidance().compile(2), 1,
                      torch.arange(3), ODE, 0, history_positions=positions)


def test_keyframes_join_the_window_they_fall_in_and_come_back_unchanged(gen):
    """Window 6, context 2, 12 frames: windows start at 0, 4, 8; a keyframe pair at frames 8-9 falls into window 1,
    which then generates frames 6-7 between its history (4-5) and the keyframes; window 2 keeps the keyframes as its
    history. Window 0 is untouched; window 1 equals one sample_window call with the keyframes at offsets 4-5."""
    hist = _history()
    keys = torch.randn(3, 2, *FRAME, generator=torch.Generator().manual_seed(9))
    kw = dict(history=hist, config=ODE, window=6, context=2, indices=[4, 5, 6])
    plain = history_rollout(gen, PROMPTS, FRAME, 12, seed=2, **kw)
    out = history_rollout(gen, PROMPTS, FRAME, 12, seed=2, keyframes=keys, keyframe_positions=[8, 9], **kw)
    assert torch.equal(out.video[:, 8:10], keys) and torch.equal(out.video[:, :2], hist)
    assert out.generated.tolist() == [False] * 2 + [True] * 6 + [False] * 2 + [True] * 2
    assert out.windows == [{"start": 0, "history": 2, "keyframes": 0, "new": 4, "nfe": 1},
                           {"start": 4, "history": 2, "keyframes": 2, "new": 4, "nfe": 1},
                           {"start": 8, "history": 2, "keyframes": 0, "new": 2, "nfe": 1}]
    assert out.network_calls == 3 * 3 and out.calls_per_frame == pytest.approx(9 / 8)
    assert torch.equal(out.video[:, 2:6], plain.video[:, 2:6])
    cond = gen.encode_prompts(PROMPTS)
    compiled = HistoryGuidance().compile(4, generated=[True, True, False, False])  # 4-5 generated, keys real
    with torch.no_grad():
        want, _ = sample_window(gen, torch.cat([out.video[:, 4:6], keys], dim=1), 2, cond, None, compiled, 2,
                                torch.tensor([4, 5, 6]), ODE, 1, history_positions=[0, 1, 4, 5])
    assert torch.equal(out.video[:, 6:8], want)
    assert (out.video[:, 6:8] - plain.video[:, 6:8]).abs().max() > 1e-3  # the keyframes condition the frames before
    # a window made only of known frames calls nothing
    full = history_rollout(gen, PROMPTS, FRAME, 6, seed=2, history=hist, config=ODE, window=6, context=2,
                           keyframes=torch.cat([keys, keys], dim=1), keyframe_positions=[2, 3, 4, 5])
    assert full.network_calls == 0 and not full.generated.any() and torch.equal(full.video[:, 4:], keys)


def test_keyframes_are_real_history_for_stabilization(gen):
    """Stabilization noises generated history only. Keyframes 4-5 fall into window 0 beside the real history 0-1,
    and are window 1's whole history: frames 0-9 sample the same with and without stabilization; window 2 (history
    8-9, generated) does not."""
    keys = torch.randn(3, 2, *FRAME, generator=torch.Generator().manual_seed(9))
    outs = [history_rollout(gen, PROMPTS, FRAME, 12, seed=2, history=_history(), config=ODE, window=6, context=2,
                            guidance=HistoryGuidance(stabilization=s), keyframes=keys, keyframe_positions=[4, 5])
            for s in (0.0, 0.3)]
    assert [w["keyframes"] for w in outs[0].windows] == [2, 0, 0]
    assert torch.equal(outs[0].video[:, :10], outs[1].video[:, :10])
    assert (outs[0].video[:, 10:] - outs[1].video[:, 10:]).abs().max() > 1e-3


@pytest.mark.parametrize("kwargs, match", [
    ({"keyframe_positions": [8, 9]}, "without keyframes"),
    ({"keyframes": torch.zeros(3, 2, *FRAME)}, "need keyframe_positions"),
    ({"keyframes": torch.zeros(3, 2, *FRAME), "keyframe_positions": [8]}, "one position per keyframe"),
    ({"keyframes": torch.zeros(3, 2, *FRAME), "keyframe_positions": [8, 8]}, r"distinct frame indices in \[2, 12\)"),
    ({"keyframes": torch.zeros(3, 2, *FRAME), "keyframe_positions": [1, 2]}, r"distinct frame indices in \[2, 12\)"),
    ({"keyframes": torch.zeros(3, 2, *FRAME), "keyframe_positions": [11, 12]}, r"distinct frame indices"),
    ({"keyframes": torch.zeros(2, 2, *FRAME), "keyframe_positions": [8, 9]}, "2 samples for 3 prompts"),
    ({"keyframes": torch.zeros(3, 1, *FRAME), "keyframe_positions": [7]}, "temporal patch"),
])
def test_bad_keyframes_are_refused(gen, kwargs, match):
    with pytest.raises(ValueError, match=match):
        history_rollout(gen, PROMPTS, FRAME, 12, seed=2, history=_history(), config=ODE, window=6, context=2, **kwargs)


def test_the_default_rule_shows_generated_history_at_dfots_stabilization_level(gen, monkeypatch):
    """Issue 48: history_rollout's default rule (HistoryGuidance()) now sees a later window's generated history at
    DFoT's level 0.02, sigma 0.0402 at equal SNR (it was clean); the given history stays clean."""
    seen = []
    real = gen.velocity

    def spy(x, sigma, cond, **kw):
        seen.append(sigma.clone())
        return real(x, sigma, cond, **kw)

    monkeypatch.setattr(gen, "velocity", spy)
    history_rollout(gen, PROMPTS, FRAME, 6, seed=0, history=_history(),
                    config=RolloutConfig(num_steps=1, kernel="ode", micro_batch_size=16), window=4)
    first, second = (s[:3] for s in seen)  # one view (conditional), 3 samples
    assert len(seen) == 2 and (first[:, :2] == 0).all()
    assert torch.equal(second[:, :2], torch.full((3, 2), 0.04015957521372477, dtype=torch.float32))


def test_dfot_units_roll_out_exactly_as_the_converted_sigmas(gen):
    from genrl.flow import dfot_level_to_sigma

    in_dfot = HistoryGuidance("fractional", scale=3.0, fractional_sigma=0.4, stabilization=0.02, units="dfot")
    in_sigma = HistoryGuidance("fractional", scale=3.0, fractional_sigma=dfot_level_to_sigma(0.4),
                               stabilization=dfot_level_to_sigma(0.02))
    a, b = (history_rollout(gen, PROMPTS, FRAME, 8, seed=3, history=_history(), guidance=rule, config=ODE, window=4)
            for rule in (in_dfot, in_sigma))
    assert torch.equal(a.video, b.video) and torch.equal(a.log_probs, b.log_probs)
    # and differ from reading DFoT's numbers as sigmas (genrl before issue 48)
    as_sigma = history_rollout(gen, PROMPTS, FRAME, 8, seed=3, history=_history(), config=ODE, window=4,
                               guidance=HistoryGuidance("fractional", scale=3.0, fractional_sigma=0.4,
                                                        stabilization=0.02))
    assert (as_sigma.video[:, 2:] - a.video[:, 2:]).abs().max() > 1e-4
