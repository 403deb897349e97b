"""ODE initialisation of a causal student (CausVid sec. 4.3): teacher pairs, their datamodule, the ODEInit method.

Tiny random DiT teacher / student and a tiny text encoder (tests/conftest.py); the CLI run composes
configs/ode_init/shapes.yaml with tiny overrides, so the shipped config cannot rot.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from genrl.data.ode_pairs import ODEPairs, ODEPairsDataModule, load_ode_pairs, save_ode_pairs
from genrl.methods.ode_init import ODEInit, chunk_states_to_frames, draw_chunk_states, select_states, shapes_schedule
from genrl.models.causal import CausalConfig
from genrl.models.families import GeneratorSpec
from genrl.models.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
LATENT = (4, 3, 8, 8)  # [T, C, H, W]: 2 chunks of 2 latent frames
PROMPTS = ["a red circle moving left", "a blue square staying still", "a green triangle moving up"]
TEACHER_STEPS, CFG, N, BATCH = 6, 2.0, 6, 4


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"pipelines_{name}", ROOT / "pipelines" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ode_pairs = _script("ode_pairs")
STUDENT = shapes_schedule().sigmas()[:-1].tolist()  # [1, .75, .5, .25]


def _teacher(tiny_policy, tiny_text_encoder):
    from genrl.models.generator import DiTGenerator
    from genrl.models.text_encoder import TextEncoder

    return DiTGenerator(ModelSpec(pretrained=tiny_policy).build().eval(),
                        TextEncoder.from_pretrained(tiny_text_encoder))


def _generate(teacher, out, **kw):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(N)]
    args = dict(teacher_steps=TEACHER_STEPS, cfg_scale=CFG, shift=1.0, seed=0, out=out, batch_size=BATCH,
                progress=False)
    args.update(kw)
    with torch.no_grad():
        return ode_pairs.generate_ode_pairs(teacher, prompts, LATENT, STUDENT, **args)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory, tiny_policy, tiny_text_encoder) -> Path:
    return _generate(_teacher(tiny_policy, tiny_text_encoder), tmp_path_factory.mktemp("pairs") / "pairs.pt")


def _student(tiny_policy, tiny_text_encoder, spec: GeneratorSpec | None = None, **kw) -> ODEInit:
    m = ODEInit(generator=spec or GeneratorSpec(pretrained=tiny_policy, text_encoder=tiny_text_encoder),
                latent_shape=list(LATENT), **kw)
    m.configure_model()
    return m


def _batch(pairs_file, batch_size=N):
    dm = ODEPairsDataModule(str(pairs_file), batch_size=batch_size, val=None)
    return dm.make_train_loader().dataset.batch(0)


# ---------------------------------------------------------------------------------------------- teacher pairs
@pytest.mark.parametrize("student,steps,shift", [
    (STUDENT, 40, 1.0),
    (ode_pairs.student_sigmas_of([1000, 750, 500, 250], 5.0), 48, 8.0),  # Self-Forcing student, CausVid teacher
    (ode_pairs.student_sigmas_of([1000, 800, 600, 400, 200], 5.0), 20, 3.0),  # Rolling Forcing's list
])
def test_teacher_schedule_contains_every_student_sigma(student, steps, shift):
    sched = ode_pairs.teacher_schedule(student, steps, shift).tolist()
    assert len(sched) == steps + 1 and sched[0] == 1.0 and sched[-1] == 0.0
    assert all(a > b for a, b in zip(sched, sched[1:]))
    assert all(s in sched for s in student)  # exactly, not approximately


def test_teacher_schedule_errors():
    with pytest.raises(ValueError, match="too coarse"):
        ode_pairs.teacher_schedule([1.0, 0.9, 0.85, 0.8], 3)
    with pytest.raises(ValueError, match="strictly descending"):
        ode_pairs.teacher_schedule([0.5, 0.75], 10)
    with pytest.raises(ValueError, match="teacher_steps"):
        ode_pairs.teacher_schedule(STUDENT, 0)


def test_stored_states_equal_an_independent_ode_rollout(pairs_file, tiny_policy, tiny_text_encoder):
    from genrl.rollout.noise import randn_per_sample

    pairs = load_ode_pairs(pairs_file)
    assert pairs.latents.shape == (N, len(STUDENT) + 1, *LATENT) and pairs.latents.dtype == torch.float32
    assert pairs.sigmas.tolist() == STUDENT + [0.0]
    assert pairs.prompts == [PROMPTS[i % 3] for i in range(N)] and pairs.index.tolist() == list(range(N))
    sched = pairs.teacher_sigmas.tolist()
    assert len(sched) == TEACHER_STEPS + 1 and all(s in sched for s in pairs.sigmas.tolist())
    # independent float64 Euler integration with standard-form CFG, one network call for the whole batch
    teacher = _teacher(tiny_policy, tiny_text_encoder)
    cond, uncond = teacher.encode_prompts(pairs.prompts), teacher.encode_prompts([""] * N)
    x = randn_per_sample(LATENT, 0, range(N)).double()
    states = {1.0: x.clone()}
    with torch.no_grad():
        for s, s_next in zip(sched, sched[1:]):
            sig = torch.full((N,), s)
            v_c = teacher.velocity(x.float(), sig, cond).double()
            v_u = teacher.velocity(x.float(), sig, uncond).double()
            x = x + (s_next - s) * (v_u + CFG * (v_c - v_u))
            states[s_next] = x.clone()
    for i, s in enumerate(pairs.sigmas.tolist()):
        assert torch.allclose(pairs.latents[:, i].double(), states[s], atol=2e-5, rtol=0), s
    assert not torch.equal(pairs.latents[:, 0], pairs.latents[:, -1])


def test_generation_resumes_skips_and_refuses_other_settings(pairs_file, tiny_policy, tiny_text_encoder, tmp_path,
                                                            monkeypatch):
    import genrl.rollout.sampler as sampler

    teacher = _teacher(tiny_policy, tiny_text_encoder)
    real, calls = sampler.rollout, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    out = tmp_path / "pairs.pt"
    monkeypatch.setattr(sampler, "rollout", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _generate(teacher, out)
    assert not out.exists() and len(list((tmp_path / "pairs.pt.parts").glob("*.pt"))) == 1
    monkeypatch.setattr(sampler, "rollout", real)
    _generate(teacher, out)  # resumes: only the missing shard is generated, then merged
    assert not (tmp_path / "pairs.pt.parts").exists()
    a, b = load_ode_pairs(out), load_ode_pairs(pairs_file)
    assert torch.equal(a.latents, b.latents) and a.settings == b.settings
    mtime = out.stat().st_mtime_ns
    monkeypatch.setattr(sampler, "rollout", interrupted)  # a complete file: nothing to generate
    _generate(teacher, out)
    assert out.stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="other settings"):
        _generate(teacher, out, cfg_scale=4.0)


def test_bad_files_raise_clear_errors(tmp_path, pairs_file, tiny_policy, tiny_text_encoder):
    with pytest.raises(FileNotFoundError, match="pipelines/ode_pairs.py"):
        load_ode_pairs(tmp_path / "missing.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00not a torch file" * 10)
    with pytest.raises(ValueError, match="junk.pt.*not a readable ODE-pairs file"):
        load_ode_pairs(junk)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match="not an ODE-pairs file"):
        load_ode_pairs(other)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(Path(pairs_file).read_bytes()[:5000])
    with pytest.raises(ValueError, match="corrupt"):
        load_ode_pairs(truncated)
    p = load_ode_pairs(pairs_file)
    with pytest.raises(ValueError, match="states per trajectory"):
        save_ode_pairs(tmp_path / "bad.pt", ODEPairs(p.latents[:, :3], p.sigmas, p.teacher_sigmas, p.prompts, p.index))
    with pytest.raises(FileNotFoundError, match="missing.pt"):  # the datamodule fails before any training
        ODEPairsDataModule(str(tmp_path / "missing.pt")).setup("fit")
    student = _student(tiny_policy, tiny_text_encoder, schedule=shapes_schedule().__class__(
        causal=CausalConfig(chunk_size=2), shift=5.0))
    with pytest.raises(ValueError, match="regenerate the pairs"):
        student.regression_loss(_batch(pairs_file), step=0)


# ---------------------------------------------------------------------------------------------- datamodule
def test_datamodule_epochs_shuffle_and_resume(pairs_file):
    dm = ODEPairsDataModule(str(pairs_file), batch_size=4, seed=3, val="shapes:heldout", val_size=5, val_batch_size=2)
    stream = dm.make_train_loader().dataset
    batches = [stream.batch(b) for b in range(6)]  # 24 slots = 4 epochs of 6 trajectories
    rows = torch.cat([b["index"] for b in batches])
    for e in range(4):
        assert sorted(rows[6 * e : 6 * e + 6].tolist()) == list(range(6))
    assert not torch.equal(rows[:6], rows[6:12])  # reshuffled per epoch
    b0 = batches[0]
    assert b0["ode_latents"].shape == (4, 5, *LATENT) and b0["ode_sigmas"].tolist() == STUDENT + [0.0]
    pairs = load_ode_pairs(pairs_file)
    assert torch.equal(b0["ode_latents"][1], pairs.latents[int(b0["index"][1])])
    assert b0["prompts"][1] == pairs.prompts[int(b0["index"][1])]
    again = ODEPairsDataModule(str(pairs_file), batch_size=4, seed=3).make_train_loader(start=4)
    resumed = next(iter(again))
    assert torch.equal(resumed["position"], batches[4]["position"])
    assert torch.equal(resumed["index"], batches[4]["index"])
    loader = dm.make_train_loader(track_delivery=True)
    loader.mark_delivered(batches[2])
    assert loader.state_dict() == {"batches_consumed": 3}
    val = dm.val_batches()
    assert [len(b["prompts"]) for b in val] == [2, 2, 1] and val[0]["index"].tolist() == [-1, -2]
    halves = [dm.make_train_loader(r, 2).dataset for r in (0, 1)]  # batch_size is global: 2 ranks split it
    for b in range(3):
        assert torch.cat([h.batch(b)["position"] for h in halves]).tolist() == batches[b]["position"].tolist()


# ---------------------------------------------------------------------------------------------- the loss
def test_chunk_state_draw_is_per_chunk_independent_and_deterministic():
    causal = CausalConfig(chunk_size=2)
    d = draw_chunk_states(7, [3, 5, 9], step=11, num_chunks=4, num_states=4)
    assert d.shape == (3, 4) and d.dtype == torch.long and 0 <= int(d.min()) and int(d.max()) < 4
    assert torch.equal(d, draw_chunk_states(7, [3, 5, 9], 11, 4, 4))
    assert torch.equal(d[1:2], draw_chunk_states(7, [5], 11, 4, 4))  # independent of batch composition
    assert not torch.equal(draw_chunk_states(7, range(64), 11, 4, 4), draw_chunk_states(7, range(64), 12, 4, 4))
    frames = chunk_states_to_frames(d, causal, 8)
    assert torch.equal(frames[:, 0::2], frames[:, 1::2]) and torch.equal(frames[:, ::2], d)  # constant in a chunk
    many = draw_chunk_states(0, range(4000), 0, 4, 4)
    same = (many[:, 0] == many[:, 1]).float().mean().item()
    assert abs(same - 0.25) < 0.03  # independent across chunks: P(equal) = 1 / S
    counts = torch.bincount(many.flatten(), minlength=4).float() / many.numel()
    assert torch.allclose(counts, torch.full((4,), 0.25), atol=0.02)


def test_select_states_copies_each_chunk_from_its_state():
    lat = torch.randn(2, 5, 4, 3, 2, 2)
    sig = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    fs = torch.tensor([[0, 0, 3, 3], [2, 2, 1, 1]])
    x, s = select_states(lat, sig, fs)
    for b in range(2):
        for t in range(4):
            assert torch.equal(x[b, t], lat[b, fs[b, t], t]) and s[b, t] == sig[fs[b, t]]
    wan = lat.permute(0, 1, 3, 2, 4, 5)  # [B, S + 1, C, T, H, W]
    xw, _ = select_states(wan, sig, fs, frame_dim=2)
    assert torch.equal(xw, x.permute(0, 2, 1, 3, 4))
    with pytest.raises(ValueError, match="frame_states"):
        select_states(lat, sig, fs[:, :3])


def _exact_velocity(target, garbage_on_clean=False):
    def velocity(x, sigma, cond, **kw):
        s = sigma.to(torch.float64)[:, :, None, None, None]
        v = (x.double() - target.double()) / s.clamp_min(1e-12)
        if garbage_on_clean:
            v = torch.where(s == 0, torch.full_like(v, 1e6), v)
        return v.float()
    return velocity


def test_loss_is_zero_for_the_exact_x0_and_positive_otherwise(pairs_file, tiny_policy, tiny_text_encoder, monkeypatch):
    student = _student(tiny_policy, tiny_text_encoder)
    batch = _batch(pairs_file)
    real = student.regression_loss(batch, step=0)
    assert float(real["loss"].detach()) > 1e-6 and real["loss"].requires_grad
    assert torch.equal(real["x0_target"], batch["ode_latents"][:, -1])
    target = batch["ode_latents"][:, -1]
    monkeypatch.setattr(student.generator, "velocity", _exact_velocity(target))
    assert float(student.regression_loss(batch, step=0)["loss"]) < 1e-10


def test_frames_at_sigma_zero_are_excluded(pairs_file, tiny_policy, tiny_text_encoder, monkeypatch):
    student = _student(tiny_policy, tiny_text_encoder, draw_clean_state=True)
    batch = _batch(pairs_file)
    ids = batch["position"]
    step = next(s for s in range(200) if 0 < int((draw_chunk_states(0, ids, s, 2, 5) == 4).sum()) < ids.numel() * 2)
    monkeypatch.setattr(student.generator, "velocity", _exact_velocity(batch["ode_latents"][:, -1], True))
    out = student.regression_loss(batch, step=step)
    assert bool((out["sigma"] == 0).any()) and bool((out["sigma"] != 0).any())
    assert float(out["loss"]) < 1e-10  # the 1e6 garbage on clean frames never enters the loss


def test_training_steps_lower_the_loss_on_a_fixed_batch(pairs_file, tiny_policy, tiny_text_encoder):
    from conftest import TINY_DIT

    torch.manual_seed(0)  # a fresh student (zero-initialised output: x0_hat = x), far from the teacher's endpoints
    student = _student(tiny_policy, tiny_text_encoder, spec=GeneratorSpec(components={"transformer": dict(TINY_DIT)},
                                                                          text_encoder=tiny_text_encoder))
    batch = _batch(pairs_file)
    params = {n: p.detach().clone() for n, p in student.generator.transformer.named_parameters()}
    opt = torch.optim.AdamW(student.generator.transformer.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = student.regression_loss(batch, step=0)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    final = float(student.regression_loss(batch, step=0)["loss"].detach())
    assert final < 0.7 * losses[0], losses
    changed = [n for n, p in student.generator.transformer.named_parameters() if not torch.equal(p, params[n])]
    assert len(changed) > len(params) // 2


# ---------------------------------------------------------------------------------------------- CLI
def _fit(tmp_path, pairs_file, tiny_policy, tiny_text_encoder, *args):
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401
    from genrl.cli import GenRLCLI

    override = {
        "trainer": {"accelerator": "cpu", "val_check_interval": 2, "log_every_n_steps": 1,
                    "enable_progress_bar": False},
        "model": {"init_args": {
            "generator": {"pretrained": tiny_policy, "text_encoder": tiny_text_encoder},
            "latent_shape": list(LATENT), "rewards": [{"name": "colorfulness"}],
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.003}}, "warmup_steps": 2}},
        "data": {"init_args": {"path": str(pairs_file), "batch_size": 2, "val_size": 3, "val_batch_size": 3}},
    }
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    return GenRLCLI(args=["fit", "--config", str(ROOT / "configs/ode_init/shapes.yaml"),
                          "--config", str(tmp_path / "tiny.yaml"), *args])


def test_fit_resume_equals_uninterrupted(tmp_path, monkeypatch, pairs_file, tiny_policy, tiny_text_encoder):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _fit(tmp_path / "a", pairs_file, tiny_policy, tiny_text_encoder, "--trainer.max_steps=4")
    after_full = {n: p.detach().clone() for n, p in full.model.generator.transformer.named_parameters()}
    assert full.model.generator.causal == CausalConfig(chunk_size=2)
    m = full.trainer.logged_metrics
    assert "val/colorfulness/reward" in m and "train/loss" in m
    assert (Path("runs/ode_init_shapes/export") / "config.json").is_file()
    assert list(Path("runs/ode_init_shapes").rglob("*.mp4"))
    monkeypatch.chdir(tmp_path / "b")
    first = _fit(tmp_path / "b", pairs_file, tiny_policy, tiny_text_encoder, "--trainer.max_steps=2")
    after_two = {n: p.detach().clone() for n, p in first.model.generator.transformer.named_parameters()}
    resumed = _fit(tmp_path / "b", pairs_file, tiny_policy, tiny_text_encoder, "--trainer.max_steps=4",
                   "--ckpt_path=last")
    assert resumed.trainer.global_step == 4
    for n, p in resumed.model.generator.transformer.named_parameters():
        assert torch.allclose(p, after_full[n], atol=1e-6, rtol=0), n
    assert any(not torch.equal(after_two[n], after_full[n]) for n in after_full)


def test_wan_causal_student_regresses_a_bidirectional_wan_teachers_pairs(tmp_path):
    """The Wan config's path on tiny random components: teacher "wan", student "wan_causal" ([B, C, T, h, w])."""
    from genrl.models.families import GeneratorSpec, build_generator
    from genrl.rollout.autoregressive import ChunkSchedule
    from genrl.testing.families import TINY

    size = dict(height=16, width=16, num_frames=13, max_sequence_length=16)  # 4 latent frames = 2 chunks of 2
    teacher = build_generator(GeneratorSpec(family="wan", components=TINY["wan"], **size)).eval()
    shape = tuple(teacher.latent_shape)
    with torch.no_grad():
        path = ode_pairs.generate_ode_pairs(teacher, PROMPTS[:2], shape, STUDENT, teacher_steps=5, cfg_scale=2.0,
                                            out=tmp_path / "wan.pt", batch_size=2, progress=False)
    student = ODEInit(generator=GeneratorSpec(family="wan_causal", components=TINY["wan"], **size),
                      schedule=ChunkSchedule(causal=CausalConfig(chunk_size=2), shift=1.0),
                      rewards=[{"name": "colorfulness"}])
    student.configure_model()
    assert student.frame_dim == 2 and student.generator.causal == CausalConfig(chunk_size=2)
    batch = _batch(path, 2)
    assert batch["ode_latents"].shape == (2, 5, *shape)
    out = student.regression_loss(batch, step=0)
    out["loss"].backward()
    assert out["sigma"].shape == (2, 4) and torch.equal(out["sigma"][:, 0], out["sigma"][:, 1])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.generator.transformer.parameters())
    latents = student.generate(PROMPTS[:2], [-1, -2])
    assert latents.shape == (2, *shape) and torch.isfinite(latents).all()
