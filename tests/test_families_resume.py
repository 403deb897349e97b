"""Resume equals uninterrupted for the diffusers families added with Wan2.2 and image-to-video: LoRA GRPO on each tiny
pipeline, 2 iterations in one run against 1 iteration, a checkpoint, and a resumed run (``ckpt_path``); image-to-video
families train on a prompt file with an image per line, so the image prompts resume with the data stream."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from families_util import save_tiny_pipeline
from PIL import Image

from genrl.testing.families import TINY_SIZE

#: the Wan2.2 / image-to-video families run by default (they exercise the experts and the image condition through a
#: checkpoint); the others, whose resume path is the plain family one, are slow tests (``pytest -m slow``), to keep
#: the default suite within its time
FAMILIES = ["wan22", "wan_i2v", "wan22_ti2v"] + [
    pytest.param(f, marks=pytest.mark.slow)
    for f in ("skyreels_v2", "hunyuan_video15", "ltx2", "qwen_image", "flux2", "flux2_klein")]
IMAGE_FAMILIES = {"wan_i2v", "wan22_ti2v"}


def _prompt_file(folder, family: str) -> str:
    """A .jsonl of 3 prompts; for an image-to-video family each with a first frame of the sample size."""
    size = TINY_SIZE[family]
    lines = []
    for i, text in enumerate(["a red circle moving left", "a blue square staying still", "a green star moving up"]):
        line = {"prompt": text}
        if family in IMAGE_FAMILIES:
            pixels = np.random.default_rng(i).integers(0, 256, (size["height"], size["width"], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"first_{i}.png")
            line["image"] = f"first_{i}.png"
        lines.append(json.dumps(line))
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(lines))
    return str(path)


def _fit(family: str, pipeline, prompts: str, root, max_steps: int, ckpt_path: str | None = None):
    """``genrl fit`` (the real CLI, so the checkpoint holds what a user's does) of LoRA GRPO on the tiny ``family``
    pipeline, a checkpoint every iteration; returns the trained (LoRA) parameters."""
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401
    from genrl.cli import GenRLCLI

    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": max_steps, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                    "limit_val_batches": 0, "default_root_dir": str(root),
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(root / "ckpt"), "save_last": True,
                                                 "every_n_train_steps": 1}}]},
        "model": {"class_path": "genrl.methods.GRPO", "init_args": {
            "generator": {"family": family, "pretrained": str(pipeline), **TINY_SIZE[family]},
            "rollout": {"num_steps": 3, "kernel": "flow_grpo", "sde_steps": "all", "micro_batch_size": 4,
                        "cfg_scale": 2.0},
            "eval_rollout": {"num_steps": 2, "kernel": "ode", "micro_batch_size": 4},
            "rewards": [{"name": "colorfulness"}],
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
            "lora": {"rank": 4, "alpha": 8, "init_lora_weights": True}, "clip_range": 0.001}},
        "data": {"class_path": "genrl.data.PromptDataModule", "init_args": {
            "train": prompts, "val": None, "prompts_per_batch": 2, "group_size": 2, "seed": 0}},
    }
    path = root / "config.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))  # JSON is YAML
    cli = GenRLCLI(args=["fit", "--config", str(path)] + ([f"--ckpt_path={ckpt_path}"] if ckpt_path else []))
    return {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_equals_uninterrupted(family, tmp_path):
    pipeline = save_tiny_pipeline(family, tmp_path / "pipe")
    prompts = _prompt_file(tmp_path, family)
    full = _fit(family, pipeline, prompts, tmp_path / "full", max_steps=2)
    first = _fit(family, pipeline, prompts, tmp_path / "split", max_steps=1)
    resumed = _fit(family, pipeline, prompts, tmp_path / "split", max_steps=2,
                   ckpt_path=str(tmp_path / "split" / "ckpt" / "last.ckpt"))
    assert full and full.keys() == resumed.keys() and all("lora_" in k for k in full)
    assert any(not torch.equal(first[k], full[k]) for k in full)  # the second iteration moved the adapter
    for k, v in full.items():
        torch.testing.assert_close(resumed[k], v, atol=1e-6, rtol=0, msg=k)
