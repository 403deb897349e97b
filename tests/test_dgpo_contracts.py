"""DGPO's contracts (genrl.methods.dgpo): the constructor's checks and documented defaults, and ``training_step``
with every phase it calls replaced by a recording fake, so that each unit's loss, the roles evaluated, the sigma
draws per optimizer step, the advantage clip, the EMA rollout switch and the fast EMA's decay are checked against a
float64 hand computation in well under a second (the end-to-end tests in tests/test_dgpo.py are too slow for
mutation runs)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

import genrl.methods.dgpo as dgpo_mod
from genrl.methods.common import ode_validation_config
from genrl.methods.dgpo import DGPO
from genrl.rollout.sampler import RolloutConfig

F64 = torch.float64


def _ro(steps: int = 4) -> RolloutConfig:
    return RolloutConfig(kernel="ode", num_steps=steps)


def _make(**kw) -> DGPO:
    kw.setdefault("rollout", _ro())
    return DGPO(latent_shape=[2], **kw)


# ------------------------------------------------------------------ constructor


def test_signature_defaults_are_the_documented_reference_values():
    """Catches a changed default: the docstring / docs/methods/preference.md give the reference values (adv_clip 5,
    beta 100, 4 sigmas, EMA ramp 1e-3 up to 0.3, KL off, one optimizer step, advantages as RAM / GRPO)."""
    p = inspect.signature(DGPO.__init__).parameters
    want = {"reward_combine": "weighted_sum", "advantage_std": "group", "advantage_eps": 1e-4, "adv_clip": 5.0,
            "beta": 100.0, "num_timesteps": 4, "trunc_steps": None, "clip_range": None, "kl_beta": 0.0,
            "ema_decay_ramp": 1e-3, "ema_decay_max": 0.3, "switch_ema_ref": None, "updates_per_iteration": 1,
            "micro_batch_size": None, "max_grad_norm": 1.0, "seed": 0}
    assert {k: p[k].default for k in want} == want
    m = DGPO(latent_shape=[2])  # every default at once: valid, the scorer combines by the default
    assert m.scorer.manager.combine == "weighted_sum"
    assert {k: m.hparams[k] for k in want} == want


@pytest.mark.parametrize("kw", [dict(beta=0.0), dict(adv_clip=0.0), dict(clip_range=0.0), dict(kl_beta=-1e-9),
                                dict(num_timesteps=0), dict(updates_per_iteration=0),
                                dict(num_timesteps=3, updates_per_iteration=2),
                                dict(ema_decay_max=1.0), dict(ema_decay_max=-1e-9), dict(ema_decay_ramp=-1e-9),
                                dict(ema_decay_max=1.0, ema_decay_ramp=0.5),
                                dict(num_timesteps=5), dict(trunc_steps=4), dict(num_timesteps=2, trunc_steps=0)])
def test_bad_arguments_raise(kw):
    """Catches a relaxed bound (>= for >, `and` for `or`): each of these is just outside the documented ranges."""
    with pytest.raises(ValueError):
        _make(**kw)


@pytest.mark.parametrize("kw", [dict(beta=0.5), dict(adv_clip=0.5), dict(clip_range=1e-3), dict(kl_beta=0.0),
                                dict(num_timesteps=1), dict(num_timesteps=1, trunc_steps=0),
                                dict(num_timesteps=4, updates_per_iteration=4), dict(ema_decay_max=0.0),
                                dict(ema_decay_ramp=0.0), dict(ema_decay_max=0.999)])
def test_boundary_arguments_are_accepted(kw):
    """Catches a tightened bound (> 1 for > 0, <= 1 for < 1, 0 < for 0 <=): the smallest valid values construct,
    and the grid size is trunc_steps + 1."""
    m = _make(**kw)
    assert m.grid_size == (kw["trunc_steps"] + 1 if "trunc_steps" in kw else 4)


def test_rollout_is_forced_to_ode_and_the_rest_kept():
    """Catches the rollout config being replaced or its kernel lost: a given SDE rollout keeps its step count and
    shift and becomes the ODE; no rollout gives the default ODE; the validation sampler is the rollout's ODE; the
    reward combination and latent shape are kept."""
    m = DGPO(latent_shape=[2, 3], rollout=RolloutConfig(kernel="flow_grpo", num_steps=6, shift=3.0),
             reward_combine="zscore_sum")
    assert (m.rollout_config.kernel, m.rollout_config.num_steps, m.rollout_config.shift) == ("ode", 6, 3.0)
    assert m.eval_config == ode_validation_config(m.rollout_config)
    assert m.latent_shape == (2, 3) and m.scorer.manager.combine == "zscore_sum"
    d = DGPO(latent_shape=[2])
    assert d.rollout_config == RolloutConfig(kernel="ode") and d.rollout_config.kernel == "ode"
    assert d.eval_config == ode_validation_config(d.rollout_config)
    own = RolloutConfig(kernel="ode", num_steps=3)
    assert DGPO(latent_shape=[2], eval_rollout=own).eval_config is own


# ------------------------------------------------------------------ training_step with recording fakes

_X0 = (torch.arange(8, dtype=F64).reshape(4, 2) / 10)
_GROUP = torch.tensor([0, 0, 1, 1])
_RAW_ADV = torch.tensor([7.0, -9.0, 0.5, -0.5], dtype=F64)
_SIG = torch.tensor([0.9, 0.7, 0.5, 0.3])
_W = 1.3  # the policy's one "weight": e_theta = w * base


def _base(x0: torch.Tensor, sigma: float, m: int) -> torch.Tensor:
    return x0.pow(2).sum(-1) + sigma + m + 1.0


def _z(m: int) -> torch.Tensor:
    return 0.3 * (m + 1) * torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=F64)


class _Cond:
    def __init__(self, idx):
        self.idx = list(idx)

    def select(self, idx):
        return [self.idx[i] for i in idx]


class _Roles:
    def __init__(self, rec):
        self.rec = rec

    def swap(self, gen, name):
        self.rec["swap"].append((gen, name))
        return "swapped"

    def update_lagged(self, name, decay):
        self.rec["lagged"].append((name, decay))
        return decay


def _run(monkeypatch, it: int = 0, old_gap: float = 0.0, **kw):
    """One training_step of a DGPO built with ``kw`` at iteration ``it``, every phase faked; returns the record."""
    m = _make(micro_batch_size=2, **kw)
    rec = {k: [] for k in ("collect", "score", "adv", "errors", "logits", "steps", "log", "log_dict", "swap",
                           "lagged")}
    gen = SimpleNamespace(encode_prompts=lambda prompts: _Cond(range(len(prompts))))
    m.generator = gen
    m.roles = _Roles(rec)
    m.iteration.fill_(it)
    w = torch.nn.Parameter(torch.tensor(_W, dtype=F64))

    def collect(g, prompts, shape, seed, index, config, iteration, policy=None):
        rec["collect"].append(dict(g=g, shape=shape, seed=seed, index=index, config=config, it=iteration,
                                   policy=policy() if policy is not None else None))
        return SimpleNamespace(samples=_X0.clone())

    def score(method, scorer, ro, group, **k):
        rec["score"].append(k)
        return SimpleNamespace(group=group)

    def adv_of(method, scores, **k):
        rec["adv"].append(k)
        return _RAW_ADV.clone()

    def errors(x0, group, cond, sigma, iteration, mm, roles):
        rec["errors"].append(dict(x0=x0.clone(), group=group.tolist(), cond=cond, sigma=sigma, it=iteration, m=mm,
                                  roles=roles))
        b = _base(x0, sigma, mm)
        e = {"theta": w * b}
        if "old_policy" in roles:  # the sample of global index 0 has a higher error under theta_old
            e["old_policy"] = w.detach() * b + torch.tensor([old_gap if i == 0 else 0.0 for i in cond], dtype=F64)
        if "reference" in roles:
            e["reference"] = b
        v = {"theta": w * x0, "reference": x0 * 0.5}
        return e, v

    def group_logits(x0, group, adv, cond, chunks, all_group, size, sigma, iteration, mm):
        rec["logits"].append(dict(adv=adv.clone(), size=size, sigma=sigma, it=iteration, m=mm,
                                  chunks=[c.tolist() for c in chunks], all_group=all_group.tolist()))
        return _z(mm)

    def opt_steps(module, optimizer, steps, max_grad_norm):
        for units in steps:
            rec["steps"].append([(u.__defaults__[0], u.__defaults__[1].tolist(), *u()) for u in units])
        rec["max_grad_norm"] = max_grad_norm
        return {"train/loss": 1.5}

    for name, fn in (("collect_endpoints", collect), ("score", score), ("group_advantages_of", adv_of),
                     ("optimizer_steps", opt_steps)):
        monkeypatch.setattr(dgpo_mod, name, fn)
    monkeypatch.setattr(m, "errors", errors)
    monkeypatch.setattr(m, "group_logits", group_logits)
    monkeypatch.setattr(m, "sigmas", lambda i: _SIG.clone())
    monkeypatch.setattr(m, "optimizers", lambda: "opt")
    monkeypatch.setattr(m, "log_dict", lambda d, **k: rec["log_dict"].append((d, k)))
    monkeypatch.setattr(m, "log", lambda name, value, **k: rec["log"].append((name, value, k)))
    batch = {"prompts": ["p0", "p1", "p2", "p3"], "index": torch.tensor([10, 11, 12, 13]), "group": _GROUP}
    m.training_step(batch, 0)
    rec["model"], rec["gen"] = m, gen
    return rec


def _expected_unit(m: int, c: list[int], clip: float | None = None, old_gap: float = 0.0, kl_beta: float = 0.0,
                   adv_clip: float = 5.0):
    """(loss before scaling, stats) of one unit in float64 by hand."""
    x0, a, z = _X0[c], _RAW_ADV[c].clamp(-adv_clip, adv_clip), _z(m)[c]
    e = _W * _base(x0, float(_SIG[m]), m)
    loss = (torch.sigmoid(z) * a * e).sum()
    stats = {"train/weight": float(torch.sigmoid(z).sum())}
    if clip is not None:
        old = e + torch.tensor([old_gap if i == 0 else 0.0 for i in c], dtype=F64)
        rho = torch.exp(old - e)
        cut = ((a > 0) & (rho > 1 + clip)) | ((a < 0) & (rho < 1 - clip))
        stats["train/clipfrac"] = float(cut.sum())
    if kl_beta > 0:
        kl = ((_W * x0 - 0.5 * x0) ** 2).mean(-1)
        loss = loss + kl_beta * kl.sum()
        stats["train/kl"] = float(kl.sum())
    stats["train/loss"] = float(loss)
    return float(loss), stats


def _check_units(rec, per_update: int, **exp):
    n = 4
    for u, units in enumerate(rec["steps"]):
        ms = [mm for mm, _, *_ in units]
        assert ms == [mm for mm in range(u * per_update, (u + 1) * per_update) for _ in range(2)]
        for mm, c, loss, stats, w in units:
            want, want_stats = _expected_unit(mm, c, **exp)
            assert loss.requires_grad  # the policy error keeps its graph
            assert float(loss.detach()) == pytest.approx(want / (n * per_update), rel=1e-9, abs=1e-12)
            assert stats.keys() == want_stats.keys()
            for k in stats:
                assert stats[k] == pytest.approx(want_stats[k], rel=1e-9, abs=1e-12), k
            assert w == len(c)


def test_one_step_units_losses_scale_and_what_reaches_each_phase(monkeypatch):
    """Catches a wrong loss scale (1 / (n x per_update)), a lost advantage clip (+-adv_clip), the wrong roles in the
    trained pass (only theta without clip / KL), units replaced instead of accumulated over chunks, wrong stat names,
    and wrong arguments to the rollout, the scorer, the advantages, the optimizer phase and the loggers."""
    rec = _run(monkeypatch, it=2)
    assert len(rec["steps"]) == 1
    assert [[c for _, c, *_ in s] for s in rec["steps"]] == [[[0, 1], [2, 3]] * 4]
    _check_units(rec, per_update=4)
    assert [e["roles"] for e in rec["errors"]] == [("theta",)] * 8
    for e in rec["errors"]:
        assert e["sigma"] == float(_SIG[e["m"]]) and e["it"] == 2 and e["cond"] in ([0, 1], [2, 3])
        assert torch.equal(e["x0"], _X0[e["cond"]])
    (col,) = rec["collect"]
    assert col["policy"] is None and col["it"] == 2 and col["seed"] == 0 and col["shape"] == (2,)
    assert col["index"].tolist() == [10, 11, 12, 13] and col["config"] is rec["model"].rollout_config
    assert rec["score"] == [{"iteration": 2}]
    assert rec["adv"] == [dict(std="group", eps=1e-4, min_group_size=2, iteration=2)]
    clipped = [5.0, -5.0, 0.5, -0.5]
    assert [lg["m"] for lg in rec["logits"]] == [0, 1, 2, 3]
    for lg in rec["logits"]:
        assert lg["adv"].tolist() == clipped and lg["size"] == 2 and lg["it"] == 2
        assert lg["sigma"] == float(_SIG[lg["m"]]) and lg["chunks"] == [[0, 1], [2, 3]]
    assert rec["max_grad_norm"] == 1.0
    assert rec["log_dict"] == [({"train/loss": 1.5}, {"batch_size": 4})]
    assert rec["log"] == [("train/iteration", 3.0, {"batch_size": 4})]  # no fast EMA: no old_decay
    assert rec["lagged"] == [] and rec["swap"] == [] and int(rec["model"].iteration) == 3


def test_two_updates_draw_their_own_sigmas_and_the_kl_term_is_added(monkeypatch):
    """Catches the sigma loop of update u not being m in [u x per_update, (u + 1) x per_update), a loss scale not
    1 / (n x per_update), and the KL term's sign / scale / stat (kl_beta x sum of mean (v - v_ref)^2, reference
    evaluated only with kl_beta > 0)."""
    rec = _run(monkeypatch, num_timesteps=4, updates_per_iteration=2, kl_beta=0.5, adv_clip=0.6, max_grad_norm=0.0)
    assert len(rec["steps"]) == 2
    _check_units(rec, per_update=2, kl_beta=0.5, adv_clip=0.6)
    assert [e["roles"] for e in rec["errors"]] == [("theta", "reference")] * 8
    assert rec["logits"][0]["adv"].tolist() == [0.6, -0.6, 0.5, -0.5]
    assert rec["max_grad_norm"] == 0.0


def test_dsm_clip_counts_cut_samples_and_the_fast_ema_decay(monkeypatch):
    """Catches the clip count (samples cut, not kept), a lost clip branch or old_policy role, and the fast EMA's
    decay not being min(max, ramp x (iteration + 1)) or its log's name / batch size."""
    rec = _run(monkeypatch, it=3, old_gap=0.5, clip_range=0.01, ema_decay_ramp=0.01)
    _check_units(rec, per_update=4, clip=0.01, old_gap=0.5)
    assert [s["train/clipfrac"] for *_, s, _ in rec["steps"][0]] == [1.0, 0.0] * 4  # sample 0: A > 0, rho > 1.01
    assert [e["roles"] for e in rec["errors"]] == [("theta", "old_policy")] * 8
    assert rec["lagged"] == [("old_policy", pytest.approx(0.04))]
    assert rec["log"][0] == ("train/old_decay", pytest.approx(0.04), {"batch_size": 4})
    assert rec["collect"][0]["policy"] is None  # no switch_ema_ref: the live policy rolls out


@pytest.mark.parametrize("it,by_ema", [(2, False), (3, True), (4, True)])
def test_the_fast_ema_rolls_out_from_switch_ema_ref_on(monkeypatch, it, by_ema):
    """Catches the switch being `>` instead of `>=`, always / never on, or swapping the wrong role into the
    wrong generator."""
    rec = _run(monkeypatch, it=it, switch_ema_ref=3)
    assert rec["collect"][0]["policy"] == ("swapped" if by_ema else None)
    assert rec["swap"] == ([(rec["gen"], "old_policy")] if by_ema else [])
    assert rec["lagged"] == [("old_policy", pytest.approx(min(0.3, 1e-3 * (it + 1))))]
