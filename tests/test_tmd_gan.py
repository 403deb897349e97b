"""DMD2-v's GAN term in TMD's stage 2: the non-saturating and logistic losses in closed form, the Conv3D feature
heads, the generator loss through the frozen teacher's features (value and gradient linear in gan_weight), the
heads trained with the critic while the teacher stays frozen, and the options' errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from genrl.flow import gan_discriminator_loss, gan_generator_loss
from genrl.methods.tmd import TMD
from genrl.models import FeatureGANHeads
from genrl.models.roles import swapped_transformer
from genrl.models.trunk import trunk_adapter

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle moving left", "a blue square moving up", "a green triangle", "a cyan circle staying still"]


def test_gan_losses_in_closed_form():
    """Generator: mean log(1 + exp(-l)), gradient -(1 - sigmoid(l)) / B; discriminator: mean log(1 + exp(-l_r)) +
    mean log(1 + exp(l_f)); at zero logits log 2 and 2 log 2 (float64 references)."""
    g = torch.Generator().manual_seed(0)
    fake = (torch.randn(6, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    real = torch.randn(4, generator=g, dtype=torch.float64) * 3
    loss = gan_generator_loss(fake)
    ref = torch.log1p(torch.exp(-fake.detach())).mean()
    assert loss.dtype == torch.float32 and abs(float(loss) - float(ref)) < 1e-6
    (grad,) = torch.autograd.grad(loss, fake)
    torch.testing.assert_close(grad, -(1 - torch.sigmoid(fake.detach())) / 6, atol=1e-7, rtol=0)
    d = gan_discriminator_loss(real, fake.detach())
    d_ref = torch.log1p(torch.exp(-real)).mean() + torch.log1p(torch.exp(fake.detach())).mean()
    assert abs(float(d) - float(d_ref)) < 1e-6
    assert float(gan_generator_loss(torch.zeros(3))) == pytest.approx(math.log(2), abs=1e-7)
    assert float(gan_discriminator_loss(torch.zeros(2), torch.zeros(5))) == pytest.approx(2 * math.log(2), abs=1e-7)
    # a discriminator that separates real (large positive) from fake (large negative) has loss near 0
    assert float(gan_discriminator_loss(torch.full((2,), 30.0), torch.full((2,), -30.0))) < 1e-12


def test_feature_heads_score_each_sample_alone_and_sum_their_taps():
    """[B] float32 logits, one head per tap, summed; a sample's logit does not depend on the rest of the batch
    (GroupNorm is per sample); image grids (F = 1) work; a wrong number of grids is refused."""
    torch.manual_seed(0)
    heads = FeatureGANHeads(8, num_taps=2, channels=4)
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(3, 8, 2, 4, 4, generator=g), torch.randn(3, 8, 2, 4, 4, generator=g)]
    logits = heads(feats)
    assert logits.shape == (3,) and logits.dtype == torch.float32
    alone = heads([f[1:2] for f in feats])
    torch.testing.assert_close(alone, logits[1:2], atol=1e-6, rtol=0)
    parts = [h(f).squeeze(-1) for h, f in zip(heads.heads, feats, strict=True)]
    torch.testing.assert_close(logits, parts[0] + parts[1], atol=1e-6, rtol=0)
    assert heads([torch.randn(2, 8, 1, 3, 5), torch.randn(2, 8, 1, 3, 5)]).shape == (2,)
    with pytest.raises(ValueError, match="1 feature grids for 2 GAN heads"):
        heads(feats[:1])
    with pytest.raises(ValueError, match="num_taps >= 1"):
        FeatureGANHeads(8, num_taps=0)


def _stage2(tiny_policy, tiny_text_encoder, **kwargs) -> TMD:
    args = dict(generator={"family": "dit", "pretrained": tiny_policy, "text_encoder": tiny_text_encoder},
                stage="dmd", head_layers=1, seed=3, teacher={"pretrained": tiny_policy}, gan_channels=8)
    args.update(kwargs)
    model = TMD(**args)
    model.configure_model()
    return model


def _data(b: int = 4):
    x0 = torch.randn(b, 8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return x0, torch.tensor([5, 0, 9, 2])[:b]


def test_generator_loss_adds_the_weighted_gan_term_through_the_teachers_features(tiny_policy, tiny_text_encoder):
    """gan_weight w: the generator loss is VSD + w softplus(-heads(teacher features of x_sigma)) with x_sigma the
    VSD's noising of x_hat (recomputed here from the teacher's own trunk); the student's gradient is affine in w
    (grad(w) = grad(0) + w grad_gan) and the GAN part is not zero; w = 0 builds no heads."""
    plain = _stage2(tiny_policy, tiny_text_encoder)
    assert plain.gan_heads is None and "gan_heads" not in plain.roles.table
    model = _stage2(tiny_policy, tiny_text_encoder, gan_weight=0.5)
    assert model.gan_layers == [1, 2]  # the default for L = 2: round(1.06), round(1.54), 2
    x0, idx = _data()
    cond = model.generator.encode_prompts(PROMPTS)
    params = [p for p in model.generator.transformer.parameters() if p.requires_grad]

    def grads(weight: float):
        model.hparams.gan_weight = weight
        x_hat = model.student_sample(x0, cond, idx, it=1)
        out = model.vsd_step_loss(x_hat, cond, idx, it=1)
        return out, torch.cat([g.flatten() for g in torch.autograd.grad(out["loss"], params)])

    out, g_half = grads(0.5)
    _, g_zero = grads(0.0)
    _, g_one = grads(1.0)
    torch.testing.assert_close(g_one - g_zero, 2 * (g_half - g_zero), atol=1e-6, rtol=1e-4)
    assert float((g_one - g_zero).abs().max()) > 1e-6
    # the value, restated from the teacher's trunk at the VSD's own noising
    from genrl.methods.distill import dmd_noised
    from genrl.methods.tmd import _S_DMD
    from genrl.noise import mix_seed

    h = model.hparams
    with torch.no_grad():
        x_hat = model.student_sample(x0, cond, idx, it=1)
        sigma, _, x_sigma = dmd_noised(x_hat, idx, mix_seed(h.seed, 1), _S_DMD, h.dmd_shift, h.min_timestep,
                                       h.max_timestep)
        with swapped_transformer(model.generator, model.roles.get("teacher")) as gen:
            feats = trunk_adapter(gen).features_at(x_sigma, sigma, cond, [1, 2])
        want = torch.nn.functional.softplus(-model.gan_heads(feats)).mean()
    assert float(out["gan"]) == pytest.approx(float(want), rel=1e-5)


def test_critic_step_trains_the_heads_on_real_against_fake_and_leaves_the_teacher(tiny_policy, tiny_text_encoder):
    """The critic's loss gains the logistic loss of the heads on the teacher's features of noised data (real) vs
    noised samples (fake), at the critic's sigma; an optimizer step of the critic's optimizer moves the heads and not
    the teacher; without the data latents it is an error."""
    torch.manual_seed(0)  # the heads' initialisation, whatever ran before
    model = _stage2(tiny_policy, tiny_text_encoder, gan_weight=0.03)
    with torch.no_grad():  # fresh heads give logits near 0 for everything: spread them so real / fake differ
        for head in model.gan_heads.heads:
            head[-1].weight.mul_(300.0)
    x0, idx = _data()
    cond = model.generator.encode_prompts(PROMPTS)
    with torch.no_grad():
        x_hat = model.student_sample(x0, cond, idx, it=2)
    out = model.critic_step_loss(x_hat, cond, idx, 2, x0)
    base = TMD.critic_step_loss(_stage2(tiny_policy, tiny_text_encoder), x_hat, cond, idx, 2)
    assert float(out["loss"]) == pytest.approx(float(base["loss"]) + float(out["gan"]), rel=1e-5)
    assert 0.0 <= float(out["gan_accuracy"]) <= 1.0
    # restated: real = noised data (its own noise stream), fake = the critic's noising of x_hat, at the critic's sigma
    from genrl.flow import add_noise
    from genrl.methods.distill import dmd_noised
    from genrl.methods.tmd import _S_CRITIC, _S_GAN_REAL
    from genrl.noise import mix_seed, randn_per_sample

    h, seed = model.hparams, mix_seed(model.hparams.seed, 2)
    sigma, _, fake = dmd_noised(x_hat, idx, seed, _S_CRITIC, h.dmd_shift, h.min_timestep, h.max_timestep)
    real = add_noise(x0, randn_per_sample(x0.shape[1:], seed, idx, stream=_S_GAN_REAL), sigma)
    with torch.no_grad(), swapped_transformer(model.generator, model.roles.get("teacher")) as gen:
        adapter = trunk_adapter(gen)
        l_real = model.gan_heads(adapter.features_at(real, sigma, cond, [1, 2]))
        l_fake = model.gan_heads(adapter.features_at(fake, sigma, cond, [1, 2]))
    assert float(out["gan"]) == pytest.approx(float(gan_discriminator_loss(l_real, l_fake)), rel=1e-5)
    assert float((l_real - l_fake).abs().max()) > 0.1  # the spread heads tell the two inputs apart
    assert float(out["gan"]) != pytest.approx(float(gan_discriminator_loss(l_fake, l_real)), rel=1e-3)  # roles matter
    heads = {k: v.clone() for k, v in model.gan_heads.state_dict().items()}
    teacher = {k: v.clone() for k, v in model.roles.get("teacher").state_dict().items()}
    opt = torch.optim.SGD(list(model.critic.parameters()) + list(model.gan_heads.parameters()), lr=0.1)
    out["loss"].backward()
    opt.step()
    assert any(not torch.equal(heads[k], v) for k, v in model.gan_heads.state_dict().items())
    assert all(torch.equal(teacher[k], v) for k, v in model.roles.get("teacher").state_dict().items())
    with pytest.raises(ValueError, match="data latents x0"):
        model.critic_step_loss(x_hat, cond, idx, 2)


def test_gan_options_are_checked(tiny_policy, tiny_text_encoder):
    with pytest.raises(ValueError, match="applies to stage 'dmd' only; got 0.03 in stage 'meanflow'"):
        TMD(generator={"family": "dit", "pretrained": tiny_policy, "text_encoder": tiny_text_encoder}, gan_weight=0.03)
    with pytest.raises(ValueError, match="gan_weight must be >= 0"):
        TMD(generator={"family": "dit", "pretrained": tiny_policy, "text_encoder": tiny_text_encoder}, stage="dmd",
            gan_weight=-1.0)
    with pytest.raises(ValueError, match=r"gan_layers \[3\]: block counts of the teacher must be in 1 \.\. L = 2"):
        _stage2(tiny_policy, tiny_text_encoder, gan_weight=0.03, gan_layers=[3])


def test_shapes_stage2_config_trains_with_the_gan_term_through_the_cli(tmp_path, monkeypatch, tiny_policy,
                                                                       tiny_text_encoder):
    """configs/tmd/shapes_dmd.yaml with gan_weight 0.03 through `genrl fit` (fresh head, tiny student): the heads are
    a checkpointed role stepped by the critic's optimizer, the GAN losses and accuracy are logged, and the heads
    move."""
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401
    from genrl.cli import GenRLCLI

    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "configs/tmd/shapes_dmd.yaml"),
            f"--model.init_args.generator.pretrained={tiny_policy}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
            f"--model.init_args.teacher.pretrained={tiny_policy}", "--model.init_args.head_init=null",
            "--model.init_args.gan_weight=0.03", "--model.init_args.gan_channels=8",
            "--model.init_args.critic_updates_per_generator_update=2",
            "--data.init_args.batch_size=2", "--data.init_args.val_size=2", "--data.init_args.num_workers=0",
            "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0"]
    cli = GenRLCLI(args=args, run=False)
    cli.model.configure_model()
    before = {k: v.clone() for k, v in cli.model.gan_heads.state_dict().items()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    m = cli.trainer.logged_metrics
    assert {"train/gan_generator_loss", "train/gan_discriminator_loss", "train/gan_accuracy"} <= set(m)
    _, opt_c = cli.model.optimizers()
    in_critic_opt = {id(p) for group in opt_c.optimizer.param_groups for p in group["params"]}
    assert all(id(p) in in_critic_opt for p in cli.model.gan_heads.parameters())
    assert any(not torch.equal(before[k], v) for k, v in cli.model.gan_heads.state_dict().items())
    assert any(k.startswith("gan_heads.") for k in cli.model.state_dict())
