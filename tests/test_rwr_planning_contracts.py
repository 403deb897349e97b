"""Contracts of reward-weighted regression (genrl/methods/rwr.py) and of the planner role (genrl/methods/planning.py)
(issue 51, mutation survivors): RWR's defaults (beta 1, the ODE rollout, max_grad_norm 1, seed 0), its argument
checks, one training step against a float64 closed form (weights exp(beta A) * valid normalised over the valid
samples, the uniform re-noising draw at (seed, iteration, sample index), the clipped update, the logged
``train/loss`` / ``train/weight_max`` / ``train/iteration`` with the local batch size), the minimum group size and the
iteration named in its errors, and the validation step's sampler; the planner's construction from a config, the
``lm`` kind's required path, and sample_plans with and without a planner.

RWR runs as a module used on its own: the collect phase is replaced by a recorder returning fixed endpoints, the
scorer by a fixed reward vector, the policy by a two-parameter velocity v = a x_t + b t, and Lightning's ``log`` /
``optimizers`` / ``manual_backward`` / ``clip_gradients`` by small fakes. No Trainer, no model, no download.
"""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow.forward_rl import sample_timesteps
from genrl.methods import planning
from genrl.methods import rwr as rwr_module
from genrl.methods.phases import Rollouts
from genrl.methods.rwr import RewardWeightedRegression
from genrl.models.plans import TEMPLATE_CANDIDATES, Plan, Step, TemplatePlanner, split_then
from genrl.noise import mix_seed, randn_per_sample
from genrl.rollout.sampler import RolloutConfig

NAN = math.nan
F64 = torch.float64
LATENT = (2, 1, 2, 2)  # frames, channels, height, width
RWR_T, RWR_EPS = 41, 42  # the pinned stream numbers of "rwr.t" / "rwr.eps" (tests/test_noise_streams.py)


# ------------------------------------------------------------------------------------------------------- fakes
class _Log:
    """A recording ``LightningModule.log``: every call as (key, value, kwargs)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict]] = []

    def __call__(self, key, value, **kwargs) -> None:
        self.calls.append((key, value, kwargs))

    def kwargs(self, key: str) -> dict:
        (kw,) = [k for name, _, k in self.calls if name == key]
        return kw

    def __getitem__(self, key: str) -> float:
        (value,) = [v for k, v, _ in self.calls if k == key]
        return value


class _Result:
    """The surface of a RewardResult that score() and log_validation_rewards() read."""

    def __init__(self, total: torch.Tensor, valid: torch.Tensor) -> None:
        self.total, self.valid = total, valid

    def metrics(self) -> dict[str, float]:
        return {}


class _Scorer(torch.nn.Module):
    """A scorer returning fixed rewards (an nn.Module: it replaces the method's registered child)."""

    def __init__(self, total: list[float]) -> None:
        super().__init__()
        t = torch.tensor(total, dtype=torch.float32)
        self.result = _Result(t, ~t.isnan())
        self.calls: list[tuple[torch.Tensor, list[str]]] = []

    def forward(self, pixels, prompts, **meta):
        self.calls.append((pixels, list(prompts)))
        return self.result


class _Policy(torch.nn.Module):
    """v = a x_t + b t (t broadcast over the latent), the prompts' encoding recorded."""

    def __init__(self, a: float = 3.0, b: float = -2.0) -> None:
        super().__init__()
        self.transformer = torch.nn.Module()
        self.transformer.a = torch.nn.Parameter(torch.tensor(a))
        self.transformer.b = torch.nn.Parameter(torch.tensor(b))
        self.encoded: list[list[str]] = []

    def encode_prompts(self, prompts):
        self.encoded.append(list(prompts))
        return "cond"

    def velocity(self, x_t, t, cond):
        assert cond == "cond"
        return self.transformer.a * x_t + self.transformer.b * t.reshape(-1, *([1] * (x_t.dim() - 1)))


class _Collect:
    """Replaces rwr.collect_endpoints: records its arguments, returns fixed endpoints x0 and pixels."""

    def __init__(self, x0: torch.Tensor) -> None:
        self.x0, self.pixels = x0, torch.rand(len(x0), 1, 3, 2, 2, generator=torch.Generator().manual_seed(5))
        self.calls: list[tuple] = []

    def __call__(self, generator, prompts, latent_shape, seed, index, config, iteration):
        self.calls.append((generator, list(prompts), latent_shape, seed, index, config, iteration))
        return Rollouts(list(prompts), self.pixels, self.x0)


def _rwr(monkeypatch, total, lr: float = 0.1, iteration: int = 3, **kwargs):
    """An RWR module with the fakes above; returns (module, collect recorder, optimizer, clip calls)."""
    module = RewardWeightedRegression(latent_shape=list(LATENT), **kwargs)
    module.generator = _Policy()
    module.scorer = _Scorer(total)
    module.iteration.fill_(iteration)
    module.log = _Log()
    params = list(module.generator.transformer.parameters())
    opt = torch.optim.SGD(params, lr=lr)
    clips: list[dict] = []

    def clip_gradients(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clips.append({"optimizer": optimizer, "val": gradient_clip_val, "algorithm": gradient_clip_algorithm})
        torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    module.optimizers = lambda: opt
    module.manual_backward = lambda loss: loss.backward()
    module.clip_gradients = clip_gradients
    x0 = torch.randn(len(total), *LATENT, generator=torch.Generator().manual_seed(11))
    collect = _Collect(x0)
    monkeypatch.setattr(rwr_module, "collect_endpoints", collect)
    return module, collect, opt, clips


def _batch(group: list[int], index: list[int] | None = None) -> dict:
    n = len(group)
    return {"prompts": [f"p{g}" for g in group], "index": torch.tensor(index or [10 + i for i in range(n)]),
            "group": torch.tensor(group)}


def _weights64(total: list[float], group: list[int], beta: float) -> torch.Tensor:
    """exp(beta A) * valid / mean over the valid samples, A = (r - group mean) / (group std (ddof 0) + 1e-4) over
    each group's valid rewards, in float64."""
    r, g = torch.tensor(total, dtype=F64), torch.tensor(group)
    valid = ~r.isnan()
    adv = torch.zeros_like(r)
    for k in g.unique():
        m = (g == k) & valid
        vals = r[m]
        adv[m] = (vals - vals.mean()) / (vals.std(unbiased=False) + 1e-4)
    w = torch.exp(beta * adv) * valid
    return w / w[valid].mean()


def _step64(x0: torch.Tensor, index: torch.Tensor, seed: int, it: int, w: torch.Tensor, a: float, b: float):
    """The float64 RWR loss at (a, b) and its gradient: t ~ U(0, 1) and eps ~ N(0, I) addressed by (seed, it, stream,
    sample index), x_t = (1 - t) x0 + t eps, L = mean_b w_b mean_e (a x_t + b t - (eps - x0))^2."""
    t = sample_timesteps(len(index), mix_seed(seed, it, RWR_T), index, step=0, density="uniform").to(F64)
    eps = randn_per_sample(x0.shape[1:], mix_seed(seed, it, RWR_EPS), index, step=0).to(F64)
    x = x0.to(F64)
    tb = t.reshape(-1, 1, 1, 1, 1)
    x_t, u = (1 - tb) * x + tb * eps, eps - x
    pa, pb = torch.tensor(a, dtype=F64, requires_grad=True), torch.tensor(b, dtype=F64, requires_grad=True)
    loss = (w * ((pa * x_t + pb * tb - u) ** 2).flatten(1).mean(1)).mean()
    ga, gb = torch.autograd.grad(loss, [pa, pb])
    return float(loss.detach()), torch.stack([ga, gb])


# --------------------------------------------------------------------------------------------- RWR construction
def test_rwr_defaults_are_beta_1_the_ode_rollout_max_grad_norm_1_and_seed_0():
    """Catches a changed default: beta, max_grad_norm or seed, or the default rollout's kernel (the deterministic ODE
    sampler RWR's endpoints come from), or a latent shape that is dropped / not made a tuple."""
    module = RewardWeightedRegression()
    assert module.hparams.beta == 1.0 and module.hparams.max_grad_norm == 1.0 and module.hparams.seed == 0
    assert module.rollout_config == RolloutConfig(kernel="ode") and module.rollout_config.kernel == "ode"
    assert module.latent_shape is None
    assert RewardWeightedRegression(latent_shape=[2, 1, 4, 4]).latent_shape == (2, 1, 4, 4)
    given = RolloutConfig(kernel="ode", num_steps=3)
    assert RewardWeightedRegression(rollout=given).rollout_config is given


@pytest.mark.parametrize("beta", [0.0, -1.0])
def test_rwr_refuses_a_non_positive_beta(beta):
    """Catches ``beta >= 0`` accepted (beta = 0 makes every weight 1: no reward signal at all)."""
    with pytest.raises(ValueError, match="beta must be > 0"):
        RewardWeightedRegression(beta=beta)


# --------------------------------------------------------------------------------------------- RWR training step
TOTAL = [0.2, 0.5, NAN, 1.0, 0.0]  # one failed reward (NaN) in group 0
GROUP = [0, 0, 0, 1, 1]  # a group of 2: the smallest RWR accepts


def test_rwr_training_step_matches_the_float64_closed_form_with_the_defaults(monkeypatch):
    """One step with the defaults (beta 1, max_grad_norm 1, seed 0) at iteration 3, a failed reward in the batch.
    Catches: the endpoints not addressed by (seed, batch index, rollout config, iteration); weights not exp(beta A)
    * valid / their valid mean (divided by valid, beta / A, multiplied by the mean); the re-noising draw not uniform
    or not at (seed, iteration, index); the update without the gradient clip of norm 1; the unit's weight not 1
    (the logged loss would be halved); ``train/loss`` / ``train/weight_max`` / ``train/iteration`` under another
    name or without batch_size = the local batch size; the iteration counter not advanced."""
    module, collect, opt, clips = _rwr(monkeypatch, TOTAL)
    batch = _batch(GROUP)
    a0, b0 = 3.0, -2.0
    assert module.training_step(batch, 0) is None

    (call,) = collect.calls
    assert call[0] is module.generator and call[1] == batch["prompts"] and call[2] == LATENT and call[3] == 0
    assert torch.equal(call[4], batch["index"]) and call[5] == RolloutConfig(kernel="ode") and call[6] == 3
    assert module.scorer.calls[0][1] == batch["prompts"] and module.generator.encoded == [batch["prompts"]]

    w = _weights64(TOTAL, GROUP, beta=1.0)
    assert w[2] == 0 and float(w[[0, 1, 3, 4]].mean()) == pytest.approx(1.0)
    loss, grad = _step64(collect.x0, batch["index"], 0, 3, w, a0, b0)
    log = module.log
    assert log["train/weight_max"] == pytest.approx(float(w.max()), rel=1e-6)
    assert log["train/loss"] == pytest.approx(loss, rel=1e-5)
    for key in ("train/loss", "train/weight_max", "train/iteration"):
        assert log.kwargs(key) == {"batch_size": 5}, key
    assert log["train/iteration"] == 4.0 and int(module.iteration) == 4

    assert [(c["optimizer"], c["val"], c["algorithm"]) for c in clips] == [(opt, 1.0, "norm")]
    gnorm = float(grad.norm())
    assert gnorm > 1.5  # the clip is active: the step is lr * grad / |grad|
    expected = torch.tensor([a0, b0], dtype=F64) - 0.1 * grad * (1.0 / (gnorm + 1e-6))
    got = torch.stack([p.detach().to(F64) for p in module.generator.transformer.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_rwr_beta_is_the_inverse_temperature_of_the_weights(monkeypatch):
    """Catches beta not applied as exp(beta * A) (``beta / A``, or the default in place of the given value) and a
    given max_grad_norm / seed not used: weights at beta = 2.5, seed 7 at iteration 0, no clip (max_grad_norm 0)."""
    module, collect, opt, clips = _rwr(monkeypatch, TOTAL, iteration=0, beta=2.5, max_grad_norm=0.0, seed=7)
    batch = _batch(GROUP, index=[4, 0, 3, 1, 2])
    module.training_step(batch, 0)
    w = _weights64(TOTAL, GROUP, beta=2.5)
    assert module.log["train/weight_max"] == pytest.approx(float(w.max()), rel=1e-6)
    assert collect.calls[0][3] == 7 and collect.calls[0][6] == 0 and clips == []
    loss, grad = _step64(collect.x0, batch["index"], 7, 0, w, 3.0, -2.0)
    assert module.log["train/loss"] == pytest.approx(loss, rel=1e-5)
    got = torch.stack([p.detach().to(F64) for p in module.generator.transformer.parameters()])
    torch.testing.assert_close(got, torch.tensor([3.0, -2.0], dtype=F64) - 0.1 * grad, rtol=1e-5, atol=1e-6)


def test_rwr_refuses_a_group_of_one_naming_the_iteration(monkeypatch):
    """Catches a minimum group size other than 2 (1: a lone sample's advantage is always 0; 3: a group of 2 refused,
    see the closed-form test) and the iteration left out of the error."""
    module, *_ = _rwr(monkeypatch, [0.2, 0.5, 1.0], iteration=3)
    with pytest.raises(ValueError, match=r"iteration 3: a group of size 1: .* at least 2 rollouts"):
        module.training_step(_batch([0, 0, 1]), 0)


def test_rwr_all_failed_rewards_raise_naming_the_iteration(monkeypatch):
    """Catches the iteration not passed to the score phase (its error names the iteration of the failing batch)."""
    module, *_ = _rwr(monkeypatch, [NAN, NAN, NAN, NAN], iteration=6)
    with pytest.raises(RuntimeError, match="iteration 6: every reward of the batch is invalid"):
        module.training_step(_batch([0, 0, 1, 1]), 0)


def test_rwr_validation_samples_the_rollout_config_at_iteration_0(monkeypatch):
    """Catches the validation samples not addressed by (seed, batch index) with the rollout config at iteration 0
    (fixed noise across validations: the curve compares the same samples), and ``val/total`` not their mean reward."""
    module, collect, *_ = _rwr(monkeypatch, [0.25, NAN, 0.75], iteration=5, seed=9)
    batch = _batch([0, 0, 1], index=[7, 8, 9])
    out = module.validation_step(batch, 0)
    (call,) = collect.calls
    assert call[1] == batch["prompts"] and call[2] == LATENT and call[3] == 9
    assert torch.equal(call[4], torch.tensor([7, 8, 9])) and call[5] is module.rollout_config and call[6] == 0
    assert out["prompts"] == batch["prompts"] and out["videos"] is collect.pixels
    assert module.log["val/total"] == pytest.approx(0.5) and module.log.kwargs("val/total")["batch_size"] == 3


# ------------------------------------------------------------------------------------------------------- planning
def test_build_planner_passes_the_template_arguments():
    """Catches the template planner built without its config's other keys (candidates, init_logits dropped: every
    candidate, uniform logits)."""
    planner = planning.build_planner({"kind": "template", "candidates": ["reversed", "merged"],
                                      "init_logits": [0.5, -1.0]})
    assert isinstance(planner, TemplatePlanner) and planner.candidates == ("reversed", "merged")
    assert planner.splitter is split_then
    torch.testing.assert_close(planner.logits.detach(), torch.tensor([0.5, -1.0]))
    shapes = planning.build_planner({"kind": "template", "splitter": "shapes"})
    assert shapes.splitter is planning.SPLITTERS["shapes"] and shapes.candidates == TEMPLATE_CANDIDATES


@pytest.mark.parametrize("spec", [{"kind": "lm"}, {"kind": "lm", "path": ""}])
def test_check_planner_spec_requires_the_lm_path(spec):
    """Catches the ``lm`` kind accepted without a model folder (the check compares the kind to the wrong name)."""
    with pytest.raises(ValueError, match="planner.path is required"):
        planning.check_planner_spec(spec)


def test_sample_plans_without_a_planner_is_k_copies_of_the_global_prompt():
    """Catches the global plan's prompt, its one step over every chunk, or its behaviour log-prob (exactly [0.0],
    one value) changed or dropped."""
    plans = planning.sample_plans(None, ["a", "b"], 3, 2, seed=1, iteration=4, indices=torch.tensor([5, 6]))
    assert [len(row) for row in plans] == [2, 2]
    for prompt, row in zip(["a", "b"], plans):
        for plan in row:
            assert plan.global_prompt == prompt and plan.steps == (Step(prompt, 0, 3),)
            assert isinstance(plan.behaviour_log_probs, torch.Tensor)
            assert torch.equal(plan.behaviour_log_probs, torch.zeros(1))


class _Planner:
    """Records sample()'s arguments (TemplatePlanner's signature)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sample(self, global_prompts, num_chunks, k, seed, iteration=0, prompt_indices=None):
        self.calls.append((list(global_prompts), num_chunks, k, seed, iteration, prompt_indices))
        return [["plan"] * k for _ in global_prompts]


def test_sample_plans_addresses_the_planner_by_seed_iteration_and_sample_ids():
    """Catches the seed, the iteration or the sample ids not passed to the planner (a prompt's plans would then not
    be addressed by (seed, iteration, sample id)); checked on a recorder and on a real template planner."""
    rec = _Planner()
    out = planning.sample_plans(rec, ["a", "b"], 3, 2, seed=11, iteration=4, indices=torch.tensor([7, 2]))
    assert out == [["plan", "plan"], ["plan", "plan"]]
    assert rec.calls == [(["a", "b"], 3, 2, 11, 4, [7, 2])]
    assert all(type(i) is int for i in rec.calls[0][5])

    planner = TemplatePlanner(init_logits=[0.3, -0.2, 0.1, 0.0, -0.4])
    got = planning.sample_plans(planner, ["a then b", "c then d"], 2, 6, 11, 4, torch.tensor([7, 2]))
    want = planner.sample(["a then b", "c then d"], 2, 6, 11, 4, prompt_indices=[7, 2])
    assert [[p.candidate for p in row] for row in got] == [[p.candidate for p in row] for row in want]
    assert all(isinstance(p, Plan) for row in got for p in row)
