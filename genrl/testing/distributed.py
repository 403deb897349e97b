"""Multi-process test support: a callback that records what a run did on every rank, and the launcher the tests and
benchmarks use (``torchrun``, as a user launches a multi-GPU run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from genrl.models.sharding import full_state_dict, local_numel, repeated_blocks
from genrl.rewards import RewardModel, register_reward
from genrl.strategies import FSDP2Strategy

__all__ = ["KillDuringCheckpoint", "NaNOnRank1", "RunRecorder", "launch", "read_metrics"]


@register_reward("test_nan_on_rank1")
class NaNOnRank1(RewardModel):
    """Mean pixel value, except that every sample scored on global rank 1 fails (NaN, invalid): a rank whose rewards
    are all invalid. Registered as ``test_nan_on_rank1`` when this module is imported (a ``RunRecorder`` in the
    run's callbacks imports it)."""

    def score(self, pixels, prompts, **meta):
        import torch.distributed as dist

        reward = pixels.float().mean(dim=(1, 2, 3, 4))
        if dist.is_available() and dist.is_initialized() and dist.get_rank() == 1:
            invalid = torch.zeros_like(reward, dtype=torch.bool)
            return {"reward": torch.full_like(reward, float("nan")), "valid": invalid}
        return {"reward": reward}


class RunRecorder(Callback):
    """Records a run for comparison with another one (e.g. 1 process against 2).

    Writes, under ``dirpath``: ``metrics_rank<r>.jsonl`` (after every training batch: the iteration and every logged
    scalar), ``numel_rank<r>.json`` (per role: parameter elements held by the rank and whole, at the start), and at
    the end of ``fit`` ``tokens_rank<r>.json`` (per role: the most tokens its first repeated block returned in one
    call; halved under 2-way context parallelism), ``params.pt`` (rank 0: every checkpointed role's full weights,
    gathered under FSDP2) and ``params_rank<r>.pt`` under DDP-like strategies (each rank's own copy, to check the
    replicas agree).
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def _nets(self, pl_module: LightningModule) -> dict:
        roles = pl_module.roles
        return {name: net for name, net in roles.shardable().items() if roles.table[name].checkpointed}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        numel = {name: local_numel(net) for name, net in pl_module.roles.shardable().items()}
        (self.dirpath / f"numel_rank{trainer.global_rank}.json").write_text(json.dumps(numel))
        self._tokens: dict[str, int] = {}
        for name, net in pl_module.roles.shardable().items():
            blocks = repeated_blocks(net)
            if blocks:  # the sequence length the first block returns (split under context parallelism)
                blocks[0].register_forward_hook(self._count(name))

    def _count(self, name: str):
        def hook(module, args, output):
            x = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(x) and x.dim() >= 2:
                self._tokens[name] = max(self._tokens.get(name, 0), int(x.shape[1]))
        return hook

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        row = {"iteration": int(getattr(pl_module, "iteration", trainer.global_step)),
               "global_step": int(trainer.global_step)}
        row.update({k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1})
        with open(self.dirpath / f"metrics_rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (self.dirpath / f"tokens_rank{trainer.global_rank}.json").write_text(json.dumps(self._tokens))
        full = {f"{name}.{k}": v for name, net in self._nets(pl_module).items()
                for k, v in full_state_dict(net).items()}
        if trainer.is_global_zero:
            torch.save(full, self.dirpath / "params.pt")
        local = {f"{name}.{k}": v.detach().cpu() for name, net in self._nets(pl_module).items()
                 for k, v in net.state_dict().items() if not hasattr(v, "to_local")}
        if local:
            torch.save(local, self.dirpath / f"params_rank{trainer.global_rank}.pt")


class KillDuringCheckpoint(FSDP2Strategy):
    """:class:`~genrl.strategies.FSDP2Strategy` whose rank ``rank`` kills itself (``SIGKILL``, as the OOM killer or a
    lost node would) during its ``save``-th checkpoint write (1-based): after it has written its shard and before
    the ranks agree the checkpoint is complete, so the checkpoint is on disk but must not be published. For the
    atomicity tests."""

    def __init__(self, rank: int = 1, save: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kill_rank, self.kill_save, self._saves = rank, save, 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        self._saves += 1
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def barrier(self, name: str | None = None) -> None:
        if name == "genrl_checkpoint_written" and self.global_rank == self.kill_rank and self._saves == self.kill_save:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        super().barrier(name)


def read_metrics(dirpath: str | os.PathLike, rank: int = 0) -> list[dict]:
    """The rows :class:`RunRecorder` wrote for ``rank``."""
    lines = Path(dirpath, f"metrics_rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def launch(args: list[str], nproc: int, cwd: str | os.PathLike, timeout: float = 600,
           env: dict[str, str] | None = None, check: bool = True, script: str | None = None
           ) -> subprocess.CompletedProcess:
    """``genrl fit <args>`` in ``cwd``: one plain process for ``nproc`` 1, else ``torchrun --standalone
    --nproc_per_node <nproc> -m genrl fit <args>`` (gloo on CPUs); one thread per process, offline. With ``script``
    (a Python file) that file runs instead of ``-m genrl fit``. A start that fails because the rendezvous port was
    taken meanwhile (another test's processes) is retried once. Raises RuntimeError with the output's tail when the
    run fails and ``check`` is True."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    target = [script] if script is not None else ["-m", "genrl", "fit"]
    if nproc == 1:
        cmd = [sys.executable, *target, *args]
    else:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", *target, *args]
    for _ in range(2):
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        if out.returncode == 0 or "address already in use" not in (out.stdout + out.stderr).lower():
            break
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-6000:]}")
    return out
