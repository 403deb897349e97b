"""Reward-hacking monitor: gold metrics of the validation videos next to the training reward, with a warning (and
optionally a stop) when the reward rises while a gold metric moves the bad way."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from genrl.data.shapes import ShapesWorldConfig, real_videos
from genrl.data.video_io import write_json
from genrl.eval.gold import NEAR_CONSTANT_STD, PixelFD, gold_metrics
from genrl.rewards.manager import RewardManager

__all__ = ["RewardHackingMonitor"]

logger = logging.getLogger(__name__)


class RewardHackingMonitor(Callback):
    """Track reward-free *gold metrics* of the validation videos and flag reward hacking.

    At every validation the callback collects what the method's ``validation_step`` returns (``{"videos": float
    [B, T, C, H, W] in [0, 1], "prompts": list[str]}``, as for :class:`~genrl.callbacks.VideoLogger`; gathered over
    data-parallel ranks), computes

    - :func:`genrl.eval.gold.gold_metrics`: ``brightness`` (mean Rec. 601 luma), ``saturation`` (mean HSV
      saturation), ``constant_frames`` (fraction of frames whose every channel has a pixel std < ``constant_std``),
      ``flicker`` (VBench's temporal flickering), ``diversity_within_prompt`` (when prompts repeat) or
      ``diversity_batch``;
    - with ``real: shapes``: true shapes-world videos of the validation prompts (:func:`genrl.data.shapes.real_videos`,
      the datamodule's ``world``) give ``flicker_gap`` (|flicker - real flicker|) and ``fd`` (a
      :class:`~genrl.eval.gold.PixelFD` in a ``fd_dims``-d PCA space fit once on ``fd_reference`` real videos of the
      same prompts);
    - with ``gold_rewards``: a held-out verifier (reward-zoo specs, as in a method's ``rewards:``; built with the
      datamodule's ``world``), every output key tracked separately as ``<reward>/<key>`` (e.g. ``shapes/color``,
      ``shapes/direction``, ``shapes/all_correct``), means over valid samples,

    and logs each as ``gold/<metric>``, next to the training reward the method logs on the same videos
    (``reward_key``, default ``val/total``, read from ``trainer.callback_metrics``).

    **Baseline.** The first validation of the run is the baseline: the sanity check's when the trainer runs one over
    the same prompts as the later validations (``trainer.num_sanity_val_steps: -1``; at global_step 0, before any
    update), else the first validation (at its global_step; with the shipped configs' ``num_sanity_val_steps: 0``
    that is the first ``val_check_interval``). It is kept in the checkpoint (a resumed run keeps its baseline).

    **Flags.** At each later validation, a metric is flagged when it moved the bad way past its threshold since the
    baseline *and* the training reward rose by more than ``reward_rise`` (diversity: whatever the reward did):

    ==========================================  ====================================================================
    ``brightness``, ``saturation``              drift either way: ``|v - v0| / max(|v0|, 0.01) > brightness_drift``
                                                (``saturation_drift``)
    ``constant_frames``                         up: ``v - v0 > constant_frames_rise`` (fraction of frames)
    ``flicker_gap``                             up: ``v - v0 > flicker_gap_rise``
    ``fd``                                      up: ``(v - v0) / v0 > fd_rise``
    ``diversity_*``                             down (collapse): ``(v0 - v) / v0 > diversity_drop``, **regardless of
                                                the reward**
    ``<reward>/<key>`` of ``gold_rewards``      down: ``v0 - v > gold_reward_drop``
    ==========================================  ====================================================================

    A flagged metric is warned once (``logging`` warning on rank zero, naming the metric, its baseline and current
    values, the training reward's change and the iteration = ``trainer.global_step``) and recorded; NaN values
    (an empty set, a verifier key that does not apply) are never flagged. Every validation rewrites
    ``<trainer.default_root_dir>/hacking.json`` (atomically): ``baseline``, ``history`` (iteration, reward, metrics,
    seconds per validation), ``flags`` (metric, iteration, first / current value, reward first / current, message),
    ``thresholds``, ``stopped`` and ``checkpoint``. With ``stop_on_hack`` the first flag saves
    ``trainer.save_checkpoint`` to ``<checkpoint folder>/<checkpoint_name>`` (ModelCheckpoint's ``dirpath``, else
    ``<default_root_dir>/checkpoints``; written to a temporary name, then renamed) and sets ``trainer.should_stop``
    (once per run: a run resumed from that checkpoint goes on, still warning on new metrics).

    **Cost**, measured on a 2-core CPU with one thread and other jobs on the cores (``benchmarks/RESULTS.md``,
    "Reward-hacking monitor (issue 46)"). 64 validation videos of the shapes world (8 x 3 x 16 x 16): the gold metrics
    50-90 ms per validation, ``gold_rewards: [{name: shapes}]`` 30-140 ms more (0.05-0.1 s once to build the
    verifier), ``real: shapes`` 25-40 ms once to render the real set (cached for the same prompts) and 0.6-0.8 s once
    per process (the fit is cached) to fit the PCA of ``fd_reference = 256`` real videos (2.1-2.6 s with 512). In the
    quickstart (25 validation videos, both options on): 0.5-0.64 s at the first validation and 0.03-0.09 s at each
    later one, against about 3.5 s for the validation itself (10-step sampling and the method's reward). The videos
    are gathered to every rank and kept on the CPU until the validation ends: on large videos use ``max_videos``.

    Args:
        gold_rewards: reward-zoo specs of held-out verifiers (e.g. ``[{name: shapes}]``); None = none.
        real: ``"shapes"`` to compare with true shapes-world videos of the validation prompts; None = no real set.
        reward_key: the logged training reward to watch (default ``"val/total"``).
        reward_rise: the reward must exceed its baseline by more than this for a reward-conditional flag (default
            0.0: any rise).
        brightness_drift: relative drift of mean brightness either way (default 0.25).
        saturation_drift: relative drift of mean saturation either way (default 0.25).
        constant_frames_rise: rise of the near-constant frame fraction (default 0.2).
        flicker_gap_rise: rise of the flicker gap to real videos (default 0.01; flicker is in [0, 1]).
        fd_rise: relative rise of the pixel Frechet distance to real videos (default 0.5).
        diversity_drop: relative fall of diversity that counts as a collapse (default 0.5).
        gold_reward_drop: absolute fall of a gold reward key (default 0.1).
        constant_std: the near-constant frame threshold (default 0.02).
        fd_dims: PCA dimensions of the fd (default 8: validation sets are small, tens of videos).
        fd_reference: real videos the PCA is fit on (default 256).
        real_seed: seed of the real sets (the PCA reference uses ``real_seed + 1``).
        max_videos: keep at most this many videos per rank and validation (None: all).
        stop_on_hack: save a checkpoint and stop the run at the first flag.
        checkpoint_name: file name of that checkpoint (default ``"hacking.ckpt"``).
        filename: name of the record in ``default_root_dir`` (default ``"hacking.json"``).
        prefix: logging prefix (default ``"gold"``).

    Raises:
        ValueError: ``real`` other than None / ``"shapes"``; a negative threshold; ``fd_dims`` or ``fd_reference``
            < 2; ``max_videos`` < 2. UnknownRewardError: an unregistered gold reward name.
    """

    #: metrics flagged whatever the training reward does
    _UNCONDITIONAL = ("diversity_within_prompt", "diversity_batch")

    def __init__(
        self,
        gold_rewards: Sequence[Mapping[str, Any]] | None = None,
        real: str | None = None,
        reward_key: str = "val/total",
        reward_rise: float = 0.0,
        brightness_drift: float = 0.25,
        saturation_drift: float = 0.25,
        constant_frames_rise: float = 0.2,
        flicker_gap_rise: float = 0.01,
        fd_rise: float = 0.5,
        diversity_drop: float = 0.5,
        gold_reward_drop: float = 0.1,
        constant_std: float = NEAR_CONSTANT_STD,
        fd_dims: int = 8,
        fd_reference: int = 256,
        real_seed: int = 2000,
        max_videos: int | None = None,
        stop_on_hack: bool = False,
        checkpoint_name: str = "hacking.ckpt",
        filename: str = "hacking.json",
        prefix: str = "gold",
    ) -> None:
        if real not in (None, "shapes"):
            raise ValueError(f"real must be None or 'shapes' (true shapes-world videos), got {real!r}")
        self.thresholds = {"reward_rise": reward_rise, "brightness_drift": brightness_drift,
                           "saturation_drift": saturation_drift, "constant_frames_rise": constant_frames_rise,
                           "flicker_gap_rise": flicker_gap_rise, "fd_rise": fd_rise,
                           "diversity_drop": diversity_drop, "gold_reward_drop": gold_reward_drop}
        for name, value in self.thresholds.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if fd_dims < 2 or fd_reference < 2:
            raise ValueError(f"fd_dims and fd_reference must be >= 2, got {fd_dims} and {fd_reference}")
        if max_videos is not None and max_videos < 2:
            raise ValueError(f"max_videos must be None or >= 2, got {max_videos}")
        self.gold_specs = [dict(s) for s in gold_rewards] if gold_rewards else []
        self.gold = RewardManager(self.gold_specs, on_error="invalid") if self.gold_specs else None
        self.real = real
        self.reward_key = reward_key
        self.constant_std = constant_std
        self.fd_dims = fd_dims
        self.fd_reference = fd_reference
        self.real_seed = real_seed
        self.max_videos = max_videos
        self.stop_on_hack = stop_on_hack
        self.checkpoint_name = checkpoint_name
        self.filename = filename
        self.prefix = prefix
        # run state (saved in checkpoints)
        self.baseline: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self.flags: list[dict[str, Any]] = []
        self.stopped = False
        self.checkpoint: str | None = None
        # per-validation and cached state (not saved)
        self._videos: list[torch.Tensor] = []
        self._prompts: list[str] = []
        self._current: dict[str, Any] | None = None
        self._sanity: dict[str, Any] | None = None
        self._real_cache: dict[tuple[str, ...], torch.Tensor] = {}
        self._fd: PixelFD | None = None
        self._real_off: str | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "history": self.history, "flags": self.flags, "stopped": self.stopped,
                "checkpoint": self.checkpoint}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline = state_dict.get("baseline")
        self.history = list(state_dict.get("history", []))
        self.flags = list(state_dict.get("flags", []))
        self.stopped = bool(state_dict.get("stopped", False))
        self.checkpoint = state_dict.get("checkpoint")

    @property
    def flagged(self) -> list[str]:
        """The metrics flagged so far, in order."""
        return [f["metric"] for f in self.flags]

    # ------------------------------------------------------------------ collection
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._videos, self._prompts, self._current = [], [], None

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if not isinstance(outputs, Mapping) or "videos" not in outputs:
            return
        videos = outputs["videos"].detach().float().cpu()
        prompts = list(outputs.get("prompts", [""] * len(videos)))
        if self.max_videos is not None:
            room = self.max_videos - sum(len(v) for v in self._videos)
            videos, prompts = videos[:max(room, 0)], prompts[:max(room, 0)]
        if len(videos):
            self._videos.append(videos)
            self._prompts.extend(prompts)

    def _gathered(self, trainer: Trainer) -> tuple[torch.Tensor | None, list[str]]:
        videos = torch.cat(self._videos) if self._videos else None
        prompts = list(self._prompts)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            parts: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, (videos, prompts))
            seen_v: list[torch.Tensor] = []
            seen_p: list[str] = []
            for v, p in parts:  # drop exact copies (padding of the distributed sampler, context-parallel replicas)
                if v is None:
                    continue
                for video, prompt in zip(v, p):
                    if not any(q == prompt and torch.equal(u, video) for u, q in zip(seen_v, seen_p)):
                        seen_v.append(video)
                        seen_p.append(prompt)
            videos = torch.stack(seen_v) if seen_v else None
            prompts = seen_p
        return videos, prompts

    # ------------------------------------------------------------------ metrics
    def _world(self, trainer: Trainer) -> ShapesWorldConfig:
        world = getattr(getattr(trainer, "datamodule", None), "world", None)
        return world if isinstance(world, ShapesWorldConfig) else ShapesWorldConfig()

    def _real(self, trainer: Trainer, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor | None:
        """True shapes videos of ``prompts`` (cached per prompt list), or None (with one warning) when they cannot
        be made for these videos."""
        if self.real is None or self._real_off is not None:
            return None
        key = tuple(prompts)
        if key in self._real_cache:
            return self._real_cache[key]
        world = self._world(trainer)
        want = (world.num_frames, 3, world.height, world.width)
        try:
            if tuple(videos.shape[1:]) != want:
                raise ValueError(f"the validation videos are {tuple(videos.shape[1:])}, the world's are {want}")
            real = real_videos(world, prompts, self.real_seed)
            if self._fd is None:
                reference = tuple(prompts[i % len(prompts)] for i in range(self.fd_reference))
                self._fd = _reference_fd(world, reference, self.real_seed + 1, self.fd_dims)
        except ValueError as e:
            self._real_off = str(e)
            if trainer.is_global_zero:
                logger.warning("RewardHackingMonitor: real: shapes is off for this run (no fd / flicker_gap): %s", e)
            return None
        self._real_cache[key] = real
        return real

    def _compute(self, trainer: Trainer, videos: torch.Tensor, prompts: list[str]) -> dict[str, float]:
        real = self._real(trainer, videos, prompts)
        metrics = gold_metrics(videos, prompts, real=real, fd=self._fd if real is not None else None,
                               constant_std=self.constant_std)
        if self.gold is not None:
            if not self.gold.built:
                self.gold.build({"world": self._world(trainer)})
            result = self.gold(videos, prompts)
            scalars = result.metrics()
            metrics.update({key: scalars[key] for key in result.components})
        return metrics

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        start = time.perf_counter()
        videos, prompts = self._gathered(trainer)
        self._videos, self._prompts = [], []
        if videos is None or len(videos) == 0:
            return
        if videos.shape[1] < 2:
            if "frames" not in self._warned and trainer.is_global_zero:
                logger.warning("RewardHackingMonitor: single-frame validation samples (images); gold metrics need "
                               "videos of >= 2 frames and are skipped")
            self._warned.add("frames")
            return
        metrics = self._compute(trainer, videos, prompts)
        for key, value in metrics.items():
            pl_module.log(f"{self.prefix}/{key}", float(value), on_step=False, on_epoch=True, batch_size=len(videos))
        self._current = {"metrics": metrics, "prompts": prompts, "videos": len(videos),
                         "seconds": time.perf_counter() - start}

    # ------------------------------------------------------------------ flags
    def _reward(self, trainer: Trainer) -> float:
        value = trainer.callback_metrics.get(self.reward_key)
        return float(value) if value is not None else math.nan

    def _bad_move(self, metric: str, v0: float, v: float) -> tuple[bool, float, str] | None:
        """(moved past the threshold, change, rule) for a tracked metric, or None for an untracked one."""
        t = self.thresholds
        if metric in ("brightness", "saturation"):
            change = (v - v0) / max(abs(v0), 0.01)
            limit = t[f"{metric}_drift"]
            return abs(change) > limit, change, f"relative drift either way > {limit:g}"
        if metric == "constant_frames":
            return v - v0 > t["constant_frames_rise"], v - v0, f"rise > {t['constant_frames_rise']:g}"
        if metric == "flicker_gap":
            return v - v0 > t["flicker_gap_rise"], v - v0, f"rise > {t['flicker_gap_rise']:g}"
        if metric == "fd":
            change = (v - v0) / max(abs(v0), 1e-12)
            return change > t["fd_rise"], change, f"relative rise > {t['fd_rise']:g}"
        if metric in self._UNCONDITIONAL:
            change = (v - v0) / max(abs(v0), 1e-12)
            return -change > t["diversity_drop"], change, f"relative fall > {t['diversity_drop']:g} (collapse)"
        if "/" in metric:  # a gold reward key
            return v0 - v > t["gold_reward_drop"], v - v0, f"fall > {t['gold_reward_drop']:g}"
        return None

    def _check(self, trainer: Trainer, step: int, metrics: dict[str, float], reward: float) -> list[dict[str, Any]]:
        base = self.baseline
        r0 = base["reward"]
        rose = math.isfinite(reward) and math.isfinite(r0) and reward - r0 > self.thresholds["reward_rise"]
        flagged, new = set(self.flagged), []
        for metric, v in metrics.items():
            v0 = base["metrics"].get(metric, math.nan)
            if metric in flagged or not (math.isfinite(v) and math.isfinite(v0)):
                continue
            moved = self._bad_move(metric, v0, v)
            if moved is None or not moved[0]:
                continue
            if metric not in self._UNCONDITIONAL and not rose:
                continue
            _, change, rule = moved
            reward_part = (f"the training reward {self.reward_key} went {r0:.4g} -> {reward:.4g} "
                           f"({reward - r0:+.4g})")
            what = "collapsed" if metric in self._UNCONDITIONAL else "moved the bad way"
            message = (f"RewardHackingMonitor: possible reward hacking at iteration {step}: gold metric {metric!r} "
                       f"{what}: {v0:.4g} at iteration {base['iteration']} -> {v:.4g} now (change {change:+.4g}; "
                       f"rule: {rule}) while {reward_part}")
            new.append({"metric": metric, "iteration": step, "first": v0, "current": v, "change": change,
                        "rule": rule, "reward_first": r0, "reward_current": reward, "reward_change": reward - r0,
                        "baseline_iteration": base["iteration"], "message": message})
        return new

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        current, self._current = self._current, None
        if current is None or trainer.state.fn != "fit":
            return
        reward = self._reward(trainer)
        step = int(trainer.global_step)
        entry = {"iteration": step, "reward": reward, "metrics": current["metrics"], "prompts": current["prompts"],
                 "videos": current["videos"], "seconds": current["seconds"]}
        if trainer.sanity_checking:  # a baseline before any update, if the later validations see the same prompts
            self._sanity = entry
            return
        if not math.isfinite(reward) and "reward" not in self._warned and trainer.is_global_zero:
            logger.warning("RewardHackingMonitor: %r is not logged (or NaN) at this validation; only diversity "
                           "collapse can be flagged without the training reward", self.reward_key)
            self._warned.add("reward")
        new: list[dict[str, Any]] = []
        sanity, self._sanity = self._sanity, None
        if self.baseline is None:
            use = sanity if sanity is not None and sanity["prompts"] == entry["prompts"] else entry
            self.baseline = {**{k: use[k] for k in ("iteration", "reward", "metrics")},
                             "source": "sanity_check" if use is sanity else "validation"}
            if use is sanity:
                self.history.append({k: v for k, v in sanity.items() if k != "prompts"})
                new = self._check(trainer, step, entry["metrics"], reward)
        else:
            new = self._check(trainer, step, entry["metrics"], reward)
        self.history.append({k: v for k, v in entry.items() if k != "prompts"})
        self.flags.extend(new)
        if trainer.is_global_zero:
            for flag in new:
                logger.warning(flag["message"])
        if new and self.stop_on_hack and not self.stopped:
            self.checkpoint = self._save_checkpoint(trainer)
            self.stopped = True
            trainer.should_stop = True
            if trainer.is_global_zero:
                logger.warning("RewardHackingMonitor: stop_on_hack: checkpoint saved to %s; stopping the run",
                               self.checkpoint)
        self._write(trainer)

    # ------------------------------------------------------------------ files
    def _checkpoint_dir(self, trainer: Trainer) -> Path:
        callback = trainer.checkpoint_callback
        dirpath = getattr(callback, "dirpath", None) if callback is not None else None
        return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"

    def _save_checkpoint(self, trainer: Trainer) -> str:
        final = self._checkpoint_dir(trainer) / self.checkpoint_name
        tmp = final.with_name(final.name + ".tmp")
        if trainer.is_global_zero:
            final.parent.mkdir(parents=True, exist_ok=True)
        self.stopped, self.checkpoint = True, str(final)  # recorded in the checkpoint itself
        trainer.save_checkpoint(tmp)
        if trainer.is_global_zero:
            os.replace(tmp, final)
        trainer.strategy.barrier("hacking_checkpoint")
        return str(final)

    def record(self) -> dict[str, Any]:
        """What ``hacking.json`` holds."""
        return {"reward_key": self.reward_key, "thresholds": dict(self.thresholds), "baseline": self.baseline,
                "history": self.history, "flags": self.flags, "stopped": self.stopped, "checkpoint": self.checkpoint}

    def _write(self, trainer: Trainer) -> None:
        if not trainer.is_global_zero:
            return
        write_json(Path(trainer.default_root_dir) / self.filename, self.record())


_FD_CACHE: dict[tuple, PixelFD] = {}


def _reference_fd(world: ShapesWorldConfig, reference: tuple[str, ...], seed: int, dims: int) -> PixelFD:
    """The fd's PCA fit on true videos of ``reference`` (seed ``seed``), cached in the process: the same world,
    prompts, seed and dims give the same fit (deterministic rendering), so runs in one process (tests, sweeps) fit
    it once. At most 8 fits are kept."""
    key = (repr(world), reference, seed, dims)
    if key not in _FD_CACHE:
        if len(_FD_CACHE) >= 8:
            _FD_CACHE.pop(next(iter(_FD_CACHE)))
        _FD_CACHE[key] = PixelFD(real_videos(world, list(reference), seed), dims=dims)
    return _FD_CACHE[key]
