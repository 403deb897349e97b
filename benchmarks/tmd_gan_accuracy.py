"""Accuracy of a TMD stage-2 run's GAN heads on fresh shapes-world samples.

For each checkpoint: 64 training-world videos (data seed 123) as the real samples, the run's student samples from
them as the fake ones, three noise draws (iterations 1-3); prints the heads' accuracy (real logit > 0, fake logit
< 0, averaged) and their logistic loss (chance: 50%, 2 log 2 = 1.386).

    python benchmarks/tmd_gan_accuracy.py runs/tmd_gan/s0/dmd/runs/tmd_shapes_dmd/checkpoints/last.ckpt \
        runs/tmd_gan/s1/dmd/runs/tmd_shapes_dmd/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import inspect

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", help="last.ckpt of TMD stage-2 runs with gan_weight > 0")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)

    from genrl.data import ShapesDataModule
    from genrl.methods.common import video_batch
    from genrl.methods.tmd import TMD

    for ckpt in args.checkpoints:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        names = set(inspect.signature(TMD.__init__).parameters)
        model = TMD(**{k: v for k, v in state["hyper_parameters"].items() if k in names})
        model.configure_model()
        if model.gan_heads is None:
            raise SystemExit(f"{ckpt}: the run has no GAN heads (gan_weight 0)")
        model.load_state_dict(state["state_dict"], strict=False)
        data = ShapesDataModule(batch_size=args.batch, seed=123, num_workers=0)
        data.setup("fit")
        x0, prompts, idx = video_batch(model, next(iter(data.train_dataloader())))
        cond = model.generator.encode_prompts(prompts)
        with torch.no_grad():
            for it in (1, 2, 3):
                out = model.critic_step_loss(model.student_sample(x0, cond, idx, it), cond, idx, it, x0)
                print(f"{ckpt} draw {it}: accuracy {float(out['gan_accuracy']):.3f}, loss {float(out['gan']):.3f}")


if __name__ == "__main__":
    main()
