"""Reward manager: the rewards of a method, scored in chunks and combined
(docs/rewards.md, The RewardManager).

A :class:`RewardManager` is a plain Python object, **not** a ``torch.nn.Module``. A method keeps it as an
ordinary attribute, so the reward models are not children of the LightningModule: they are not wrapped
by DDP / FSDP, not saved in its ``state_dict`` (checkpoints), not seen by ``parameters()`` (optimizer) and
not switched to train mode by Lightning. The models are frozen (``requires_grad_(False)``) and in eval
mode; the method moves them with :meth:`RewardManager.to` in ``setup()``::

    class MyGRPO(LightningModule):
        def __init__(self, rewards: list[dict], combine: str = "weighted_sum"):
            super().__init__()
            self.rewards = RewardManager(rewards, combine=combine)      # specs only: nothing built yet

        def setup(self, stage):
            world = getattr(self.trainer.datamodule, "world", None)
            self.rewards.build(context={"world": world} if world is not None else None).to(self.device)

        def training_step(self, batch, batch_idx):
            result = self.rewards(videos, prompts)                      # RewardResult, CPU float32
            adv = self.rewards.per_reward_advantages(result, group_ids)  # or group advantages of result.total
            self.log_dict({f"train/{k}": v for k, v in result.metrics().items()})

        # combine="zscore_sum" keeps running statistics: save them or a resumed run diverges
        def on_save_checkpoint(self, checkpoint):
            checkpoint["reward_manager"] = self.rewards.state_dict()

        def on_load_checkpoint(self, checkpoint):
            if "reward_manager" in checkpoint:
                self.rewards.load_state_dict(checkpoint["reward_manager"])

Combination modes (``combine``), all applied to each reward's main ``"reward"`` key after its spec's
``scale`` / ``shift``:

* ``"weighted_sum"``: ``total = sum_i w_i r_i`` (Flow-GRPO).
* ``"zscore_sum"``: ``total = sum_i w_i (r_i - m_i) / (s_i + eps)`` with ``m_i`` / ``s_i`` the running mean
  and population std of reward i over every valid sample it has scored so far, this batch included
  (Welford / Chan batch update in float64; flow_grpo#188). The statistics live in
  :meth:`RewardManager.state_dict`.
* ``"advantage_sum"``: ``total`` is the weighted sum as above; the intended training signal is
  :func:`per_reward_advantages`: group advantages of each reward separately, then their weighted sum
  (DanceGRPO multi-reward, GDPO), so that a reward with a large spread does not drown the others.

Per reward, ``standardize: true`` in its spec applies the ``zscore_sum`` standardisation to that reward only,
under any mode: ``w_i (r_i - m_i) / (s_i + eps)`` enters ``total`` while the other rewards enter as
``w_i r_i`` (e.g. a reward on an unknown, drifting scale next to calibrated ones). The running statistics are
the same per-reward ones, kept in :meth:`RewardManager.state_dict`. It changes ``total`` only:
``RewardResult.rewards`` / ``components`` stay the raw (scaled / shifted) values, and
:func:`per_reward_advantages` (``advantage_sum``) group-normalises every reward anyway.

Distributed runs: the manager scores what it is given. Each rank scores its own shard; group statistics
(advantages) need the all-gathered rewards, and ``zscore_sum`` statistics diverge between ranks unless every
rank calls the manager on the same (gathered) batch or only feeds gathered rewards. Gathering is the
method's job.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch
from torch import Tensor

from genrl.flow.policy import group_advantages, group_stats
from genrl.rewards.base import RewardModel
from genrl.rewards.registry import RewardSpec, get_reward_class

__all__ = [
    "slice_meta",
    "RewardManager",
    "RewardResult",
    "as_reward_spec",
    "build_reward_with_context",
    "per_reward_advantages",
]

logger = logging.getLogger(__name__)

Combine = Literal["weighted_sum", "zscore_sum", "advantage_sum"]
OnError = Literal["raise", "invalid"]
_COMBINES = ("weighted_sum", "zscore_sum", "advantage_sum")
_ON_ERROR = ("raise", "invalid")
_SPEC_FIELDS = tuple(f.name for f in fields(RewardSpec))
#: Constructor arguments a build context never supplies (the spec always sets them).
_RESERVED = ("path", "scale", "shift")
#: eps of the z-score denominator ``std + eps``.
ZSCORE_EPS = 1e-6


# ---------------------------------------------------------------------------------------------- specs
def as_reward_spec(spec: RewardSpec | Mapping[str, Any]) -> RewardSpec:
    """Normalise a config entry to a :class:`~genrl.rewards.RewardSpec`.

    A mapping may use the RewardSpec fields (``name``, ``path``, ``weight``, ``scale``, ``shift``,
    ``kwargs``, ``standardize``) and may also give constructor arguments flat, e.g. ``{"name": "shapes",
    "world": {...}}`` (the form ``PretrainMethod.val_rewards`` uses); flat keys are merged into ``kwargs``.

    Raises:
        TypeError: not a RewardSpec or mapping, or ``kwargs`` not a mapping.
        ValueError: no ``name``; a constructor argument given both flat and in ``kwargs``; a non-finite
            ``weight``, ``scale`` or ``shift``; a non-bool ``standardize``.
    """
    if isinstance(spec, RewardSpec):
        out = replace(spec, kwargs=dict(spec.kwargs))
    elif isinstance(spec, Mapping):
        d = dict(spec)
        if "name" not in d:
            raise ValueError(f"a reward spec needs a 'name', got keys {sorted(d)}")
        kwargs = d.pop("kwargs", None) or {}
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"reward spec {d['name']!r}: 'kwargs' must be a mapping, got {type(kwargs).__name__}")
        kwargs = dict(kwargs)
        flat = {k: d.pop(k) for k in list(d) if k not in _SPEC_FIELDS}
        both = sorted(set(flat) & set(kwargs))
        if both:
            raise ValueError(f"reward spec {d['name']!r}: {both} given both flat and in 'kwargs'")
        kwargs.update(flat)
        out = RewardSpec(**d, kwargs=kwargs)
    else:
        raise TypeError(f"a reward spec must be a RewardSpec or a dict, got {type(spec).__name__}")
    if not isinstance(out.name, str) or not out.name:
        raise ValueError(f"a reward spec name must be a non-empty string, got {out.name!r}")
    for attr in ("weight", "scale", "shift"):
        value = getattr(out, attr)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward spec {out.name!r}: {attr} must be a finite number, got {value!r}")
        setattr(out, attr, float(value))
    if not isinstance(out.standardize, bool):
        raise ValueError(f"reward spec {out.name!r}: standardize must be true or false, got {out.standardize!r}")
    return out


def _accepted_keywords(cls: type) -> set[str]:
    params = inspect.signature(cls.__init__).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in kinds and p.name != "self"}


def build_reward_with_context(
    spec: RewardSpec | Mapping[str, Any], context: Mapping[str, Any] | None = None
) -> RewardModel:
    """Build one reward from its spec plus shared context, frozen and in eval mode.

    Each ``context`` entry ``key: value`` is passed as ``key=value`` to the reward's constructor when the
    constructor declares a parameter named ``key`` (``**kwargs`` catch-alls do not count) and the spec does not
    set it; ``path`` / ``scale`` / ``shift`` always come from the spec. Example: ``context={"world":
    datamodule.world}`` configures :class:`~genrl.rewards.ShapesVerifier` (``world=``) with the training world
    and is ignored by rewards without a ``world`` argument. This replaces ``PretrainMethod.setup``'s inline
    ``if name == "shapes": spec.setdefault("world", world)``.

    Args:
        spec: a RewardSpec or a dict (see :func:`as_reward_spec`).
        context: shared constructor values (e.g. ``{"world": ShapesWorldConfig(...)}``); None = none.

    Returns:
        The built :class:`~genrl.rewards.RewardModel` with ``requires_grad_(False)`` and ``eval()`` applied.

    Raises:
        UnknownRewardError (KeyError, ValueError): unknown name; the message lists the registered rewards.
        TypeError, ValueError: from the spec or the reward's constructor (see :func:`~genrl.rewards.build_reward`).
    """
    spec = as_reward_spec(spec)
    cls = get_reward_class(spec.name)
    kwargs = dict(spec.kwargs)
    if context:
        accepted = _accepted_keywords(cls)
        for key, value in context.items():
            if key in accepted and key not in kwargs and key not in _RESERVED:
                kwargs[key] = value
    model = replace(spec, kwargs=kwargs).build()
    model.requires_grad_(False)
    return model.eval()


# ---------------------------------------------------------------------------------------------- results
@dataclass
class RewardResult:
    """Scores of one batch of B samples (every tensor is on the CPU, length B).

    Attributes:
        components: every float output key of every reward, float32, keyed ``"<reward>/<key>"`` (e.g.
            ``"shapes/reward"``, ``"shapes/color"``). ``"<reward>/reward"`` is after the spec's scale / shift.
            Keys other than ``reward`` may be NaN by design (an attribute that does not apply).
        rewards: ``{reward: float32 [B]}``: the main key after scale / shift; NaN where that reward is invalid.
        reward_valid: ``{reward: bool [B]}``: each reward's own validity mask.
        valid: bool [B]: AND of all rewards' masks.
        total: float32 [B]: the combination (see :class:`RewardManager`); NaN exactly where ``valid`` is False.
        weights: ``{reward: weight}``.
        combine: the combination mode used.
        errors: ``{reward: number of chunk calls that raised}`` in this batch (``on_error="invalid"``).
        nan_rewards: ``{reward: samples whose main score was NaN / inf although the reward marked them valid}``.
        stats: extra scalars for logging (running mean / std / count per standardised reward: every reward under
            ``zscore_sum``, those with ``standardize`` otherwise; a groupwise reward's ``last_stats``, e.g.
            ``"pairwise/judge_failures"``).
    """

    components: dict[str, Tensor]
    rewards: dict[str, Tensor]
    reward_valid: dict[str, Tensor]
    valid: Tensor
    total: Tensor
    weights: dict[str, float]
    combine: str = "weighted_sum"
    errors: dict[str, int] = field(default_factory=dict)
    nan_rewards: dict[str, int] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.valid.shape[0])

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> RewardResult:
        """A new result with ``fn`` applied to every [B] tensor (components, rewards, masks, total), e.g. an
        all-gather across ranks before :func:`per_reward_advantages`: ``result.map_tensors(lambda t:
        module.all_gather(t).reshape(-1).cpu())``. ``fn`` must keep dtypes and return 1-d tensors of one
        common length. Counts and stats are copied unchanged (they stay this rank's)."""
        return RewardResult(
            components={k: fn(v) for k, v in self.components.items()},
            rewards={k: fn(v) for k, v in self.rewards.items()},
            reward_valid={k: fn(v) for k, v in self.reward_valid.items()},
            valid=fn(self.valid),
            total=fn(self.total),
            weights=dict(self.weights),
            combine=self.combine,
            errors=dict(self.errors),
            nan_rewards=dict(self.nan_rewards),
            stats=dict(self.stats),
        )

    def metrics(self) -> dict[str, float]:
        """Scalars for ``log_dict`` (add your own prefix, e.g. ``"train/"``).

        Keys:
            ``total``: mean of ``total`` over valid samples.
            ``invalid_fraction``: fraction of samples with ``valid`` False.
            ``<reward>/<key>``: mean of each component over valid samples whose value is not NaN;
                ``<reward>/reward`` is the per-reward mean (after scale / shift).
            ``<reward>/invalid_fraction``: fraction the reward itself marked invalid.
            ``<reward>/errors``: chunk calls of the reward that raised; ``<reward>/nan_rewards``: samples with
                a NaN main score the reward had called valid.
            plus :attr:`stats`.
        Means over no samples are NaN.
        """
        v = self.valid
        out: dict[str, float] = {
            "total": _masked_mean(self.total, v),
            "invalid_fraction": float((~v).float().mean()) if len(v) else float("nan"),
        }
        for key, value in self.components.items():
            out[key] = _masked_mean(value, v)
        for name, mask in self.reward_valid.items():
            out[f"{name}/invalid_fraction"] = float((~mask).float().mean()) if len(mask) else float("nan")
            out[f"{name}/errors"] = float(self.errors.get(name, 0))
            out[f"{name}/nan_rewards"] = float(self.nan_rewards.get(name, 0))
        out.update(self.stats)
        return out


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    keep = mask & ~torch.isnan(x)
    return float(x[keep].double().mean()) if bool(keep.any()) else float("nan")


# ---------------------------------------------------------------------------------------------- advantages
def _group_index(group_ids: Tensor | Sequence[Any], n: int) -> Tensor:
    """Group ids (int tensor or any sequence of hashables, e.g. prompts) -> int64 [n] indices 0..G-1."""
    if isinstance(group_ids, Tensor):
        ids = group_ids.detach().cpu().reshape(-1)
        if ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"group_ids must be an integer tensor or a sequence of hashables, got {ids.dtype}")
        if ids.numel() != n:
            raise ValueError(f"got {ids.numel()} group ids for {n} samples")
        return torch.unique(ids, return_inverse=True)[1]
    ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"got {len(ids)} group ids for {n} samples")
    index: dict[Any, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in ids], dtype=torch.int64)


def per_reward_advantages(
    result: RewardResult,
    group_ids: Tensor | Sequence[Any],
    std: Literal["group", "global", "none"] = "group",
    eps: float = 1e-4,
    ddof: int = 0,
    return_details: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor], dict[str, float]]:
    """Multi-reward advantages: group advantages of each reward separately, then their weighted sum
    (DanceGRPO's multi-reward advantage; GDPO): ``A = sum_i w_i (r_i - mean_g(r_i)) / (std_g(r_i) + eps)``.

    Statistics of every reward are taken over the samples valid for the whole result (``result.valid``), so
    all rewards standardise the same set. Invalid samples get advantage exactly 0 (mask them out of the loss
    with ``result.valid`` as well), and so does every group whose reward std is below 1e-6 for that reward.
    Uses :func:`genrl.flow.group_advantages` per reward.
    Group statistics need the whole group: in multi-rank runs gather the result across ranks first.

    Args:
        result: a :class:`RewardResult` of B samples.
        group_ids: int tensor [B] or a length-B sequence of hashables (e.g. prompts) naming each sample's group.
        std: ``"group"`` (per-group std), ``"global"`` (std over all valid samples), ``"none"`` (no division).
        eps: added to the std in the denominator.
        ddof: delta degrees of freedom of the std (0 = population).
        return_details: also return the per-reward advantages and logging scalars.

    Returns:
        float32 [B] advantages; with ``return_details``, ``(advantages, {reward: float32 [B]}, metrics)``
        where metrics holds ``"<reward>/zero_std_groups"``: the fraction of groups (with a valid sample) whose
        std of that reward is below 1e-6, i.e. that give it no signal.

    Raises:
        ValueError: ``len(group_ids) != B``, or an unknown ``std``.
        TypeError: float group ids.
    """
    n = len(result)
    inverse = _group_index(group_ids, n)
    total = torch.zeros(n, dtype=torch.float32)
    per: dict[str, Tensor] = {}
    details: dict[str, float] = {}
    for name, r in result.rewards.items():
        adv = group_advantages(r, inverse, std=std, eps=eps, ddof=ddof, valid=result.valid).detach().cpu().float()
        adv = torch.where(result.valid, adv, torch.zeros_like(adv))
        per[name] = adv
        total = total + result.weights[name] * adv
        if return_details and n:
            ok = result.valid & torch.isfinite(r)
            details[f"{name}/zero_std_groups"] = float(group_stats(r, inverse, valid=ok)["zero_std_fraction"])
    if return_details:
        return total, per, details
    return total


# ---------------------------------------------------------------------------------------------- manager
class _Welford:
    """Running count / mean / sum of squared deviations (float64), updated a batch at a time (Chan et al.)."""

    __slots__ = ("count", "mean", "m2")

    def __init__(self, count: float = 0.0, mean: float = 0.0, m2: float = 0.0) -> None:
        self.count, self.mean, self.m2 = float(count), float(mean), float(m2)

    def update(self, x: Tensor) -> None:
        x = x.detach().double().reshape(-1)
        nb = x.numel()
        if nb == 0:
            return
        mb = float(x.mean())
        m2b = float(((x - mb) ** 2).sum())
        n = self.count + nb
        delta = mb - self.mean
        self.mean += delta * nb / n
        self.m2 += m2b + delta * delta * self.count * nb / n
        self.count = n

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 0.0

    def state(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}


def slice_meta(meta: Mapping[str, Any], n: int, lo: int, hi: int) -> dict[str, Any]:
    """Rows ``lo:hi`` of the per-sample entries of a reward's ``meta`` (a length-``n`` list / tuple, or a tensor
    whose first dim is ``n``); other values (scalars, shared settings) are passed unchanged."""
    out = {}
    for key, value in meta.items():
        if isinstance(value, Tensor) and value.ndim > 0 and value.shape[0] == n:
            out[key] = value[lo:hi]
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = value[lo:hi]
        else:
            out[key] = value
    return out


class RewardManager:
    """The reward models of a method, scored in chunks and combined into one training signal.

    Not an ``nn.Module`` (see the module docstring): assigning it to a LightningModule attribute keeps the
    models out of ``state_dict()``, ``parameters()``, DDP / FSDP wrapping and ``.train()``.

    Construction only normalises and checks the specs; the models are built by :meth:`build` (call it in
    the method's ``setup()``, with a context if a reward needs one) or, failing that, on the first call
    without context. Models are frozen (``requires_grad_(False)``) and in eval mode.

    Args:
        specs: reward entries: :class:`~genrl.rewards.RewardSpec` or dicts (see :func:`as_reward_spec`).
            Each reward is named by its registry name; a repeated name gets a suffix ``_2``, ``_3``, ...
        combine: ``"weighted_sum"``, ``"zscore_sum"`` or ``"advantage_sum"`` (see the module docstring).
        batch_size: at most this many samples per reward call (a large rollout batch is scored in chunks and
            concatenated, so a reward does not run out of memory). >= 1.
        on_error: a reward call that raises: ``"raise"`` re-raises as RuntimeError naming the reward and
            the chunk size; ``"invalid"`` logs a warning with the exception text and marks that chunk invalid
            (NaN) for that reward, counted in ``RewardResult.errors`` / metrics ``"<reward>/errors"``.
        device: where the models run (None = where they were built, the CPU). :meth:`to` changes it.

    Call: ``manager(pixels float [B, T, C, H, W] in [0, 1], prompts: list[str], **meta) -> RewardResult``.

    Raises:
        ValueError: empty ``specs``, ``batch_size`` < 1, an unknown ``combine`` / ``on_error``, a non-finite
            weight / scale / shift.
        UnknownRewardError (KeyError, ValueError): an unregistered reward name (lists the registered ones).
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec | Mapping[str, Any]],
        combine: Combine = "weighted_sum",
        batch_size: int = 64,
        on_error: OnError = "raise",
        device: str | torch.device | None = None,
    ) -> None:
        if isinstance(specs, (RewardSpec, Mapping)):
            specs = [specs]
        specs = list(specs or [])
        if not specs:
            raise ValueError("RewardManager needs at least one reward spec, got none")
        if combine not in _COMBINES:
            raise ValueError(f"combine must be one of {_COMBINES}, got {combine!r}")
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.specs: list[RewardSpec] = [as_reward_spec(s) for s in specs]
        for spec in self.specs:
            get_reward_class(spec.name)  # unknown name -> UnknownRewardError listing the registered ones
        self.names: list[str] = []
        for spec in self.specs:
            label, k = spec.name, 1
            while label in self.names:
                k += 1
                label = f"{spec.name}_{k}"
            self.names.append(label)
        self.combine: str = combine
        self.batch_size = batch_size
        self.on_error: str = on_error
        self.device: torch.device | None = torch.device(device) if device is not None else None
        self.models: dict[str, RewardModel] = {}
        self._stats: dict[str, _Welford] = {n: _Welford() for n in self.names}
        #: cumulative failures over the manager's life: ``{reward: {"errors": chunks, "nan_rewards": samples}}``
        self.failure_counts: dict[str, dict[str, int]] = {n: {"errors": 0, "nan_rewards": 0} for n in self.names}

    # ------------------------------------------------------------------ construction / placement
    @property
    def weights(self) -> dict[str, float]:
        """``{reward: weight}`` in spec order."""
        return {n: s.weight for n, s in zip(self.names, self.specs)}

    @property
    def groupwise(self) -> bool:
        """True when a reward is groupwise (its class sets ``groupwise = True``, e.g. ``"pairwise"``): it scores a
        sample against the rest of its group, so the caller must pass ``group=`` and whole groups."""
        return any(getattr(get_reward_class(s.name), "groupwise", False) for s in self.specs)

    @property
    def built(self) -> bool:
        """True once :meth:`build` has run."""
        return bool(self.models)

    def build(self, context: Mapping[str, Any] | None = None, rebuild: bool = False) -> RewardManager:
        """Instantiate the rewards (see :func:`build_reward_with_context` for how ``context`` is used).

        Args:
            context: shared constructor values, e.g. ``{"world": datamodule.world}``.
            rebuild: build again even if already built (otherwise a second call is a no-op).

        Returns:
            self (models frozen, eval mode, on :attr:`device` if set).

        Raises:
            UnknownRewardError, TypeError, ValueError: from the registry / the reward constructors.
        """
        if self.built and not rebuild:
            return self
        models = {name: build_reward_with_context(spec, context) for name, spec in zip(self.names, self.specs)}
        if self.device is not None:
            models = {name: m.to(self.device) for name, m in models.items()}
        self.models = models
        return self

    def to(self, device: str | torch.device) -> RewardManager:
        """Move the models to ``device`` (and score there from now on); returns self."""
        self.device = torch.device(device)
        for name, model in self.models.items():
            self.models[name] = model.to(self.device)
        return self

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, name: str) -> RewardModel:
        """The built model of reward ``name`` (builds without context if needed); KeyError lists the names."""
        if name not in self.names:
            raise KeyError(f"no reward {name!r} in this manager; rewards: {', '.join(self.names)}")
        self.build()
        return self.models[name]

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}(w={s.weight:g})" for n, s in zip(self.names, self.specs))
        return (
            f"RewardManager([{parts}], combine={self.combine!r}, batch_size={self.batch_size}, "
            f"on_error={self.on_error!r}, device={self.device}, built={self.built})"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The running z-score statistics and failure counts (plain Python values, for a checkpoint).

        The method must store this itself (``on_save_checkpoint``): the manager is not part of the module's
        ``state_dict``. Models are not included (they are frozen and rebuilt from the specs).
        """
        return {
            "names": list(self.names),
            "combine": self.combine,
            "stats": {n: self._stats[n].state() for n in self.names},
            "failure_counts": {n: dict(c) for n, c in self.failure_counts.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output so a resumed run continues identically.

        Raises:
            ValueError: the saved reward names differ from this manager's (a changed reward config).
        """
        names = list(state.get("names", []))
        if names != self.names:
            raise ValueError(f"reward manager state is for rewards {names}, this manager has {self.names}")
        self._stats = {n: _Welford(**state["stats"][n]) for n in self.names}
        saved = state.get("failure_counts", {})
        self.failure_counts = {
            n: {key: int(saved.get(n, {}).get(key, 0)) for key in ("errors", "nan_rewards")} for n in self.names
        }

    def running_stats(self) -> dict[str, tuple[float, float, float]]:
        """``{reward: (count, mean, std)}`` of the z-score statistics (population std; 0 before any sample)."""
        return {n: (w.count, w.mean, w.std) for n, w in self._stats.items()}

    # ------------------------------------------------------------------ scoring
    def _model_device(self, model: RewardModel) -> torch.device | None:
        if self.device is not None:
            return self.device
        for t in model.parameters():
            return t.device
        for t in model.buffers():
            return t.device
        return None

    def _score_one(
        self, name: str, model: RewardModel, pixels: Tensor, prompts: list[str], meta: Mapping[str, Any]
    ) -> tuple[dict[str, Tensor], Tensor, int]:
        """One reward over the whole batch, chunked: (float32 CPU outputs, bool valid, failed chunk count). A
        groupwise reward is called once on the whole batch (a chunk could cut a group)."""
        n = pixels.shape[0]
        device = self._model_device(model)
        chunks: list[tuple[int, int, dict[str, Tensor] | None]] = []
        errors = 0
        step = max(n, 1) if getattr(model, "groupwise", False) else self.batch_size
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            x = pixels[lo:hi]
            if device is not None:
                x = x.to(device)
            try:
                with torch.no_grad():
                    out = model(x, prompts[lo:hi], **slice_meta(meta, n, lo, hi))
                if not isinstance(out, Mapping) or "reward" not in out:
                    raise RuntimeError(f"returned {type(out).__name__} without a 'reward' key")
                out = {k: v.detach().cpu() for k, v in out.items()}
            except Exception as exc:
                if self.on_error == "raise":
                    raise RuntimeError(
                        f"reward {name!r} failed on a chunk of {hi - lo} samples (samples {lo}:{hi} of a batch "
                        f"of {n}, batch_size={self.batch_size}): {type(exc).__name__}: {exc}"
                    ) from exc
                logger.warning(
                    "reward %r failed on a chunk of %d samples (samples %d:%d of %d); marking them invalid: %s: %s",
                    name, hi - lo, lo, hi, n, type(exc).__name__, exc,
                )
                errors += 1
                out = None
            chunks.append((lo, hi, out))
        keys = list(dict.fromkeys(["reward", *model.dimensions]))
        for _, _, out in chunks:
            if out is not None:
                keys += [k for k in out if k != "valid" and k not in keys]
        values = {k: torch.full((n,), float("nan"), dtype=torch.float32) for k in keys}
        valid = torch.zeros(n, dtype=torch.bool)
        for lo, hi, out in chunks:
            if out is None:
                continue
            for k, v in out.items():
                if k != "valid":
                    values[k][lo:hi] = v.float().reshape(-1)
            valid[lo:hi] = out["valid"].to(torch.bool).reshape(-1) if "valid" in out else True
        return values, valid, errors

    def __call__(self, pixels: Tensor, prompts: Sequence[str], **meta: Any) -> RewardResult:
        """Score a batch with every reward and combine.

        Args:
            pixels: float ``[B, T, C, H, W]`` in [0, 1] on any device (moved chunk by chunk to each model's
                device); detached, scored under ``no_grad`` (for reward gradients call a model directly).
            prompts: B strings.
            **meta: passed to every reward; tensors with first dimension B and lists / tuples of length B are
                sliced per chunk, anything else is passed whole. ``group`` (int [B] or B hashables: the samples'
                group ids) is reserved: it goes to the groupwise rewards only (:attr:`groupwise`; the pointwise
                ones never see it), each called once on the whole batch, and their ``last_stats`` scalars join
                :attr:`RewardResult.stats` as ``"<reward>/<key>"``.

        Returns:
            :class:`RewardResult` (CPU, float32 scores). ``zscore_sum`` (or a spec's ``standardize``) updates
            the running statistics with this batch's valid samples before standardising it.

        Raises:
            TypeError, ValueError: pixels not a rank-5 float tensor, or ``len(prompts) != B``.
            RuntimeError: a reward raised and ``on_error="raise"`` (names the reward and chunk size).
        """
        if not isinstance(pixels, Tensor):
            raise TypeError(f"pixels must be a torch.Tensor [B, T, C, H, W] in [0, 1], got {type(pixels).__name__}")
        if pixels.ndim != 5 or not pixels.is_floating_point():
            raise ValueError(
                f"pixels must be a float tensor [B, T, C, H, W] in [0, 1], got shape {tuple(pixels.shape)} "
                f"dtype {pixels.dtype}"
            )
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of strings")
        prompts = list(prompts)
        n = pixels.shape[0]
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for a batch of {n} videos (shape {tuple(pixels.shape)})")
        self.build()
        pixels = pixels.detach()
        group = meta.pop("group", None)

        components: dict[str, Tensor] = {}
        rewards: dict[str, Tensor] = {}
        reward_valid: dict[str, Tensor] = {}
        errors: dict[str, int] = {}
        nan_rewards: dict[str, int] = {}
        judge_stats: dict[str, float] = {}
        for name in self.names:
            model = self.models[name]
            groupwise = getattr(model, "groupwise", False)
            values, valid, err = self._score_one(name, model, pixels, prompts,
                                                 {**meta, "group": group} if groupwise else meta)
            if groupwise:
                judge_stats.update({f"{name}/{k}": float(v) for k, v in (getattr(model, "last_stats", None)
                                                                          or {}).items()})
            main = values["reward"]
            broken = valid & ~torch.isfinite(main)
            n_broken = int(broken.sum())
            if n_broken:
                logger.warning(
                    "reward %r returned a non-finite score for %d sample(s) it marked valid; treating them as "
                    "invalid (indices %s)", name, n_broken, broken.nonzero().flatten()[:16].tolist(),
                )
                valid = valid & ~broken
            main = torch.where(valid, main, torch.full_like(main, float("nan")))
            values["reward"] = main
            for key, value in values.items():
                components[f"{name}/{key}"] = value
            rewards[name] = main
            reward_valid[name] = valid
            errors[name] = err
            nan_rewards[name] = n_broken
            self.failure_counts[name]["errors"] += err
            self.failure_counts[name]["nan_rewards"] += n_broken

        valid_all = torch.ones(n, dtype=torch.bool)
        for mask in reward_valid.values():
            valid_all &= mask
        weights = self.weights
        stats: dict[str, float] = dict(judge_stats)
        total = torch.zeros(n, dtype=torch.float64)
        for name, spec in zip(self.names, self.specs):
            r = torch.where(valid_all, rewards[name].double(), torch.zeros(n, dtype=torch.float64))
            if self.combine == "zscore_sum" or spec.standardize:
                w = self._stats[name]
                w.update(rewards[name][reward_valid[name]])
                r = torch.where(valid_all, (r - w.mean) / (w.std + ZSCORE_EPS), r)
                stats.update({f"{name}/running_mean": w.mean, f"{name}/running_std": w.std,
                              f"{name}/running_count": w.count})
            total = total + weights[name] * r
        total = torch.where(valid_all, total, torch.full_like(total, float("nan"))).float()
        return RewardResult(
            components=components,
            rewards=rewards,
            reward_valid=reward_valid,
            valid=valid_all,
            total=total,
            weights=weights,
            combine=self.combine,
            errors=errors,
            nan_rewards=nan_rewards,
            stats=stats,
        )

    def per_reward_advantages(
        self,
        result: RewardResult,
        group_ids: Tensor | Sequence[Any],
        std: Literal["group", "global", "none"] = "group",
        eps: float = 1e-4,
        ddof: int = 0,
        return_details: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor], dict[str, float]]:
        """:func:`per_reward_advantages` (the ``"advantage_sum"`` training signal) of ``result``."""
        return per_reward_advantages(result, group_ids, std=std, eps=eps, ddof=ddof, return_details=return_details)
