"""Helpers shared by the per-family tests: tiny pipeline folders and a 2-step GRPO run on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def save_tiny_pipeline(family: str, folder: Path, seed: int = 0) -> Path:
    """Build the tiny random ``family`` from config values and ``save_pretrained`` it to ``folder``."""
    from genrl.models.families import family_class
    from genrl.testing.families import TINY, TINY_SIZE

    gen = family_class(family).from_config(TINY[family], seed=seed, **TINY_SIZE[family])
    return gen.save_pretrained(folder)


def tiny_pipeline_fixture(family: str):
    """A module-scoped fixture: the folder of the tiny ``family`` pipeline saved by :func:`save_tiny_pipeline`.
    Assign it in a test module as ``<family>_folder = tiny_pipeline_fixture("<family>")``."""

    @pytest.fixture(scope="module", name=f"{family}_folder")
    def folder(tmp_path_factory):
        return save_tiny_pipeline(family, tmp_path_factory.mktemp(family) / "pipe")

    return folder


def pipeline_with_lora(pipeline_class, folder: Path, generator, lora_dir: Path):
    """``pipeline_class`` (a diffusers pipeline) loaded offline from ``folder``, with ``generator``'s LoRA adapter
    saved in the diffusers LoRA format to ``lora_dir`` and loaded by ``load_lora_weights``."""
    saved = generator.save_lora(lora_dir)
    assert (saved / "pytorch_lora_weights.safetensors").is_file()
    pipe = pipeline_class.from_pretrained(str(folder), local_files_only=True)
    pipe.load_lora_weights(str(saved))
    return pipe


def grpo_two_steps(family: str, folder: Path, lora: dict | None = None, kernel: str = "flow_grpo",
                   cfg_scale: float = 1.0, num_frames: int | None = None, train: str = "shapes:train",
                   options: dict | None = None, max_steps: int = 2, sde_steps: str = "all",
                   preconfigure: bool = True):
    """Run ``max_steps`` GRPO iterations of the tiny ``family`` loaded offline from ``folder`` on the prompts ``train``
    (an image-to-video family: a .jsonl with ``image`` per line), with family ``options``; ``sde_steps`` "all" or
    "window_low" (only step 1 of 3 is stochastic); ``preconfigure`` False lets ``fit`` build the model (as ``genrl
    fit`` does; "before" is then empty); returns (model, trainable parameters before, after)."""
    from lightning.pytorch import Trainer

    from genrl.data import PromptDataModule
    from genrl.methods import GRPO
    from genrl.models.families import GeneratorSpec
    from genrl.models.lora import LoraSpec
    from genrl.rollout.sampler import RolloutConfig
    from genrl.testing.families import TINY_SIZE

    size = dict(TINY_SIZE[family])
    if num_frames is not None:
        size["num_frames"] = num_frames
    spec = GeneratorSpec(family=family, pretrained=str(folder), options=dict(options or {}), **size)
    model = GRPO(
        generator=spec,
        rollout=RolloutConfig(num_steps=3, kernel=kernel, micro_batch_size=4, cfg_scale=cfg_scale,
                              **(dict(sde_steps="all") if sde_steps == "all" else
                                 dict(sde_steps="window", num_sde_steps=1, window_start=1, window_end=2))),
        eval_rollout=RolloutConfig(num_steps=2, kernel="ode", micro_batch_size=4),
        rewards=[{"name": "colorfulness"}],
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        lora=LoraSpec(**lora) if lora is not None else None,
        clip_range=1e-3,
    )
    data = PromptDataModule(train=train, val=None, prompts_per_batch=2, group_size=2, seed=0)
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0)
    before = {}
    if preconfigure:
        model.configure_model()
        before = {n: p.detach().clone() for n, p in model.generator.transformer.named_parameters() if p.requires_grad}
    trainer.fit(model, data)
    after = {n: p.detach().clone() for n, p in model.generator.transformer.named_parameters() if p.requires_grad}
    assert int(model.iteration) == max_steps
    return model, before, after
