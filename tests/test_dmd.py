"""DMD with Self-Forcing rollouts (docs/methods/distillation.md, Invariants tested): zero point, gradient
algebra through the method, two-optimizer cadence under gradient accumulation, accumulation == one batch,
resume == uninterrupted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.flow.dmd import dmd_gradient

ROOT = Path(__file__).resolve().parents[1]
DMD_CFG = str(ROOT / "configs/dmd/shapes.yaml")
TINY = str(ROOT / "configs/tiny/dmd.yaml")


def _cli(args: list[str], run: bool = True) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", DMD_CFG, "--config", TINY, "--trainer.enable_progress_bar=false"]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _method(tiny_causal, *extra):
    cli = _cli([*tiny_causal, *extra], run=False)
    model = cli.model
    model.configure_model()
    return model


def test_dmd_gradient_is_zero_when_critic_equals_teacher_without_cfg(tiny_causal):
    model = _method(tiny_causal, "--model.init_args.teacher_cfg_scale=1.0")
    model.critic.load_state_dict(model.roles.get("teacher").state_dict())
    cond = model.generator.encode_prompts(["a red circle moving left", "a blue square moving up"])
    out = model.generator_loss(cond, torch.tensor([0, 1]), it=0)
    out["loss"].backward()
    grads = [p.grad for p in model.generator.transformer.parameters()]
    assert all(g is not None for g in grads)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    # and with CFG w = 2 the same setup pushes the student (the test can fail)
    model2 = _method(tiny_causal, "--model.init_args.teacher_cfg_scale=2.0")
    model2.critic.load_state_dict(model2.roles.get("teacher").state_dict())
    model2.generator_loss(cond, torch.tensor([0, 1]), it=0)["loss"].backward()
    assert any(p.grad.abs().sum() > 0 for p in model2.generator.transformer.parameters())


def test_generator_gradient_is_the_dmd_direction_through_the_rollout(tiny_causal):
    """d loss / d theta equals d<sg(g), x>/d theta / N: the loss only routes g / N into the rollout's graph."""
    model = _method(tiny_causal)
    cond = model.generator.encode_prompts(["a red circle moving left", "a blue square moving up"])
    captured = {}
    import genrl.methods.dmd as dmd_mod

    real = dmd_mod.dmd_gradient

    def spy(x, x0_fake, x0_real, **kw):
        captured["x"], captured["g"] = x, real(x, x0_fake, x0_real, **kw)
        return captured["g"]

    dmd_mod.dmd_gradient = spy
    try:
        out = model.generator_loss(cond, torch.tensor([0, 1]), it=0)
    finally:
        dmd_mod.dmd_gradient = real
    params = [p for p in model.generator.transformer.parameters()]
    grads = torch.autograd.grad(out["loss"], params, retain_graph=True, allow_unused=True)
    x, g = captured["x"], captured["g"]
    surrogate = (g.detach().to(x.dtype) * x).sum() / x.numel()  # every frame carries a graph here
    ref = torch.autograd.grad(surrogate, params, allow_unused=True)
    assert sum(a is not None for a in grads) > len(params) // 2
    for a, b in zip(grads, ref):
        if a is None:
            assert b is None or b.abs().max() == 0
            continue
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-4)
    assert g.abs().sum() > 0 and torch.equal(g, dmd_gradient(x, *_x0s(model, cond, x)))


def _x0s(model, cond, x):
    sigma, _, x_t = model._noised(x, torch.tensor([0, 1]), 0, 21)
    with torch.no_grad():
        return model.fake_x0(x_t, sigma, cond), model.real_x0(x_t, sigma, cond)


def test_accumulated_micro_batches_equal_one_batch(tiny_causal):
    model = _method(tiny_causal)
    prompts = ["a red circle moving left", "a blue square moving up", "a green triangle", "a cyan circle"]
    idx = torch.arange(4)

    def grads(rows_list):
        for p in list(model.generator.transformer.parameters()) + list(model.critic.parameters()):
            p.grad = None
        for rows in rows_list:
            cond = model.generator.encode_prompts([prompts[i] for i in rows])
            loss = (model.generator_loss(cond, idx[rows], it=0)["loss"]
                    + model.critic_step_loss(cond, idx[rows], 0)["loss"])
            (loss / len(rows_list)).backward()
        params = list(model.generator.transformer.parameters()) + list(model.critic.parameters())
        return [p.grad.clone() for p in params]

    one = grads([[0, 1, 2, 3]])
    two = grads([[0, 1], [2, 3]])
    for a, b in zip(one, two):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()
    assert any(a.abs().sum() > 0 for a in one)


def test_max_steps_counts_iterations_and_resume_equals_uninterrupted(tmp_path, monkeypatch, tiny_causal):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _cli([*tiny_causal, "--trainer.max_steps=4", "--trainer.enable_progress_bar=true"])
    # ratio 2: iterations 0 and 2 step both networks, 1 and 3 only the critic; max_steps 4 = 4 iterations (6
    # optimizer steps), checkpoints every 2 iterations, the progress bar ends at 4 of 4
    assert int(full.model.iteration) == 4 and full.trainer.global_step == 4
    opt_g, opt_c = full.model.optimizers()
    assert opt_g.optimizer.state[next(iter(opt_g.optimizer.state))]["step"] == 2
    assert opt_c.optimizer.state[next(iter(opt_c.optimizer.state))]["step"] == 4
    assert sorted(p.name for p in Path("runs/dmd_shapes/checkpoints").glob("epoch=*")) == [
        "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    bar = full.trainer.progress_bar_callback.train_progress_bar  # rich's task of the training bar
    assert (bar.completed, bar.total) == (4, 4)
    metrics = full.trainer.logged_metrics
    assert "val/total" in metrics and "train/critic_loss" in metrics and "train/dmd_grad_rms" in metrics
    # the checkpoint loads as a causal student that generate.py samples chunk by chunk
    from genrl.models.loading import load_generator
    from pipelines.generate import main as generate

    ckpt = str(tmp_path / "a/runs/dmd_shapes/checkpoints/last.ckpt")
    student = load_generator(ckpt, text_encoder=tiny_causal[2].split("=", 1)[1])
    assert student.causal is not None and student.schedule.timesteps == [1000.0, 500.0]
    records = generate(["--model", ckpt, "--text-encoder", tiny_causal[2].split("=", 1)[1], "--prompt",
                        "a red circle moving left", "--out", str(tmp_path / "samples")])
    assert records[0]["kernel"] == "causal_consistency" and records[0]["steps"] == 2
    assert (tmp_path / "samples" / records[0]["file"]).is_file()
    # an export records the chunk schedule next to the weights; loading it gives the causal student back
    from genrl.callbacks import DiffusersExport

    DiffusersExport(dirpath=str(tmp_path / "export")).on_train_end(full.trainer, full.model)
    exported = load_generator(str(tmp_path / "export"), text_encoder=tiny_causal[2].split("=", 1)[1])
    assert exported.schedule.timesteps == [1000.0, 500.0] and exported.causal.chunk_size == 2
    assert exported.load_info["ema"] is True  # the tiny config has the EMA callback: the export holds its weights

    monkeypatch.chdir(tmp_path / "b")
    _cli([*tiny_causal, "--trainer.max_steps=2"])
    resumed = _cli([*tiny_causal, "--trainer.max_steps=4", "--ckpt_path=last"])
    assert int(resumed.model.iteration) == 4
    sd_full, sd_res = full.model.state_dict(), resumed.model.state_dict()
    for k in sd_full:  # tensors, and the reward manager's state (the scorer's extra state)
        if torch.is_tensor(sd_full[k]):
            assert torch.allclose(sd_full[k].float(), sd_res[k].float(), atol=1e-6), k
        else:
            assert sd_full[k] == sd_res[k], k

    # gradient accumulation over 2 micro-batches: the same 4 iterations and 2 + 4 optimizer steps
    monkeypatch.chdir(tmp_path / "c")
    acc = _cli([*tiny_causal, "--trainer.max_steps=4", "--model.init_args.accumulate_grad_batches=2",
                "--trainer.val_check_interval=8"])
    assert int(acc.model.iteration) == 4 and int(acc.model.micro_step) == 8

    # the student and the critic both changed; the teacher is a registered child but not checkpointed
    base = torch.load(next(Path(tmp_path / "a").rglob("epoch=*step=2.ckpt")), weights_only=False)["state_dict"]
    assert not any(k.startswith("frozen.") for k in base)
    assert any(n.startswith("frozen.teacher.") for n, _ in full.model.named_parameters())
    changed = {k.split(".")[0] for k in sd_full
               if k in base and torch.is_tensor(base[k]) and not torch.equal(sd_full[k], base[k])}
    assert {"generator", "critic"} <= changed


def test_bad_settings_raise(tiny_causal):
    with pytest.raises(ValueError, match="chunk"):
        _method(tiny_causal, "--model.init_args.num_frames=7")
    with pytest.raises(ValueError, match="critic_updates_per_generator_update"):
        _method(tiny_causal, "--model.init_args.critic_updates_per_generator_update=0")


def test_generator_loss_weight_hook_scales_the_dmd_gradient_per_sample(tiny_causal):
    """The weight hook (for reward-weighted DMD): w = [2, 0] doubles sample 0's share of the loss and removes sample 1's
    (the loss is 0.5 sum(w (x - sg(x - g))^2) / N, so it is linear in w per sample); None leaves DMD unchanged."""
    model = _method(tiny_causal)
    cond = model.generator.encode_prompts(["a red circle moving left", "a blue square moving up"])
    idx = torch.tensor([0, 1])
    seen = {}

    def only(i):
        def hook(x, x0_fake, x0_real, indices, *, prompts, method):
            seen["args"] = (x.shape, x0_fake.shape, x0_real.shape, indices.tolist())
            seen["prompts"], seen["method"] = prompts, method
            return torch.tensor([1.0, 0.0]) if i == 0 else torch.tensor([0.0, 1.0])
        return hook

    plain = float(model.generator_loss(cond, idx, it=0)["loss"])
    model.generator_loss_weight = only(0)
    first = float(model.generator_loss(cond, idx, it=0, prompts=["p0", "p1"])["loss"])
    assert seen["prompts"] == ["p0", "p1"] and seen["method"] is model
    model.generator_loss_weight = only(1)
    second = float(model.generator_loss(cond, idx, it=0)["loss"])
    model.generator_loss_weight = lambda *a, **k: 2.0
    doubled = float(model.generator_loss(cond, idx, it=0)["loss"])
    assert seen["args"][3] == [0, 1] and seen["args"][0] == seen["args"][1] == seen["args"][2]
    assert first > 0 and second > 0 and first != second
    assert first + second == pytest.approx(plain, rel=1e-5) and doubled == pytest.approx(2 * plain, rel=1e-5)
