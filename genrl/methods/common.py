"""Pieces every method composes (plain functions and small modules; no base class): the policy built from its spec,
the :class:`Scorer` (the reward manager as a child whose checkpointed state is the manager's running statistics),
the rank view of a batch (gather, this rank's slice), optimizers over trainable roles, validation logging."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from genrl.data import data_parallel_of
from genrl.models.conditions import check_prompt_images
from genrl.models.families import GeneratorSpec, build_generator, family_class
from genrl.models.lora import LoraSpec
from genrl.models.roles import Roles
from genrl.rewards import RewardManager
from genrl.rollout.sampler import RolloutConfig

__all__ = ["SHAPES_DIT", "Scorer", "advance_iteration", "backward_step", "build_policy", "build_student",
           "check_before_loading", "check_finite", "check_no_dropout", "clip_and_step", "configure_policy",
           "configure_policy_optimizer",
           "default_latent_shape", "frame_shape_of", "gather_batch", "gather_objects", "linear_warmup",
           "local_mini_batch", "log_validation_rewards", "ode_validation_config", "policy_optimizer", "policy_spec",
           "rank_slice", "role_optimizers", "step_uncounted", "trainer_of", "world_of"]


#: the default policy of the shapes-world methods: the shipped base model (genrl's DiT).
SHAPES_DIT = GeneratorSpec(family="dit", pretrained="assets/shapes-dit")


def build_policy(spec: GeneratorSpec | dict | None, lora: LoraSpec | dict | None = None):
    """The policy generator of a method from its one ``generator:`` spec (:class:`~genrl.models.families.GeneratorSpec`;
    genrl's DiT is ``family: dit``; None: :data:`SHAPES_DIT`), with the LoRA adapter (:class:`~genrl.models.lora.
    LoraSpec` or its dict) added when given; transformer in train mode.

    Raises:
        FileNotFoundError, ValueError: from the loaders (missing weights, bad specs).
    """
    generator = build_generator(spec if spec is not None else SHAPES_DIT)
    if lora is not None:
        (lora if isinstance(lora, LoraSpec) else LoraSpec(**lora)).add_to(generator)
    generator.transformer.train()  # from_pretrained returns eval mode
    return generator


def build_student(spec: GeneratorSpec | dict | None, lora: LoraSpec | dict | None = None):
    """:func:`build_policy` for a distillation student, whose default weights are a previous stage's export:
    a missing folder names the config key and the stage that writes it.

    Raises:
        FileNotFoundError: the student's weights are missing (with the fix).
    """
    try:
        return build_policy(spec, lora)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e}\nThe student's starting weights (model.init_args.generator.pretrained, or generator.transformer_path "
            f"for a diffusers family) are missing. The shapes distillation configs start from the ODE-init stage: run "
            f"`genrl fit --config configs/ode_init/shapes.yaml` first (it writes runs/ode_init_shapes/export), or "
            f"start from the base model with --model.init_args.generator.pretrained=assets/shapes-dit"
        ) from e


def policy_spec(method: LightningModule, spec: GeneratorSpec | dict | None,
                default: GeneratorSpec = SHAPES_DIT) -> GeneratorSpec:
    """``spec`` as a :class:`GeneratorSpec` (a dict from a config is converted; None gives ``default``), recorded as
    plain values in ``method.hparams["generator"]`` so checkpoints name the generator that was built
    (:func:`genrl.models.loading.load_generator` rebuilds it) and load with ``torch.load(weights_only=True)``."""
    spec = default if spec is None else spec if isinstance(spec, GeneratorSpec) else GeneratorSpec(**spec)
    method.hparams["generator"] = asdict(spec)
    return spec


def init_method(method: LightningModule, generator: GeneratorSpec | dict | None, rewards: list[dict] | None = None,
                reward_combine: str = "weighted_sum", ignore: tuple[str, ...] = ("optimizer",)) -> GeneratorSpec:
    """The construction every genrl method shares; call it from ``__init__`` right after ``super().__init__()`` and
    the method's own argument checks. It records the ``__init__`` arguments as hyperparameters (all but ``ignore``,
    the optimizer factories, which are not plain values), switches to manual optimization (every method steps its
    own optimizers through :mod:`genrl.methods.phases`), records the generator spec (:func:`policy_spec`), and
    creates what the hooks fill in or use later: ``method.generator = None`` (built in ``configure_model``), the
    checkpointed ``iteration`` counter (int64 buffer, 0), the reward :class:`Scorer` and the role table
    (:class:`~genrl.models.roles.Roles`; declare the roles in ``configure_model``).

    Returns:
        ``method.generator_spec``.
    """
    caller = inspect.currentframe().f_back
    method.save_hyperparameters(ignore=list(ignore), frame=caller)
    method.automatic_optimization = False
    spec = policy_spec(method, generator)
    method.generator_spec = spec
    method.generator = None
    method.register_buffer("iteration", torch.zeros((), dtype=torch.long))
    method.scorer = Scorer(rewards, reward_combine)
    method.roles = Roles(method)
    return spec


def trainer_of(module: LightningModule):
    """The Trainer ``module`` is attached to, or None (a module used on its own, e.g. in a test)."""
    try:
        return module.trainer
    except RuntimeError:
        return None


def world_of(module: LightningModule) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of ``module``'s trainer (:func:`genrl.data.data_parallel_of`: the
    global rank and world size, except under context parallelism, where the ranks of one group count once);
    (0, 1) without a trainer. The slice of every global batch a rank holds, the gathers and the global means
    follow it."""
    return data_parallel_of(trainer_of(module))


class Scorer(nn.Module):
    """The reward manager of a method (rollout scoring and validation), as a child module that holds no weights.

    The reward models stay outside the module tree (frozen, rebuilt from their specs, never checkpointed or wrapped
    by a strategy); the manager's running state (z-score statistics, failure counts) is this module's *extra state*,
    so it is saved in every checkpoint and restored on resume with no hook in the method.

    Args:
        specs: reward specs (``[{"name": "shapes", "weight": 1.0}, ...]``, see :class:`genrl.rewards.RewardSpec`);
            None: the shapes verifier, ``[{"name": "shapes"}]``.
        combine: ``"weighted_sum"``, ``"zscore_sum"`` or ``"advantage_sum"`` (see :class:`genrl.rewards.RewardManager`).
    Raises:
        ValueError: an empty list, an unknown combine mode; UnknownRewardError: an unregistered reward name.
    """

    def __init__(self, specs: list[dict[str, Any]] | None = None, combine: str = "weighted_sum") -> None:
        super().__init__()
        specs = [{"name": "shapes"}] if specs is None else specs
        if not specs:
            raise ValueError("the method needs at least one reward; e.g. model.init_args.rewards: [{name: shapes}]")
        self.manager = RewardManager(specs, combine=combine)  # not an nn.Module: its models are not children
        self._pending: dict | None = None

    def build(self, trainer=None) -> RewardManager:
        """Build the reward models once; the trainer's datamodule ``world`` (the shapes world) goes to the rewards
        that take it. Applies a state restored before the build."""
        if not self.manager.built:
            world = getattr(getattr(trainer, "datamodule", None), "world", None)
            self.manager.build({"world": world} if world is not None else {})
        if self._pending is not None:
            self.manager.load_state_dict(self._pending)
            self._pending = None
        return self.manager

    def forward(self, pixels: torch.Tensor, prompts: list[str], **meta: Any):
        """Score pixels [B, T, C, H, W] in [0, 1] (any device / dtype) for ``prompts`` -> a
        :class:`~genrl.rewards.RewardResult` (CPU tensors of length B). ``meta`` goes to every reward (per-sample
        lists of length B, e.g. TempAct's ``frame_spans``)."""
        return self.build()(pixels.float().cpu(), prompts, **meta)

    def get_extra_state(self) -> dict | None:
        return self.manager.state_dict() if self.manager.built else self._pending

    def set_extra_state(self, state: dict | None) -> None:
        self._pending = state
        if self.manager.built and state is not None:
            self.build()


def gather_batch(module: LightningModule, t: torch.Tensor) -> torch.Tensor:
    """``t`` [n, ...] of this rank -> the global batch [world * n, ...] on the CPU (data-parallel rank order), via
    Lightning's ``all_gather``; unchanged on one slice. Group statistics (advantages) are computed on the gathered
    batch. Under context parallelism the ``c`` ranks of a group hold the same rows (global rank = data-parallel
    rank x c + position in the group): one copy of each is kept."""
    _, world = world_of(module)
    if world == 1:
        return t
    gathered = module.all_gather(t.to(module.device))  # [processes, n, ...]
    copies = gathered.shape[0] // world
    if copies > 1:
        gathered = gathered.reshape(world, copies, *t.shape)[:, 0]
    return gathered.reshape(-1, *t.shape[1:]).cpu()


def gather_objects(module: LightningModule, items: list) -> list:
    """``items`` (picklable, e.g. prompts) of this rank -> the global batch's list in data-parallel rank order
    (``torch.distributed.all_gather_object``); unchanged on one slice. Under context parallelism one copy of each
    group's rows is kept, as :func:`gather_batch` does."""
    _, world = world_of(module)
    if world == 1:
        return list(items)
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(items))
    copies = len(out) // world
    return [x for part in out[::copies] for x in part]


def local_mini_batch(module: LightningModule, mini_batch_size: int | None, local: int) -> int:
    """This rank's share of a global ``mini_batch_size`` (samples per optimizer step over all ranks; None: the whole
    batch) when each of the W ranks holds ``local`` samples: ``mini_batch_size / W``.

    Raises:
        ValueError: W does not divide ``mini_batch_size``, or the share does not divide ``local`` (names the
            values and the divisors that would work).
    """
    _, world = world_of(module)
    if mini_batch_size is None:
        return local
    if mini_batch_size % world or local % (mini_batch_size // world):
        total = local * world
        ok = [d for d in range(world, total + 1, world) if total % d == 0 and local % (d // world) == 0]
        raise ValueError(f"mini_batch_size {mini_batch_size} cannot split the batch of {total} samples "
                         f"(prompts_per_batch x group_size) over {world} device(s) into equal optimizer steps; use one "
                         f"of {ok}")
    return mini_batch_size // world


def rank_slice(module: LightningModule, t: torch.Tensor, n: int) -> torch.Tensor:
    """This rank's ``n`` rows of a gathered batch ``t`` [world * n, ...] (inverse of :func:`gather_batch`)."""
    rank, _ = world_of(module)
    return t[rank * n : (rank + 1) * n]


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


def role_optimizers(method: LightningModule, joined: dict[str, list[str]] | None = None, **factories) -> list:
    """``method.roles.optimizers(joined=joined, **factories)`` (one optimizer per trainable role, ``joined`` roles
    adding their parameters to a named one's) for a method that updates several networks in separate backward passes
    (DMD: generator and critic; AFD: student and discriminator; TMD: student with its flow head, and critic).

    Under DDP such a backward leaves the other network's parameters without a gradient, which DDP accepts only with
    ``find_unused_parameters`` (the ``configs/trainer/ddp.yaml`` profile sets it); FSDP2 needs nothing.

    Raises:
        ValueError: several networks under a DDP strategy without ``find_unused_parameters`` (names the fix).
    """
    trainer = trainer_of(method)
    wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
    if len(factories) > 1 and isinstance(wrapped, DistributedDataParallel) and not wrapped.find_unused_parameters:
        raise ValueError(
            f"{type(method).__name__} updates {', '.join(factories)} in separate backward passes; under DDP that "
            f"needs find_unused_parameters: use --trainer.strategy=ddp_find_unused_parameters_true (or the profile "
            f"configs/trainer/ddp.yaml), or FSDP2 (configs/trainer/fsdp2.yaml)")
    return method.roles.optimizers(joined=joined, **factories)


def configure_policy_optimizer(method: LightningModule):
    """``configure_optimizers`` of a method with one optimizer over its policy: ``method.optimizer_factory`` over the
    trainable parameters of ``method.generator`` (assign it in the class body: ``configure_optimizers =
    configure_policy_optimizer``)."""
    return policy_optimizer(method.generator, method.optimizer_factory)


def ode_validation_config(rollout: RolloutConfig, num_steps: int | None = None) -> RolloutConfig:
    """The default validation sampler of a flat-rollout method: the deterministic ODE with the rollout's shift, CFG
    scale, null prompt, micro-batch, batching and noise backend, ``num_steps`` steps (default: the rollout's); the
    rollout's explicit sigma ``schedule`` too when the step count is the rollout's (a schedule of another length
    cannot apply: the shift's schedule is used then)."""
    steps = num_steps or rollout.num_steps
    return RolloutConfig(kernel="ode", num_steps=steps, shift=rollout.shift, cfg_scale=rollout.cfg_scale,
                         micro_batch_size=rollout.micro_batch_size, null_prompt=rollout.null_prompt,
                         schedule=rollout.schedule if steps == rollout.num_steps else None,
                         batching=rollout.batching, noise_backend=rollout.noise_backend)


def check_finite(loss: torch.Tensor, role: str, iteration: int, hint: str = "") -> None:
    """Raise FloatingPointError naming the role, the value and the iteration when ``loss`` is NaN / inf."""
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite {role} loss {loss.item()} at iteration {iteration}; lower the {role} "
                                 f"learning rate{hint}")


def check_no_dropout(module: nn.Module) -> None:
    """Raise ValueError naming the first dropout layer with p > 0 in ``module``: an update that reuses forwards run
    in eval mode (``reuse_rollout_forward``) would otherwise differ from the train-mode recomputation."""
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            raise ValueError(f"reuse_rollout_forward: the policy has dropout p={m.p} at {name!r}; the rollout runs "
                             "in eval mode, so its forwards are not the training forwards. Set the dropout to 0 or "
                             "reuse_rollout_forward: false")


def default_latent_shape(generator, latent_shape=None) -> tuple[int, ...]:
    """``latent_shape``, else the generator's (a diffusers family), else the shapes world's DiT (8, 3, 16, 16)."""
    return tuple(latent_shape) if latent_shape else tuple(getattr(generator, "latent_shape", (8, 3, 16, 16)))


def log_validation_rewards(method: LightningModule, scorer: Scorer, videos: torch.Tensor, prompts: list[str],
                           **meta: Any) -> dict:
    """Score validation ``videos`` (pixels [B, T, C, H, W] in [0, 1]) with ``scorer`` (``meta``: per-sample reward
    inputs) and log ``val/<reward>/<key>`` and ``val/total`` (mean over valid samples; NaN when none is valid).
    Returns ``{"videos", "prompts"}``, the validation-step output :class:`~genrl.callbacks.VideoLogger` reads."""
    result = scorer(videos, prompts, **meta)
    bs = len(prompts)
    for key, value in result.metrics().items():
        if key != "total":
            method.log(f"val/{key}", float(value), batch_size=bs)
    method.log("val/total", float(result.total[result.valid].mean()) if result.valid.any() else math.nan,
               prog_bar=True, batch_size=bs)
    return {"videos": videos, "prompts": prompts}


def configure_policy(method: LightningModule, reference: bool = False, build=build_policy):
    """The ``configure_model`` body of a method that trains one policy (GRPO, BranchGRPO, RAM, RWR): build
    ``method.generator_spec`` with ``method.hparams.lora`` (``build``: :func:`build_policy`), resolve
    ``method.latent_shape`` (:func:`default_latent_shape`), register the policy as the trainable role ``generator``
    of ``method.roles``, declare the reference (:meth:`~genrl.models.roles.Roles.reference_copy`) when ``reference``,
    and build ``method.scorer``'s reward models.

    Returns:
        the new generator, or None when the method was already configured (Lightning calls the hook again on
        every ``fit`` / ``validate`` of the same module; the networks are built once).
    """
    if method.generator is not None:
        return None
    check_before_loading(method)
    generator = build(method.generator_spec, method.hparams.get("lora"))
    method.latent_shape = default_latent_shape(generator, method.latent_shape)
    method.roles.trainable("generator", generator)
    if reference:
        method.roles.reference_copy(generator)
    method.scorer.build(trainer_of(method))
    return generator


def check_before_loading(method: LightningModule) -> None:
    """What can be refused before a diffusers family's weights load: the sample size against the folder's rules
    (:func:`genrl.models.loading.check_sample_size`: height / width multiples, a video's frame count such as Wan's
    4k + 1), and the image-to-video prompts of the trainer's datamodule (its ``train_records`` and ``val_batches()``,
    when it has them): each image exists and has the generator's height x width
    (:func:`genrl.models.conditions.check_prompt_images`). Nothing to check for genrl's DiT, a spec without a local
    folder, or without a trainer / images.

    Raises:
        FileNotFoundError, ValueError: names the bad value (a size, a frame count, an image), the rule and the fix.
    """
    spec = method.generator_spec
    if not isinstance(spec, GeneratorSpec) or spec.family == "dit":
        return
    if spec.pretrained is not None and Path(spec.pretrained).expanduser().is_dir():
        from genrl.models.loading import check_sample_size

        video = family_class(spec.family).is_video
        check_sample_size(spec.pretrained, spec.height, spec.width, spec.num_frames if video else None,
                          flag="generator.")
    trainer = trainer_of(method)
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    if dm is None:
        return
    prompts = [r.prompt for r in getattr(dm, "train_records", None) or []]
    if hasattr(dm, "val_batches"):
        prompts += [p for b in dm.val_batches() for p in b["prompts"]]
    check_prompt_images(prompts, spec.height, spec.width)


def advance_iteration(method: LightningModule, batch_size: int) -> int:
    """End of a manual-optimization iteration: ``method.iteration`` (a checkpointed int64 buffer, which addresses the
    iteration's random draws) += 1, logged as ``train/iteration``; returns the new value."""
    method.iteration += 1
    method.log("train/iteration", float(method.iteration), batch_size=batch_size)
    return int(method.iteration)


def linear_warmup(optimizer, warmup_steps: int) -> dict:
    """``configure_optimizers``' return value for ``optimizer`` with a linear learning-rate warm-up: the factor
    min(1, (step + 1) / max(1, warmup_steps)), stepped per optimizer step (``warmup_steps`` 0: factor 1 throughout)."""
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def step_uncounted(method: LightningModule, optimizer) -> None:
    """Step ``optimizer`` (a Lightning optimizer of ``method``) through the trainer's strategy, its precision plugin
    and the ``on_before_optimizer_step`` hooks, like ``optimizer.step()``, but without advancing
    ``trainer.global_step``.

    Multi-optimizer methods step their secondary networks this way (DMD's generator, AFD's discriminator), so that
    ``trainer.max_steps``, ``every_n_train_steps``, ``val_check_interval`` and the progress bar all count iterations
    (one per training batch), whatever the number of networks updated in it. Without a trainer (a module used on its
    own) it is ``optimizer.step()``.
    """
    trainer = trainer_of(method)
    if trainer is None or not hasattr(optimizer, "optimizer"):
        optimizer.step()
        return
    trainer.strategy.optimizer_step(optimizer.optimizer, lambda: None)


def backward_step(method: LightningModule, optimizer, loss: torch.Tensor, role: str, hint: str = "",
                  counted: bool = True) -> None:
    """One manual-optimization update of ``method``: check ``loss`` is finite (FloatingPointError naming ``role``, the
    iteration and ``hint``), zero the gradients, back-propagate, clip to ``method.hparams.max_grad_norm`` (when > 0)
    and step ``optimizer`` (``counted``: as a trainer step; else :func:`step_uncounted`, for the secondary network of
    an iteration)."""
    check_finite(loss, role, int(method.iteration), hint)
    optimizer.zero_grad()
    method.manual_backward(loss)
    clip_and_step(method, optimizer, method.hparams.get("max_grad_norm", 0.0), counted)


def clip_and_step(method: LightningModule, optimizer, max_grad_norm: float = 0.0, counted: bool = True) -> None:
    """Clip the accumulated gradients of ``optimizer``'s parameters to norm ``max_grad_norm`` (when > 0) and step
    it: as a trainer step (``counted``) or with :func:`step_uncounted` (a secondary network of the iteration)."""
    if max_grad_norm > 0:
        method.clip_gradients(optimizer, gradient_clip_val=max_grad_norm, gradient_clip_algorithm="norm")
    if counted:
        optimizer.step()
    else:
        step_uncounted(method, optimizer)
