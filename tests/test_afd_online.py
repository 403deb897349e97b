"""AFD's online black-box teachers: the shapes renderer as a teacher, the clip / latent cache, the loop that queries
the teacher on the batch's own prompts with addressed seeds, resume == uninterrupted with an online teacher, the
discriminator's regularisers (matching-aware term, label smoothing), per-prompt advantages and the saturation
warning."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.data.online_teacher import OnlineTeacherSpec, ShapesRendererTeacher, TeacherCache
from genrl.data.shapes import ShapesWorldConfig
from genrl.data.teacher_videos import CallableTeacher, TeacherVideoStore, UnknownPromptError, VideoSpec, normalise_video
from genrl.flow.nft import bt_loss, centered_advantages
from genrl.noise import mix_seed

ROOT = Path(__file__).resolve().parents[1]
RENDERER_CFG = str(ROOT / "configs/afd/shapes_renderer.yaml")
TINY = str(ROOT / "configs/tiny/afd.yaml")
SPEC = VideoSpec(8, 16, 16, 8.0)
TRAIN = ["a red circle moving left slowly", "a blue square moving up quickly", "a green triangle staying still",
         "a yellow circle moves right, then moves down"]


def _cli(tiny_policy, tiny_text_encoder, args: list[str], run: bool = True) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", RENDERER_CFG, "--config", TINY, "--trainer.enable_progress_bar=false",
            f"--model.init_args.generator.pretrained={tiny_policy}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}"]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


# ---------------------------------------------------------------------------------------------- renderer teacher
def test_renderer_teacher_scores_about_one_on_every_attribute():
    from genrl.data.prompts import load_prompts
    from genrl.rewards.shapes import ShapesVerifier

    world = ShapesWorldConfig()
    prompts = [r.prompt for r in load_prompts("shapes:train")]
    teacher = ShapesRendererTeacher(world=world)
    videos = teacher.videos_for(prompts, seed=3, indices=range(len(prompts)))
    assert videos.shape == (len(prompts), 8, 3, 16, 16) and videos.dtype == torch.float32
    scores = ShapesVerifier(world=world)(videos, prompts)
    for key in ("all_correct", "color_correct", "shape_correct", "direction_correct"):
        assert float(scores[key].float().mean()) == 1.0, key
    assert float(scores["reward"].mean()) > 0.99
    # a pure function of (seed, index): the same sample in another batch is the same clip; another index moves it
    again = teacher.videos_for([prompts[5], prompts[0]], seed=3, indices=[5, 0])
    assert torch.equal(again[0], videos[5]) and torch.equal(again[1], videos[0])
    assert not torch.equal(teacher.videos_for([prompts[0]], seed=3, indices=[1])[0], videos[0])
    with pytest.raises(ValueError, match="cannot render prompt 'a photo of a cat'"):
        teacher.videos_for(["a photo of a cat"], seed=0)


def test_renderer_teacher_at_another_size_and_rate_is_normalised_to_the_student():
    world = ShapesWorldConfig(height=32, width=32, num_frames=16, object_size=10.0)
    big = ShapesRendererTeacher(VideoSpec(16, 32, 32, 16.0), world=world, fps=16.0)
    small = ShapesRendererTeacher(SPEC, world=world, fps=16.0)
    raw = big.videos_for(TRAIN[:2], seed=1, indices=[4, 5])
    out = small.videos_for(TRAIN[:2], seed=1, indices=[4, 5])
    for r, o in zip(raw, out):
        assert torch.equal(o, normalise_video(r, 16.0, SPEC))  # every other frame, 2x2 area filter
        assert torch.allclose(o[1], r[2].reshape(3, 16, 2, 16, 2).mean(dim=(2, 4)), atol=1e-6)


# ---------------------------------------------------------------------------------------------- cache
def _ramp_api(calls):
    def api(prompts, seed, indices):  # 24 fps, 30 frames of 32 x 48; frame k of sample i has grey (7 k + i) / 255
        calls.append((list(prompts), seed, list(indices)))
        levels = (torch.arange(30.0)[None, :] * 7 + torch.tensor(indices, dtype=torch.float32)[:, None]) / 255
        return levels[:, :, None, None, None].expand(-1, -1, 3, 32, 48).clone(), 24.0
    return api


def test_online_clips_are_normalised_exactly_like_the_folders(tmp_path):
    """The same source video through the online path (TeacherCache over a callable) and through a folder (mp4 +
    captions read by TeacherVideoStore) selects the same frames with the same filter."""
    from genrl.data.video_io import write_video

    calls: list = []
    online = TeacherCache(CallableTeacher(_ramp_api(calls), SPEC))
    clip = online.videos_for(["a"], seed=0, indices=[0])[0]
    raw = _ramp_api([])(["a"], 0, [0])[0][0]
    assert torch.equal(clip, normalise_video(raw, 24.0, SPEC))
    folder = tmp_path / "folder"
    folder.mkdir()
    write_video(folder / "a.mp4", raw, fps=24)
    (folder / "captions.txt").write_text("a.mp4\ta\n")
    from_folder = TeacherVideoStore(folder, spec=SPEC).videos_for(["a"], seed=0)[0]
    assert from_folder.shape == clip.shape
    assert (from_folder - clip).abs().max() < 3 / 255  # mp4 coding only: same frames (0, 3, ..., 21), same filter


def test_cache_equals_uncached_queries_once_and_survives_a_restart(tmp_path):
    calls: list = []
    source = CallableTeacher(_ramp_api(calls), SPEC, name="ramp")
    plain = source.videos_for(TRAIN[:3], seed=2, indices=[7, 8, 9])
    cache = TeacherCache(source, cache_dir=tmp_path / "cache")
    first = cache.videos_for(TRAIN[:3], seed=2, indices=[7, 8, 9])
    assert torch.equal(first, plain) and cache.queries == 3
    second = cache.videos_for([TRAIN[1], TRAIN[3]], seed=2, indices=[8, 10])  # one hit, one miss
    assert torch.equal(second[0], plain[1]) and cache.queries == 4 and calls[-1][2] == [10]
    fresh = TeacherCache(CallableTeacher(_ramp_api(calls), SPEC, name="ramp"), cache_dir=tmp_path / "cache")
    assert torch.equal(fresh.videos_for(TRAIN[:3], seed=2, indices=[7, 8, 9]), plain) and fresh.queries == 0
    # latents: encode(clips), cached per codec id; a second codec id encodes again
    encoded = []

    def encode(px):
        encoded.append(px.shape[0])
        return px * 2 - 1

    lat = cache.latents_for(TRAIN[:3], 2, [7, 8, 9], encode, "codec-a")
    assert torch.equal(lat, plain * 2 - 1) and encoded == [3]
    assert torch.equal(cache.latents_for(TRAIN[:3], 2, [7, 8, 9], encode, "codec-a"), lat) and encoded == [3]
    cache.latents_for(TRAIN[:1], 2, [7], encode, "codec-b")
    assert encoded == [3, 1]


def test_variants_cap_the_clips_per_prompt_and_a_fallback_answers_unknown_prompts(tmp_path):
    calls: list = []
    cache = TeacherCache(CallableTeacher(_ramp_api(calls), SPEC), variants_per_prompt=2)
    out = cache.videos_for(["a"] * 12, seed=0, indices=range(12))
    asked = calls[0][2]
    assert sorted(asked) == [0, 1] and cache.queries == 2  # 12 samples, 2 distinct clips made once each
    want = [mix_seed(0, i, 0x56415249) % 2 for i in range(12)]
    assert cache.addresses(0, range(12)) == want
    for i in range(12):
        assert torch.equal(out[i], out[want.index(want[i])])

    class Store:  # a folder that knows only prompt "a"
        spec, prompts = SPEC, ["a"]

        def videos_for(self, prompts, seed, indices):
            if any(p != "a" for p in prompts):
                raise UnknownPromptError(f"no clip for {[p for p in prompts if p != 'a']}")
            return torch.zeros(len(prompts), 8, 3, 16, 16)

    fb_calls: list = []
    mixed = TeacherCache(Store(), fallback=CallableTeacher(_ramp_api(fb_calls), SPEC))
    got = mixed.videos_for(["a", "b", "a"], seed=0, indices=[0, 1, 2])
    assert fb_calls == [(["b"], 0, [1])] and float(got[0].abs().sum()) == 0 and float(got[1].mean()) > 0
    with pytest.raises(UnknownPromptError, match="no clip"):
        TeacherCache(Store()).videos_for(["b"], seed=0)
    with pytest.raises(ValueError, match="variants_per_prompt"):
        TeacherCache(Store(), variants_per_prompt=0)
    with pytest.raises(ValueError, match="needs path"):
        OnlineTeacherSpec(kind="generator").build()


# ---------------------------------------------------------------------------------------------- the AFD loop
def test_afd_queries_the_online_teacher_with_the_batch_prompts_and_addressed_seed(tmp_path, monkeypatch, tiny_policy,
                                                                                    tiny_text_encoder):
    calls: list = []
    render = ShapesRendererTeacher._render

    def recording(self, prompts, seed, indices):
        calls.append((list(prompts), seed, list(indices)))
        return render(self, prompts, seed, indices)

    monkeypatch.setattr(ShapesRendererTeacher, "_render", recording)
    monkeypatch.chdir(tmp_path)
    cli = _cli(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=2", "--trainer.limit_val_batches=0"])
    assert int(cli.model.iteration) == 2
    seed = mix_seed(cli.model.hparams.seed, 33)
    fresh = _cli(tiny_policy, tiny_text_encoder, [], run=False).datamodule
    fresh.setup("fit")
    batches = [b for _, b in zip(range(2), fresh.train_dataloader())]
    assert calls == [(list(b["prompts"]), seed, b["index"].tolist()) for b in batches]
    assert "train/score_teacher" in cli.trainer.logged_metrics and "train/adv_abs_mean" in cli.trainer.logged_metrics


def test_afd_with_an_online_teacher_resumes_exactly(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    args = ["--model.init_args.mismatch_weight=0.5", "--model.init_args.label_smoothing=0.1",
            "--model.init_args.advantage_baseline=group", "--model.init_args.samples_per_prompt=2",
            "--model.init_args.teacher_fm_weight=0.5"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _cli(tiny_policy, tiny_text_encoder, args)
    assert int(full.model.iteration) == 3 and "val/disc_accuracy" in full.trainer.logged_metrics
    assert float(full.trainer.logged_metrics["train/teacher_fm"]) > 0
    final = full.model.state_dict()
    monkeypatch.chdir(tmp_path / "b")
    _cli(tiny_policy, tiny_text_encoder, args + ["--trainer.max_steps=1"])
    resumed = _cli(tiny_policy, tiny_text_encoder, args + ["--ckpt_path=last"])
    assert int(resumed.model.iteration) == 3
    assert list(resumed.model.saturation.recent) == list(full.model.saturation.recent)
    assert len(full.model.saturation.recent) == 3
    for k, v in resumed.model.state_dict().items():
        if torch.is_tensor(v):
            assert torch.allclose(v.float(), final[k].float(), atol=1e-6), k


@pytest.fixture
def model(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    m = _cli(tiny_policy, tiny_text_encoder, ["--model.init_args.samples_per_prompt=2"], run=False).model
    m.configure_model()
    return m


def test_mismatch_term_and_label_smoothing_in_closed_form(model):
    """Planted scores: D(v, c) = mean of v + 10 * (cond's first feature); the loss is the BT formula term by term."""
    from genrl.methods.distill import discriminator_loss

    def score(v, cond, sigma=None, frame_dim=1, double_backward=None):
        return v.float().mean(dim=(1, 2, 3, 4)) + 10 * cond.hidden_states[:, 0, 0]

    planted = type("D", (), {"score": staticmethod(score)})()
    teacher, student = torch.randn(3, 8, 3, 16, 16), torch.randn(6, 8, 3, 16, 16)
    prompts = ["a red circle", "a blue square", "a red circle"]
    cond_t = model.generator.encode_prompts(prompts)
    cond_s = cond_t.select([0, 0, 1, 1, 2, 2])
    s_y, s_x = score(teacher, cond_t), score(student, cond_s)
    s_y2 = s_y.repeat_interleave(2)
    base, _ = discriminator_loss(planted, teacher, student, cond_t, cond_s, 2)
    assert torch.allclose(base, bt_loss(s_y2, s_x))
    eps = 0.1
    smooth, _ = discriminator_loss(planted, teacher, student, cond_t, cond_s, 2, label_smoothing=eps)
    gap = s_y2 - s_x
    assert torch.allclose(smooth, ((1 - eps) * torch.nn.functional.softplus(-gap)
                                   + eps * torch.nn.functional.softplus(gap)).mean())
    wrong = score(teacher.roll(1, 0), cond_t)
    mism, _ = discriminator_loss(planted, teacher, student, cond_t, cond_s, 2, mismatch_weight=0.5,
                                 mismatch_valid=torch.tensor([False, True, True]))
    expected = bt_loss(s_y2, s_x) + 0.5 * torch.nn.functional.softplus(-(s_y - wrong))[1:].mean()
    assert torch.allclose(mism, expected)


def test_group_baseline_ranks_each_prompts_rollouts(model):
    teacher, student = torch.randn(2, 8, 3, 16, 16), torch.randn(4, 8, 3, 16, 16)
    cond_t = model.generator.encode_prompts(["a red circle", "a blue square"])
    cond_s = cond_t.select([0, 0, 1, 1])
    s_idx = torch.tensor([10, 11, 14, 15])  # prompt slots 5 and 7, K = 2
    model.hparams.advantage_baseline = "batch"
    d, adv_b, *_ = model.advantages(teacher, student, cond_t, cond_s, s_idx)
    assert torch.allclose(adv_b, centered_advantages(d, clip=model.hparams.clip_c))
    model.hparams.advantage_baseline = "group"
    d2, adv_g, r, s_x, s_y = model.advantages(teacher, student, cond_t, cond_s, s_idx)
    assert torch.equal(d2, d) and torch.allclose(d, s_x - s_y.repeat_interleave(2))
    centred = torch.cat([d[:2] - d[:2].mean(), d[2:] - d[2:].mean()])
    assert torch.allclose(adv_g, centred / (d.std(unbiased=False) + 1e-6), atol=1e-5)  # DiffusionNFT: global std
    assert torch.allclose(adv_g[0], -adv_g[1]) and not torch.allclose(adv_g, adv_b)


def _fit_with_planted_scores(tiny_policy, tiny_text_encoder, planted, monkeypatch):
    from genrl.models.discriminator import VideoDiscriminator

    real = VideoDiscriminator.score

    def score(self, v, cond, sigma=None, frame_dim=1, double_backward=None):
        return real(self, v, cond, sigma=sigma, frame_dim=frame_dim, double_backward=double_backward) * 0 + planted(v)

    monkeypatch.setattr(VideoDiscriminator, "score", score)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _cli(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=3", "--trainer.limit_val_batches=0",
                                              "--model.init_args.saturation_window=2",
                                              "--model.init_args.disc_noise_max=0", "--model.init_args.r1_weight=0"])
    return [str(w.message) for w in seen if "AFD: the discriminator" in str(w.message)]


def test_saturation_warning_fires_on_an_always_right_discriminator_only(tmp_path, monkeypatch, tiny_policy,
                                                                        tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    # the renderer's clips are mostly exact black background, a student's never: "the fraction of pixels at the clip's
    # minimum" is always right
    def background(v):
        flat = v.detach().flatten(1)
        return (flat <= flat.min(1, keepdim=True).values + 1e-6).float().mean(1) * 100

    always = _fit_with_planted_scores(tiny_policy, tiny_text_encoder, background, monkeypatch)
    assert len(always) == 1 and "disc_noise_max" in always[0] and "mismatch_weight" in always[0]
    gen = torch.Generator().manual_seed(0)
    balanced = _fit_with_planted_scores(tiny_policy, tiny_text_encoder,
                                        lambda v: torch.randn(v.shape[0], generator=gen), monkeypatch)
    assert balanced == []


def test_check_saturation_window(model):
    from genrl.methods.distill import SaturationMonitor

    model.saturation = SaturationMonitor("AFD", 0.95, 3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        flags = [model.check_saturation(a) for a in (1.0, 1.0, 0.8, 1.0, 1.0, 0.94, 1.0)]
    assert flags == [False, False, False, False, False, True, True]  # window means .93 .93 .93 .98 .98
    assert sum("AFD: the discriminator" in str(w.message) for w in seen) == 1
    assert not math.isnan(model.hparams.saturation_threshold)


def test_trunk_discriminator_scores_the_frozen_initial_student_features(tmp_path, monkeypatch, tiny_policy,
                                                                         tiny_text_encoder):
    """discriminator_trunk: heads on a frozen copy of the initial student (bidirectional), only the heads train."""
    from genrl.models.discriminator import TrunkDiscriminator
    from genrl.models.roles import swapped_transformer
    from genrl.models.trunk import trunk_adapter

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="discriminator_trunk"):
        _cli(tiny_policy, tiny_text_encoder, ["--model.init_args.discriminator_trunk=[1]"], run=False)
    args = ["--model.init_args.discriminator_trunk=[1, 2]", "--model.init_args.r1_weight=0",
            "--trainer.limit_val_batches=0"]
    cli = _cli(tiny_policy, tiny_text_encoder, args, run=False)
    cli.model.configure_model()
    disc, gen = cli.model.discriminator, cli.model.generator
    assert isinstance(disc, TrunkDiscriminator) and disc.layers == [1, 2]
    trunk0 = {k: v.clone() for k, v in disc.trunk.state_dict().items()}
    heads0 = {k: v.clone() for k, v in disc.heads.state_dict().items()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert all(torch.equal(v, trunk0[k]) for k, v in disc.trunk.state_dict().items())  # frozen
    assert any(not torch.equal(v, heads0[k]) for k, v in disc.heads.state_dict().items())  # trained
    student = dict(gen.transformer.named_parameters())
    assert any(not torch.equal(student[k], v) for k, v in disc.trunk.named_parameters() if k in student)
    x = torch.randn(3, 8, 3, 16, 16)
    cond = gen.encode_prompts(["a red circle", "a blue square", "a green triangle"])
    sigma = torch.tensor([0.0, 0.3, 0.6])
    with torch.no_grad(), swapped_transformer(gen, disc.trunk) as g:
        causal, g.causal = g.causal, None
        feats = trunk_adapter(g).features_at(x, sigma, cond, [1, 2])
        g.causal = causal
        expected = disc.heads(feats)
    assert gen.causal is not None  # the student's layout is restored
    with torch.no_grad():
        assert torch.allclose(disc.score(x, cond, sigma=sigma), expected, atol=1e-6)
        assert not torch.allclose(disc.score(x, cond), expected)  # sigma reaches the trunk
    with pytest.raises(ValueError, match="R1 / R2"):
        disc.score(x, cond, double_backward=True)


def test_teacher_flow_matching_term_targets_eps_minus_y_and_changes_the_update(model, monkeypatch):
    import genrl.methods.distill as afd_module  # where the teacher-forced flow-matching term calls the velocity

    y = torch.randn(2, 8, 3, 16, 16)
    cond = model.generator.encode_prompts(["a red circle", "a blue square"])
    idx = torch.tensor([3, 4])
    seen = {}

    def oracle(gen, x0, x_t, sigma, cond, causal):  # the exact velocity of the straight path: eps - y
        seen["sigma"] = sigma
        s = sigma[:, :, None, None, None]
        return (x_t - x0) / s

    monkeypatch.setattr(afd_module, "teacher_forced_velocity", oracle)
    assert float(model.teacher_fm_loss(y, cond, idx, it=0, step=0)) < 1e-10
    levels = set(model.schedule.sigmas()[:-1].tolist())
    sig = seen["sigma"]
    assert sig.shape == (2, 8) and set(sig.flatten().tolist()) <= levels
    assert torch.equal(sig[:, ::2], sig[:, 1::2])  # one level per chunk of 2 frames

    def off_by_y(gen, x0, x_t, sigma, cond, causal):  # eps - y + y: error y everywhere
        return oracle(gen, x0, x_t, sigma, cond, causal) + x0

    monkeypatch.setattr(afd_module, "teacher_forced_velocity", off_by_y)
    assert torch.allclose(model.teacher_fm_loss(y, cond, idx, it=0, step=0), (y ** 2).mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="teacher_fm_weight"):
        type(model)(teacher_fm_weight=-1.0)


def test_nft_weight_scales_only_the_on_policy_term(model):
    x0 = torch.randn(4, 8, 3, 16, 16)
    cond = model.generator.encode_prompts(["a red circle"] * 2 + ["a blue square"] * 2)
    r, idx = torch.tensor([0.1, 0.9, 0.5, 0.7]), torch.arange(4)
    with torch.no_grad():
        full, stats = model.nft_step_loss(x0, r, cond, idx, it=0, step=0)
        model.hparams.nft_weight = 0.0
        ref_only, stats0 = model.nft_step_loss(x0, r, cond, idx, it=0, step=0)
    assert torch.allclose(full - ref_only, stats["nft_loss"], atol=1e-6) and float(stats["nft_loss"]) > 0
    assert torch.allclose(ref_only, model.hparams.ref_weight * stats0["ref_reg"], atol=1e-7)


def test_teacher_flow_matching_weight_changes_only_the_students_update(tmp_path, monkeypatch, tiny_policy,
                                                                       tiny_text_encoder):
    """One iteration with teacher_fm_weight 0 and 5: the discriminator's step (before the student's) is identical,
    the student's differs."""
    states = {}
    for w in (0.0, 5.0):
        (tmp_path / str(w)).mkdir()
        monkeypatch.chdir(tmp_path / str(w))
        cli = _cli(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                                                    f"--model.init_args.teacher_fm_weight={w}"])
        states[w] = {k: v.clone() for k, v in cli.model.state_dict().items() if torch.is_tensor(v)}
    a, b = states[0.0], states[5.0]
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("discriminator."))
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("generator."))
