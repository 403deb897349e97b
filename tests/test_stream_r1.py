"""Stream-R1 = DMD + StreamR1Weighting (genrl.methods.stream_r1), through the real CLI on a tiny causal student:
beta 0 with a flat saliency is DMD bit for bit, no gradient reaches the student through the reward, the weights are
logged, the balance history is checkpointed and a resumed run equals an uninterrupted one, each knob changes the
weight."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.methods.stream_r1 import StreamR1Weighting
from genrl.rewards import RewardModel, register_reward

ROOT = Path(__file__).resolve().parents[1]
DMD_CFG = str(ROOT / "configs/dmd/shapes.yaml")
STREAM = str(ROOT / "configs/stream_r1/shapes.yaml")
TINY = str(ROOT / "configs/tiny/dmd.yaml")
PROMPTS = ["a red circle moving left", "a blue square moving up"]


@register_reward("test_flat_saliency")
class _Flat(RewardModel):
    """Differentiable and linear in the pixels: its input gradient (so its saliency) is the same everywhere."""

    differentiable = True
    dimensions = ("reward", "a", "b", "c")
    channels = (3,)

    def score(self, pixels, prompts, **meta):
        m = pixels.mean(dim=(1, 2, 3, 4))
        return {"reward": m, "a": m, "b": 2 * m, "c": 3 * m}


def _cli(args: list[str], run: bool = True) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", DMD_CFG, "--config", STREAM, "--config", TINY, "--trainer.enable_progress_bar=false"]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _method(tiny_causal, *extra):
    cli = _cli([*tiny_causal, *extra], run=False)
    cli.model.configure_model()
    return cli.model


def _spied(weighting, seen: dict):
    """``weighting`` as a hook that also keeps the weight it returned in ``seen["w"]``."""
    def spy(*args, **kwargs):
        seen["w"] = weighting(*args, **kwargs)
        return seen["w"]
    return spy


def _grads(model, weight_hook, it: int = 0):
    """Generator loss and gradients with ``weight_hook`` as the DMD weight (None: plain DMD)."""
    model.generator.zero_grad(set_to_none=True)
    model.generator_loss_weight = weight_hook if weight_hook is not None else (lambda *a, **k: None)
    cond = model.generator.encode_prompts(PROMPTS)
    out = model.generator_loss(cond, torch.tensor([0, 1]), it, PROMPTS)
    out["loss"].backward()
    return out["loss"].detach(), {n: p.grad.clone() for n, p in model.generator.transformer.named_parameters()}


def test_beta_zero_with_a_flat_saliency_is_dmd_bit_for_bit(tiny_causal):
    model = _method(tiny_causal, "--model.init_args.weighting.init_args.beta=0.0",
                    "--model.init_args.weighting.init_args.reward={name: test_flat_saliency}",
                    "--model.init_args.weighting.init_args.dimensions=[a, b, c]",
                    "--model.init_args.weighting.init_args.normalization={}")
    weighting, seen = model.weighting, {}
    spy = _spied(weighting, seen)
    loss_w, grads_w = _grads(model, spy)
    assert torch.equal(seen["w"], torch.ones_like(seen["w"]))
    loss, grads = _grads(model, None)
    assert torch.equal(loss_w, loss)
    assert all(torch.equal(grads_w[n], grads[n]) for n in grads)
    assert weighting.last["stream_r1/w_intra_std"] == 0.0 and weighting.last["stream_r1/w_inter_mean"] == 1.0


def test_no_gradient_reaches_the_student_through_the_reward(tiny_causal):
    """The weight is a constant of the loss: the student's gradients with the live weighting equal those with its
    weight replayed as a plain tensor, the weight has no graph, and the reward's parameters get no gradient."""
    model = _method(tiny_causal)
    weighting, seen = model.weighting, {}
    spy = _spied(weighting, seen)
    _, live = _grads(model, spy)
    w = seen["w"]
    assert w.grad_fn is None and not w.requires_grad
    assert w.shape == (2, 8, 1, 16, 16)  # [B, T, 1, H, W]: the latent grid, broadcast over channels
    assert bool((w > 0).all()) and float(w.std()) > 0  # the shapes reward's saliency is not flat
    assert all(p.grad is None for p in weighting.reward.parameters())
    _, replay = _grads(model, lambda *a, **k: w.clone())
    assert all(torch.equal(live[n], replay[n]) for n in live)
    _, plain = _grads(model, None)
    assert any(not torch.equal(live[n], plain[n]) for n in live)  # and the weight did change the update


def test_each_knob_changes_the_weight(tiny_causal):
    model = _method(tiny_causal)
    cond = model.generator.encode_prompts(PROMPTS)
    out = model.student_rollout(cond, torch.tensor([0, 1]), 7, grad=False)
    x = out.latents
    args = (x, x, x, torch.tensor([0, 1]))

    def weight(**kw):
        w = StreamR1Weighting(**{"reward": {"name": "shapes_video"}, **kw})
        return w(*args, prompts=PROMPTS, method=model)

    both, inter, intra = weight(), weight(intra=False), weight(inter=False)
    assert torch.allclose(inter.mean((1, 2, 3, 4)), inter[:, 0, 0, 0, 0])  # inter only: one value per rollout
    assert torch.allclose(intra.mean((1, 2, 3, 4)).double(), torch.ones(2, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(both, inter * intra, rtol=1e-5)
    assert not torch.allclose(weight(beta=0.5), both)
    assert not torch.allclose(weight(spatial_floor=0.9), both)
    assert not torch.allclose(weight(temporal_floor=0.9), both)
    assert torch.equal(weight(inter=False, intra=False), torch.ones_like(both))


def test_stream_r1_trains_logs_checkpoints_its_history_and_resumes(tmp_path, monkeypatch, tiny_causal):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _cli([*tiny_causal, "--trainer.limit_val_batches=0"])
    model = full.model
    assert int(model.weighting.filled) == 2  # generator updates at iterations 0 and 2
    m = full.trainer.logged_metrics
    for key in ("stream_r1/w_inter_mean", "stream_r1/w_intra_max", "stream_r1/r_final", "stream_r1/penalty",
                "stream_r1/fusion_text_alignment", "stream_r1/text_alignment", "train/generator_loss"):
        assert key in m and math.isfinite(float(m[key])), key
    assert float(m["stream_r1/w_intra_max"]) >= 1.0 >= float(m["stream_r1/w_intra_min"]) > 0.0
    assert float(m["stream_r1/w_inter_min"]) > 0.0 and float(m["stream_r1/invalid"]) == 0.0
    # the tiny config's callbacks write under runs/dmd_shapes
    ckpt = torch.load(tmp_path / "a/runs/dmd_shapes/checkpoints/last.ckpt", weights_only=False)
    assert torch.equal(ckpt["state_dict"]["weighting.history"], model.weighting.history.cpu())
    monkeypatch.chdir(tmp_path / "b")
    _cli([*tiny_causal, "--trainer.limit_val_batches=0", "--trainer.max_steps=2"])
    resumed = _cli([*tiny_causal, "--trainer.limit_val_batches=0", "--ckpt_path=last"])
    assert torch.equal(resumed.model.weighting.history, model.weighting.history)
    a = dict(model.generator.transformer.named_parameters())
    for n, p in resumed.model.generator.transformer.named_parameters():
        assert torch.allclose(p, a[n], atol=1e-6, rtol=0), n


def test_bad_weightings_are_named():
    with pytest.raises(ValueError, match="not in dimensions"):
        StreamR1Weighting(normalization={"vq": [0.0, 1.0]})
    with pytest.raises(ValueError, match="std > 0"):
        StreamR1Weighting(normalization={"text_alignment": [0.5, 0.0]})
    with pytest.raises(ValueError, match="even"):
        StreamR1Weighting(window=3)
    with pytest.raises(ValueError, match="beta"):
        StreamR1Weighting(beta=-1.0)


def test_a_dimension_the_reward_does_not_return_is_named_with_the_ones_it_does(tiny_causal):
    model = _method(tiny_causal, "--model.init_args.weighting.init_args.reward={name: test_flat_saliency}",
                    "--model.init_args.weighting.init_args.dimensions=[a, b, motion_qualty]",
                    "--model.init_args.weighting.init_args.normalization={}")
    with pytest.raises(ValueError, match=r"\['motion_qualty'\] are not outputs .* returns \['a', 'b', 'c', "
                                         r"'reward'\]"):
        _grads(model, model.weighting)
