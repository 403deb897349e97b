"""Contracts of the RL phases in genrl/methods/phases.py (issue 51, mutation survivors): score (groupwise dispatch,
gathered metrics, each logged once with the local batch size), reward spread, group_advantages_of's defaults,
errors_at (re-noising at one sigma, per-role DSM errors), grid_sigmas (range checks, addressed permutations),
renoise (addressing, per-frame t, device), optimizer_steps (clipping, gradient checks, per-step statistics,
counted steps), update_plan's bounds, video_batch without a trainer and flat_validation_step's wiring.

Everything runs on tiny hand-made inputs with fakes for the Lightning module (a recording ``log``, a two-rank
``all_gather``); no Trainer, no model, no download.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from genrl.flow.forward_rl import sample_timesteps
from genrl.flow.policy import group_stats
from genrl.methods import phases
from genrl.methods.phases import (
    Rollouts,
    Scores,
    errors_at,
    grid_sigmas,
    group_advantages_of,
    optimizer_steps,
    renoise,
    reward_spread,
    score,
    update_plan,
    video_batch,
)
from genrl.noise import mix_seed, randn_per_sample
from genrl.rollout.sampler import RolloutConfig

NAN = math.nan
F64 = torch.float64


# ------------------------------------------------------------------------------------------------------- fakes
class _Log:
    """A recording ``LightningModule.log``: every call as (key, value, kwargs)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict]] = []

    def __call__(self, key, value, **kwargs) -> None:
        self.calls.append((key, value, kwargs))

    @property
    def keys(self) -> list[str]:
        return [k for k, _, _ in self.calls]

    def __getitem__(self, key: str) -> float:
        (value,) = [v for k, v, _ in self.calls if k == key]
        return value


def _one_process():
    """A module used on its own (no trainer): rank 0 of 1."""
    return SimpleNamespace(trainer=None, log=_Log())


class _RankZeroOfTwo:
    """Rank 0 of a two-rank data-parallel run: Lightning's all_gather stacks this rank's tensor with rank 1's, which
    holds fixed rows of the same length (by dtype: rewards, validity, group ids)."""

    PEER = {torch.float32: torch.tensor([0.9, 0.3, 0.5]), torch.bool: torch.tensor([True, True, True]),
            torch.int64: torch.tensor([2, 2, 1])}

    def __init__(self) -> None:
        self.trainer = SimpleNamespace(strategy=SimpleNamespace(
            distributed_sampler_kwargs={"rank": 0, "num_replicas": 2}))
        self.device = torch.device("cpu")
        self.log = _Log()

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t, self.PEER[t.dtype]])


class _Result:
    """A RewardResult's surface that score() reads."""

    def __init__(self, total, valid, metrics) -> None:
        self.total, self.valid, self._metrics = total, valid, metrics

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)


class _Scorer:
    """Records the per-sample meta it is called with. ``manager``: an object with ``groupwise`` (or None: a scorer
    without a manager; ``"bare"``: a manager without the attribute)."""

    def __init__(self, result, groupwise=None) -> None:
        if groupwise == "bare":
            self.manager = SimpleNamespace()
        elif groupwise is not None:
            self.manager = SimpleNamespace(groupwise=groupwise)
        self.result = result
        self.calls: list[dict] = []

    def __call__(self, pixels, prompts, **meta):
        self.calls.append(meta)
        return self.result


def _rollouts(n: int = 3) -> Rollouts:
    return Rollouts([f"p{i}" for i in range(n)], torch.rand(n, 1, 3, 2, 2), None)


def _local_result() -> _Result:
    total, valid = torch.tensor([0.2, 0.6, NAN]), torch.tensor([True, True, False])
    return _Result(total, valid, {"total": 0.4, "invalid_fraction": 1 / 3, "shapes/reward": 0.4, "shapes/errors": 0.0})


# ------------------------------------------------------------------------------------------------------- score
def test_score_gathers_over_ranks_and_logs_each_metric_once_with_the_local_batch_size():
    """Two ranks: totals / validity / groups are the gathered batch (rank order); ``reward/total`` is the mean over
    its valid samples, ``reward/invalid_fraction`` its invalid share, ``advantage/*`` its group statistics; the
    reward's own metrics are logged as computed on this rank. Every key is logged exactly once (the result's own
    total / invalid_fraction are not logged) and every call carries batch_size = the local batch size."""
    module = _RankZeroOfTwo()
    group = torch.tensor([0, 0, 1])
    scorer = _Scorer(_local_result())
    out = score(module, scorer, _rollouts(), group)
    all_total = torch.tensor([0.2, 0.6, NAN, 0.9, 0.3, 0.5])
    all_valid = torch.tensor([True, True, False, True, True, True])
    all_group = torch.tensor([0, 0, 1, 2, 2, 1])
    assert torch.equal(out.total.isnan(), all_total.isnan()) and torch.equal(out.total[all_valid], all_total[all_valid])
    assert torch.equal(out.valid, all_valid) and torch.equal(out.group, all_group) and out.local == 3
    log = module.log
    assert len(log.keys) == len(set(log.keys)), log.keys
    assert log["reward/total"] == pytest.approx((0.2 + 0.6 + 0.9 + 0.3 + 0.5) / 5, abs=1e-7)
    assert log["reward/invalid_fraction"] == pytest.approx(1 / 6, abs=1e-7)
    assert log["reward/shapes/reward"] == 0.4 and log["reward/shapes/errors"] == 0.0
    stats = group_stats(all_total, all_group, valid=all_valid)
    assert {k: log[f"advantage/{k}"] for k in stats} == {k: float(v) for k, v in stats.items()}
    assert set(log.keys) == {"reward/shapes/reward", "reward/shapes/errors", "reward/total", "reward/invalid_fraction",
                             *(f"advantage/{k}" for k in stats)}
    assert all(kw.get("batch_size") == 3 for _, _, kw in log.calls), log.calls

    # without group ids: no group statistic, nothing gathered for the groups
    module = _RankZeroOfTwo()
    out = score(module, _Scorer(_local_result()), _rollouts(), None, prefix="planner")
    assert out.group is None and torch.equal(out.valid, all_valid)
    assert not [k for k in module.log.keys if k.startswith("advantage/")]
    assert module.log["planner/total"] == pytest.approx(0.5, abs=1e-7)


def test_score_passes_local_group_ids_and_the_meta_to_a_groupwise_scorer():
    """A groupwise scorer (manager.groupwise) gets meta = the caller's meta plus ``group``: this rank's own group ids
    (not the gathered ones), after the check that every group lies whole on one rank; Scores.group is the gathered
    batch's. Without group ids it is a ValueError."""
    module = _RankZeroOfTwo()
    module.PEER = {**module.PEER, torch.int64: torch.tensor([7, 7, 7])}
    group = torch.tensor([4, 4, 4])
    scorer = _Scorer(_local_result(), groupwise=True)
    out = score(module, scorer, _rollouts(), group, meta={"extra": [1, 2, 3]})
    (meta,) = scorer.calls
    assert sorted(meta) == ["extra", "group"] and meta["extra"] == [1, 2, 3] and meta["group"] is group
    assert torch.equal(out.group, torch.tensor([4, 4, 4, 7, 7, 7]))
    stats = group_stats(out.total, out.group, valid=out.valid)
    assert module.log["advantage/reward_mean"] == float(stats["reward_mean"])

    scorer = _Scorer(_local_result(), groupwise=True)
    score(_one_process(), scorer, _rollouts(), torch.tensor([0, 0, 1]))
    assert sorted(scorer.calls[0]) == ["group"]
    with pytest.raises(ValueError, match="needs the batch's group ids"):
        score(_one_process(), _Scorer(_local_result(), groupwise=True), _rollouts(), None)
    # a group split over the two ranks is refused
    split = _RankZeroOfTwo()
    with pytest.raises(ValueError, match="spread over ranks 0..1"):
        score(split, _Scorer(_local_result(), groupwise=True), _rollouts(), torch.tensor([1, 2, 2]))


@pytest.mark.parametrize("manager", [None, "bare", False])
def test_score_calls_a_pointwise_scorer_with_the_meta_only(manager):
    """A scorer without a manager, a manager without ``groupwise`` or a pointwise one: called with exactly the
    caller's meta (no group ids, none needed)."""
    scorer = _Scorer(_local_result(), groupwise=manager)
    out = score(_one_process(), scorer, _rollouts(), None, meta={"frame_spans": ["a", "b", "c"]})
    assert scorer.calls == [{"frame_spans": ["a", "b", "c"]}] and out.group is None
    scorer = _Scorer(_local_result(), groupwise=manager)
    score(_one_process(), scorer, _rollouts(), torch.tensor([0, 0, 1]))
    assert scorer.calls == [{}]


# ------------------------------------------------------------------------------------------------ reward spread
def _scores(total, valid, local=2, group=None) -> Scores:
    return Scores(None, torch.tensor(total, dtype=F64), torch.tensor(valid), group, local)


def test_reward_spread_logs_the_valid_samples_stds_and_returns_the_reward_std():
    """advantage/std and reward/batch_std are the (unbiased) stds over the valid samples, logged once each with
    batch_size = the local batch size; the reward std is returned."""
    module = _one_process()
    scores = _scores([0.2, 0.6, NAN, 1.0], [True, True, False, True])
    adv = torch.tensor([1.0, -2.0, 5.0, 4.0])
    assert reward_spread(module, scores, adv, iteration=3) == pytest.approx(0.4, abs=1e-12)
    assert module.log.keys == ["advantage/std", "reward/batch_std"]
    assert module.log["advantage/std"] == pytest.approx(3.0, abs=1e-6)  # std of (1, -2, 4), ddof 1
    assert module.log["reward/batch_std"] == pytest.approx(0.4, abs=1e-12)
    assert all(kw.get("batch_size") == 2 for _, _, kw in module.log.calls)
    # exactly two valid samples: a std (n - 1 = 1)
    module = _one_process()
    two = reward_spread(module, _scores([0.1, NAN, 0.5, NAN], [True, False, True, False]),
                        torch.tensor([1.0, 0.0, 3.0, 0.0]), 0)
    assert two == pytest.approx(0.4 / math.sqrt(2), abs=1e-12)
    assert module.log["advantage/std"] == pytest.approx(math.sqrt(2), abs=1e-6)


@pytest.mark.parametrize("valid", [[False, True, False, False], [False, False, False, False]])
def test_reward_spread_is_zero_with_fewer_than_two_valid_samples(valid):
    """With one valid sample (or none) both stds are 0.0, not NaN (a std needs two samples)."""
    module = _one_process()
    rstd = reward_spread(module, _scores([0.3, 0.7, NAN, 0.1], valid), torch.tensor([0.5, 1.5, 0.0, 2.0]), 0)
    assert rstd == 0.0 and module.log["advantage/std"] == 0.0 and module.log["reward/batch_std"] == 0.0


def test_reward_spread_warns_only_below_a_std_of_1e_6(caplog):
    """The collapse warning fires when the valid rewards' std is below 1e-6 (all equal), and not at a std of exactly
    1e-6 or at an ordinary spread."""
    logger = "genrl.methods.phases"
    with caplog.at_level(logging.WARNING, logger=logger):
        assert reward_spread(_one_process(), _scores([0.5, 0.5, 0.5], [True] * 3), torch.zeros(3), 7) == 0.0
    assert [r.getMessage() for r in caplog.records if "scores the same" in r.getMessage()][0].startswith("iteration 7")
    for total in ([-1e-6, 1e-6, 0.0], [0.2, 0.6, 1.0]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=logger):
            rstd = reward_spread(_one_process(), _scores(total, [True] * 3), torch.zeros(3), 0)
        assert rstd >= 1e-6 and not [r for r in caplog.records if "scores the same" in r.getMessage()], total


# --------------------------------------------------------------------------------------- group_advantages_of
def test_group_advantages_of_defaults_are_group_std_eps_1e_4_and_allow_singleton_groups():
    """Defaults: (r - group mean) / (group std (ddof 0) + 1e-4) over the valid samples of each group, no per-reward
    split (the module needs no scorer), a one-sample group allowed (advantage 0); invalid samples get 0."""
    total = [0.50, 0.52, 0.51, NAN, 0.1, 0.9, 0.3]
    valid = [True, True, True, False, True, True, True]
    group = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    scores = Scores(None, torch.tensor(total), torch.tensor(valid), group, 7)
    adv = group_advantages_of(SimpleNamespace(trainer=None), scores)
    want = []
    for g, r, v in zip(group.tolist(), total, valid, strict=True):
        rs = [x for gg, x, vv in zip(group.tolist(), total, valid, strict=True) if gg == g and vv]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / len(rs))
        want.append((r - mean) / (std + 1e-4) if v and std >= 1e-6 else 0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), torch.tensor(want, dtype=F64), rtol=1e-5, atol=1e-5)
    assert adv[0] == pytest.approx(-0.01 / (math.sqrt(2 / 3) * 0.01 + 1e-4), rel=1e-4)


# ----------------------------------------------------------------------------------------------- update plan
def test_update_plan_accepts_one_row_and_one_row_mini_batches():
    """n = 1 and mini_batch = 1 are valid: one step per row, in order."""
    assert [r.tolist() for r in update_plan(0, 0, n=1, mini_batch=1)] == [[0]]
    assert [r.tolist() for r in update_plan(3, 1, n=3, mini_batch=1)] == [[0], [1], [2]]


# ----------------------------------------------------------------------------------------------- video batch
def test_video_batch_without_a_trainer_numbers_the_samples_from_zero():
    """A module used on its own (no trainer: step 0, rank 0 of 1) gets ids arange(B)."""
    module = SimpleNamespace(trainer=None, generator=SimpleNamespace(encode=lambda p: 2 * p))
    pixels = torch.rand(3, 1, 3, 2, 2)
    x0, prompts, index = video_batch(module, {"pixels": pixels, "prompts": ["a", "b", "c"]})
    assert index.tolist() == [0, 1, 2] and prompts == ["a", "b", "c"]
    torch.testing.assert_close(x0, 2 * pixels)


# ----------------------------------------------------------------------------------------- flat validation step
def test_flat_validation_step_uses_the_modules_scorer_eval_config_shape_and_seed(monkeypatch):
    """validation_step = flat_validation with module.scorer, module.eval_config (the validation sampler, not the
    training one), module.latent_shape and module.hparams.seed."""
    seen = []
    monkeypatch.setattr(phases, "flat_validation", lambda *a: seen.append(a) or {"ok": True})
    module = SimpleNamespace(scorer=object(), eval_config=object(), config=object(), latent_shape=(1, 3, 2, 2),
                             hparams=SimpleNamespace(seed=17))
    batch = {"prompts": ["a"], "index": torch.tensor([0])}
    assert phases.flat_validation_step(module, batch, 0) == {"ok": True}
    assert seen == [(module, module.scorer, batch, module.eval_config, (1, 3, 2, 2), 17)]


# ----------------------------------------------------------------------------------------------------- renoise
def _randn_on_device(monkeypatch):
    """randn_per_sample drawing on ``device``, as on an accelerator (here: the CPU draw moved there), so that the
    meta device can stand for one."""
    real = phases.randn_per_sample

    def draw(shape, seed, indices, step=0, stream=0, device="cpu", **kw):
        return real(shape, seed, indices, step=step, stream=stream, **kw).to(device)

    monkeypatch.setattr(phases, "randn_per_sample", draw)


def test_renoise_draws_t_and_eps_at_their_addresses_and_noises_linearly():
    """t = sample_timesteps at (seed, iteration, t_stream) and eps = randn_per_sample at (seed, iteration,
    eps_stream), both per key and ``draw``; x_t = (1 - t) x0 + t eps, u = eps - x0 (float64 reference); rows with
    the same key share t and eps; another draw gives other values."""
    x0 = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))
    keys = torch.tensor([5, 5, 9])
    t, eps, x_t, u = renoise(x0, keys, 11, 4, 2, 21, 22)
    want_t = sample_timesteps(3, mix_seed(11, 4, 21), keys, step=2)
    want_eps = randn_per_sample((2, 4), mix_seed(11, 4, 22), keys, step=2)
    assert torch.equal(t, want_t) and torch.equal(eps, want_eps)
    assert torch.equal(t[0], t[1]) and torch.equal(eps[0], eps[1]) and not torch.equal(eps[0], eps[2])
    tb = t.double()[:, None, None]
    torch.testing.assert_close(x_t.double(), (1 - tb) * x0.double() + tb * eps.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(u.double(), eps.double() - x0.double(), rtol=0, atol=1e-6)
    t0, eps0, _, _ = renoise(x0, keys, 11, 4, 0, 21, 22)
    assert not torch.equal(t0, t) and not torch.equal(eps0, eps)


def test_renoise_per_frame_t_follows_frame_dim():
    """A given per-frame t [B, T] broadcasts over the frame axis: dim 1 by default ([B, T, C]), ``frame_dim=2`` for
    [B, C, T] latents."""
    x0 = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    keys = torch.tensor([0, 1])
    t = torch.tensor([[0.1, 0.5, 0.9], [0.2, 0.4, 0.6]])
    _, eps, x_t, _ = renoise(x0, keys, 3, 0, 0, 1, 2, t=t)
    tb = t[:, :, None].double()
    torch.testing.assert_close(x_t.double(), (1 - tb) * x0.double() + tb * eps.double(), rtol=0, atol=1e-6)
    xw = x0.transpose(1, 2).contiguous()  # [B, C=4, T=3]
    _, eps, x_t, _ = renoise(xw, keys, 3, 0, 0, 1, 2, frame_dim=2, t=t)
    tb = t[:, None, :].double()
    torch.testing.assert_close(x_t.double(), (1 - tb) * xw.double() + tb * eps.double(), rtol=0, atol=1e-6)


def test_renoise_outputs_live_on_the_endpoints_device(monkeypatch):
    """t (drawn on the CPU) and eps come out on x0's device (the meta device stands for an accelerator)."""
    _randn_on_device(monkeypatch)
    x0 = torch.zeros(2, 3, device="meta")
    t, eps, x_t, u = renoise(x0, torch.tensor([0, 1]), 0, 0, 0, 1, 2)
    assert {v.device.type for v in (t, eps, x_t, u)} == {"meta"} and x_t.shape == (2, 3)


# --------------------------------------------------------------------------------------------------- errors_at
_W = {"reference": -1.0, "old_policy": 2.0}


class _Gen:
    """velocity = w * x + t * cond per sample: w a trainable 0.5 for the live weights, else the swapped-in role's."""

    def __init__(self) -> None:
        self.w = torch.tensor(0.5, requires_grad=True)
        self.active = "theta"
        self.ts: list[torch.Tensor] = []

    def velocity(self, x, t, cond):
        assert t.shape == (x.shape[0],) and t.device == x.device  # a real network needs t beside x
        self.ts.append(t)
        w = self.w if self.active == "theta" else torch.tensor(_W[self.active])
        shape = (-1, *[1] * (x.ndim - 1))
        return w * x + t.reshape(shape) * cond.reshape(shape)


class _Roles:
    @contextmanager
    def _use(self, gen, name):
        if name not in _W:
            raise KeyError(f"role {name!r} is not declared")
        gen.active = name
        try:
            yield
        finally:
            gen.active = "theta"

    def reference(self, gen):
        return self._use(gen, "reference")

    def swap(self, gen, name):
        return self._use(gen, name)


def test_errors_at_gives_each_roles_dsm_error_at_one_sigma():
    """x0 re-noised at sigma (t = sigma for every row, no t draw) with eps addressed by (seed, iteration, eps_stream,
    key, draw); e_r = mean (v_r(x_t, sigma, cond) - u)^2 per row for every role (float64 reference), theta with a
    graph, the others without; u = eps - x0. A generator without ``frame_dim`` is fine; an undeclared role is a
    KeyError."""
    gen = _Gen()
    module = SimpleNamespace(generator=gen, roles=_Roles())
    x0 = torch.randn(3, 2, 2, generator=torch.Generator().manual_seed(2))
    keys, cond, sigma = torch.tensor([4, 4, 8]), torch.tensor([1.0, -2.0, 3.0]), 0.3
    err, v, u = errors_at(module, x0, keys, cond, sigma, seed=5, iteration=6, draw=1, eps_stream=7,
                          roles=("theta", "reference", "old_policy"))
    eps = randn_per_sample((2, 2), mix_seed(5, 6, 7), keys, step=1).double()
    x_t = (1 - sigma) * x0.double() + sigma * eps
    want_u = eps - x0.double()
    torch.testing.assert_close(u.double(), want_u, rtol=0, atol=1e-6)
    assert [tuple(t.tolist()) for t in gen.ts] == [(pytest.approx(sigma),) * 3] * 3
    for role, w in {"theta": 0.5, **_W}.items():
        want_v = w * x_t + sigma * cond.double()[:, None, None]
        torch.testing.assert_close(v[role].double(), want_v, rtol=0, atol=1e-5)
        want_e = ((want_v - want_u) ** 2).mean(dim=(1, 2))
        assert err[role].dtype == torch.float32 and err[role].shape == (3,)
        torch.testing.assert_close(err[role].double(), want_e, rtol=1e-5, atol=1e-6)
        assert err[role].requires_grad == (role == "theta")
    assert list(err) == ["theta", "reference", "old_policy"]
    with pytest.raises(KeyError, match="fast_ema"):
        errors_at(module, x0, keys, cond, sigma, 5, 6, 1, 7, roles=("fast_ema",))


def test_errors_at_puts_sigma_on_the_endpoints_device(monkeypatch):
    """The noise level handed to the network lives on x0's device (the meta device stands for an accelerator)."""
    _randn_on_device(monkeypatch)
    gen = _Gen()
    module = SimpleNamespace(generator=gen, roles=_Roles())
    x0 = torch.zeros(2, 3, device="meta")
    err, _, _ = errors_at(module, x0, torch.tensor([0, 1]), torch.zeros(2, device="meta"), 0.5, 0, 0, 0, 3,
                          roles=("theta",))
    assert gen.ts[0].device.type == "meta" and err["theta"].shape == (2,)


# ------------------------------------------------------------------------------------------------- grid sigmas
def test_grid_sigmas_draws_addressed_permutations_of_the_first_grid_levels():
    """count <= grid: distinct values among the first ``grid`` sigmas of the rollout grid (never the final 0);
    count > grid: consecutive permutations, every value count // grid times or once more; float32; the same for the
    same (seed, iteration, stream) and different when any of them changes."""
    config = RolloutConfig(num_steps=8)
    levels = config.sigmas()[:8].float()
    s = grid_sigmas(config, 8, 8, seed=1, iteration=2, stream=3)
    assert s.dtype == torch.float32 and sorted(s.tolist()) == sorted(levels.tolist()) and bool((s > 0).all())
    assert torch.equal(s, grid_sigmas(config, 8, 8, 1, 2, 3))
    for other in ((9, 2, 3), (1, 9, 3), (1, 2, 9)):
        assert not torch.equal(s, grid_sigmas(config, 8, 8, *other)), other
    part = grid_sigmas(config, 5, 3, 1, 2, 3)
    assert len(set(part.tolist())) == 3 and set(part.tolist()) <= set(levels[:5].tolist())
    many = grid_sigmas(config, 3, 7, 4, 0, 1)
    assert sorted(many[:3].tolist()) == sorted(many[3:6].tolist()) == sorted(levels[:3].tolist())
    assert many[6].item() in levels[:3].tolist()


def test_grid_sigmas_bounds_are_inclusive():
    """grid = 1 (the highest level only), grid = num_steps and count = 1 are valid; grid 0, grid > num_steps and
    count 0 are ValueErrors, whatever the other argument."""
    config = RolloutConfig(num_steps=4)
    assert grid_sigmas(config, 1, 3, 0, 0, 0).tolist() == [1.0, 1.0, 1.0]
    assert sorted(grid_sigmas(config, 4, 4, 0, 0, 0).tolist()) == [0.25, 0.5, 0.75, 1.0]
    assert len(grid_sigmas(config, 2, 1, 0, 0, 0)) == 1
    for grid, count in ((0, 2), (5, 2), (2, 0), (4, 0)):
        with pytest.raises(ValueError, match="grid sigmas"):
            grid_sigmas(config, grid, count, 0, 0, 0)


# -------------------------------------------------------------------------------------------- optimizer steps
class _Manual:
    """Manual optimisation without a Trainer: manual_backward is loss.backward(); clip_gradients clips the norm of
    the optimizer's parameters and is recorded."""

    def __init__(self, trainer=None) -> None:
        self.trainer = trainer
        self.clips: list[tuple] = []

    def manual_backward(self, loss):
        loss.backward()

    def clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm):
        self.clips.append((gradient_clip_val, gradient_clip_algorithm))
        params = [p for g in optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)


def _unit(p, coef, stats, w, made):
    def run():
        loss = (p * torch.tensor(coef)).sum()
        made.append(loss)
        return loss, stats, w
    return run


def test_optimizer_steps_accumulate_units_step_unclipped_by_default_and_report_weighted_means():
    """Each step zeroes the gradients, back-propagates every unit (gradients add up) and steps; no clipping by
    default. Returns sum(weighted stats) / sum(weights) over all steps plus ``{stat}/step{j}`` per step (only
    with more than one step); check_finite sees every unit's loss."""
    p = torch.tensor([3.0, 4.0], requires_grad=True)
    module, made, checked = _Manual(), [], []
    opt = torch.optim.SGD([p], lr=1.0)
    steps = [[_unit(p, [10.0, 0.0], {"loss": 2.0}, 1.0, made), _unit(p, [0.0, 20.0], {"loss": 6.0, "kl": 1.0}, 2.0,
                                                                        made)],
             [_unit(p, [1.0, 1.0], {"loss": 1.0}, 1.0, made)]]
    out = optimizer_steps(module, opt, steps, check_finite=checked.append)
    assert p.tolist() == [3.0 - 10.0 - 1.0, 4.0 - 20.0 - 1.0] and module.clips == []
    assert out == pytest.approx({"loss": 9.0 / 4, "kl": 1.0 / 4, "loss/step0": 8.0 / 3, "kl/step0": 1.0 / 3,
                                 "loss/step1": 1.0})
    assert len(checked) == 3 and all(a is b for a, b in zip(checked, made, strict=True))
    # one step: no per-step keys; max_grad_norm > 0 clips the accumulated gradient to that norm
    p2 = torch.tensor([0.0, 0.0], requires_grad=True)
    module = _Manual()
    one = optimizer_steps(module, torch.optim.SGD([p2], lr=1.0),
                          [[_unit(p2, [30.0, 40.0], {"loss": 3.0}, 2.0, [])]], max_grad_norm=5.0)
    assert one == {"loss": 1.5} and module.clips == [(5.0, "norm")]
    torch.testing.assert_close(p2.detach(), torch.tensor([-3.0, -4.0]), rtol=1e-5, atol=1e-5)


def test_optimizer_steps_refuse_a_step_without_gradient_but_allow_frozen_units_and_empty_steps():
    """A step whose units all lack a graph is a ValueError; a frozen unit beside a trained one is not
    back-propagated; a step without units only steps the optimizer."""
    p = torch.tensor([1.0], requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    frozen = lambda: (torch.tensor(2.0), {"loss": 2.0}, 1.0)  # noqa: E731
    with pytest.raises(ValueError, match="no gradient"):
        optimizer_steps(_Manual(), opt, [[frozen]])
    out = optimizer_steps(_Manual(), opt, [[frozen, _unit(p, [1.0], {"loss": 4.0}, 1.0, [])]])
    assert out == {"loss": 3.0} and p.tolist() == [0.0]
    assert optimizer_steps(_Manual(), opt, [[]]) == {} and p.tolist() == [0.0]


class _LightningOptimizer:
    """A Lightning optimizer wrapper: step() is a counted trainer step."""

    def __init__(self, optimizer, record) -> None:
        self.optimizer, self.record = optimizer, record

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        self.record.append("counted")
        self.optimizer.step()


@pytest.mark.parametrize("counted", [True, False])
def test_optimizer_steps_counted_or_through_the_strategy(counted):
    """counted=True steps the (Lightning) optimizer, which advances global_step; counted=False goes through the
    strategy's optimizer_step on the inner optimizer (step_uncounted)."""
    record = []
    strategy = SimpleNamespace(optimizer_step=lambda opt, closure: record.append(("strategy", opt)) or opt.step())
    module = _Manual(SimpleNamespace(strategy=strategy, global_rank=0, world_size=1))
    p = torch.tensor([1.0], requires_grad=True)
    inner = torch.optim.SGD([p], lr=1.0)
    optimizer_steps(module, _LightningOptimizer(inner, record), [[_unit(p, [1.0], {}, 1.0, [])]], counted=counted)
    assert record == (["counted"] if counted else [("strategy", inner)]) and p.tolist() == [0.0]
