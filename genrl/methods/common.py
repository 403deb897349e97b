"""Construction shared by the RL methods (composition: plain functions, no shared base class)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any



def build_policy(generator_spec, transformer_spec, text_encoder: str, max_text_length: int, lora=None):
    """The policy generator of a method: a diffusers family (``generator_spec``, a
    :class:`~genrl.models.families.GeneratorSpec`) or genrl's DiT (``transformer_spec`` + a text encoder), with
    the LoRA adapter (:class:`~genrl.methods.grpo.LoraSpec` or its dict) added when given; transformer in train
    mode.

    Raises:
        FileNotFoundError, ValueError: from the loaders (missing weights, bad specs).
    """
    from genrl.methods.grpo import LoraSpec
    from genrl.models.generator import DiTGenerator
    from genrl.models.text_encoder import TextEncoder

    if generator_spec is not None:
        from genrl.models.families import build_generator

        generator = build_generator(generator_spec)
    else:
        encoder = TextEncoder.from_pretrained(text_encoder, max_length=max_text_length)
        generator = DiTGenerator(transformer_spec.build(), encoder)
    if lora is not None:
        (lora if isinstance(lora, LoraSpec) else LoraSpec(**lora)).add_to(generator)
    generator.transformer.train()  # from_pretrained returns eval mode
    return generator


def build_student(generator_spec, transformer_spec, text_encoder: str, max_text_length: int, lora=None):
    """:func:`build_policy` for a distillation student, whose default weights are a previous stage's export:
    a missing folder names the config key and the stage that writes it.

    Raises:
        FileNotFoundError: the student's weights are missing (with the fix).
    """
    try:
        return build_policy(generator_spec, transformer_spec, text_encoder, max_text_length, lora)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e}\nThe student's starting weights (model.init_args.transformer.pretrained, or generator.pretrained / "
            f"transformer_path) are missing. The shapes distillation configs start from the ODE-init stage: run "
            f"`genrl fit --config configs/ode_init/shapes.yaml` first (it writes runs/ode_init_shapes/export), or "
            f"start from the base model with --model.init_args.transformer.pretrained=assets/shapes-dit"
        ) from e


def build_reward_manager(specs: list[dict[str, Any]], combine: str, trainer=None):
    """A built :class:`~genrl.rewards.RewardManager` for ``specs``; the datamodule's shapes world (when the
    trainer has a datamodule with one) is passed to rewards that take it."""
    from genrl.rewards import RewardManager

    world = getattr(getattr(trainer, "datamodule", None), "world", None) if trainer is not None else None
    manager = RewardManager(specs, combine=combine)
    manager.build({"world": world} if world is not None else {})
    return manager


#: checkpoint key of the reward manager's state (running normalisers etc.).
REWARD_STATE_KEY = "genrl_reward_manager"


def ensure_reward_manager(method) -> None:
    """Build ``method.rewards`` from ``method._reward_specs`` / ``method.hparams.reward_combine`` once (a
    method's ``setup``)."""
    if method.rewards is None:
        method.rewards = build_reward_manager(method._reward_specs, method.hparams.reward_combine, method._trainer)


def save_reward_state(method, checkpoint: dict) -> None:
    """``on_save_checkpoint``: store the reward manager's state (when built) under :data:`REWARD_STATE_KEY`."""
    if method.rewards is not None:
        checkpoint[REWARD_STATE_KEY] = method.rewards.state_dict()


def stash_reward_state(method, checkpoint: dict) -> None:
    """``on_load_checkpoint``: keep the reward manager's stored state until the manager exists (it is built in
    ``setup``, which Lightning may call after the checkpoint is loaded)."""
    method._pending_reward_state = checkpoint.get(REWARD_STATE_KEY)


def restore_reward_state(method) -> None:
    """Load a stashed reward-manager state into ``method.rewards`` once (start of ``training_step``)."""
    if getattr(method, "_pending_reward_state", None) is not None:
        method.rewards.load_state_dict(method._pending_reward_state)
        method._pending_reward_state = None


def gather_batch(method, t):
    """``t`` [n, ...] of this rank -> the global batch [world * n, ...] on the CPU (rank order), via Lightning's
    ``all_gather``; unchanged on one process. Group statistics (advantages) are computed on the gathered batch."""
    if method._trainer is None or method.trainer.world_size == 1:
        return t
    return method.all_gather(t.to(method.device)).reshape(-1, *t.shape[1:]).cpu()


def policy_optimizer(generator, factory):
    """``factory(trainable parameters of generator.transformer)``.

    Raises:
        ValueError: nothing is trainable (a frozen transformer without LoRA).
    """
    params = [p for p in generator.transformer.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters in the policy; check the lora / transformer config")
    return factory(params)




def frame_shape_of(generator, latent_shape=None, default: tuple[int, ...] = (3, 16, 16)) -> tuple[int, ...]:
    """Latent shape of one frame (without the frame axis) of ``latent_shape`` (default: the generator's
    ``latent_shape``; ``default`` when it has none, e.g. genrl's DiT): DiT (C, H, W), Wan (C, h, w)."""
    shape = latent_shape if latent_shape is not None else getattr(generator, "latent_shape", None)
    if shape is None:
        return tuple(default)
    fd = getattr(generator, "frame_dim", 1)
    return tuple(int(v) for i, v in enumerate(shape) if i != fd - 1)


@contextmanager
def swapped_transformer(generator, transformer):
    """Evaluate ``generator`` (its input handling, text conditioning, causal layout) with another transformer:
    a frozen teacher, a critic, an old policy or a reference. Restores the live transformer and layout."""
    live, causal = generator.transformer, getattr(generator, "causal", None)
    generator.transformer = transformer
    try:
        yield generator
    finally:
        generator.transformer = live
        if causal is not None:
            generator.causal = causal


@contextmanager
def reference_weights(generator, reference, lora) -> Any:
    """Evaluate ``generator`` with the frozen reference policy: with a LoRA adapter (``lora`` not None) the
    adapter-disabled model, else the frozen ``reference`` transformer copy (moved to the generator's device).
    Use under ``torch.no_grad()``; restores the live policy."""
    if lora is not None:
        generator.transformer.disable_adapters()
        try:
            yield generator
        finally:
            generator.transformer.enable_adapters()
        return
    with swapped_transformer(generator, reference.to(generator.device)) as gen:
        yield gen


def log_validation_rewards(method, videos, prompts: list[str]) -> None:
    """Score validation ``videos`` (pixels [B, T, C, H, W] in [0, 1]) with ``method.rewards`` and log
    ``val/<reward>/<key>`` and ``val/total`` (mean over valid samples; NaN when none is valid)."""
    result = method.rewards(videos.float().cpu(), prompts)
    bs = len(prompts)
    for key, value in result.metrics().items():
        if key != "total":
            method.log(f"val/{key}", float(value), batch_size=bs)
    method.log("val/total", float(result.total[result.valid].mean()) if result.valid.any() else math.nan,
               prog_bar=True, batch_size=bs)
