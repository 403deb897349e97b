"""FSDP2 for every role of a genrl method, on Lightning's ``ModelParallelStrategy``."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy

from genrl.models.roles import LaggedCopy
from genrl.models.sharding import ShardingConfig, is_sharded, shard_module

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

    It is Lightning's ``ModelParallelStrategy`` with a data-parallel mesh of every process (tensor parallel size 1);
    the method code is the same as on one device (no ``fully_shard`` call in any method). Use it from a trainer
    profile (``configs/trainer/fsdp2.yaml``) or ``--trainer.strategy=genrl.strategies.FSDP2Strategy``.

    Args:
        param_dtype / reduce_dtype / reshard_after_forward / offload_frozen: see
            :class:`genrl.models.sharding.ShardingConfig` (the usual GPU setting: ``param_dtype: bf16``,
            ``reduce_dtype: fp32``).
        save_distributed_checkpoint: one shard file per rank (True, scales to any model) or one full file
            assembled on rank 0 (False).
        process_group_backend: ``"nccl"`` on GPUs (default there), ``"gloo"`` on CPUs (default there).
        timeout: collective timeout (a ``datetime.timedelta``).
    Raises:
        TypeError: the module has no ``roles`` (not a genrl method): shard it in its own ``configure_model``.
    """

    def __init__(self, param_dtype: Literal["bf16", "fp16", "fp32"] | None = None,
                 reduce_dtype: Literal["bf16", "fp16", "fp32"] | None = None, reshard_after_forward: bool = True,
                 offload_frozen: bool = False, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, **kwargs) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **kwargs)
        self.sharding = ShardingConfig(param_dtype, reduce_dtype, reshard_after_forward, offload_frozen)

    def setup_environment(self) -> None:
        # every process is one data-parallel rank: a mesh of (world size, 1)
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer) -> None:
        module = self.lightning_module
        roles = getattr(module, "roles", None)
        if roles is None:
            raise TypeError(f"FSDP2Strategy shards the roles of a genrl method; {type(module).__name__} has no "
                            f"`roles`. Use lightning's ModelParallelStrategy and call fully_shard in configure_model")
        mesh = self.device_mesh["data_parallel"]
        for net in roles.shardable().values():
            if not is_sharded(net):  # fit then validate on one module: shard once
                shard_module(net, mesh, self.sharding)
        policy = getattr(module, "generator", None)
        for name, role in roles.table.items():
            lagged = roles.get(name)
            if role.kind == "lagged" and isinstance(lagged, LaggedCopy) and policy is not None:
                lagged.shard_like(policy.transformer)
        super().setup(trainer)

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
    """Delete the hidden folders ``.<name>.<nonce>`` of checkpoint ``path`` other than ``keep``."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.\d+$")
    for entry in path.parent.iterdir() if path.parent.is_dir() else ():
        if entry.name != keep and pattern.match(entry.name) and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
