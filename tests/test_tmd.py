"""The TMD method (genrl.methods.TMD): both stages' losses against closed forms on a closed-gate student, the CFG
knob of the stage-1 target, gradients through the stage-2 rollout, the configs through the real CLI (shapes world
and tiny random Wan, both stages), the exported flow head, and resume equals uninterrupted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from genrl.flow import transition_grid
from genrl.methods.tmd import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, TMD, load_head

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle moving left", "a blue square moving up", "a green triangle", "a cyan circle staying still"]


def _cli(args: list[str], run: bool = True):
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401
    from genrl.cli import GenRLCLI

    return GenRLCLI(args=(["fit"] if run else []) + args, run=run)


def _method(tiny_policy, tiny_text_encoder, **kwargs) -> TMD:
    args = dict(generator={"family": "dit", "pretrained": tiny_policy, "text_encoder": tiny_text_encoder},
                head_layers=1, caption_dropout=0.0, seed=3)
    args.update(kwargs)
    model = TMD(**args)
    model.configure_model()
    return model


def _close_gate(model: TMD) -> None:
    with torch.no_grad():
        model.flow_head.alpha.fill_(-float("inf"))  # sigmoid(-inf) == 0: the head sees the backbone's tokens only


def _spy_features(monkeypatch) -> list:
    """Record every (x_t, t) the student's backbone is called with (TransitionModel.features, for this test)."""
    from genrl.models.trunk import TransitionModel

    seen, real = [], TransitionModel.features

    def features(self, x, t, cond):
        seen.append((x.detach().clone(), t.detach().clone()))
        return real(self, x, t, cond)

    monkeypatch.setattr(TransitionModel, "features", features)
    return seen


@pytest.mark.parametrize("parameterization", ["noise", "denoiser"])
def test_closed_gate_stage1_loss_is_the_teachers_flow_matching_error(tiny_policy, tiny_text_encoder,
                                                                     parameterization, monkeypatch):
    """With the gate closed, the head's time at t_i and r = s always, the head returns the teacher velocity v_T(x_t, t),
    the target is the conditional velocity v = y1 - y, so u - target is y - v_T ("noise") or (y - v_T) / s
    ("denoiser"), with y = x1 - x0: the stage-1 error is the teacher's flow-matching error at x_t, in closed form."""
    model = _method(tiny_policy, tiny_text_encoder, p_equal=1.0, head_time="outer", parameterization=parameterization)
    _close_gate(model)
    seen = _spy_features(monkeypatch)
    x0 = torch.randn(4, 8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([5, 0, 9, 2])
    out = model.meanflow_loss(x0, PROMPTS, idx, it=2)
    (x_t, t), = seen
    grid = transition_grid(2, 10.0, 0.999).float()
    assert all(float(v) in grid[:2].tolist() for v in t)  # an outer grid point t_M .. t_1, never 0
    tt = t.view(-1, 1, 1, 1, 1)
    x1 = (x_t - (1 - tt) * x0) / tt
    with torch.no_grad():
        v_teacher = model.generator.velocity(x_t, t, model.generator.encode_prompts(PROMPTS)).float()
    err = (x1 - x0) - v_teacher
    if parameterization == "denoiser":
        # s is not observable from outside: recover it from the error ratio of one sample and check it is one number
        # in (0.001, 0.999) per sample
        ratio = (out["u_minus_target"] / err)
        s_inv = ratio.flatten(1).median(dim=1).values
        assert torch.allclose(ratio, s_inv.view(-1, 1, 1, 1, 1).expand_as(ratio), rtol=1e-3, atol=1e-3)
        assert bool((s_inv > 1.0).all())
        err = err * s_inv.view(-1, 1, 1, 1, 1)
    assert torch.allclose(out["u_minus_target"], err, atol=2e-4, rtol=1e-4)
    assert float(out["r_equal_s"]) == 1.0


def test_cfg_scale_shifts_the_stage1_target_by_the_teachers_guidance(tiny_policy, tiny_text_encoder, monkeypatch):
    """meanflow_cfg_scale w: y becomes y + (w - 1)(v_T(x_t, c) - v_T(x_t, null)); with a closed gate the error
    changes by exactly that term (w = 1: no teacher role at all)."""
    kwargs = dict(p_equal=1.0, head_time="outer", parameterization="noise")
    plain = _method(tiny_policy, tiny_text_encoder, **kwargs)
    assert plain.teacher_spec is None and "teacher" not in plain.roles.table
    guided = _method(tiny_policy, tiny_text_encoder, meanflow_cfg_scale=3.0, negative_prompt="blurry", **kwargs)
    x0 = torch.randn(4, 8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    idx = torch.arange(4)
    outs = []
    for m in (plain, guided):
        _close_gate(m)
        outs.append(m.meanflow_loss(x0, PROMPTS, idx, it=0)["u_minus_target"])
    seen = _spy_features(monkeypatch)
    guided.meanflow_loss(x0, PROMPTS, idx, it=0)
    (x_t, t), = seen
    gen = guided.generator
    with torch.no_grad():
        v_c = gen.velocity(x_t, t, gen.encode_prompts(PROMPTS)).float()
        v_u = gen.velocity(x_t, t, gen.encode_prompts(["blurry"] * 4)).float()
    assert (v_c - v_u).abs().max() > 1e-3
    assert torch.allclose(outs[1] - outs[0], 2.0 * (v_c - v_u), atol=2e-4)


def test_closed_gate_stage2_sample_is_the_teachers_x0_and_gradients_reach_everything(tiny_policy, tiny_text_encoder,
                                                                                    monkeypatch):
    """Stage 2's generator sample x_hat = x_t - t y_hat: with the gate closed, the head's time at t_i and the
    "denoiser" inner flow (which telescopes to y_hat for any N), it is the teacher's x0 prediction x_t - t v_T(x_t, t);
    with an open gate the VSD loss sends gradients to the backbone, the head's own parts and the head blocks."""
    model = _method(tiny_policy, tiny_text_encoder, stage="dmd", head_time="outer", inner_steps=3,
                    teacher={"pretrained": tiny_policy})
    _close_gate(model)
    seen = _spy_features(monkeypatch)
    x0 = torch.randn(2, 8, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    cond = model.generator.encode_prompts(PROMPTS[:2])
    idx = torch.tensor([4, 7])
    with torch.no_grad():
        x_hat = model.student_sample(x0, cond, idx, it=1)
    (x_t, t), = seen
    with torch.no_grad():
        v = model.generator.velocity(x_t, t, cond).float()
    assert torch.allclose(x_hat, x_t - t.view(-1, 1, 1, 1, 1) * v, atol=1e-5)

    with torch.no_grad():
        model.flow_head.alpha.fill_(0.0)
    x_hat = model.student_sample(x0, cond, idx, it=1)
    loss = model.vsd_step_loss(x_hat, cond, idx, it=1)["loss"]
    loss.backward()
    blocks = model.generator.transformer.blocks
    head = model.flow_head
    for name, params in [("backbone block", blocks[0].parameters()), ("head block", blocks[-1].parameters()),
                         ("gate", [head.alpha]), ("fusion modulation", head.fusion_mod.parameters())]:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params), name
    assert all(p.grad is None for p in model.frozen["teacher"].parameters())


def test_bad_arguments_fail_early_with_the_value_named(tiny_policy, tiny_text_encoder):
    with pytest.raises(ValueError, match="stage must be one of"):
        TMD(stage="distill")
    with pytest.raises(ValueError, match="p_equal"):
        TMD(p_equal=1.5)
    with pytest.raises(ValueError, match="head_time"):
        TMD(head_time="middle")
    with pytest.raises(ValueError, match="explicit teacher"):
        TMD(generator={"family": "wan", "components": {}}, stage="dmd")
    model = TMD(generator={"family": "dit", "pretrained": tiny_policy, "text_encoder": tiny_text_encoder},
                head_init=str(ROOT / "assets"))
    with pytest.raises(FileNotFoundError, match="holds no flow_head.safetensors: stage 2 starts from"):
        model.configure_model()
    missing = TMD(generator={"family": "dit", "pretrained": tiny_policy, "text_encoder": tiny_text_encoder},
                  head_init="runs/no_such_stage1/export")
    with pytest.raises(FileNotFoundError, match="does not exist: stage 2 .* run it first"):
        missing.configure_model()


def test_a_head_trained_at_another_split_point_is_refused(tmp_path, tiny_policy, tiny_text_encoder):
    """head_init's flow_head.json records head_layers / head_time / parameterization; a run that sets other values
    fails naming both (the head's parameters do not depend on H, so loading alone would not notice)."""
    from genrl.methods.tmd import save_head

    first = _method(tiny_policy, tiny_text_encoder)
    save_head(first.flow_head, tmp_path, {"head_layers": 1, "head_time": "inner", "parameterization": "denoiser"})
    same = _method(tiny_policy, tiny_text_encoder, head_init=str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(same.flow_head.state_dict().values(),
                                                 first.flow_head.state_dict().values()))
    with pytest.raises(ValueError, match=r"trained with head_time='inner'; this run sets head_time='outer'"):
        _method(tiny_policy, tiny_text_encoder, head_init=str(tmp_path), head_time="outer")
    with pytest.raises(ValueError, match="head_layers"):
        TMD(generator={"family": "dit", "pretrained": tiny_policy, "text_encoder": tiny_text_encoder},
            head_layers=2).configure_model()  # the tiny model has 2 blocks: 1 <= head_layers <= 1


def _shapes_args(tiny_policy, tiny_text_encoder, config: str, out: Path, **extra) -> list[str]:
    args = ["--config", str(ROOT / "configs/tmd" / config),
            f"--model.init_args.generator.pretrained={tiny_policy}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
            "--data.init_args.batch_size=2", "--data.init_args.val_size=2", "--data.init_args.num_workers=0",
            "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--trainer.val_check_interval=2"]
    return args + [f"--{k}={v}" for k, v in extra.items()]


def test_shapes_configs_train_both_stages_export_the_head_and_resume_exactly(tmp_path, monkeypatch, tiny_policy,
                                                                            tiny_text_encoder):
    """configs/tmd/shapes_meanflow.yaml then shapes_dmd.yaml through `genrl fit` (tiny student): stage 1 trains the
    transformer and the head and exports both; stage 2 starts from that export (weights and head), trains student,
    head and critic, leaves the teacher alone; an interrupted stage 2 resumed with --ckpt_path last equals the
    uninterrupted run."""
    monkeypatch.chdir(tmp_path)
    s1 = _cli(_shapes_args(tiny_policy, tiny_text_encoder, "shapes_meanflow.yaml", tmp_path,
                           **{"trainer.max_steps": 2, "model.init_args.warmup_steps": 0}))
    export = tmp_path / "runs/tmd_shapes_meanflow/export"
    assert (export / HEAD_WEIGHTS_FILE).is_file() and (export / "config.json").is_file()
    cfg = json.loads((export / HEAD_CONFIG_FILE).read_text())
    assert cfg["effective_nfe"] == 2 * (1 + 1 / 2) and cfg["head_layers"] == 1  # the tiny student has L = 2
    metrics = s1.trainer.logged_metrics
    assert "train/loss" in metrics and "val/effective_nfe" in metrics
    assert int(s1.model.iteration) == 2

    common = {"trainer.max_steps": 4, "model.init_args.generator.pretrained": str(export),
              "model.init_args.head_init": str(export), "model.init_args.teacher.pretrained": tiny_policy,
              "model.init_args.critic_updates_per_generator_update": 2}
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _cli(_shapes_args(tiny_policy, tiny_text_encoder, "shapes_dmd.yaml", tmp_path, **common))
    head0 = s1.model.flow_head.state_dict()
    exported_head = load_head(type(s1.model.flow_head)(s1.model.student.adapter, 1), export)
    assert exported_head["head_layers"] == 1
    m = full.model
    assert int(m.iteration) == 4 and full.trainer.global_step == 4
    opt_g, opt_c = m.optimizers()
    assert opt_g.optimizer.state[next(iter(opt_g.optimizer.state))]["step"] == 2  # iterations 0 and 2
    assert opt_c.optimizer.state[next(iter(opt_c.optimizer.state))]["step"] == 4
    n_head = sum(1 for _ in m.flow_head.parameters())
    assert len(opt_g.optimizer.param_groups[0]["params"]) == sum(1 for _ in m.generator.transformer.parameters()) \
        + n_head  # the head is stepped with the student
    assert any(not torch.equal(head0[k], v) for k, v in m.flow_head.state_dict().items())
    teacher = m.frozen["teacher"].state_dict()
    from genrl.models import ModelSpec

    shipped = ModelSpec(pretrained=tiny_policy).build().state_dict()
    assert all(torch.equal(teacher[k], v) for k, v in shipped.items())
    assert not any(k.startswith("student.") for k in m.state_dict())  # the head is stored once
    assert "train/critic_loss" in full.trainer.logged_metrics and "train/vsd_grad_rms" in full.trainer.logged_metrics

    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    _cli(_shapes_args(tiny_policy, tiny_text_encoder, "shapes_dmd.yaml", tmp_path,
                      **{**common, "trainer.max_steps": 3, "model.init_args.generator.pretrained": str(export)}))
    resumed = _cli(_shapes_args(tiny_policy, tiny_text_encoder, "shapes_dmd.yaml", tmp_path, **common)
                   + ["--ckpt_path=last"])
    assert int(resumed.model.iteration) == 4
    a, b = full.model.state_dict(), resumed.model.state_dict()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.allclose(a[k].float(), b[k].float(), atol=1e-6), k


def test_wan_configs_train_two_steps_of_each_stage_on_tiny_components(tmp_path, monkeypatch):
    """configs/tmd/wan2.1_t2v_1.3b_{meanflow,dmd}.yaml with tiny random Wan components (H = 1 of the tiny model's
    blocks) and a folder of captioned mp4s: 2 steps of each stage through the real CLI, the stage-1 CFG teacher and
    the stage-2 teacher / critic as tiny random transformers and the GAN heads on the teacher's features; then one
    transition-sampler rollout of the student."""
    from genrl.data.video_io import write_video
    from genrl.rollout.transition import transition_rollout
    from genrl.testing.families import TINY, TINY_SIZE, tiny_generator_spec

    monkeypatch.chdir(tmp_path)
    size = TINY_SIZE["wan"]
    videos = tmp_path / "videos"
    videos.mkdir()
    for i, caption in enumerate(["a red circle moving left", "a blue square staying still"]):
        write_video(videos / f"{i}.mp4", torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(i)), fps=16)
        (videos / f"{i}.txt").write_text(caption)
    tiny_transformer = {"model_class": "diffusers.WanTransformer3DModel", "pretrained": None, "subfolder": None,
                        "dtype": None, "config": TINY["wan"]["transformer"]}
    data = {"root": str(videos), "num_frames": size["num_frames"], "height": size["height"], "width": size["width"],
            "batch_size": 2, "num_workers": 0, "val_fraction": 0.0}
    trainer = {"accelerator": "cpu", "precision": "32-true", "max_steps": 2, "limit_val_batches": 0,
               "enable_progress_bar": False, "logger": False, "callbacks": []}
    for stage, extra in [("meanflow", {"teacher": tiny_transformer, "warmup_steps": 0}),
                         ("dmd", {"teacher": tiny_transformer, "critic": {**tiny_transformer},
                                  "head_init": None, "critic_updates_per_generator_update": 2})]:
        override = {"trainer": trainer, "data": {"init_args": data}, "model": {"init_args": {
            "generator": tiny_generator_spec("wan", gradient_checkpointing=False, transformer_path=None),
            "head_layers": 1,
            "rewards": [{"name": "shapes"}], **extra}}}
        (tmp_path / f"{stage}.yaml").write_text(json.dumps(override))
        cli = _cli(["--config", str(ROOT / f"configs/tmd/wan2.1_t2v_1.3b_{stage}.yaml"), "--config",
                    str(tmp_path / f"{stage}.yaml")], run=False)
        assert cli.model.hparams.stage == stage and cli.model.hparams.head_layers == 1
        cli.model.configure_model()
        before = {n: p.detach().clone() for n, p in cli.model.named_parameters()}
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert cli.trainer.global_step == 2
        changed = {n.split(".")[0] for n, p in cli.model.named_parameters() if not torch.equal(before[n], p.detach())}
        assert changed == ({"generator", "flow_head"} if stage == "meanflow"
                           else {"generator", "flow_head", "critic", "gan_heads"})  # the config's GAN term is on
    gen = cli.model.generator
    out = transition_rollout(cli.model.student, gen.encode_prompts(["a red circle", "a blue square"]),
                             gen.latent_shape, 0, torch.arange(2), cli.model.sampler)
    assert out.latents.shape == (2, *gen.latent_shape) and torch.isfinite(out.latents).all()
    assert out.effective_nfe == cli.model.effective_nfe


def test_stage1_target_subtracts_the_derivative_along_the_conditional_path(tiny_policy, tiny_text_encoder,
                                                                           monkeypatch):
    """With r < s (p_equal 0) the target is v - (s - r) du/ds with du/ds the paper's central difference
    [u(y_s + d v, s + d) - u(y_s - d v, s - d)] / 2d (d = 5e-3), restated here from the head; the head's time is the
    inner s, so du/ds is not zero. The exact directional derivative (autograd) differs from it by a large fraction on
    this random model: the sinusoidal embedding of 1000 s has frequencies up to 1000 per unit s, which a difference
    over 2d = 0.01 damps (sin(w d) / (w d)); the paper's choice, kept, and said in docs/methods/tmd.md."""
    import genrl.methods.tmd as tmd_mod
    from genrl.flow import average_velocity
    from genrl.noise import mix_seed, randn_per_sample

    model = _method(tiny_policy, tiny_text_encoder, p_equal=0.0, parameterization="denoiser", gate_init=0.0)
    seen, real_draw = {}, tmd_mod.sample_inner_times

    def draw(*args, **kwargs):
        seen["s"], seen["r"] = real_draw(*args, **kwargs)
        return seen["s"], seen["r"]

    monkeypatch.setattr(tmd_mod, "sample_inner_times", draw)
    feats_seen = _spy_features(monkeypatch)
    x0 = torch.randn(3, 8, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    idx = torch.tensor([1, 6, 8])
    out = model.meanflow_loss(x0, PROMPTS[:3], idx, it=5)
    s, r = seen["s"], seen["r"]
    d = 5e-3
    assert bool((r < s).all()) and bool((s > d).all()) and bool((s < 1 - d).all())  # interior: central differences
    (x_t, t), = feats_seen
    tt = t.view(-1, 1, 1, 1, 1)
    y = (x_t - (1 - tt) * x0) / tt - x0  # x1 - x0
    y1 = randn_per_sample(x0.shape[1:], mix_seed(3, 5), idx, stream=tmd_mod._S_INNER_NOISE)  # the inner noise
    sv, rv = s.view(-1, 1, 1, 1, 1), r.view(-1, 1, 1, 1, 1)
    y_s, v = (1 - sv) * y + sv * y1, y1 - y
    with torch.no_grad():
        feats = model.student.features(x_t, t, model.generator.encode_prompts(PROMPTS[:3]))

        def u_of(e: float) -> torch.Tensor:
            return average_velocity(y_s + e * v, s + e, y1, model.student.head(y_s + e * v, s + e, r, feats, t))

        dudt = (u_of(d) - u_of(-d)) / (2 * d)
        target = v - (sv - rv) * dudt
        ref = u_of(0.0) - target
    assert ((sv - rv) * dudt).abs().mean() > 0.1  # the derivative term matters here
    assert torch.allclose(out["u_minus_target"], ref, atol=1e-3, rtol=1e-4), (out["u_minus_target"] - ref).abs().max()
