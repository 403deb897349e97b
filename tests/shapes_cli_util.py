"""A method's ``genrl fit`` composed after configs/base/shapes.yaml on a tiny random policy: the CLI the preference
methods' tests (DPO, DGPO, CRD) build, with a checkpoint every step and no validation."""

from __future__ import annotations

from pathlib import Path

import torch

from genrl.cli import GenRLCLI

ROOT = Path(__file__).resolve().parents[1]


def fit_on_shapes_base(method_config: str, tiny_policy, tiny_text_encoder, args: list[str],
                       run: bool = True) -> GenRLCLI:
    """``genrl fit --config configs/base/shapes.yaml --config <method_config>`` with the tiny policy and text encoder,
    2 prompts x 4 samples, the colorfulness reward (signal on a random policy), lr 0.003, then ``args``."""
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", str(ROOT / "configs/base/shapes.yaml"), "--config", str(ROOT / method_config),
            "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
            "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: "
            "{dirpath: runs/shapes/checkpoints, save_last: true, every_n_train_steps: 1}}]",
            f"--model.init_args.generator.pretrained={tiny_policy}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
            "--model.init_args.rollout.micro_batch_size=8", "--model.init_args.rewards=[{name: colorfulness}]",
            "--model.init_args.optimizer.init_args.lr=0.003", "--data.init_args.prompts_per_batch=2",
            "--data.init_args.group_size=4"]
    return GenRLCLI(args=(["fit"] if run else []) + base + list(args), run=run)


def trainable(cli) -> dict[str, torch.Tensor]:
    """A copy of the policy transformer's parameters."""
    return {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters()}
