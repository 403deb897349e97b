"""GRPO through the real CLI on a tiny random policy: resume, training signal, LoRA, rewards, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.rewards import RewardModel, register_reward

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs/quickstart.yaml")
TINY = str(ROOT / "configs/tiny/grpo.yaml")


POLICY: list[str] = []


@pytest.fixture(autouse=True)
def _random_tiny_policy(tiny_policy):
    # a tiny policy with random (not zero-initialised) weights, loaded through the pretrained path
    POLICY[:] = [f"--model.init_args.generator.pretrained={tiny_policy}", "--model.init_args.generator.components={}"]


def _fit(args: list[str], run: bool = True) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", QUICK, "--config", TINY, "--trainer.enable_progress_bar=false", *POLICY]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _trainable(cli) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters()}


@register_reward("test_half_nan")
class _HalfNaN(RewardModel):
    """Brightness reward that fails (NaN, valid False) on every other sample."""

    def score(self, pixels, prompts, **meta):
        r = pixels.mean(dim=(1, 2, 3, 4))
        valid = torch.arange(len(prompts)) % 2 == 0
        return {"reward": torch.where(valid, r, torch.nan), "valid": valid}


@register_reward("test_all_nan")
class _AllNaN(RewardModel):
    def score(self, pixels, prompts, **meta):
        return {"reward": torch.full((len(prompts),), math.nan)}


def test_resume_equals_uninterrupted_and_params_change(tmp_path, monkeypatch, tiny_text_encoder):
    enc = f"--model.init_args.generator.text_encoder={tiny_text_encoder}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _fit([enc, "--trainer.max_steps=4"])
    assert int(full.model.iteration) == 4 and full.trainer.global_step == 4
    after_full = _trainable(full)
    # the export records the validation sampler, which generate.py / shapes_eval.py then use by default
    from genrl.models.loading import load_generator

    cfg = full.model.eval_config
    sampling = load_generator("runs/quickstart/export", text_encoder=tiny_text_encoder).load_info["sampling"]
    assert sampling == {"steps": 2, "cfg_scale": cfg.cfg_scale, "shift": cfg.shift}
    # so does every checkpoint (SamplingRecord), and an export made from a checkpoint keeps it
    ckpt = "runs/quickstart/checkpoints/last.ckpt"
    assert load_generator(ckpt, text_encoder=tiny_text_encoder).load_info["sampling"] == sampling
    from pipelines.export import main as export

    export(["--ckpt", ckpt, "--out", "exported"])
    assert json.loads(Path("exported/genrl_export.json").read_text())["sampling"] == sampling
    monkeypatch.chdir(tmp_path / "b")
    first = _fit([enc, "--trainer.max_steps=2"])
    after_two = _trainable(first)
    resumed = _fit([enc, "--trainer.max_steps=4", "--ckpt_path=last"])
    assert int(resumed.model.iteration) == 4
    after_resume = _trainable(resumed)
    for k in after_full:
        assert torch.allclose(after_full[k], after_resume[k], atol=1e-6, rtol=0), k
    changed = [k for k in after_full if not torch.equal(after_full[k], after_two[k])]
    assert len(changed) > len(after_full) // 2, "GRPO steps did not change the policy"
    metrics = resumed.trainer.logged_metrics
    assert "reward/shapes/reward" in metrics and "train/ratio_mean" in metrics
    assert list(Path("runs/quickstart").rglob("*.mp4"))


def test_first_update_has_ratio_one_and_no_clipping(tmp_path, monkeypatch, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    cli = _fit([f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.max_steps=1"])
    m = cli.trainer.logged_metrics
    # one mini-batch, one epoch: every log-prob is recomputed before the first optimizer step
    assert float(m["train/ratio_mean"]) == 1.0
    assert float(m["train/clipfrac"]) == 0.0
    assert float(m["train/approx_kl"]) == 0.0


def test_statistics_are_logged_per_optimizer_step(tmp_path, monkeypatch, tiny_text_encoder):
    """Two mini-batches of 4: the first optimizer step is on-policy (ratio exactly 1, nothing clipped), the second
    runs after the first changed the weights (ratio not 1); each is logged apart (``/step0``, ``/step1``) and the
    plain key is their mean (equal weights)."""
    monkeypatch.chdir(tmp_path)
    cli = _fit([f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.max_steps=2",
                "--trainer.limit_val_batches=0", "--model.init_args.reuse_rollout_forward=false",
                "--model.init_args.mini_batch_size=4", "--model.init_args.clip_range=0.5"])
    m = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert cli.trainer.global_step == 2 and int(cli.model.iteration) == 1
    assert m["train/ratio_mean/step0"] == 1.0 and m["train/approx_kl/step0"] == 0.0
    assert m["train/ratio_mean/step1"] != 1.0 and m["train/approx_kl/step1"] > 0
    assert m["train/ratio_mean"] == pytest.approx((m["train/ratio_mean/step0"] + m["train/ratio_mean/step1"]) / 2,
                                                  rel=1e-6)  # logged as float32
    assert "train/ratio_mean/step2" not in m


@pytest.mark.parametrize("extra", [[], ["--model.init_args.kl_beta=0.5"],
                                   ["--model.init_args.kl_beta=0.5", "--model.init_args.kl_kind=gaussian"]])
def test_reuse_rollout_forward_is_the_same_update(tmp_path, monkeypatch, tiny_text_encoder, extra):
    """reuse_rollout_forward back-propagates the rollout's own forwards: after 2 iterations (the second's rollout
    by the once-updated policy) the weights equal those of recomputing the forwards, with the KL terms too (their
    velocity / mean come from the kept graph), and the logged ratio is exactly 1."""
    import genrl.methods.grpo as grpo

    enc = f"--model.init_args.generator.text_encoder={tiny_text_encoder}"
    runs, recomputed = {}, []
    recompute = grpo.transition_log_prob
    monkeypatch.setattr(grpo, "transition_log_prob", lambda *a, **kw: recomputed.append(1) or recompute(*a, **kw))
    for reuse in (False, True):
        (tmp_path / str(reuse)).mkdir()
        monkeypatch.chdir(tmp_path / str(reuse))
        recomputed.clear()
        cli = _fit([enc, "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
                    f"--model.init_args.reuse_rollout_forward={reuse}", *extra])
        runs[reuse] = (_trainable(cli), cli.trainer.logged_metrics)
        assert len(recomputed) == (0 if reuse else 2 * 3)  # 2 iterations x 3 trained steps, or none
    (plain, m_plain), (reused, m_reused) = runs[False], runs[True]
    for k in plain:
        assert torch.allclose(plain[k], reused[k], rtol=1e-5, atol=1e-6), k
    assert float(m_reused["train/ratio_mean"]) == 1.0
    assert float(m_reused["train/loss"]) == pytest.approx(float(m_plain["train/loss"]), rel=1e-5, abs=1e-7)
    if extra:
        assert float(m_reused["train/kl"]) == pytest.approx(float(m_plain["train/kl"]), rel=1e-4, abs=1e-9)


def test_reuse_rollout_forward_refuses_what_it_cannot_reuse(tmp_path, monkeypatch, tiny_text_encoder):
    """Several optimizer steps per rollout (inner epochs, mini-batches) and a policy with active dropout are
    refused with errors naming the setting."""
    from genrl.methods.common import check_no_dropout

    monkeypatch.chdir(tmp_path)
    enc = f"--model.init_args.generator.text_encoder={tiny_text_encoder}"
    with pytest.raises(ValueError, match=r"inner_epochs: 1 \(got 2\)"):
        _fit([enc, "--model.init_args.reuse_rollout_forward=true", "--model.init_args.inner_epochs=2"])
    with pytest.raises(ValueError, match=r"mini_batch_size: null \(got 4\)"):
        _fit([enc, "--model.init_args.reuse_rollout_forward=true", "--model.init_args.mini_batch_size=4"])
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Dropout(0.1)))
    with pytest.raises(ValueError, match=r"dropout p=0.1 at '1.0'"):
        check_no_dropout(net)
    check_no_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))


def test_lora_trains_only_the_adapter_and_kl_reference(tmp_path, monkeypatch, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    cli = _fit([
        f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.max_steps=2",
        "--model.init_args.lora.rank=4", "--model.init_args.kl_beta=0.1",
    ], run=False)
    cli.model.configure_model()
    before = _trainable(cli)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = _trainable(cli)
    lora = [k for k in after if "lora_" in k]
    assert lora and all(not torch.equal(before[k], after[k]) for k in lora if "lora_B" in k)
    base = [k for k in after if "lora_" not in k]
    assert all(torch.equal(before[k], after[k]) for k in base), "LoRA training changed base weights"
    assert "train/kl" in cli.trainer.logged_metrics and float(cli.trainer.logged_metrics["train/kl"]) >= 0


def test_nan_rewards_are_masked_not_zeroed(tmp_path, monkeypatch, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    cli = _fit([f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.max_steps=1",
                "--model.init_args.rewards=[{name: test_half_nan}]", "--trainer.limit_val_batches=0"])
    m = cli.trainer.logged_metrics
    assert float(m["reward/invalid_fraction"]) == 0.5
    assert math.isfinite(float(m["reward/total"]))


def test_all_invalid_rewards_stop_with_a_clear_error(tmp_path, monkeypatch, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="every reward of the batch is invalid"):
        _fit([f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.max_steps=1",
              "--model.init_args.rewards=[{name: test_all_nan}]", "--trainer.limit_val_batches=0"])


def test_bad_config_errors(tmp_path, monkeypatch, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    enc = f"--model.init_args.generator.text_encoder={tiny_text_encoder}"
    with pytest.raises(Exception, match="no_such_reward"):
        _fit([enc, "--model.init_args.rewards=[{name: no_such_reward}]"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt"):
        _fit([enc, f"--data.init_args.train={empty}"])
    with pytest.raises(ValueError, match="mini_batch_size"):
        _fit([enc, "--model.init_args.mini_batch_size=3"])


def test_real_text_run_on_vbench_prompts(tmp_path, monkeypatch):
    """Real input: VBench prompts through the real MiniLM encoder and the shipped base model, for a few steps."""
    monkeypatch.chdir(tmp_path)
    POLICY.clear()  # the real shipped policy (assets/shapes-dit), not the tiny one
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    cli = GenRLCLI(args=[
        "fit", "--config", QUICK, "--config", str(ROOT / "configs/grpo/vbench_colorfulness.yaml"),
        "--trainer.enable_progress_bar=false", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        "--model.init_args.rollout.num_steps=3", "--model.init_args.rollout.sde_steps=all",
        "--data.init_args.prompts_per_batch=2", "--data.init_args.group_size=2",
    ])
    assert cli.model.generator.text_encoder.hidden_size == 384  # the real MiniLM
    m = cli.trainer.logged_metrics
    assert math.isfinite(float(m["reward/colorfulness/reward"])) and float(m["reward/invalid_fraction"]) == 0.0
    assert int(cli.model.iteration) == 2
    from genrl.data.prompts import load_prompts

    vbench = {r.prompt for r in load_prompts("vbench")}
    assert len(vbench) > 900


def test_update_plan_cuts_passes_into_mini_batches_and_permutes_each_pass_by_its_address():
    from genrl.methods.phases import update_plan
    from genrl.noise import mix_seed

    one = update_plan(0, 3, n=5, mini_batch=2)  # one pass keeps the order; the last step is shorter
    assert [r.tolist() for r in one] == [[0, 1], [2, 3], [4]]
    two = update_plan(7, 3, n=6, mini_batch=3, inner_epochs=2)
    assert len(two) == 4
    for epoch in range(2):  # each pass is the permutation addressed by (seed, iteration, pass, stream 11)
        want = torch.randperm(6, generator=torch.Generator().manual_seed(mix_seed(7, 3, epoch, 11)))
        assert torch.equal(torch.cat(two[2 * epoch : 2 * epoch + 2]), want)
    assert not torch.equal(torch.cat(two[:2]), torch.cat(two[2:]))  # the passes differ
    assert [r.tolist() for r in update_plan(7, 3, 6, 3, 2)] == [r.tolist() for r in two]  # resume repeats it
    assert not torch.equal(torch.cat(update_plan(7, 4, 6, 3, 2)), torch.cat(two))  # the next iteration does not
    with pytest.raises(ValueError, match="mini_batch=0"):
        update_plan(0, 0, n=4, mini_batch=0)


def test_variants_resume_equal_uninterrupted(tmp_path, monkeypatch, tiny_text_encoder):
    """GRPO's variants together: MixGRPO's progressive window (a function of the checkpointed iteration), the
    GRPO-Guard loss with the step's stored moments, and Pref-GRPO's win-rate reward resume exactly."""
    variant = ["--config", str(ROOT / "configs/grpo/shapes_mixgrpo.yaml"), "--config",
               str(ROOT / "configs/grpo/shapes_guard.yaml"), "--config", str(ROOT / "configs/grpo/shapes_pref.yaml"),
               f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
               "--model.init_args.rollout.window_iterations=1"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _fit(variant + ["--trainer.max_steps=4"])
    after_full = _trainable(full)
    assert full.model.rollout_config.sde_steps == "progressive" and full.model.hparams.policy_loss == "guard"
    assert "reward/pairwise/reward" in full.trainer.logged_metrics
    monkeypatch.chdir(tmp_path / "b")
    _fit(variant + ["--trainer.max_steps=2"])
    resumed = _fit(variant + ["--trainer.max_steps=4", "--ckpt_path=last"])
    for k, v in _trainable(resumed).items():
        assert torch.allclose(after_full[k], v, atol=1e-6, rtol=0), k
