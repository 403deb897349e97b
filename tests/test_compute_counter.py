"""ComputeCounter (genrl.callbacks.compute): training compute in forward-equivalents of the policy's network.

A toy method pins the unit (rows, size weights, backward = 2 forwards only where a gradient arrives, tuple outputs,
nothing counted in validation or the sanity check); then every method of the arena runs one or two iterations of its
tiny config through the real CLI (``genrl fit`` adds the counter) and its counts are compared with a hand count
derived here from the config's values (in sample units: rows x frame share; weighted by parameter share). The budget
stops a run at an iteration boundary, ``--compute_budget`` is validated, and a cut-and-resumed run reports exactly
what an uninterrupted one does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from genrl.callbacks import ComputeCounter
from genrl.callbacks.compute import UNIT
from genrl.cli import GenRLCLI
from genrl.models.roles import Roles
from genrl.rollout.autoregressive import sample_exit_step

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "configs"


# ---------------------------------------------------------------------------------------------- helpers
def _fit(args: list[str]) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    return GenRLCLI(args=["fit", "--trainer.enable_progress_bar=false", *args])


def _counter(cli: GenRLCLI) -> ComputeCounter:
    found = [c for c in cli.trainer.callbacks if isinstance(c, ComputeCounter)]
    assert len(found) == 1, "genrl fit adds exactly one ComputeCounter"
    return found[0]


def _record(cli: GenRLCLI) -> dict:
    return json.loads((Path(cli.trainer.default_root_dir) / "compute.json").read_text())


def _check(cli: GenRLCLI, expected: dict[str, tuple[float, float]], weights: dict[str, float] | None = None,
           iterations: int = 1) -> dict:
    """The run's compute.json against a hand count ``{role: (forwards, backwards)}`` in sample units: the counts
    exactly, the fe as weight x (forwards + 2 backwards) summed over the roles."""
    rec = _record(cli)
    weights = {role: 1.0 for role in expected} | (weights or {})
    assert rec["finished"] is True and rec["unit"] == UNIT and rec["iterations"] == iterations
    assert {r: (v["forwards"], v["backwards"]) for r, v in rec["per_role"].items()} == expected
    for role, (f, b) in expected.items():
        assert rec["per_role"][role]["weight"] == pytest.approx(weights[role], rel=1e-12)
        assert rec["per_role"][role]["forward_equivalents"] == pytest.approx(weights[role] * (f + 2 * b), rel=1e-12)
    total = sum(weights[r] * (f + 2 * b) for r, (f, b) in expected.items())
    assert rec["forward_equivalents"] == pytest.approx(total, rel=1e-12)
    assert _counter(cli).forward_equivalents == pytest.approx(total, rel=1e-12)
    assert float(cli.trainer.callback_metrics["compute/forward_equivalents"]) == pytest.approx(total, rel=1e-6)
    return rec


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------- the unit
class _Pair(nn.Module):
    """A plain role network with a tuple output (both halves used by the loss: one backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        y = self.lin(x)
        return y, 2 * y


class _Toy(LightningModule):
    """Per training batch: the policy (20 parameters) runs 3 rows without grad, 2 rows backpropagated and 5 rows
    with grad whose output no loss uses; the critic (5 parameters: weight 1/4) 4 rows backpropagated through a tuple
    output; the frozen teacher (20 parameters) 2 rows. Validation runs the policy on 7 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.roles = Roles(self)
        self.roles.trainable("generator", nn.Linear(4, 4))
        self.roles.trainable("critic", _Pair())
        self.roles.frozen("teacher", nn.Linear(4, 4))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt = self.optimizers()
        opt.zero_grad()
        with torch.no_grad():
            self.generator(x[:3])
            self.frozen["teacher"](x[:2])
        self.generator(x[:5])  # a graph, but no gradient ever reaches it
        a, b = self.critic(x[:4])
        self.manual_backward(self.generator(x[:2]).pow(2).mean() + a.mean() + b.mean())
        opt.step()

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val/score", float(self.generator(x[:7]).mean()))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=8)

    val_dataloader = train_dataloader


def test_units_rows_weights_backward_only_where_gradients_arrive_and_no_validation(tmp_path):
    counter = ComputeCounter()
    trainer = Trainer(max_steps=2, val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=1,
                      callbacks=[counter], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path), accelerator="cpu")
    model = _Toy()
    trainer.fit(model)
    per = {r: (t.calls, t.forwards, t.backwards) for r, t in counter.per_role.items()}
    # 2 batches: policy 3 + 5 + 2 rows forward, 2 backward; critic 4 and 4 (the tuple counted once); teacher 2 and 0
    assert per == {"generator": (6, 20.0, 4.0), "critic": (2, 8.0, 8.0), "teacher": (2, 4.0, 0.0)}
    assert counter.weights == {"generator": 1.0, "critic": 0.25, "teacher": 1.0}
    per_batch = (10 + 2 * 2) + 0.25 * (4 + 2 * 4) + 2  # = 19
    assert counter.forward_equivalents == 2 * per_batch == 38.0
    assert counter.iterations == 2 and float(trainer.callback_metrics["compute/fe_critic"]) == 6.0
    rows = [(r["global_step"], r["iterations"], r["forward_equivalents"], sorted(r["metrics"]))
            for r in counter.history]
    assert rows == [(1, 1, 19.0, ["val/score"]), (2, 2, 38.0, ["val/score"])]  # the sanity check adds no row
    rec = json.loads((tmp_path / "compute.json").read_text())
    assert rec["finished"] is True and rec["budget"] is None and rec["stopped_by_budget"] is False
    assert rec["forward_equivalents"] == 38.0 and rec["global_step"] == 2 and rec["policy_parameters"] == 20
    assert rec["per_role"]["critic"] == {"calls": 2, "forwards": 8.0, "backwards": 8.0, "weight": 0.25,
                                         "forward_equivalents": 6.0}
    assert rec["wall_s"] > 0 and rec["peak_memory_bytes"] > 0 and rec["peak_memory_source"] == "rss"
    # validating after fit counts nothing and adds no history row
    trainer.validate(model, verbose=False)
    assert counter.forward_equivalents == 38.0 and len(counter.history) == 2
    with pytest.raises(ValueError, match="got -1"):
        ComputeCounter(budget=-1)


# ---------------------------------------------------------------------------------------------- GRPO family
GRPO = ["--config", str(CFG / "quickstart.yaml"), "--config", str(CFG / "tiny/grpo.yaml")]


def _grpo_iteration(reuse: bool, kl: bool) -> dict[str, tuple[float, float]]:
    """GRPO on configs/tiny/grpo.yaml: P = 2 prompts x G = 4 rollouts of S = 4 steps with CFG (w = 2: 2 rows per
    sample), every step stochastic but the last (sde_steps all, skip_last_step) -> 3 trained steps."""
    p, g, s, cfg, trained = 2, 4, 4, 2, 3
    rollout = p * g * s * cfg
    update = 0 if reuse else p * g * cfg * trained  # reuse_rollout_forward back-propagates the rollout's forwards
    out = {"generator": (rollout + update, p * g * cfg * trained)}
    if kl:  # the reference's guided velocity at every trained step
        out["reference"] = (p * g * cfg * trained, 0)
    return out


def test_grpo_reuse_counts_rollout_forwards_and_their_backward(tmp_path, monkeypatch, tiny_policy_args):
    monkeypatch.chdir(tmp_path)
    cli = _fit([*GRPO, *tiny_policy_args, "--trainer.max_steps=2", "--trainer.limit_val_batches=0"])
    rc = cli.model.rollout_config
    assert (rc.num_steps, rc.cfg_scale, cli.model.hparams.reuse_rollout_forward) == (4, 2.0, True)
    (f, b), = _grpo_iteration(reuse=True, kl=False).values()
    _check(cli, {"generator": (2 * f, 2 * b)}, iterations=2)  # 2 x (64 + 2 x 48) = 320
    assert _counter(cli).forward_equivalents == 320.0


def test_grpo_recomputed_update_with_kl_reference(tmp_path, monkeypatch, tiny_policy_args):
    monkeypatch.chdir(tmp_path)
    cli = _fit([*GRPO, *tiny_policy_args, "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                "--model.init_args.reuse_rollout_forward=false", "--model.init_args.kl_beta=0.01"])
    _check(cli, _grpo_iteration(reuse=False, kl=True))  # 64 + 48 + 2 x 48 + 48 = 256
    assert _counter(cli).forward_equivalents == 256.0


BRANCH = ["--config", str(CFG / "branch_grpo/shapes.yaml"), "--model.init_args.rollout.num_steps=4",
          "--model.init_args.tree.split_steps=[0,2]", "--model.init_args.rollout.micro_batch_size=8",
          "--model.init_args.rewards=[{name: shapes}, {name: colorfulness}]", "--trainer.limit_val_batches=0",
          "--trainer.max_steps=1"]


@pytest.mark.parametrize("mix", [False, True], ids=["tree", "mix"])
def test_branch_grpo_counts_frontiers_and_one_recomputed_forward_per_trained_edge(tmp_path, monkeypatch,
                                                                                  tiny_policy_args, mix):
    """2 trees, 4 steps, splits {0, 2}, factor 2, no CFG, batching fast (no padding). Rollout: the frontiers 1, 2, 2,
    4 per tree. Update: one forward (and backward) per trained edge, a split's parent recomputed for each child:
    edges 2, 2, 4, 4 per tree (Mix, window 1 of stride 2: only steps 0 and 2 are stochastic -> 2 + 4)."""
    monkeypatch.chdir(tmp_path)
    cli = _fit([*BRANCH, *tiny_policy_args,
                *(["--model.init_args.tree.mix_window=1", "--model.init_args.tree.mix_stride=2"] if mix else [])])
    trees, frontier, edges = 2, [1, 2, 2, 4], [2, 2, 4, 4]
    trained = [0, 2] if mix else [0, 1, 2, 3]
    assert cli.model.tree_config.sde_mask(4).nonzero().flatten().tolist() == trained
    rollout = trees * sum(frontier)
    update = trees * sum(edges[k] for k in trained)
    _check(cli, {"generator": (rollout + update, update)})
    assert _counter(cli).forward_equivalents == (54.0 if mix else 90.0)


# ---------------------------------------------------------------------------------------------- forward-process RL
RAM = ["--config", str(CFG / "ram/shapes.yaml")]


@pytest.mark.parametrize("objective,extra,reference", [
    ("ram", [], True),
    ("nft", ["--config", str(CFG / "ram/nft_shapes.yaml")], True),          # kl_beta 1e-4: a reference
    ("awm", ["--config", str(CFG / "ram/awm_shapes.yaml"), "--model.init_args.kl_beta=0"], False),
])
def test_ram_nft_awm_count_old_policy_under_the_policy_and_the_reference_when_read(tmp_path, monkeypatch,
                                                                                   tiny_policy_args, objective,
                                                                                   extra, reference):
    """configs/tiny/ram.yaml: n = 2 x 4 endpoints of S = 3 ODE steps with CFG w = 2, rolled out by theta_old (swapped
    into the live transformer: counted as the policy); K = 2 re-noisings per endpoint, each one theta forward with
    backward, one theta_old forward and, when the objective reads it, one reference forward (conditional only)."""
    monkeypatch.chdir(tmp_path)
    cli = _fit([*RAM, *extra, "--config", str(CFG / "tiny/ram.yaml"), *tiny_policy_args, "--trainer.max_steps=1",
                "--trainer.limit_val_batches=0"])
    assert cli.model.hparams.objective == objective
    n, s, cfg, k = 8, 3, 2, 2
    expected = {"generator": (n * s * cfg + k * n * 2, k * n)}
    if reference:
        expected["reference"] = (k * n, 0)
    _check(cli, expected)
    assert _counter(cli).forward_equivalents == (128.0 if reference else 112.0)


def test_reward_weighted_regression(tmp_path, monkeypatch, tiny_policy_args):
    """configs/tiny/rwr.yaml: 8 endpoints of 2 ODE steps without CFG, one flow-matching forward and backward each."""
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--config", str(CFG / "rwr/shapes.yaml"), "--config", str(CFG / "tiny/rwr.yaml"), *tiny_policy_args,
                "--trainer.max_steps=1", "--trainer.limit_val_batches=0"])
    n, s = 8, 2
    _check(cli, {"generator": (n * s + n, n)})  # 40 fe


def test_sol_rl_preview_counts_the_rollout_copy_as_the_policy(tmp_path, monkeypatch, tiny_policy_args):
    """configs/tiny/sol_rl.yaml (DiffusionNFT with a preview): 2 prompts x a pool of 6 previewed in 2 steps by the bf16
    rollout copy (weight 1), 2 kept per prompt regenerated by theta_old in 3 steps, 2 draws of theta (+ backward),
    theta_old and the reference."""
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--config", str(CFG / "sol_rl/shapes.yaml"), "--config", str(CFG / "tiny/sol_rl.yaml"),
                *tiny_policy_args, "--trainer.max_steps=1", "--trainer.limit_val_batches=0"])
    prompts, pool, keep, preview_steps, steps, draws = 2, 6, 2, 2, 3, 2
    kept = prompts * keep
    _check(cli, {"rollout": (prompts * pool * preview_steps, 0),
                 "generator": (kept * steps + draws * kept * 2, draws * kept),
                 "reference": (draws * kept, 0)})
    assert _counter(cli).forward_equivalents == 76.0


# ---------------------------------------------------------------------------------------------- distillation
def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"pipelines_{name}", ROOT / "pipelines" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ode_init_counts_one_full_sequence_forward_and_backward(tmp_path, monkeypatch, tiny_policy,
                                                                tiny_text_encoder):
    from genrl.methods.ode_init import shapes_schedule
    from genrl.models import DiTGenerator, ModelSpec, TextEncoder

    latent = (4, 3, 8, 8)
    teacher = DiTGenerator(ModelSpec(pretrained=tiny_policy).build().eval(),
                           TextEncoder.from_pretrained(tiny_text_encoder))
    with torch.no_grad():
        pairs = _script("ode_pairs").generate_ode_pairs(
            teacher, ["a red circle moving left", "a blue square moving up"] * 2, latent,
            shapes_schedule().sigmas()[:-1].tolist(), teacher_steps=4, cfg_scale=2.0, out=tmp_path / "pairs.pt",
            batch_size=4, progress=False)
    override = {"trainer": {"accelerator": "cpu", "limit_val_batches": 0},
                "model": {"init_args": {"generator": {"pretrained": tiny_policy, "text_encoder": tiny_text_encoder},
                                        "latent_shape": list(latent), "rewards": [{"name": "colorfulness"}]}},
                "data": {"init_args": {"path": str(pairs), "batch_size": 2, "val_size": 2, "val_batch_size": 2}}}
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--config", str(CFG / "ode_init/shapes.yaml"), "--config", str(tmp_path / "tiny.yaml"),
                "--trainer.max_steps=2"])
    b, iterations = 2, 2  # one block-causal forward over all 4 frames per sample, with its backward
    rec = _check(cli, {"generator": (iterations * b, iterations * b)}, iterations=2)
    assert rec["sample_frames"] == 4 and rec["forward_equivalents"] == 12.0


DMD = ["--config", str(CFG / "dmd/shapes.yaml")]
DMD_TINY = ["--config", str(CFG / "tiny/dmd.yaml")]


def _dmd_count(iterations: int) -> dict[str, tuple[float, float]]:
    """Self-Forcing DMD on configs/tiny/dmd.yaml: B = 2 videos of 8 latent frames in chunks of 2 (each chunk forward
    counts 2/8 of a sample: the 4 chunks of one pass count 1 per video), S = 2 steps, teacher CFG w = 2, the generator
    updated on every 2nd iteration. Generator iteration with exit step e: the rollout runs e + 1 chunk forwards and one
    commit per chunk, the exit forwards back-propagated; the critic's x0 and the teacher's guided x0 (2 calls) on the
    B noised samples. Every iteration: the critic's no-grad rollout (S forwards + a commit per chunk) and its
    flow-matching forward with backward."""
    b, s, ratio = 2, 2, 2
    gen_f = gen_b = critic_f = critic_b = teacher_f = 0
    for it in range(iterations):
        if it % ratio == 0:
            e = sample_exit_step(s, 0, it, "uniform", broadcast=None, rank=0)
            gen_f, gen_b, critic_f, teacher_f = gen_f + b * (e + 2), gen_b + b, critic_f + b, teacher_f + 2 * b
        gen_f, critic_f, critic_b = gen_f + b * (s + 1), critic_f + b, critic_b + b
    return {"generator": (gen_f, gen_b), "teacher": (teacher_f, 0), "critic": (critic_f, critic_b)}


@pytest.mark.parametrize("stream_r1", [False, True], ids=["dmd", "stream_r1"])
def test_dmd_and_stream_r1_count_chunk_forwards_by_their_frame_share(tmp_path, monkeypatch, tiny_causal, stream_r1):
    """Stream-R1's reward weight adds no role network: its count is DMD's."""
    monkeypatch.chdir(tmp_path)
    cli = _fit([*DMD, *(["--config", str(CFG / "stream_r1/shapes.yaml")] if stream_r1 else []), *DMD_TINY,
                *tiny_causal, "--trainer.max_steps=2", "--trainer.limit_val_batches=0"])
    h = cli.model.hparams
    assert (h.num_frames, h.teacher_cfg_scale, h.critic_updates_per_generator_update) == (8, 2.0, 2)
    assert sample_exit_step(2, 0, 0, "uniform", broadcast=None, rank=0) == 1  # iteration 0 runs both steps
    rec = _check(cli, _dmd_count(2), iterations=2)
    assert rec["sample_frames"] == 8 and rec["forward_equivalents"] == 40.0
    # the rollout's chunk calls: 2 iterations x 4 chunks x 3 passes + the generator turn's 4 x 3; the teacher: 2
    assert rec["per_role"]["generator"]["calls"] == 36 and rec["per_role"]["teacher"]["calls"] == 2


def test_tmd_counts_backbone_and_head_block_passes_and_the_head_by_its_size(tmp_path, monkeypatch, tiny_policy,
                                                                           tiny_text_encoder):
    """TMD stage dmd on the tiny DiT (L = 2 blocks, head H = 1, N = 2 inner steps), B = 2 videos, the generator
    updated on iteration 0 of 2. The student's passes run blocks through the trunk adapter, never the transformer's
    forward: the backbone counts (L - H) / L, each head pass H / L of the policy, plus the flow head's own forward
    weighted by its parameters; the critic and the teacher (CFG w = 3: 2 calls) are whole forwards."""
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--config", str(CFG / "tmd/shapes_dmd.yaml"), f"--model.init_args.generator.pretrained={tiny_policy}",
                f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
                f"--model.init_args.teacher.pretrained={tiny_policy}", "--model.init_args.head_init=null",
                "--model.init_args.critic_updates_per_generator_update=2", "--data.init_args.batch_size=2",
                "--data.init_args.num_workers=0", "--trainer.limit_val_batches=0", "--trainer.max_steps=2"])
    m = cli.model
    b, layers, head, inner = 2, 2, 1, 2
    assert (m.student.num_layers, m.hparams.head_layers, m.sampler.inner_steps) == (layers, head, inner)
    student = b * ((layers - head) + inner * head) / layers  # 3 per iteration
    expected = {"generator": (2 * student, student), "flow_head": (2 * inner * b, inner * b),
                "teacher": (2 * b, 0), "critic": (3 * b, 2 * b)}
    rec = _check(cli, expected, {"flow_head": _numel(m.flow_head) / _numel(m.generator.transformer)}, iterations=2)
    assert rec["per_role"]["generator"]["calls"] == 0  # the transformer's forward never ran


def test_afd_counts_the_discriminator_by_its_size_and_r1_as_a_second_backward(tmp_path, monkeypatch, tiny_policy,
                                                                             tiny_text_encoder, shapes_teacher):
    """AFD on configs/tiny/afd.yaml: 2 prompts x K = 2 student rollouts (8 frames in chunks of 2, S = 2 steps: 3 chunk
    passes each), the discriminator (a small VideoDiscriminator, weighted by its parameters) on the 2 teacher clips
    and 4 student samples twice (its loss, then the advantages), its loss back-propagated with R1 (the teacher scores
    get a gradient twice: torch.autograd.grad, then the backward); the NFT step's teacher-forced velocity (a chunk
    forward with backward and a commit per chunk) and the same pass for theta_old (policy) and the reference."""
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--config", str(CFG / "afd/shapes.yaml"), "--config", str(CFG / "tiny/afd.yaml"),
                f"--model.init_args.generator.pretrained={tiny_policy}",
                f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
                f"--data.init_args.folder={shapes_teacher}", "--trainer.max_steps=1", "--trainer.limit_val_batches=0"])
    m = cli.model
    assert (m.hparams.samples_per_prompt, m.hparams.r1_weight > 0, m.hparams.ref_weight > 0) == (2, True, True)
    p, n, s = 2, 4, 2
    expected = {"generator": (n * (s + 1) + 2 * n + 2 * n, n), "discriminator": (2 * (p + n), 2 * p + n),
                "reference": (2 * n, 0)}
    _check(cli, expected, {"discriminator": _numel(m.discriminator) / _numel(m.generator.transformer)})


# ---------------------------------------------------------------------------------------------- budget, resume, CLI
def test_budget_stops_after_the_first_iteration_that_reaches_it(tmp_path, monkeypatch, tiny_policy_args):
    """GRPO's tiny iteration costs 160 fe: a budget of 200 is reached at the end of iteration 2 (320), not 1 (160)."""
    monkeypatch.chdir(tmp_path)
    cli = _fit([*GRPO, *tiny_policy_args, "--trainer.max_steps=4", "--trainer.limit_val_batches=0",
                "--compute_budget=200"])
    rec = _record(cli)
    assert cli.trainer.global_step == 2 and rec["iterations"] == 2 and int(cli.model.iteration) == 2
    assert rec["stopped_by_budget"] is True and rec["budget"] == 200.0 and rec["finished"] is True
    assert 200 <= rec["forward_equivalents"] == 320.0 < 200 + 160


@pytest.mark.parametrize("value", ["0", "-5"])
def test_compute_budget_must_be_positive(tmp_path, monkeypatch, capsys, tiny_policy_args, value):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        _fit([*GRPO, *tiny_policy_args, f"--compute_budget={value}"])
    assert f"--compute_budget must be a finite number of forward-equivalents > 0, got {float(value)}" in \
        capsys.readouterr().err


def test_resume_takes_back_only_the_validation_rows_of_the_restored_iteration(tmp_path):
    """compute.json's rows at the restored (global_step, iterations) that the checkpoint lacks come back once; rows
    the checkpoint has are not doubled; rows of later iterations (an abandoned continuation) are dropped."""
    rows = [{"global_step": s, "iterations": s, "forward_equivalents": 10.0 * s, "wall_s": 0.0, "metrics": {}}
            for s in (1, 2, 3)]
    (tmp_path / "compute.json").write_text(json.dumps({"history": rows}))
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), global_step=2)
    for saved, expected in (([rows[0]], [1, 2]), (rows[:2], [1, 2])):
        counter = ComputeCounter()
        counter.load_state_dict({"iterations": 2, "history": saved})
        counter._recover_history(trainer)
        assert [r["global_step"] for r in counter.history] == expected


def test_a_configured_counter_replaces_the_default_one(tiny_policy_args):
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    cli = GenRLCLI(args=[*GRPO, *tiny_policy_args, "--trainer.callbacks+=genrl.callbacks.ComputeCounter",
                         "--trainer.callbacks.budget=1000"], run=False)
    (counter,) = [c for c in cli.trainer.callbacks if isinstance(c, ComputeCounter)]
    assert counter.budget == 1000.0


def _comparable(rec: dict) -> dict:
    """compute.json without what legitimately differs between runs (time, memory)."""
    return {"forward_equivalents": rec["forward_equivalents"], "per_role": rec["per_role"],
            "iterations": rec["iterations"], "global_step": rec["global_step"],
            "history": [{k: v for k, v in r.items() if k != "wall_s"} for r in rec["history"]]}


def test_resume_continues_the_count_exactly(tmp_path, monkeypatch, tiny_causal):
    """DMD with a validation after every iteration, cut after 2 of 3 (the step-2 checkpoint is written before the
    step-2 validation: that history row comes back from compute.json) and resumed: the same totals, per-role
    counts and history as the uninterrupted run."""
    args = [*DMD, *DMD_TINY, *tiny_causal, "--trainer.val_check_interval=1"]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _record(_fit([*args, "--trainer.max_steps=3"]))
    monkeypatch.chdir(tmp_path / "b")
    cut = _fit([*args, "--trainer.max_steps=2"])
    state = torch.load(Path(cut.trainer.checkpoint_callback.dirpath) / "last.ckpt", weights_only=False)
    assert len(state["callbacks"]["ComputeCounter"]["history"]) == 1  # saved before the step-2 validation
    resumed = _record(_fit([*args, "--trainer.max_steps=3", "--ckpt_path=last"]))
    assert _comparable(resumed) == _comparable(full)
    assert [r["global_step"] for r in full["history"]] == [1, 2, 3]
    assert full["forward_equivalents"] == pytest.approx(sum(
        f + 2 * b for f, b in _dmd_count(3).values()), rel=1e-12)
