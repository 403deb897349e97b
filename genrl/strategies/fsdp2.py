"""FSDP2 for every role of a genrl method, on Lightning's ``ModelParallelStrategy``."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy

from genrl.models.roles import LaggedCopy
from genrl.models.sharding import (
    ShardingConfig,
    enable_context_parallel,
    is_sharded,
    reshard,
    shard_module,
    supports_context_parallel,
)

__all__ = ["FSDP2Strategy", "publish_checkpoint", "remove_published"]


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) over all processes, for any genrl
    method: after the method's ``configure_model`` has built its networks, every role it declared
    (:meth:`genrl.models.roles.Roles.shardable`: the policy, a critic, a discriminator, and the frozen teacher and
    reference) is sharded block by block with :func:`genrl.models.sharding.shard_module`, and the lagged copies
    (RAM's old policy) are sharded like the parameters they follow; then Lightning builds the optimizers over the
    sharded parameters. Checkpoints are torch distributed checkpoints (a folder, one file per rank) unless
    ``save_distributed_checkpoint`` is False.

    A distributed checkpoint is written atomically: every rank writes its shard into a new hidden folder beside the
    checkpoint's name (``.last.ckpt.<nonce>``), and only when all ranks have finished does rank 0 point the name
    (``last.ckpt``, a symbolic link) at it with one ``os.replace``, then delete the folder it pointed at before.
    A rank killed during the write leaves the name on the previous, complete checkpoint (``--ckpt_path last``
    resumes it); the half-written folder is removed by the next save of that name.

    Context (sequence) parallelism: with ``context_parallel: c`` the processes form groups of ``c`` that hold the
    same samples and split each sample's tokens between them in every transformer that has a diffusers
    context-parallel plan (Wan): :func:`genrl.models.sharding.enable_context_parallel`, diffusers' Ulysses
    attention. The data-parallel size is then ``world / c``: the global batch (prompts x group size) is split over
    ``world / c`` slices (Lightning's ``distributed_sampler_kwargs``, which genrl's data modules and methods read),
    the rewards are gathered once per slice, and the gradients of a context-parallel network are summed over its
    group and averaged over the slices (the FSDP2 divide factor is ``world / c``). Networks without a plan (genrl's
    DiT, a discriminator) run whole on every rank of a group. Parameters are sharded over all ``world`` ranks.

    It is Lightning's ``ModelParallelStrategy`` with a mesh of ``(world / c, c)`` processes (Lightning's
    ``data_parallel`` and ``tensor_parallel`` dimensions; the second one is used for context parallelism, genrl
    does no tensor parallelism); the method code is the same as on one device (no ``fully_shard`` call in any
    method). Use it from a trainer profile (``configs/trainer/fsdp2.yaml``) or
    ``--trainer.strategy=genrl.strategies.FSDP2Strategy``.

    Args:
        param_dtype / reduce_dtype / reshard_after_forward / offload_frozen: see
            :class:`genrl.models.sharding.ShardingConfig` (the usual GPU setting: ``param_dtype: bf16``,
            ``reduce_dtype: fp32``).
        context_parallel: ranks per context-parallel group (1: none). Must divide the world size and the attention
            head count of the context-parallel networks.
        save_distributed_checkpoint: one shard file per rank (True, scales to any model) or one full file
            assembled on rank 0 (False).
        process_group_backend: ``"nccl"`` on GPUs (default there), ``"gloo"`` on CPUs (default there).
        timeout: collective timeout (a ``datetime.timedelta``).
    Raises:
        TypeError: the module has no ``roles`` (not a genrl method): shard it in its own ``configure_model``.
        ValueError: ``context_parallel`` below 1 or not dividing the world size; ``context_parallel > 1`` and no
            network of the method has a context-parallel plan.
    """

    def __init__(self, param_dtype: Literal["bf16", "fp16", "fp32"] | None = None,
                 reduce_dtype: Literal["bf16", "fp16", "fp32"] | None = None, reshard_after_forward: bool = True,
                 offload_frozen: bool = False, context_parallel: int = 1, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, **kwargs) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **kwargs)
        if context_parallel < 1:
            raise ValueError(f"context_parallel {context_parallel}: use 1 (none) or a group size that divides the "
                             f"number of processes")
        self.sharding = ShardingConfig(param_dtype, reduce_dtype, reshard_after_forward, offload_frozen)
        self.context_parallel = int(context_parallel)

    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        if world % self.context_parallel:
            raise ValueError(f"context_parallel {self.context_parallel} does not divide the {world} processes "
                             f"(num_nodes x devices); use a divisor of {world}")
        # a (data-parallel, context-parallel) mesh; Lightning names the second dimension tensor_parallel
        self._data_parallel_size = world // self.context_parallel
        self._tensor_parallel_size = self.context_parallel
        super().setup_environment()

    def setup(self, trainer) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        module = self.lightning_module
        roles = getattr(module, "roles", None)
        if roles is None:
            raise TypeError(f"FSDP2Strategy shards the roles of a genrl method; {type(module).__name__} has no "
                            f"`roles`. Use lightning's ModelParallelStrategy and call fully_shard in configure_model")
        nets = {name: net for name, net in roles.shardable().items() if not is_sharded(net)}  # shard once
        world, cp = self.world_size, self.context_parallel
        shard_mesh, divide = self.device_mesh["data_parallel"], {}
        if cp > 1:
            kind = self.root_device.type
            shard_mesh = init_device_mesh(kind, (world,), mesh_dim_names=("shard",))
            cp_mesh = init_device_mesh(kind, (world // cp, 1, cp), mesh_dim_names=("dp", "ring", "ulysses"))
            for name, net in nets.items():
                if supports_context_parallel(net):
                    enable_context_parallel(net, cp_mesh["ring", "ulysses"])
                    divide[name] = world // cp  # the group's gradient is the sum of its ranks' parts
            if nets and not divide:
                raise ValueError(f"context_parallel {cp}: none of the networks of {type(module).__name__} "
                                 f"({', '.join(type(n).__name__ for n in nets.values())}) has a diffusers "
                                 f"context-parallel plan; use a family that has one (Wan) or context_parallel: 1")
        for name, net in nets.items():
            shard_module(net, shard_mesh, self.sharding, gradient_divide_factor=divide.get(name))
        policy = getattr(module, "generator", None)
        for name, role in roles.table.items():
            lagged = roles.get(name)
            if role.kind == "lagged" and isinstance(lagged, LaggedCopy) and policy is not None:
                lagged.shard_like(policy.transformer)
        super().setup(trainer)
        self._kept_gathered = [n for n in roles.shardable().values() if getattr(n, "needs_double_backward", False)]
        for optimizer in self.optimizers:  # a kept-gathered network re-gathers after each update of its shards
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            stepped = [n for n in self._kept_gathered if any(id(p) in ids for p in n.parameters())]
            if stepped:
                optimizer.register_step_pre_hook(_resharding(stepped))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        for net in getattr(self, "_kept_gathered", ()):
            reshard(net)  # a checkpoint holds the shards
        return super().lightning_module_state_dict()

    # ------------------------------------------------------------------ atomic distributed checkpoints
    @property
    def atomic_checkpoints(self) -> bool:
        """Whether :meth:`save_checkpoint` publishes a checkpoint only once it is complete (distributed
        checkpoints; a single file goes through Lightning's own write)."""
        return self._save_distributed_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path, nonce = self.broadcast((str(filepath), time.time_ns()))
        path = Path(path)
        shards = path.parent / f".{path.name}.{nonce}"
        super().save_checkpoint(checkpoint, shards, storage_options)  # every rank's shard, then rank 0's meta.pt
        self.barrier("genrl_checkpoint_written")
        if self.is_global_zero:
            publish_checkpoint(shards, path)
        self.barrier("genrl_checkpoint_published")

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            remove_published(Path(filepath))


def _resharding(nets: list) -> Callable[..., None]:
    """An optimizer pre-step hook that frees the gathered weights of ``nets`` (see ``needs_double_backward`` in
    :func:`genrl.models.sharding.shard_module`)."""
    def hook(optimizer, args, kwargs) -> None:
        for net in nets:
            reshard(net)
    return hook


def publish_checkpoint(folder: Path, path: Path) -> None:
    """Make ``path`` name the complete checkpoint ``folder`` (a sibling of ``path``) atomically: a symbolic link
    (relative, so the run folder can move) created beside ``path`` and renamed onto it (``os.replace``). What
    ``path`` named before is deleted after the switch, and so are this name's folders left half-written by killed
    saves. A real folder or file at ``path`` (a checkpoint written without this strategy) is first moved aside.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
    """
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    link = path.parent / f".{path.name}.link-{folder.name.rsplit('.', 1)[-1]}"
    if path.exists() and not path.is_symlink():
        os.replace(path, path.parent / f".{path.name}.{time.time_ns()}")
    if link.is_symlink():
        link.unlink()
    os.symlink(folder.name, link, target_is_directory=True)
    os.replace(link, path)
    _remove_versions(path, keep=folder.name)


def remove_published(path: Path) -> None:
    """Delete the checkpoint ``path`` written by :class:`FSDP2Strategy` (the link and the folder it names) or a
    plain checkpoint file / folder; nothing happens when it does not exist."""
    if path.is_symlink():
        path.unlink()
        _remove_versions(path, keep=None)
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _remove_versions(path: Path, keep: str | None) -> None:
    """Delete the hidden folders ``.<name>.<nonce>`` of checkpoint ``path`` other than ``keep`` (and such a file: a
    single-file checkpoint :func:`publish_checkpoint` moved aside)."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.\d+$")
    for entry in path.parent.iterdir() if path.parent.is_dir() else ():
        if entry.name != keep and pattern.match(entry.name) and not entry.is_symlink():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
