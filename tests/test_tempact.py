"""TempAct and RL on a distilled causal student (genrl/methods/tempact.py; docs/methods/tempact.md): the executor's
first update has importance ratio exactly 1, the update moves the executor toward higher-advantage continuations,
the planner's logits move toward the better plan, the hierarchy's degenerate cases, resume == uninterrupted, and
bad configurations refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.models.plans import Plan, Step

ROOT = Path(__file__).resolve().parents[1]
EXECUTOR = str(ROOT / "configs/tempact/shapes_executor.yaml")
TINY = str(ROOT / "configs/tiny/tempact.yaml")


def _cli(args: list[str], configs=(EXECUTOR, TINY), run: bool = True) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = [x for c in configs for x in ("--config", c)] + ["--trainer.enable_progress_bar=false"]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _policy_args(tiny_policy, tiny_text_encoder):
    return [f"--model.init_args.generator.pretrained={tiny_policy}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}"]


def _method(tiny_policy, tiny_text_encoder, *extra):
    model = _cli([*_policy_args(tiny_policy, tiny_text_encoder), *extra], run=False).model
    model.configure_model()
    return model


PROMPTS = ["a red circle moves right, then moves up", "a blue square moves left, then moves down"]


def test_executor_first_update_is_on_policy_and_rewards_steer_it(tiny_policy, tiny_text_encoder):
    model = _method(tiny_policy, tiny_text_encoder, "--model.init_args.continuations=3",
                    "--model.init_args.fork_chunks=[1]")
    flat, ro, pixels = model.collect(PROMPTS, torch.tensor([0, 1]), 0)
    assert pixels.shape[:2] == (6, 8) and ro.fork_chunk == 1
    a_exec = torch.tensor([[[1.0, -1.0, 0.0]], [[0.5, 0.0, -0.5]]])  # [P, K = 1, G]
    units = model.executor_units(flat, ro, a_exec)
    assert len(units) == 3 * 3 * 1  # G branches x 3 trained chunks (f = 1 of 4) x 1 transition (2-step sampler)
    model.generator.zero_grad()
    for u in units:
        loss, stats, _ = u()
        assert stats["executor/log_ratio_abs"] == 0.0 and stats["executor/ratio_mean"] == 1.0
        loss.backward()
    # the surrogate's gradient is -mean_rows(A * grad log pi) / units: a step along it raises the log-prob of the
    # positive-advantage branch relative to the negative one
    params = [p for p in model.generator.parameters() if p.requires_grad]
    grads = [p.grad.clone() for p in params]
    assert any(g.abs().sum() > 0 for g in grads)

    def branch_logp(g: int) -> float:
        from genrl.flow.renoise import renoise_log_prob
        from genrl.rollout.branches import replay_forks

        st = replay_forks(model.generator, flat, ro, model.frame_shape, model.schedule)[g][0]
        tr = ro.traces[g][0]
        s = torch.full((2,), float(tr.sigmas[0]))
        with torch.no_grad():
            v = model.generator.velocity_chunk(tr.x[0], s, st.cond, st.cache)
        return float(renoise_log_prob(tr.x[1], tr.x[0], v, float(tr.sigmas[0]), float(tr.sigmas[1]))[0])

    before = branch_logp(0) - branch_logp(1)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(1e-3 * g / max(float(torch.cat([x.flatten() for x in grads]).norm()), 1e-12))
    assert branch_logp(0) - branch_logp(1) > before


def test_template_planner_moves_toward_the_better_plan(tiny_policy, tiny_text_encoder):
    model = _method(tiny_policy, tiny_text_encoder, "--model.init_args.planner={kind: template, splitter: shapes}",
                    "--model.init_args.plans_per_prompt=3", "--model.init_args.train_planner=true",
                    "--model.init_args.planner_lr=0.5")
    planner = model.plan_net
    plans = planner.sample(PROMPTS, 4, 3, seed=0, prompt_indices=[0, 1])
    flat = [p for row in plans for p in row]
    a_plan = torch.tensor([[1.0 if p.candidate == 0 else -1.0 for p in row] for row in plans])
    before = planner.probabilities()[0]
    loss, _, _ = model.planner_unit(flat, a_plan)()
    loss.backward()
    with torch.no_grad():
        planner.logits -= 0.5 * planner.logits.grad
    assert planner.probabilities()[0] > before or all(p.candidate == 0 for p in flat)


def test_no_planner_plans_are_the_global_prompt(tiny_policy, tiny_text_encoder):
    model = _method(tiny_policy, tiny_text_encoder)
    flat, ro, _ = model.collect(PROMPTS, torch.tensor([0, 1]), 0)
    assert [p.steps for p in flat] == [(Step(PROMPTS[0], 0, 4),), (Step(PROMPTS[1], 0, 4),)]
    assert model.fork_chunk(0) in (0, 1, 2)


@pytest.mark.parametrize("bad,match", [
    (["--model.init_args.plans_per_prompt=2", "--model.init_args.train_planner=true"], "needs a planner"),
    (["--model.init_args.continuations=0"], "must be >= 1"),
    (["--model.init_args.planner={kind: oracle}"], "planner.kind"),
    (["--model.init_args.planner={kind: template, splitter: commas}"], "unknown planner splitter"),
])
def test_bad_configurations_are_refused(tiny_policy, tiny_text_encoder, bad, match):
    with pytest.raises(ValueError, match=match):
        _cli([*_policy_args(tiny_policy, tiny_text_encoder), *bad], run=False)


def test_fit_resume_equals_uninterrupted(tiny_policy, tiny_text_encoder, tmp_path):
    def fit(root, steps, ckpt=None):
        args = [*_policy_args(tiny_policy, tiny_text_encoder), f"--trainer.default_root_dir={root}",
                f"--trainer.max_steps={steps}", "--trainer.logger=false",
                f"--trainer.callbacks.init_args.dirpath={root}/ckpt", "--model.init_args.fork_chunks=[1, 2]"]
        if ckpt:
            args.append(f"--ckpt_path={ckpt}")
        return _cli(args).model

    full = fit(tmp_path / "a", 3)
    fit(tmp_path / "b", 2)
    resumed = fit(tmp_path / "b", 3, tmp_path / "b/ckpt/last.ckpt")
    for (n, p), (_, q) in zip(full.generator.named_parameters(), resumed.generator.named_parameters()):
        assert torch.equal(p, q), n
    assert int(full.iteration) == 3


def test_plan_spans_reach_the_reward_as_frames(tiny_policy, tiny_text_encoder):
    from genrl.methods.planning import plan_frame_spans

    model = _method(tiny_policy, tiny_text_encoder)
    plan = Plan("g", (Step("a", 0, 1), Step("b", 1, 4)))
    assert plan_frame_spans(plan, model.schedule.causal) == [(0, 2), (2, 8)]


def test_wan_config_trains_two_iterations_on_tiny_components(tmp_path, monkeypatch):
    """configs/tempact/wan2.1_t2v_1.3b.yaml with a tiny random causal Wan (LoRA) and a tiny random causal-LM planner
    (LoRA) built in code: two joint iterations through the real CLI; both adapters move, nothing else does."""
    import json

    from genrl.models.planner import build_tiny_planner_lm, planner_words
    from genrl.testing.families import TINY_SIZE, tiny_generator_spec

    monkeypatch.chdir(tmp_path)
    prompts = ["a red circle moves right, then moves up", "a blue square moves left, then moves down"]
    lm = build_tiny_planner_lm(planner_words(prompts + ['"steps" "prompt" "start" "end"']), tmp_path / "lm")
    size = TINY_SIZE["wan"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    override = {
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 2, "limit_val_batches": 0,
                    "enable_progress_bar": False, "logger": False, "callbacks": []},
        "model": {"init_args": {
            "generator": tiny_generator_spec("wan"), "lora": {"rank": 4, "alpha": 4},
            "num_frames": 2, "schedule": {"causal": {"chunk_size": 1, "local_window": 1, "sink_frames": 0},
                                          "timesteps": [1000, 500]},
            "planner": {"kind": "lm", "path": str(lm), "lora": {"rank": 2, "alpha": 4}, "max_new_tokens": 8},
            "plans_per_prompt": 2, "continuations": 2, "plan_steps": 2, "fork_chunks": [1],
            "executor_rewards": [{"name": "colorfulness"}], "planner_rewards": [{"name": "colorfulness"}]}},
        "data": {"init_args": {"train": str(tmp_path / "prompts.txt"), "val": str(tmp_path / "prompts.txt"),
                               "prompts_per_batch": 1, "val_size": 1}},
    }
    assert size["num_frames"] >= 1
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    cli = _cli(["--config", str(tmp_path / "tiny.yaml")], configs=(str(ROOT / "configs/tempact/wan2.1_t2v_1.3b.yaml"),),
               run=False)
    cli.model.configure_model()
    before = {n: p.detach().clone() for n, p in cli.model.named_parameters() if p.requires_grad}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    changed = {n for n, p in cli.model.named_parameters() if p.requires_grad and not torch.equal(before[n], p)}
    assert int(cli.model.iteration) == 2
    assert any(n.startswith("generator.") for n in changed) and any(n.startswith("planner.") for n in changed)
    assert all("lora_" in n for n in before)


@pytest.mark.parametrize("mode,steps,executor_moves,planner_moves", [
    ("alternate", 1, True, False), ("alternate", 2, True, True), ("joint", 1, True, True)])
def test_update_mode_decides_which_level_steps(tiny_policy, tiny_text_encoder, tmp_path, mode, steps,
                                               executor_moves, planner_moves):
    """``alternate``: the executor on even iterations, the planner on odd ones; ``joint``: both every iteration."""
    args = [*_policy_args(tiny_policy, tiny_text_encoder), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.max_steps={steps}", "--trainer.logger=false", "--trainer.callbacks=[]",
            "--model.init_args.planner={kind: template, splitter: shapes}", "--model.init_args.plans_per_prompt=2",
            "--model.init_args.train_planner=true", "--model.init_args.fork_chunks=[2]",
            f"--model.init_args.update_mode={mode}", "--data.init_args.train=shapes:train:steps2",
            "--data.init_args.val=shapes:heldout:steps2", "--trainer.limit_val_batches=0"]
    cli = _cli(args, run=False)
    cli.model.configure_model()
    gen0 = [p.detach().clone() for p in cli.model.generator.parameters()]
    logits0 = cli.model.plan_net.logits.detach().clone()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    moved = any(not torch.equal(a, b) for a, b in zip(gen0, cli.model.generator.parameters()))
    assert moved == executor_moves
    assert (not torch.equal(logits0, cli.model.plan_net.logits.detach())) == planner_moves


def test_flat_and_hierarchical_advantages_in_closed_form(tiny_policy, tiny_text_encoder):
    """One prompt, K = 2 plans x G = 2 videos. flat: one group advantage over the 4 videos of R_plan + R_exec (std
    "global", eps 1e-4) for the executor, its mean over G for the planner; hierarchical: the plan return is the mean
    over G, the executor baseline the execution-group mean, both over the batch's std of the raw rewards."""
    r_plan = torch.tensor([[[0.0, 0.0], [1.0, 1.0]]])
    r_exec = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    ok = torch.ones(1, 2, 2, dtype=torch.bool)
    flat = _method(tiny_policy, tiny_text_encoder, "--model.init_args.planner={kind: template}",
                   "--model.init_args.plans_per_prompt=2", "--model.init_args.continuations=2",
                   "--model.init_args.advantages=flat", "--model.init_args.clip_exec=10")
    a_plan, a_exec = flat.advantages(r_plan, r_exec, ok, ok, 1)
    total = torch.tensor([1.0, 2.0, 4.0, 5.0])
    expect = (total - total.mean()) / (total.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(a_exec.reshape(-1), expect)
    torch.testing.assert_close(a_plan.reshape(-1), expect.reshape(2, 2).mean(1))
    hier = _method(tiny_policy, tiny_text_encoder, "--model.init_args.planner={kind: template}",
                   "--model.init_args.plans_per_prompt=2", "--model.init_args.continuations=2",
                   "--model.init_args.clip_exec=10", "--model.init_args.clip_plan=10")
    a_plan, a_exec = hier.advantages(r_plan, r_exec, ok, ok, 1)
    dev = torch.tensor([-0.5, 0.5, -0.5, 0.5])  # over the std of all raw executor rewards (TempAct's global std)
    torch.testing.assert_close(a_exec.reshape(-1), dev / (r_exec.std(unbiased=False) + 1e-6))
    returns = torch.tensor([0.0, 1.0])
    torch.testing.assert_close(a_plan.reshape(-1), (returns - 0.5) / (returns.std(unbiased=False) + 1e-4))
