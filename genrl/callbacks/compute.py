"""Training compute in network forward-equivalents: what a run actually spent, counted from the forwards its networks
ran, with an optional budget that stops the run at an iteration boundary.

**Unit.** One forward-equivalent (fe) is one forward pass of the policy's network over one full training sample. A
:class:`ComputeCounter` hooks every *role network* of the method (``method.roles``, :mod:`genrl.models.roles`) and
counts, during training batches only (not validation, the sanity check, test or predict):

- **rows**: each forward of a role network counts the batch size of its main input (the latents), so classifier-free
  guidance, which runs the conditional and unconditional rows in one call (or in two calls), counts twice, and a
  fixed micro-batch padded by repetition counts its padding (the network computed it);
- **frames**: for genrl's DiT (:class:`~genrl.models.dit.VideoDiT`, latents ``[B, T, C, H, W]``) and for networks of
  the policy network's own class with 5-D latents (frame axis ``generator.frame_dim``), a forward over ``T`` frames
  of a method whose full sample has ``T_full`` latent frames (``method.latent_shape``, else ``hparams.num_frames``)
  counts ``B * T / T_full``: a causal student's chunk forward with its KV cache counts its chunk's share (the
  attention to the cached prefix is not counted), and so does the context pass that commits a chunk. Where frames
  cannot be known (other families, plain modules, a method with no full-sample length) the rows are counted;
- **partial passes**: a pass that runs only some blocks of a transformer without calling its ``forward`` (TMD's
  backbone and flow head through :mod:`genrl.models.trunk`, GAN feature taps, a trunk discriminator) counts each
  block it runs as ``1 / L`` of a forward of that transformer (rows only); its embeddings and output layers are not
  counted;
- **size**: a role network's forward is weighted by (its parameter count / the policy network's parameter count), so
  a small discriminator or flow head counts its share of the policy's cost (forward FLOPs ~ 2 x parameters x tokens)
  and a same-size teacher, critic or reference counts 1. A rollout copy (Sol-RL's low-precision previewer) counts as
  the policy's network (weight 1: the unit counts network work, not its precision or speed). The ratio is an
  approximation where part of a network runs once per sample rather than per token (a flow head's time embedders:
  it overstates that network's cost);
- **backward**: a backward pass counts as two forwards. It is counted exactly when a gradient reaches a counted
  forward's output (a tensor hook on the output of every forward whose output requires grad; an output that is a
  tuple or has ``.sample`` counts once per backward pass). A gradient that reaches the same output in two autograd
  passes (R1: ``torch.autograd.grad``, then the loss's backward) counts twice; the double backward through a
  gradient's own graph is not counted.

**Not counted**: text encoders, VAEs / pixel codecs and reward models (they are not role networks);
gradient-checkpoint recomputation (forwards run inside a backward pass). A module shared by two roles counts once,
under the first role declared. **Counted as the policy** (role ``generator``): a lagged copy (theta_old), whose
tensors are swapped into the live transformer, and a LoRA policy's reference (the adapter-disabled model). A
language-model role generating token by token (TempAct's planner) counts the rows of every call.

**Also recorded**: training wall time (seconds inside ``fit``, summed over resumes), peak memory
(``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak resident set size), ``global_step``,
iterations (training batches) and a history row at every validation during ``fit``. Everything is written to
``<trainer.default_root_dir>/compute.json`` at the end of ``fit`` (``finished: true``) and at every validation end
(``finished: false``), and kept in the checkpoint, so ``--ckpt_path last`` continues the count exactly.
``genrl fit`` adds a counter to every run; ``--compute_budget FE`` stops a run at the end of the first iteration whose
total reaches ``FE`` (docs/evaluation.md, "Counting compute").
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from genrl.data.video_io import write_json
from genrl.models.dit import VideoDiT
from genrl.models.roles import LaggedCopy, RolloutCopy

__all__ = ["ComputeCounter", "COMPUTE_FILE", "UNIT"]

#: the file a counter writes in ``trainer.default_root_dir``.
COMPUTE_FILE = "compute.json"
#: the one-line definition of the unit, written into compute.json.
UNIT = ("forward-equivalent: one forward pass of the policy's network over one full training sample (rows x frame "
        "share x role parameters / policy parameters); a backward pass counts as two")
#: ModuleList attributes holding a transformer's blocks (genrl's DiT and Wan: ``blocks``; SD3 / FLUX / SANA:
#: ``transformer_blocks``; FLUX: ``single_transformer_blocks``).
BLOCK_LISTS = ("blocks", "transformer_blocks", "single_transformer_blocks")
#: keyword names of a forward's main input, in order of preference, when it is not the first positional argument.
MAIN_INPUTS = ("hidden_states", "x", "sample", "latents", "videos", "input_ids", "inputs_embeds")


def _graph_task() -> int | None:
    """The id of the autograd pass running now (-1 outside a backward pass), or None where torch does not tell."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return None if fn is None else int(fn())


def _in_backward() -> bool:
    task = _graph_task()
    return task is not None and task != -1


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output: a tensor, the tensors of a tuple / list / dict, or ``.sample``."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, torch.Tensor)]
    sample = getattr(value, "sample", None)
    return [sample] if isinstance(sample, torch.Tensor) else []


def _main_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The latents of a forward call: the first positional tensor argument, else a known keyword, else the first
    tensor found in the arguments (one level into lists and tuples)."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for key in MAIN_INPUTS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    for value in (*args, *kwargs.values()):
        found = _tensors(value) if isinstance(value, (tuple, list)) else [value]
        for t in found:
            if isinstance(t, torch.Tensor):
                return t
    return None


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_lists(module: nn.Module) -> list[nn.Module]:
    """The blocks of a transformer (every ModuleList named in :data:`BLOCK_LISTS`, in that order); [] for others."""
    out: list[nn.Module] = []
    for name in BLOCK_LISTS:
        blocks = getattr(module, name, None)
        if isinstance(blocks, nn.ModuleList):
            out.extend(blocks)
    return out


@dataclass
class _Tally:
    """One role's counts, in sample units before size weighting: ``forwards`` = sum over its forwards of rows x frame
    share (a block pass: rows / L), ``backwards`` = the same for the forwards a gradient reached (each counted once
    per autograd pass), ``calls`` = network calls (block passes not included)."""

    calls: int = 0
    forwards: float = 0.0
    backwards: float = 0.0

    def add(self, other: _Tally) -> None:
        self.calls += other.calls
        self.forwards += other.forwards
        self.backwards += other.backwards


class ComputeCounter(Callback):
    """Count a run's training compute in forward-equivalents of the policy's network (see the module docstring for
    what is and is not counted), record wall time, peak memory and a validation history, write
    ``<default_root_dir>/compute.json``, and stop the run at an iteration boundary once a budget is spent.

    The counter's state (per-role counts, iterations, wall time, peak memory, history) is saved in every checkpoint
    and restored by ``--ckpt_path last``, so a resumed run reports what an uninterrupted one would (wall time and
    memory aside). A validation that ran right after the checkpointed iteration (its row is in the compute.json the
    earlier fit wrote, not in the checkpoint) is taken back from that file on resume.

    Args:
        budget: forward-equivalents; when the running total reaches it at the end of a training batch (one method
            iteration: rollout + update), ``trainer.should_stop`` is set and the run stops there (a method never
            stops mid-iteration, so the recorded total, what the run actually used, is >= the budget by less than
            one iteration's cost). None: no budget.
        sample_frames: latent frames of one full training sample (the frame share's denominator); None: the
            method's ``latent_shape`` (its frame axis), else ``hparams.num_frames``, else unknown (rows are counted).
        filename: the file written in ``trainer.default_root_dir``.

    Raises:
        ValueError: a budget that is not a finite number > 0, or ``sample_frames`` < 1 (each names the value).
    """

    def __init__(self, budget: float | None = None, sample_frames: int | None = None,
                 filename: str = COMPUTE_FILE) -> None:
        super().__init__()
        self.budget = budget
        if sample_frames is not None and int(sample_frames) < 1:
            raise ValueError(f"sample_frames must be >= 1 (latent frames of one training sample), got {sample_frames}")
        self.sample_frames = sample_frames
        self.filename = filename
        # totals over the run (every rank's, summed), restored from checkpoints
        self.per_role: dict[str, _Tally] = {}
        self.weights: dict[str, float] = {}
        self.iterations = 0
        self.wall_s = 0.0
        self.peak_memory_bytes = 0
        self.peak_memory_source = "rss"
        self.history: list[dict] = []
        self.stopped_by_budget = False
        # this fit's bookkeeping
        self._pending: dict[str, _Tally] = {}
        self._handles: list = []
        self._active = False  # a training batch is open: its counts are pending
        # the hooks count from the start to the end of training, validation included (its counts are dropped): a
        # compiled network traces its hooks, and a flag that flipped for validation would recompile it
        self._counting = False
        self._fit_start: float | None = None
        self._restored = False
        self._frames: int | None = None
        self._policy_parameters = 0

    # ------------------------------------------------------------------ budget
    @property
    def budget(self) -> float | None:
        return self._budget

    @budget.setter
    def budget(self, value: float | None) -> None:
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"compute budget must be a finite number of forward-equivalents > 0, got {value!r}")
        self._budget = None if value is None else float(value)

    # ------------------------------------------------------------------ totals
    def role_forward_equivalents(self, include_pending: bool = False) -> dict[str, float]:
        """``{role: weight x (forwards + 2 backwards)}`` over the run so far."""
        out = {}
        for role, tally in self._tallies(include_pending).items():
            out[role] = self.weights.get(role, 1.0) * (tally.forwards + 2.0 * tally.backwards)
        return out

    @property
    def forward_equivalents(self) -> float:
        """The run's total in forward-equivalents (every role, size-weighted, backward included)."""
        return float(sum(self.role_forward_equivalents().values()))

    def _tallies(self, include_pending: bool) -> dict[str, _Tally]:
        if not include_pending or not self._pending:
            return self.per_role
        merged = {role: _Tally(**asdict(t)) for role, t in self.per_role.items()}
        for role, t in self._pending.items():
            merged.setdefault(role, _Tally()).add(t)
        return merged

    # ------------------------------------------------------------------ hooks on the networks
    def _resolve_frames(self, trainer: Trainer, pl_module: LightningModule) -> int | None:
        if self.sample_frames is not None:
            return int(self.sample_frames)
        fd = int(getattr(getattr(pl_module, "generator", None), "frame_dim", 1) or 1)
        shape = getattr(pl_module, "latent_shape", None)
        if shape is not None and len(shape) >= fd:
            return int(shape[fd - 1])
        frames = getattr(pl_module, "hparams", {}).get("num_frames")
        return int(frames) if isinstance(frames, int) and frames > 0 else None

    def networks(self, pl_module: LightningModule) -> list[tuple[str, nn.Module, str]]:
        """``(role, network, kind)`` of every distinct network of ``pl_module.roles`` the counter hooks, in the order
        the roles were declared: a generator-like role's ``transformer``, a rollout copy's ``module``, any other role
        module itself; lagged copies are skipped (their forwards run in the live transformer)."""
        roles = getattr(pl_module, "roles", None)
        out, seen = [], set()
        for name, role in getattr(roles, "table", {}).items():
            if role.kind == "lagged":
                continue
            module = roles.get(name)
            if isinstance(module, LaggedCopy):
                continue
            if isinstance(module, RolloutCopy):
                module = module.module
            elif isinstance(getattr(module, "transformer", None), nn.Module):
                module = module.transformer
            if id(module) in seen:
                continue
            seen.add(id(module))
            out.append((name, module, role.kind))
        return out

    def _install(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove()
        nets = self.networks(pl_module)
        if not nets:
            rank_zero_warn(f"ComputeCounter: {type(pl_module).__name__} declares no role networks "
                           f"(method.roles); nothing is counted")
            return
        policy_name = "generator" if any(n == "generator" for n, _, _ in nets) else \
            next((n for n, _, k in nets if k == "trainable"), nets[0][0])
        policy = next(m for n, m, _ in nets if n == policy_name)
        total = max(_numel(policy), 1)
        self._policy_parameters = total
        self._frames = self._resolve_frames(trainer, pl_module)
        frame_axis = int(getattr(getattr(pl_module, "generator", None), "frame_dim", 1) or 1)

        def axis_of(m: nn.Module) -> int | None:  # the frame axis of a network whose frames are counted
            if isinstance(m, VideoDiT):
                return 1
            return frame_axis if type(m) is type(policy) else None

        hooked: set[int] = set()
        for role, module, kind in nets:
            own = _numel(module)
            self.weights[role] = 1.0 if kind == "rollout" or module is policy else own / total
            self.per_role.setdefault(role, _Tally())
            depth = [0]  # counted passes of this role in progress: a role's inner modules count only outside them
            self._hook_pass(module, role, 1.0, depth, axis_of(module), hooked)
            for trunk in [m for m in module.modules() if _block_lists(m)]:
                share = 1.0 if trunk is module or not own else _numel(trunk) / own  # of the role network
                if trunk is not module:  # a transformer inside a role module (a trunk discriminator's trunk)
                    self._hook_pass(trunk, role, share, depth, axis_of(trunk), hooked)
                blocks = _block_lists(trunk)
                for block in blocks:
                    self._hook_pass(block, role, share / len(blocks), depth, None, hooked, block=True)

    def _hook_pass(self, module: nn.Module, role: str, share: float, depth: list[int], frame_axis: int | None,
                   hooked: set[int], block: bool = False) -> None:
        """Count each call of ``module`` made during a training batch while no other counted pass of ``role`` runs,
        as ``share`` x rows (x the frame share when ``frame_axis`` is given) in units of the role network's forward:
        ``share`` is 1 for the role network, 1 / L for one of its L blocks, a trunk's parameter fraction of the role
        network for a transformer inside it. A module already hooked (shared with an earlier role) is left alone."""
        if id(module) in hooked:
            return
        hooked.add(id(module))
        stack: list[float | None] = []

        def pre(mod, args, kwargs):
            # a call inside another counted pass of the role, outside a training batch, inside a backward pass
            # (gradient-checkpoint recomputation), or a trunk stage run as an FSDP2 root's forward: not a pass
            if not self._counting or depth[0] or _in_backward() or "forward" in vars(mod):
                stack.append(None)
                return
            x = _main_input(args, kwargs)
            rows = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.ndim >= 1 else 1
            frames = 1.0
            if frame_axis is not None and self._frames and isinstance(x, torch.Tensor) and x.ndim == 5:
                frames = int(x.shape[frame_axis]) / self._frames
            depth[0] += 1
            stack.append(rows * frames * share)

        def post(mod, args, kwargs, output):
            amount = stack.pop() if stack else None
            if amount is None:
                return
            depth[0] -= 1
            tally = self._pending.setdefault(role, _Tally())
            tally.forwards += amount
            if not block:
                tally.calls += 1
            self._watch_backward(output, role, amount)

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))

    def _watch_backward(self, output: Any, role: str, amount: float) -> None:
        """Count a backward of ``amount`` each time a gradient reaches ``output`` (once per autograd pass)."""
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if not tensors:
            return
        passes: set[int | None] = set()

        def on_grad(grad):
            task = _graph_task()
            if task not in passes:
                passes.add(task)
                self._pending.setdefault(role, _Tally()).backwards += amount
            return None

        for t in tensors:
            t.register_hook(on_grad)

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install(trainer, pl_module)
        self._counting = True
        if self._restored:
            self._recover_history(trainer)
        self.stopped_by_budget = False  # this fit's outcome (a resumed run may have a larger budget)
        if self.budget is not None and self.forward_equivalents >= self.budget:
            rank_zero_warn(f"ComputeCounter: this run already used {self.forward_equivalents:.6g} forward-equivalents "
                           f"of its budget {self.budget:.6g}; it trains nothing more")
            self.stopped_by_budget = True
            trainer.should_stop = True

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._pending = {}
        self._active = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._active = False
        self._fold(trainer)
        self.iterations += 1
        self._update_memory(pl_module)
        per_role = self.role_forward_equivalents()
        total = float(sum(per_role.values()))
        pl_module.log("compute/forward_equivalents", total, on_step=True, on_epoch=False, batch_size=1)
        for role, value in per_role.items():
            pl_module.log(f"compute/fe_{role}", value, on_step=True, on_epoch=False, batch_size=1)
        if self.budget is not None and total >= self.budget:
            self.stopped_by_budget = True
            trainer.should_stop = True

    def _fold(self, trainer: Trainer) -> None:
        """Add this batch's counts (summed over the ranks) to the run's totals."""
        pending, self._pending = self._pending, {}
        roles = sorted(set(self.per_role) | set(pending))
        if getattr(trainer, "world_size", 1) > 1:  # every rank holds the same roles: one all-reduce of the counts
            local = torch.tensor([[pending.get(r, _Tally()).calls, pending.get(r, _Tally()).forwards,
                                   pending.get(r, _Tally()).backwards] for r in roles], dtype=torch.float64,
                                 device=trainer.strategy.root_device)
            summed = trainer.strategy.reduce(local, reduce_op="sum").cpu()
            pending = {r: _Tally(int(round(float(c))), float(f), float(b)) for r, (c, f, b) in zip(roles, summed,
                                                                                                   strict=True)}
        for role, tally in pending.items():
            self.per_role.setdefault(role, _Tally()).add(tally)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active:  # between training batches: what the validation runs is not training compute
            self._pending = {}

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active:
            self._pending = {}
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._update_memory(pl_module)
        metrics = {}
        for key, value in trainer.callback_metrics.items():
            if key.startswith("val/"):
                v = float(value)
                metrics[key] = v if math.isfinite(v) else None
        row = {"global_step": int(trainer.global_step), "iterations": self.iterations,
               "forward_equivalents": self.forward_equivalents, "wall_s": self._wall(), "metrics": metrics}
        self.history.append(row)
        self._write(trainer, finished=False)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._update_memory(pl_module)
        self._close_wall()
        self._write(trainer, finished=True)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # the batch stays open: a checkpoint written on this exception after a finished step (InterruptCheckpoint)
        # includes its counts and its iteration
        self._close_wall()
        self._counting = False
        self._remove()
        try:
            self._write(trainer, finished=False)
        except Exception as e:  # noqa: BLE001 - the run's own exception is the one to report
            rank_zero_warn(f"ComputeCounter: could not write {self.path(trainer)} after the interruption: {e}")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._counting = False
        self._remove()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._active = self._counting = False
        self._remove()

    # ------------------------------------------------------------------ wall time, memory
    def _wall(self) -> float:
        return self.wall_s + (time.perf_counter() - self._fit_start if self._fit_start is not None else 0.0)

    def _close_wall(self) -> None:
        self.wall_s = self._wall()
        self._fit_start = None

    def _update_memory(self, pl_module: LightningModule) -> None:
        device = getattr(pl_module, "device", torch.device("cpu"))
        if device.type == "cuda" and torch.cuda.is_available():
            peak, source = int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak, source = int(rss if sys.platform == "darwin" else rss * 1024), "rss"
        if peak >= self.peak_memory_bytes:
            self.peak_memory_bytes, self.peak_memory_source = peak, source

    # ------------------------------------------------------------------ record
    def record(self, trainer: Trainer | None = None, finished: bool = False) -> dict:
        """What compute.json holds: ``unit``, ``budget``, ``forward_equivalents``, ``per_role`` (``{role: {"calls",
        "forwards", "backwards", "weight", "forward_equivalents"}}``, forwards / backwards in sample units before
        size weighting), ``iterations``, ``global_step``, ``stopped_by_budget``, ``wall_s``, ``peak_memory_bytes`` /
        ``peak_memory_source``, ``sample_frames``, ``policy_parameters``, ``history`` and ``finished``."""
        tallies = self._tallies(self._active)
        fe = self.role_forward_equivalents(self._active)
        per_role = {role: {"calls": t.calls, "forwards": t.forwards, "backwards": t.backwards,
                           "weight": self.weights.get(role, 1.0), "forward_equivalents": fe[role]}
                    for role, t in tallies.items()}
        return {"unit": UNIT, "budget": self.budget, "forward_equivalents": float(sum(fe.values())),
                "per_role": per_role, "iterations": self.iterations + (1 if self._active else 0),
                "global_step": int(trainer.global_step) if trainer is not None else None,
                "stopped_by_budget": self.stopped_by_budget, "wall_s": self._wall(),
                "peak_memory_bytes": self.peak_memory_bytes, "peak_memory_source": self.peak_memory_source,
                "sample_frames": self._frames, "policy_parameters": self._policy_parameters,
                "history": [dict(r) for r in self.history], "finished": finished}

    def path(self, trainer: Trainer) -> Path:
        """``<trainer.default_root_dir>/<filename>``."""
        return Path(trainer.default_root_dir) / self.filename

    def _write(self, trainer: Trainer, finished: bool) -> None:
        if not trainer.is_global_zero:
            return
        write_json(self.path(trainer), self.record(trainer, finished))

    def _recover_history(self, trainer: Trainer) -> None:
        """Add the rows of validations that ran right after the restored iteration (in compute.json, not in the
        checkpoint, which was written before them); rows from later iterations belong to an abandoned run."""
        self._restored = False
        path = self.path(trainer)
        try:
            rows = json.loads(path.read_text()).get("history", []) if path.is_file() else []
        except (OSError, ValueError):
            return
        known = {(r.get("global_step"), r.get("iterations")) for r in self.history}
        for row in rows:
            key = (row.get("global_step"), row.get("iterations"))
            if key == (int(trainer.global_step), self.iterations) and key not in known:
                self.history.append(row)
                known.add(key)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The counts, iterations, wall time, peak memory, history and budget flag (a checkpoint written at the end
        of an iteration before this callback's own end-of-batch hook ran includes that iteration)."""
        tallies = self._tallies(self._active)
        return {"per_role": {role: asdict(t) for role, t in tallies.items()}, "weights": dict(self.weights),
                "iterations": self.iterations + (1 if self._active else 0), "wall_s": self._wall(),
                "peak_memory_bytes": self.peak_memory_bytes, "peak_memory_source": self.peak_memory_source,
                "history": [dict(r) for r in self.history], "stopped_by_budget": self.stopped_by_budget}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.per_role = {role: _Tally(**t) for role, t in state_dict.get("per_role", {}).items()}
        self.weights = {role: float(w) for role, w in state_dict.get("weights", {}).items()}
        self.iterations = int(state_dict.get("iterations", 0))
        self.wall_s = float(state_dict.get("wall_s", 0.0))
        self.peak_memory_bytes = int(state_dict.get("peak_memory_bytes", 0))
        self.peak_memory_source = str(state_dict.get("peak_memory_source", "rss"))
        self.history = [dict(r) for r in state_dict.get("history", [])]
        self.stopped_by_budget = bool(state_dict.get("stopped_by_budget", False))
        self._restored = True
