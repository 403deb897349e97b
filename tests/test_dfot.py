"""Diffusion-forcing training (FlowMatchingPretrain's ``diffusion_forcing`` modes) and the DFoT configs: the
per-frame sigma draws, the noising on the generator's frame axis in closed form, and the Wan / shapes configs through
the real CLI (DFoT, Song et al. 2025)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from genrl.flow import TimestepSampler, flow_matching_loss
from genrl.methods.pretrain import FlowMatchingPretrain
from genrl.noise import randn_per_sample, sample_generator

ROOT = Path(__file__).resolve().parents[1]


def _model(patch_t: int = 2, frame_dim: int = 1, **kwargs) -> FlowMatchingPretrain:
    model = FlowMatchingPretrain(**kwargs)
    model.generator = SimpleNamespace(frame_dim=frame_dim, transformer=SimpleNamespace(
        config=SimpleNamespace(patch_size=[patch_t, 2, 2])))
    return model


def test_independent_mode_is_one_draw_per_temporal_patch_from_the_sample_address():
    """``independent`` (and ``True``, its old spelling) draw each sample's patch sigmas from its own (seed, index)
    generator, exactly the sampler's values repeated over the patch; ``none`` draws one sigma per sample."""
    idx = torch.tensor([3, 0, 11])
    got = _model(seed=4, diffusion_forcing="independent")._sample_sigma(idx, 8)
    assert torch.equal(got, _model(seed=4, diffusion_forcing=True)._sample_sigma(idx, 8))
    sampler = TimestepSampler()
    ref = torch.stack([sampler(4, sample_generator(4, int(i), 0, 1)).repeat_interleave(2) for i in idx])
    assert torch.equal(got, ref)
    flat = _model(seed=4, diffusion_forcing="none")._sample_sigma(idx, 8)
    assert flat.shape == (3,) and torch.equal(flat, ref[:, 0])  # the first draw of the same generator
    assert torch.equal(_model(seed=4)._sample_sigma(idx, 8), flat)  # the default (False) is "none"


def test_history_mode_draws_a_prefix_of_independent_levels_and_one_shared_future():
    """``history`` with allowed lengths {0, 2, 6} over 8 frames (patch 2): every row is a history prefix of h frames
    with their own levels and one level for frames h..7; each allowed h occurs (about a third each) and no other;
    a sub-batch gives the same rows (per-sample addressing)."""
    model = _model(seed=1, diffusion_forcing="history", history_frames=[0, 2, 6])
    idx = torch.arange(600)
    sig = model._sample_sigma(idx, 8)
    assert sig.shape == (600, 8) and torch.equal(sig[:, 0::2], sig[:, 1::2])
    groups = sig[:, 0::2]  # [600, 4]
    # the history length: the first group from which all later groups are equal
    lengths = []
    for row in groups:
        k = 3
        while k > 0 and row[k - 1] == row[3]:
            k -= 1
        lengths.append(2 * k)
    counts = {h: lengths.count(h) for h in set(lengths)}
    assert set(counts) == {0, 2, 6}, counts
    assert all(150 < c < 250 for c in counts.values()), counts
    assert torch.equal(model._sample_sigma(torch.tensor([599, 7]), 8), sig[[599, 7]])
    assert 0.0 < float(sig.min()) and float(sig.max()) < 1.0


def test_history_sigma_max_scales_only_the_history_prefix():
    """``history_sigma_max`` m: from the same draws, the history groups' levels are m times the unscaled ones (so in
    [0, m]), the shared future level is untouched, 0 gives a clean history; the default 1.0 is bitwise the unscaled
    rule."""
    from genrl.flow import TimestepSampler, diffusion_forcing_sigmas

    def draw(**kw):
        return diffusion_forcing_sigmas(64, 8, generator=torch.Generator().manual_seed(3), mode="history",
                                        frame_group=2, sampler=TimestepSampler(), **kw)

    plain, scaled, clean = draw(), draw(history_sigma_max=0.1), draw(history_sigma_max=0.0)
    assert torch.equal(draw(history_sigma_max=1.0), plain)
    groups = plain[:, 0::2]
    # history length in groups: the first group from which every later group equals the last
    h = torch.tensor([next(k for k in range(4) if bool((row[k:] == row[3]).all())) for row in groups])
    prefix = (torch.arange(4)[None] < h[:, None]).repeat_interleave(2, dim=1)  # [64, 8]
    assert 0 < int(prefix.sum()) < prefix.numel()
    assert torch.equal(scaled[~prefix], plain[~prefix]) and torch.equal(clean[~prefix], plain[~prefix])
    assert torch.equal(scaled[prefix], plain[prefix] * 0.1) and float(scaled[prefix].max()) <= 0.1
    assert torch.equal(clean[prefix], torch.zeros_like(clean[prefix]))
    model = _model(seed=1, diffusion_forcing="history", history_sigma_max=0.05)
    ref = _model(seed=1, diffusion_forcing="history")
    got, want = model._sample_sigma(torch.arange(40), 8), ref._sample_sigma(torch.arange(40), 8)
    assert not torch.equal(got, want) and torch.equal(got[:, -1], want[:, -1])  # the future is never a prefix
    assert torch.allclose(got[got != want] / want[got != want], torch.tensor(0.05))


def test_diffusion_forcing_arguments_are_checked():
    with pytest.raises(ValueError, match="diffusion_forcing must be true / false or one of"):
        FlowMatchingPretrain(diffusion_forcing="per_frame")
    with pytest.raises(ValueError, match=r"history_frames=4 applies to diffusion_forcing: history only"):
        FlowMatchingPretrain(diffusion_forcing="independent", history_frames=4)
    with pytest.raises(ValueError, match=r"history_sigma_max=0.1 applies to diffusion_forcing: history only"):
        FlowMatchingPretrain(diffusion_forcing="independent", history_sigma_max=0.1)
    with pytest.raises(ValueError, match=r"history_sigma_max must be in \[0, 1\].*1.5"):
        FlowMatchingPretrain(diffusion_forcing="history", history_sigma_max=1.5)
    from genrl.flow import diffusion_forcing_sigmas

    with pytest.raises(ValueError, match="history_sigma_max applies to mode='history' only"):
        diffusion_forcing_sigmas(1, 8, generator=torch.Generator(), history_sigma_max=0.5)
    with pytest.raises(ValueError, match=r"history_sigma_max must be in \[0, 1\].*-0.1"):
        diffusion_forcing_sigmas(1, 8, generator=torch.Generator(), mode="history", history_sigma_max=-0.1)
    model = _model(diffusion_forcing="history", history_frames=3)  # not a multiple of the temporal patch 2
    with pytest.raises(ValueError, match="multiple of frame_group = 2"):
        model._sample_sigma(torch.arange(2), 8)


class _FramesOnAxis2:
    """A stand-in generator with Wan's layout [B, C, F, h, w] that records what the training step feeds it."""

    frame_dim = 2

    def __init__(self, x0: torch.Tensor) -> None:
        self.x0 = x0
        self.weight = torch.nn.Parameter(torch.tensor(0.5))
        self.transformer = SimpleNamespace(config=SimpleNamespace(patch_size=[1, 2, 2]))
        self.seen = {}

    def encode(self, pixels):
        return self.x0

    def encode_prompts(self, prompts):
        return list(prompts)  # velocity below ignores it

    def velocity(self, x, sigma, cond, **kwargs):
        self.seen.update(x=x.detach().clone(), sigma=sigma.detach().clone())
        return self.weight * x


def test_training_step_noises_each_latent_frame_on_the_frame_axis_in_closed_form():
    """Wan layout (frames on axis 2), ``history`` mode: the model input is (1 - s_f) x0 + s_f eps per latent frame f
    with s the addressed per-frame draw, and the loss is the flow-matching MSE against eps - x0 over all frames."""
    x0 = torch.randn(3, 4, 5, 2, 2, generator=torch.Generator().manual_seed(0))  # [B, C, F, h, w]
    model = FlowMatchingPretrain(seed=7, diffusion_forcing="history", history_frames=[2, 4], caption_dropout=0.0)
    model.generator = _FramesOnAxis2(x0)
    model.log = lambda *a, **k: None
    batch = {"pixels": torch.zeros(3, 17, 3, 16, 16), "prompts": ["a", "b", "c"], "index": torch.tensor([5, 9, 2])}
    loss = model.training_step(batch, 0)
    sigma = model._sample_sigma(batch["index"], 5)  # [B, F]
    eps = randn_per_sample(x0.shape[1:], 7, batch["index"], stream=0)
    s = sigma[:, None, :, None, None]
    expected_x = (1 - s) * x0 + s * eps
    seen = model.generator.seen
    assert torch.equal(seen["sigma"], sigma)
    torch.testing.assert_close(seen["x"], expected_x, rtol=0, atol=1e-6)
    ref = ((0.5 * expected_x - (eps - x0)) ** 2).mean()
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(loss.detach(), flow_matching_loss(0.5 * seen["x"], x0, eps, sigma, frame_dim=2).mean())
    # per sample the levels after the history prefix are shared, the prefix has its own
    for row in sigma:
        assert row[4] == row[-1] and len(set(row.tolist())) in (3, 5)


def _cli(args: list[str], run: bool = False):
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401
    from genrl.cli import GenRLCLI

    return GenRLCLI(args=(["fit"] if run else []) + args, run=run)


def test_wan_dfot_config_trains_two_steps_and_samples_with_history_guidance(tmp_path, monkeypatch):
    """configs/dfot/wan2.1_t2v_1.3b.yaml with tiny random Wan components and a folder of captioned mp4s: 2 LoRA
    steps of history-mode diffusion forcing through the real CLI (only LoRA weights change), then one history-guided
    continuation (vanilla guidance: 2 calls per step) whose given latent frame comes back bit for bit."""
    from genrl.data.video_io import write_video
    from genrl.flow import HistoryGuidance
    from genrl.rollout import RolloutConfig
    from genrl.rollout.history import history_rollout
    from genrl.testing.families import TINY_SIZE, tiny_generator_spec

    monkeypatch.chdir(tmp_path)
    size = TINY_SIZE["wan"]
    videos = tmp_path / "videos"
    videos.mkdir()
    for i, caption in enumerate(["a red circle moving left", "a blue square staying still"]):
        write_video(videos / f"{i}.mp4", torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(i)), fps=16)
        (videos / f"{i}.txt").write_text(caption)
    override = {
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 2, "limit_val_batches": 0,
                    "enable_progress_bar": False, "logger": False, "callbacks": []},
        "model": {"init_args": {
            "generator": tiny_generator_spec("wan", gradient_checkpointing=False),
            "lora": {"rank": 4, "alpha": 4}, "history_frames": [0, 1], "warmup_steps": 0}},
        "data": {"init_args": {"root": str(videos), "num_frames": size["num_frames"], "height": size["height"],
                               "width": size["width"], "batch_size": 2, "num_workers": 0, "val_fraction": 0.0}},
    }
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    cli = _cli(["--config", str(ROOT / "configs/dfot/wan2.1_t2v_1.3b.yaml"), "--config", str(tmp_path / "tiny.yaml")])
    assert cli.model.df_mode == "history"
    cli.model.configure_model()
    before = {n: p.detach().clone() for n, p in cli.model.named_parameters()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    changed = {n for n, p in cli.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all("lora_" in n for n in changed)

    gen = cli.model.generator
    gen.transformer.eval()
    c, f, h, w = gen.latent_shape
    history = torch.randn(2, c, 1, h, w, generator=torch.Generator().manual_seed(3))
    rule = HistoryGuidance("vanilla", scale=2.0)
    out = history_rollout(gen, ["a red circle", "a blue square"], (c, h, w), f, seed=0, history=history,
                          guidance=rule, config=RolloutConfig(num_steps=2, kernel="ode"), window=f)
    assert out.video.shape == (2, c, f, h, w) and torch.equal(out.video[:, :, :1], history)
    assert out.windows == [{"start": 0, "history": 1, "keyframes": 0, "new": 1, "nfe": 2}] and out.network_calls == 4
    assert torch.isfinite(out.video).all()
    # a keyframe in Wan's layout ([B, C, K, h, w]) lands at its frame, bit for bit; the window made of it and the
    # generated frame 1 calls nothing
    key = torch.randn(2, c, 1, h, w, generator=torch.Generator().manual_seed(4))
    keyed = history_rollout(gen, ["a red circle", "a blue square"], (c, h, w), 4, seed=0, history=history,
                            guidance=rule, config=RolloutConfig(num_steps=2, kernel="ode"), window=2, context=1,
                            keyframes=key, keyframe_positions=[2])
    assert keyed.video.shape == (2, c, 4, h, w) and torch.equal(keyed.video[:, :, 2:3], key)
    assert keyed.generated.tolist() == [False, True, False, True] and keyed.network_calls == 2 * 2 * 2


def test_shapes_dfot_config_fine_tunes_the_shipped_model(tmp_path, monkeypatch):
    """configs/dfot/shapes.yaml: starts from assets/shapes-dit (its weights, not random ones), trains 2 steps with an
    independent level per temporal patch, and changes the weights."""
    from genrl.models import ModelSpec

    monkeypatch.chdir(tmp_path)
    cli = _cli(["--config", str(ROOT / "configs/dfot/shapes.yaml"), "--trainer.max_steps=2",
                "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
                "--data.init_args.batch_size=4", "--data.init_args.num_workers=0", "--trainer.callbacks=[]"])
    cli.model.configure_model()
    shipped = ModelSpec(pretrained=str(ROOT / "assets/shapes-dit")).build().state_dict()
    start = {k: v.detach().clone() for k, v in cli.model.generator.transformer.state_dict().items()}
    assert all(torch.equal(start[k], v) for k, v in shipped.items())
    assert cli.model.df_mode == "independent"
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = cli.model.generator.transformer.state_dict()
    assert cli.trainer.global_step == 2 and any(not torch.equal(start[k], after[k]) for k in start)
