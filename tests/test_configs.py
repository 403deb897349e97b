"""Every YAML under configs/ parses, and each family GRPO config trains through the real CLI when its
weights are swapped for the tiny random components (so configs cannot rot)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from genrl.cli import GenRLCLI, stray_run_paths

ROOT = Path(__file__).resolve().parents[1]
FAMILY_CONFIGS = {
    "wan": "configs/grpo/wan2.1_t2v_1.3b.yaml",
    "sd3": "configs/grpo/sd3.5_medium.yaml",
    "flux": "configs/grpo/flux.1_dev.yaml",
    "flux2": "configs/grpo/flux.2_dev.yaml",
    "flux2_klein": "configs/grpo/flux.2_klein_base_4b.yaml",
    "sana": "configs/grpo/sana.yaml",
    "hunyuan_video15": "configs/grpo/hunyuan_video1.5_t2v.yaml",
    "ltx2": "configs/grpo/ltx2_t2v.yaml",
    "skyreels_v2": "configs/grpo/skyreels_v2_t2v.yaml",
    "qwen_image": "configs/grpo/qwen_image.yaml",
}
CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")
                 if p.parent.name != "arena")  # arena configs: tests/test_arena.py
# run settings without a model (configs/base/): parsed as the base of the configs composed after them
BASES = [p for p in CONFIGS if p.startswith("configs/base/")]


def _composed_on(path: str) -> str | None:
    """The config ``path`` is composed after, as its own header says: a usage line ``--config BASE --config PATH`` or
    the words ``composed after BASE``; trainer profiles (configs/trainer/) after the quickstart. None: standalone."""
    if path.startswith("configs/trainer/"):
        return "configs/quickstart.yaml"
    text = (ROOT / path).read_text()
    usage = [m.group(1) for m in re.finditer(r"--config\s+(\S+)\s+--config\s+(\S+)", text) if m.group(2) == path]
    words = re.search(r"composed after (configs/\S+?\.yaml)", text)
    return usage[0] if usage else words.group(1) if words else None


def test_composed_configs_name_a_base_that_exists():
    """Every composition the headers declare points at a shipped config (so a renamed base fails here)."""
    bases = {p: _composed_on(p) for p in CONFIGS}
    assert sum(b is not None for b in bases.values()) >= 20
    assert all((ROOT / b).is_file() for b in bases.values() if b), bases
    assert bases["configs/stream_r1/shapes.yaml"] == "configs/dmd/shapes.yaml"
    assert bases["configs/tiny/dmd.yaml"] == "configs/dmd/shapes.yaml" and bases["configs/quickstart.yaml"] is None
    # every model-free base is the base of some config (so it is parsed)
    assert all(any(b == base for b in bases.values()) for base in BASES), BASES


def _cli(args: list[str], run: bool) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    return GenRLCLI(args=(["fit"] if run else []) + args, run=run)


@pytest.mark.parametrize("path", [p for p in CONFIGS if p not in BASES])
def test_every_config_parses(path, tmp_path, monkeypatch):
    """Every shipped config builds its model and data, on the config it says it is composed after (if any)."""
    monkeypatch.chdir(tmp_path)
    configs = [str(ROOT / base)] if (base := _composed_on(path)) else []
    args = [a for c in [*configs, str(ROOT / path)] for a in ("--config", c)]
    # GPU trainer profiles build their Trainer here on 2 CPU processes (nothing starts before fit)
    cpu = ["--trainer.accelerator=cpu"] + (["--trainer.devices=2"] if path.startswith("configs/trainer/") else [])
    cli = _cli(args + cpu, run=False)
    assert cli.model is not None and cli.datamodule is not None
    assert stray_run_paths(cli.config.trainer) == []  # logs, checkpoints and exports under the run's root


BRANCH_CONFIGS = {
    "wan": "configs/branch_grpo/wan2.1_t2v_1.3b.yaml",
    "sd3": "configs/branch_grpo/sd3.5_medium.yaml",
    "flux": "configs/branch_grpo/flux.1_dev.yaml",
}


RAM_CONFIGS = {
    "wan": "configs/ram/wan2.1_t2v_1.3b.yaml",
    "sd3": "configs/ram/sd3.5_medium.yaml",
    "flux": "configs/ram/flux.1_dev.yaml",
}


SOL_RL_CONFIGS = {
    "sana": "configs/sol_rl/sana_1.6b.yaml",
    "sd3": "configs/sol_rl/sd3.5_large.yaml",
    "flux": "configs/sol_rl/flux.1_dev.yaml",
}


PREFERENCE_CONFIGS = {"dpo": {"sd3": "configs/dpo/sd3.5_medium.yaml"},
                      "dgpo": {"sd3": "configs/dgpo/sd3.5_medium.yaml"},
                      "crd": {"sd3": "configs/crd/sd3.5_medium.yaml"}}


@pytest.mark.parametrize("method,family", [("grpo", f) for f in sorted(FAMILY_CONFIGS)]
                         + [("branch_grpo", f) for f in sorted(BRANCH_CONFIGS)]
                         + [("ram", f) for f in sorted(RAM_CONFIGS)]
                         + [("sol_rl", f) for f in sorted(SOL_RL_CONFIGS)]
                         + [(m, f) for m in sorted(PREFERENCE_CONFIGS) for f in sorted(PREFERENCE_CONFIGS[m])])
def test_family_config_trains_on_tiny_components(method, family, tmp_path, monkeypatch):
    from genrl.testing.families import tiny_generator_spec

    monkeypatch.chdir(tmp_path)
    override = {
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 1, "limit_val_batches": 0,
                    "enable_progress_bar": False, "logger": False},
        "model": {"init_args": {
            "generator": tiny_generator_spec(family, str(tmp_path / "cache")),
            "rollout": {"num_steps": 3, "num_sde_steps": 2, "micro_batch_size": 2},
            "mini_batch_size": 2, "lora": {"rank": 4},
            **({"tree": {"split_steps": [0, 1], "max_frontier": 16}, "rollout": {"num_steps": 3, "micro_batch_size": 2}}
               if method == "branch_grpo" else {}),
            "rewards": [{"name": "colorfulness"}],  # the configs' real rewards need weights / readable text
        }},
        "data": {"init_args": {"group_size": 2, "prompts_per_batch": 1}},
    }
    if method == "branch_grpo":
        del override["model"]["init_args"]["mini_batch_size"]  # BranchGRPO steps per edges_per_step
    if method == "sol_rl":  # the release's layer policy on the real family classes, simulated FP8 (no GPU here)
        policy = yaml.safe_load((ROOT / SOL_RL_CONFIGS[family]).read_text())["model"]["init_args"]["preview"]
        skip = policy["precision"]["skip"]
        override["model"]["init_args"]["preview"] = {
            "keep": 2, "num_steps": 2, "micro_batch_size": 2,
            "precision": {"format": "fake_fp8", "skip": skip, "min_dim": 0, "compile": False}}
        override["data"]["init_args"]["group_size"] = 3
    if method in ("ram", "sol_rl"):  # endpoints only: an ODE rollout, K = 2 re-noisings
        override["model"]["init_args"].update(rollout={"num_steps": 3, "micro_batch_size": 2}, num_draws=2,
                                              micro_batch_size=2)
        del override["model"]["init_args"]["mini_batch_size"]
    if method in PREFERENCE_CONFIGS:  # endpoints only; DPO: 2 draws per pair; DGPO, CRD: 2 sigmas of the 3-step grid
        override["model"]["init_args"].update(rollout={"num_steps": 3, "micro_batch_size": 2}, micro_batch_size=2,
                                              **({"num_draws": 2} if method == "dpo" else
                                                 {"num_timesteps": 2, "trunc_steps": None}))
        del override["model"]["init_args"]["mini_batch_size"]
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))  # JSON is YAML
    config = {"grpo": FAMILY_CONFIGS, "branch_grpo": BRANCH_CONFIGS, "ram": RAM_CONFIGS,
              "sol_rl": SOL_RL_CONFIGS, **PREFERENCE_CONFIGS}[method][family]
    args = ["--config", str(ROOT / config), "--config", str(tmp_path / "tiny.yaml")]
    cli = _cli(args, run=False)
    cli.model.configure_model()
    before = {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters() if p.requires_grad}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = {n: p.detach() for n, p in cli.model.generator.transformer.named_parameters() if p.requires_grad}
    assert before and all("lora_" in k for k in before)
    assert any(not torch.equal(before[k], after[k]) for k in before), f"{family}: no LoRA weight changed"
    assert list((tmp_path / "cache").glob("*.pt")), "prompt embeddings were not cached on disk"
    if method == "sol_rl":  # the skip list names real layers: some Linears quantized, the embedders kept
        report = cli.model.roles.get("rollout").report
        assert report.replaced and any("embed" in k for k in report.kept), str(report)
        assert "preview/spearman" in cli.trainer.logged_metrics


#: the Wan2.2 and image-to-video GRPO recipes, each composed after a Wan2.1 one: (tiny layout, configs, image prompts)
WAN_CONFIGS = [
    ("wan22", ["configs/grpo/wan2.1_t2v_1.3b.yaml", "configs/grpo/wan2.2_t2v_a14b.yaml"], False),
    ("wan22_ti2v", ["configs/grpo/wan2.1_t2v_1.3b.yaml", "configs/grpo/wan2.2_ti2v_5b.yaml"], False),
    ("wan_i2v", ["configs/grpo/wan2.1_i2v_14b.yaml"], True),
    ("wan22_i2v", ["configs/grpo/wan2.1_i2v_14b.yaml", "configs/grpo/wan2.2_i2v_a14b.yaml"], True),
    ("wan22_ti2v", ["configs/grpo/wan2.1_i2v_14b.yaml", "configs/grpo/wan2.2_ti2v_5b_i2v.yaml"], True),
]


@pytest.mark.parametrize("tiny,configs,images", WAN_CONFIGS, ids=[c[1][-1].split("/")[-1] for c in WAN_CONFIGS])
def test_wan22_and_i2v_configs_train_on_tiny_components(tiny, configs, images, tmp_path, monkeypatch):
    """The Wan2.2 / image-to-video recipes train through the real CLI with tiny random weights (image prompts from a
    .jsonl of tiny images), LoRA only, and the condition is part of the prompt cache."""
    import numpy as np
    from PIL import Image

    from genrl.testing.families import TINY_SIZE, tiny_generator_spec

    monkeypatch.chdir(tmp_path)
    data = {"group_size": 2, "prompts_per_batch": 1}
    if images:
        size = TINY_SIZE[tiny]
        lines = []
        for i, text in enumerate(["a red circle moving left", "a blue square staying still"]):
            pixels = np.random.default_rng(i).integers(0, 256, (size["height"], size["width"], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / f"first_{i}.png")
            lines.append(json.dumps({"prompt": text, "image": f"first_{i}.png"}))
        (tmp_path / "i2v.jsonl").write_text("\n".join(lines))
        data.update(train=str(tmp_path / "i2v.jsonl"), val=str(tmp_path / "i2v.jsonl"))
    spec = tiny_generator_spec(tiny, str(tmp_path / "cache"))
    spec.pop("pretrained")
    override = {
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 1, "limit_val_batches": 0,
                    "enable_progress_bar": False, "logger": False},
        "model": {"init_args": {
            "generator": {**spec, "pretrained": None},
            "rollout": {"num_steps": 3, "num_sde_steps": 1, "micro_batch_size": 2, "sde_candidates": [0, 1]}
            if images else {"num_steps": 3, "num_sde_steps": 2, "micro_batch_size": 2},
            "mini_batch_size": 2, "lora": {"rank": 4}, "rewards": [{"name": "colorfulness"}],
        }},
        "data": {"init_args": data},
    }
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    args = [a for c in configs for a in ("--config", str(ROOT / c))] + ["--config", str(tmp_path / "tiny.yaml")]
    cli = _cli(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    params = dict(cli.model.generator.transformer.named_parameters())
    assert all("lora_" in k for k, p in params.items() if p.requires_grad)
    assert int(cli.model.iteration) == 1 and list((tmp_path / "cache").glob("*.pt"))
    if images:
        cond = cli.model.generator.encode_prompts(cli.datamodule.train_records[0:1] and
                                                  [cli.datamodule.train_records[0].prompt])
        assert cond.extras  # the image condition travels with the prompt


def _tiny_wan_dmd(tiny: str = "wan", **init_args) -> dict:
    """Overrides of configs/dmd/wan2.1_t2v_1.3b.yaml: tiny random Wan student / teacher / critic (the ``tiny`` layout
    of :data:`genrl.testing.families.TINY`), 2 latent frames, 2 iterations on the CPU (plus ``init_args`` for the
    model)."""
    from genrl.testing.families import TINY, tiny_generator_spec

    tiny_transformer = {"model_class": "diffusers.WanTransformer3DModel", "pretrained": None, "subfolder": None,
                        "dtype": None, "config": TINY[tiny]["transformer"]}
    return {
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 2, "limit_val_batches": 0,
                    "enable_progress_bar": False, "logger": False, "callbacks": []},
        "model": {"init_args": {
            "generator": tiny_generator_spec(tiny),
            "teacher": tiny_transformer, "critic": tiny_transformer,
            "num_frames": 2, "schedule": {"causal": {"chunk_size": 1}, "timesteps": [1000, 500]},
            "critic_updates_per_generator_update": 2, "grad_window_frames": None,
            "rewards": [{"name": "colorfulness"}], **init_args,
        }},
    }


@pytest.mark.parametrize("tiny,configs,frame", [
    ("wan", ["configs/dmd/wan2.1_t2v_1.3b.yaml"], (16, 2, 2)),
    ("wan22_ti2v", ["configs/dmd/wan2.1_t2v_1.3b.yaml", "configs/dmd/wan2.2_ti2v_5b.yaml"], (8, 2, 2)),
], ids=["wan2.1", "wan2.2_ti2v_5b"])
def test_wan_dmd_config_trains_on_tiny_components(tiny, configs, frame, tmp_path, monkeypatch):
    """The Wan DMD (Self-Forcing) recipes with their weights swapped for tiny random ones: the causal Wan student
    (Wan2.1, or Wan2.2-TI2V-5B's layout: the 16x VAE, 48 channels, a timestep per token), the teacher and the critic
    transformers train through the real CLI (student and critic change)."""
    monkeypatch.chdir(tmp_path)
    override = _tiny_wan_dmd(tiny)
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    cli = _cli([a for c in configs for a in ("--config", str(ROOT / c))] + ["--config", str(tmp_path / "tiny.yaml")],
               run=False)
    cli.model.configure_model()
    assert cli.model.frame_shape == frame
    before = {n: p.detach().clone() for n, p in cli.model.named_parameters()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    changed = {n.split(".")[0] for n, p in cli.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed == {"generator", "critic"} and int(cli.model.iteration) == 2


def test_wan_ti2v_dmd_config_distills_image_to_video(tmp_path, monkeypatch):
    """configs/dmd/wan2.2_ti2v_5b.yaml on image prompts (tiny TI2V layout): the causal student's first chunk is the
    given frame (it carries no gradient), the rest is generated from it; student and critic train."""
    import numpy as np
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    lines = []
    for i, text in enumerate(["a red circle moving left", "a blue square staying still"]):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(f"f{i}.png")
        lines.append(json.dumps({"prompt": text, "image": f"f{i}.png"}))
    (tmp_path / "i2v.jsonl").write_text("\n".join(lines))
    override = _tiny_wan_dmd("wan22_ti2v")
    override["data"] = {"init_args": {"train": str(tmp_path / "i2v.jsonl"), "val": None}}
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    configs = ["configs/dmd/wan2.1_t2v_1.3b.yaml", "configs/dmd/wan2.2_ti2v_5b.yaml"]
    cli = _cli([a for c in configs for a in ("--config", str(ROOT / c))] + ["--config", str(tmp_path / "tiny.yaml")],
               run=False)
    cli.model.configure_model()
    from genrl.methods.distill import negative_cond
    from genrl.models.conditions import prompt_image

    prompts = [r.prompt for r in cli.datamodule.train_records]
    negative = negative_cond(cli.model, 2, prompts)  # the teacher's CFG drops only the text: the images stay
    assert [prompt_image(p) for p in negative.prompts] == [prompt_image(p) for p in prompts]
    assert negative.extras["first_frame_given"].tolist() == [1.0, 1.0]
    before = {n: p.detach().clone() for n, p in cli.model.named_parameters()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    changed = {n.split(".")[0] for n, p in cli.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed == {"generator", "critic"} and int(cli.model.iteration) == 2


def _tiny_wan_afd() -> dict:
    """model.init_args of the Wan AFD configs with tiny random Wan components, a LoRA and a tiny discriminator."""
    from genrl.testing.families import tiny_generator_spec

    return {"generator": tiny_generator_spec("wan"), "lora": {"rank": 4, "alpha": 4},
            "discriminator": {"model_class": "genrl.models.discriminator.VideoDiscriminator",
                              "config": {"in_channels": 16, "patch_size": [1, 2, 2], "hidden_size": 16,
                                         "num_layers": 1, "num_attention_heads": 2, "text_dim": 32, "frame_dim": 2}},
            "num_frames": 2, "schedule": {"causal": {"chunk_size": 1}, "timesteps": [1000, 500]},
            "rewards": [{"name": "colorfulness"}]}


def _fit_tiny_wan_afd(configs: list[str], override: dict, tmp_path):
    """Fit ``configs`` + ``override`` through the real CLI; both networks must train for the 2 iterations. Returns
    (cli, the trainable parameters before)."""
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    cli = _cli([*(a for c in configs for a in ("--config", str(ROOT / c))), "--config", str(tmp_path / "tiny.yaml")],
               run=False)
    cli.model.configure_model()
    before = {n: p.detach().clone() for n, p in cli.model.named_parameters() if p.requires_grad}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    changed = {n.split(".")[0] for n, p in cli.model.named_parameters() if p.requires_grad
               and not torch.equal(before[n], p.detach())}
    assert changed == {"generator", "discriminator"} and int(cli.model.iteration) == 2
    return cli, before


def test_wan_afd_config_trains_on_tiny_components(tmp_path, monkeypatch):
    """configs/afd/wan2.1_t2v_1.3b.yaml with tiny random Wan components and a folder of synthetic teacher mp4s:
    the causal Wan student (LoRA) and the discriminator train through the real CLI."""
    from genrl.data.video_io import write_video
    from genrl.testing.families import TINY_SIZE

    monkeypatch.chdir(tmp_path)
    size = TINY_SIZE["wan"]
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    captions = []
    for i, prompt in enumerate(["a red circle moving left", "a blue square staying still"]):
        g = torch.Generator().manual_seed(i)
        write_video(teacher / f"{i}.mp4", torch.rand(8, 3, 16, 16, generator=g), fps=16)
        captions.append(json.dumps({"file": f"{i}.mp4", "prompt": prompt}))
    (teacher / "captions.jsonl").write_text("\n".join(captions) + "\n")
    override = {
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 2, "limit_val_batches": 0,
                    "enable_progress_bar": False, "logger": False, "callbacks": []},
        "model": {"init_args": _tiny_wan_afd()},
        "data": {"init_args": {"folder": str(teacher), "num_frames": size["num_frames"], "height": 16, "width": 16,
                               "prompts_per_batch": 2, "val": "shapes:heldout"}},
    }
    cli, before = _fit_tiny_wan_afd(["configs/afd/wan2.1_t2v_1.3b.yaml"], override, tmp_path)
    assert all("lora_" in n for n in before if n.startswith("generator."))


def test_wan_afd_online_config_trains_with_a_teacher_of_another_family_and_size(tmp_path, monkeypatch, tiny_policy,
                                                                                  tiny_text_encoder):
    """configs/afd/wan2.1_t2v_1.3b_online.yaml with tiny random Wan components, and as its online teacher a genrl DiT
    (another family, 16x16 at 8 fps, 8 frames) whose clips are resampled to the Wan student's 16 fps format: two
    iterations through the real CLI, the teacher asked once per prompt variant, its clips and latents cached."""
    from genrl.testing.families import TINY_SIZE

    monkeypatch.chdir(tmp_path)
    size = TINY_SIZE["wan"]
    override = {
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 2, "limit_val_batches": 0,
                    "enable_progress_bar": False, "logger": False, "callbacks": []},
        "model": {"init_args": {
            **_tiny_wan_afd(),
            "teacher": {"kind": "generator", "path": tiny_policy, "text_encoder": tiny_text_encoder,
                        "num_frames": size["num_frames"], "height": 16, "width": 16, "fps": 16.0, "steps": 2,
                        "teacher_frames": 8, "teacher_height": 16, "teacher_width": 16, "teacher_fps": 8.0,
                        "variants_per_prompt": 1, "cache_dir": str(tmp_path / "cache"), "device": "cpu"},
        }},
        "data": {"init_args": {"train": "shapes:train", "val": "shapes:heldout", "prompts_per_batch": 2}},
    }
    cli, _ = _fit_tiny_wan_afd(["configs/afd/wan2.1_t2v_1.3b.yaml", "configs/afd/wan2.1_t2v_1.3b_online.yaml"],
                               override, tmp_path)
    teacher = cli.model.teacher
    assert teacher.queries == 4 and teacher.spec.fps == 16.0  # 2 x 2 distinct prompts, one variant each
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 8  # their clips and their latents


def test_old_style_policy_keys_name_the_new_generator_key(tmp_path):
    """Configs from before the one generator spec (``transformer:``, ``text_encoder:``) fail with the new key named."""
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  class_path: genrl.methods.GRPO\n  init_args:\n    transformer:\n      pretrained: "
                   "assets/shapes-dit\n    text_encoder: minilm\n")
    with pytest.raises(ValueError, match=r"model.init_args.transformer .*replaced by model.init_args.generator"):
        _cli(["--config", str(ROOT / "configs/quickstart.yaml"), "--config", str(old)], run=False)
    with pytest.raises(ValueError, match=r"model.init_args.transformer .*replaced"):  # the short -c form too
        _cli(["-c", str(ROOT / "configs/quickstart.yaml"), "-c", str(old)], run=False)
    with pytest.raises(ValueError, match=r"text_encoder.*replaced by model.init_args.generator.text_encoder"):
        _cli(["--config", str(ROOT / "configs/quickstart.yaml"), "--model.init_args.text_encoder=minilm"], run=False)


def test_wan_stream_r1_config_trains_on_tiny_components(tmp_path, monkeypatch):
    """configs/stream_r1/wan2.1_t2v_1.3b.yaml after the Wan DMD config, with tiny random Wan components and a tiny
    random VideoAlign (3 outputs: VQ, MQ, TA): 2 iterations through the real CLI, the generator update weighted by
    the reward (weight statistics logged)."""
    from genrl.testing.rewards import build_tiny_videoalign

    monkeypatch.chdir(tmp_path)
    reward = build_tiny_videoalign(tmp_path / "videoalign", seed=0, output_dim=3)
    override = _tiny_wan_dmd(weighting={"class_path": "genrl.methods.StreamR1Weighting", "init_args": {
        "reward": {"name": "videoalign", "path": reward,
                   "kwargs": {"base_model": f"{reward}/Qwen2-VL-2B-Instruct", "dtype": "float32"}},
        "window": 2}})
    (tmp_path / "tiny.yaml").write_text(json.dumps(override))
    configs = ["configs/dmd/wan2.1_t2v_1.3b.yaml", "configs/stream_r1/wan2.1_t2v_1.3b.yaml"]
    cli = _cli([*(a for c in configs for a in ("--config", str(ROOT / c))), "--config", str(tmp_path / "tiny.yaml")],
               run=False)
    assert cli.model.weighting.dimensions == ["vq", "mq", "ta"] and cli.model.weighting.beta == 2.0
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    m = cli.trainer.logged_metrics
    assert int(cli.model.iteration) == 2 and int(cli.model.weighting.filled) == 1
    for key in ("stream_r1/w_inter_mean", "stream_r1/w_intra_max", "stream_r1/ta", "stream_r1/fusion_vq"):
        assert key in m and torch.isfinite(torch.as_tensor(m[key])), key
    assert float(m["stream_r1/invalid"]) == 0.0 and float(m["stream_r1/w_intra_std"]) > 0.0
