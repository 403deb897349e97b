"""Contracts of the pieces every method composes (genrl/methods/common.py), written for the mutation survivors of that
module (issue 51): building the policy / student from its spec, the recorded generator spec and the hyperparameters
``init_method`` saves, the reward :class:`Scorer` (build context, checkpointed extra state, per-sample meta), the rank
view of a batch (gathers, a rank's share of a global mini-batch and the divisors it names), the latent-shape defaults,
the validation logging, the ODE validation sampler, the checks before a diffusers family loads, and the optimizer
plumbing (role optimizers under DDP, counted / uncounted steps, gradient clipping to a norm, the warm-up schedule).

Each test calls the function directly with tiny inputs: a bare LightningModule attached to a CPU ``Trainer`` (no
``fit``), a one-process gloo group for DDP, and recorders standing in for model loaders.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import genrl.methods.common as common
from genrl.methods.common import (
    SHAPES_DIT,
    Scorer,
    advance_iteration,
    backward_step,
    build_policy,
    build_student,
    check_before_loading,
    check_finite,
    check_no_dropout,
    clip_and_step,
    configure_policy,
    default_latent_shape,
    frame_shape_of,
    gather_batch,
    gather_objects,
    init_method,
    linear_warmup,
    local_mini_batch,
    log_validation_rewards,
    ode_validation_config,
    policy_spec,
    role_optimizers,
    step_uncounted,
)
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.roles import Roles
from genrl.rewards import RewardModel, register_reward
from genrl.rollout import RolloutConfig

PROBE = "test_common_probe"


@register_reward(PROBE)
class _ProbeReward(RewardModel):
    """reward = mean pixel + meta ``offset``; valid = meta ``ok`` (all valid without it); remembers the ``world`` it
    was built with ("unset": none was given)."""

    def __init__(self, world="unset", scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.world = world

    def score(self, pixels, prompts, offset=None, ok=None, **meta):
        r = pixels.float().mean(dim=(1, 2, 3, 4))
        if offset is not None:
            r = r + torch.as_tensor(offset, dtype=r.dtype)
        out = {"reward": r}
        if ok is not None:
            out["valid"] = torch.as_tensor(ok, dtype=torch.bool)
        return out


def _trainer(**kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, **kwargs)


def _with_world(world):
    return SimpleNamespace(datamodule=SimpleNamespace(world=world))


class _Gen(nn.Module):
    """A generator stand-in: a transformer (in eval mode, as from_pretrained returns it), optional latent_shape /
    frame_dim (a diffusers family's)."""

    def __init__(self, latent_shape=None, frame_dim=None) -> None:
        super().__init__()
        self.transformer = nn.Linear(2, 2).eval()
        if latent_shape is not None:
            self.latent_shape = latent_shape
        if frame_dim is not None:
            self.frame_dim = frame_dim


class _Method(LightningModule):
    """A method that builds its common state with init_method (its own ``lr`` and an optimizer factory)."""

    def __init__(self, generator=None, rewards=None, reward_combine: str = "weighted_sum", optimizer=None,
                 lr: float = 0.25, latent_shape=None) -> None:
        super().__init__()
        init_method(self, generator, rewards, reward_combine)
        self.latent_shape = latent_shape


class _DefaultsMethod(LightningModule):
    """A method that leaves init_method's reward / combine / ignore arguments at their defaults."""

    def __init__(self, generator=None, optimizer=None, group_size: int = 3) -> None:
        super().__init__()
        init_method(self, generator)


# ---------------------------------------------------------------------------------------------- building the policy
@pytest.fixture
def built(monkeypatch):
    """Records build_generator's specs and LoraSpec.add_to's (spec, generator) instead of loading weights."""
    calls = SimpleNamespace(specs=[], lora=[])

    def fake_build(spec):
        calls.specs.append(spec)
        return _Gen()

    monkeypatch.setattr(common, "build_generator", fake_build)
    monkeypatch.setattr(LoraSpec, "add_to", lambda self, gen: calls.lora.append((self, gen)))
    return calls


def test_build_policy_builds_the_given_spec_or_the_shapes_dit_with_lora_in_train_mode(built):
    """build_policy: spec None builds SHAPES_DIT, a given spec is built as given; a LoraSpec is added as is, a dict
    as LoraSpec(**dict); no LoRA: nothing added; the transformer is left in train mode."""
    gen = build_policy(None)
    assert built.specs == [SHAPES_DIT] and built.lora == [] and gen.transformer.training
    spec = GeneratorSpec(family="wan", pretrained="some/folder")
    lora = LoraSpec(rank=4)
    gen = build_policy(spec, lora)
    assert built.specs[-1] is spec and built.lora == [(lora, gen)] and built.lora[0][0] is lora
    gen = build_policy(spec, {"rank": 3, "alpha": 6.0})
    assert built.lora[-1] == (LoraSpec(rank=3, alpha=6.0), gen) and gen.transformer.training


def test_build_student_forwards_spec_and_lora_and_names_the_missing_export(built, monkeypatch):
    """build_student is build_policy(spec, lora); a missing weights folder is re-raised naming the config key and
    the ODE-init stage that writes it."""
    spec = GeneratorSpec(family="wan", pretrained="some/folder")
    gen = build_student(spec, {"rank": 5})
    assert built.specs == [spec] and built.lora == [(LoraSpec(rank=5), gen)]

    def missing(spec):
        raise FileNotFoundError("no folder")

    monkeypatch.setattr(common, "build_generator", missing)
    with pytest.raises(FileNotFoundError, match=r"no folder\n.*model\.init_args\.generator\.pretrained.*ode_init"):
        build_student(spec)


def test_policy_spec_converts_and_records_the_spec_as_plain_values():
    """policy_spec: None -> default, a GeneratorSpec as is, a dict -> GeneratorSpec(**dict); hparams["generator"] is
    asdict(spec)."""
    method = SimpleNamespace(hparams={})
    assert policy_spec(method, None) is SHAPES_DIT and method.hparams == {"generator": asdict(SHAPES_DIT)}
    spec = GeneratorSpec(family="wan", pretrained="w", height=64)
    assert policy_spec(method, spec) is spec and method.hparams["generator"] == asdict(spec)
    out = policy_spec(method, {"family": "sd3", "pretrained": "s", "width": 96})
    assert out == GeneratorSpec(family="sd3", pretrained="s", width=96)
    assert method.hparams == {"generator": asdict(out)}
    other = GeneratorSpec(family="sana", pretrained="d")
    assert policy_spec(method, None, default=other) is other


def test_init_method_records_the_callers_arguments_and_creates_the_common_state():
    """init_method: hparams = the method's __init__ arguments except the optimizer factory, with the generator spec
    as plain values; manual optimization (False); generator None; generator_spec = the returned spec; an int64 0-d
    ``iteration`` buffer (0, in the state dict); the Scorer with the given combine; a Roles table of the method."""
    rewards = [{"name": PROBE}]
    method = _Method({"family": "wan", "pretrained": "w"}, rewards, "zscore_sum", optimizer=object(), lr=0.5)
    spec = GeneratorSpec(family="wan", pretrained="w")
    assert dict(method.hparams) == {"generator": asdict(spec), "rewards": rewards, "reward_combine": "zscore_sum",
                                    "lr": 0.5, "latent_shape": None}
    assert method.automatic_optimization is False
    assert method.generator is None and method.generator_spec == spec
    assert method.iteration.dtype == torch.int64 and method.iteration.shape == () and int(method.iteration) == 0
    assert "iteration" in method.state_dict()
    assert isinstance(method.scorer, Scorer) and method.scorer.manager.combine == "zscore_sum"
    assert method.scorer.manager.names == [PROBE]
    assert isinstance(method.roles, Roles) and method.roles.owner is method


def test_init_method_defaults_ignore_the_optimizer_and_combine_by_weighted_sum():
    """init_method's defaults: the ``optimizer`` argument is not a hyperparameter, rewards default to the shapes
    verifier combined by ``weighted_sum``, the generator to SHAPES_DIT."""
    method = _DefaultsMethod(optimizer=object(), group_size=4)
    assert dict(method.hparams) == {"generator": asdict(SHAPES_DIT), "group_size": 4}
    assert method.generator_spec is SHAPES_DIT
    assert method.scorer.manager.combine == "weighted_sum" and method.scorer.manager.names == ["shapes"]


# ---------------------------------------------------------------------------------------------- configure_policy
def test_configure_policy_builds_once_registers_the_roles_and_resolves_the_latent_shape():
    """configure_policy: builds generator_spec with hparams.lora, registers the trainable ``generator``, declares
    the reference only when asked (default: none), resolves latent_shape (the method's, else the generator's) and
    builds the scorer with the trainer's world; a second call returns None and builds nothing."""
    calls = []

    def build(spec, lora):
        calls.append((spec, lora))
        return _Gen(latent_shape=(5, 4, 8, 8))

    method = _Method(rewards=[{"name": PROBE}])
    method.hparams["lora"] = {"rank": 2}
    method.trainer = _with_world("W")
    gen = configure_policy(method, build=build)
    assert calls == [(SHAPES_DIT, {"rank": 2})] and method.generator is gen
    assert method.latent_shape == (5, 4, 8, 8)
    assert method.roles.table["generator"].kind == "trainable" and "reference" not in method.roles.table
    assert method.scorer.manager[PROBE].world == "W"
    assert configure_policy(method, build=build) is None and len(calls) == 1

    method = _Method(rewards=[{"name": PROBE}], latent_shape=[2, 3, 4, 4])
    gen = configure_policy(method, reference=True, build=build)
    assert method.latent_shape == (2, 3, 4, 4)
    assert method.roles.table["reference"].kind == "frozen"
    assert torch.equal(method.frozen["reference"].weight, gen.transformer.weight)


# ---------------------------------------------------------------------------------------------- Scorer
def _pixels(means):
    return torch.stack([torch.full((1, 1, 2, 2), float(m), dtype=torch.float64) for m in means])


def test_scorer_builds_once_with_the_trainers_world():
    """Scorer.build: builds the rewards once, passing the datamodule's ``world`` when there is one and no world
    argument otherwise; later builds keep the models."""
    scorer = Scorer([{"name": PROBE}])
    manager = scorer.build(_with_world("W"))
    assert manager is scorer.manager and manager.built
    model = manager.models[PROBE]
    assert model.world == "W"
    assert scorer.build(_with_world("other")).models[PROBE] is model
    assert Scorer([{"name": PROBE}]).build().models[PROBE].world == "unset"
    assert Scorer([{"name": PROBE}]).build(SimpleNamespace(datamodule=object())).models[PROBE].world == "unset"


def test_scorer_defaults_to_the_shapes_verifier_and_keeps_the_combine():
    """Scorer(): the shapes verifier; the combine mode reaches the manager; an empty list is refused."""
    assert Scorer().manager.names == ["shapes"] and Scorer().manager.combine == "weighted_sum"
    assert Scorer([{"name": PROBE}], "zscore_sum").manager.combine == "zscore_sum"
    with pytest.raises(ValueError, match="at least one reward"):
        Scorer([])


def test_scorer_forward_passes_the_meta_to_every_reward():
    """Scorer(pixels, prompts, **meta): the rewards see the per-sample meta (here an offset added to the score)."""
    scorer = Scorer([{"name": PROBE}])
    result = scorer(_pixels([0.25, 0.5]), ["a", "b"], offset=[1.0, 2.0])
    torch.testing.assert_close(result.rewards[PROBE], torch.tensor([1.25, 2.5]))


def test_scorer_extra_state_round_trips_the_running_statistics():
    """The Scorer's extra state is the manager's state once built (None before, or the pending restored state); a
    state restored before the build does not build the models (they need the trainer's world), is applied at the
    build, once; a built scorer applies a restored state at once."""
    src = Scorer([{"name": PROBE}], "zscore_sum")
    assert src.get_extra_state() is None
    src.build()
    src(_pixels([0.2, 0.6, 0.7]), ["a", "b", "c"])
    state = src.get_extra_state()
    assert state == src.manager.state_dict() and state["stats"][PROBE]["count"] == 3

    dst = Scorer([{"name": PROBE}], "zscore_sum")
    dst.load_state_dict(src.state_dict())
    assert not dst.manager.built and dst.get_extra_state() == state
    dst.build(_with_world("W"))
    assert dst.manager[PROBE].world == "W"
    assert dst.manager.running_stats() == src.manager.running_stats()
    dst.build()
    assert dst.get_extra_state() == state

    live = Scorer([{"name": PROBE}], "zscore_sum")
    live.build()
    live.set_extra_state(state)
    assert live.manager.running_stats() == src.manager.running_stats()
    live.set_extra_state(None)
    assert live.manager.running_stats() == src.manager.running_stats()


# ---------------------------------------------------------------------------------------------- validation logging
class _Logs:
    def __init__(self) -> None:
        self.calls: dict[str, tuple[float, dict]] = {}

    def log(self, name, value, **kwargs):
        self.calls[name] = (value, kwargs)


def test_log_validation_rewards_logs_the_valid_mean_per_batch_size_and_returns_the_videos():
    """log_validation_rewards: ``val/<reward>/<key>`` and ``val/total`` (mean over the valid samples, the meta
    reaching the rewards), each with batch_size = number of prompts; NaN when none is valid; returns the videos and
    prompts for the video logger."""
    scorer = Scorer([{"name": PROBE}])
    videos, prompts = _pixels([0.25, 0.5, 0.75]), ["a", "b", "c"]
    logs = _Logs()
    out = log_validation_rewards(logs, scorer, videos, prompts, ok=[True, False, True])
    assert out == {"videos": videos, "prompts": prompts} and out["videos"] is videos
    value, kwargs = logs.calls["val/total"]
    assert value == pytest.approx(0.5) and kwargs["batch_size"] == 3
    assert logs.calls[f"val/{PROBE}/reward"] == (pytest.approx(0.5), {"batch_size": 3})
    assert logs.calls[f"val/{PROBE}/invalid_fraction"][0] == pytest.approx(1 / 3)
    assert "val/val/total" not in logs.calls

    logs = _Logs()
    log_validation_rewards(logs, scorer, videos, prompts, ok=[False, False, False])
    assert math.isnan(logs.calls["val/total"][0]) and logs.calls["val/total"][1]["batch_size"] == 3


def test_advance_iteration_counts_and_logs_the_iteration():
    """advance_iteration: iteration += 1, logged as ``train/iteration`` (float) with the given batch size; returns
    the new value as an int."""
    logs = _Logs()
    method = SimpleNamespace(iteration=torch.zeros((), dtype=torch.long), log=logs.log)
    assert advance_iteration(method, 4) == 1
    assert advance_iteration(method, 4) == 2 and int(method.iteration) == 2
    assert logs.calls == {"train/iteration": (2.0, {"batch_size": 4})}


def test_ode_validation_config_keeps_the_rollouts_batching_and_noise_backend():
    """ode_validation_config: the rollout's batching mode and noise backend reach the validation sampler."""
    base = RolloutConfig(num_steps=4, batching="bucketed", noise_backend="philox", micro_batch_size=2)
    val = ode_validation_config(base)
    assert (val.kernel, val.batching, val.noise_backend) == ("ode", "bucketed", "philox")


# ---------------------------------------------------------------------------------------------- shapes
def test_default_latent_shape_prefers_the_given_then_the_generators_then_the_shapes_dit():
    """default_latent_shape: a given (non-empty) shape as a tuple, else the generator's latent_shape, else
    (8, 3, 16, 16)."""
    assert default_latent_shape(_Gen(latent_shape=(5, 4, 6, 6)), [2, 3, 4, 4]) == (2, 3, 4, 4)
    assert default_latent_shape(_Gen(latent_shape=[5, 4, 6, 6])) == (5, 4, 6, 6)
    assert default_latent_shape(_Gen(latent_shape=(5, 4, 6, 6)), ()) == (5, 4, 6, 6)
    assert default_latent_shape(_Gen()) == (8, 3, 16, 16)
    assert default_latent_shape(object(), None) == (8, 3, 16, 16)


def test_frame_shape_of_drops_the_frame_axis_of_the_given_or_generators_shape():
    """frame_shape_of: the shape without axis frame_dim - 1 (frame_dim 1 unless the generator says; Wan: 2), of
    ``latent_shape`` or else the generator's; ``default`` when neither exists; python ints."""
    assert frame_shape_of(object()) == (3, 16, 16)
    assert frame_shape_of(object(), default=(4, 8, 8)) == (4, 8, 8)
    assert frame_shape_of(object(), (8, 4, 6, 10)) == (4, 6, 10)
    wan = _Gen(latent_shape=(16, 5, 4, 6), frame_dim=2)
    assert frame_shape_of(wan) == (16, 4, 6)
    assert frame_shape_of(wan, torch.Size([4, 9, 2, 2])) == (4, 2, 2)
    out = frame_shape_of(_Gen(latent_shape=(7, 2, 3, 5)), None)
    assert out == (2, 3, 5) and all(type(v) is int for v in out)


# ---------------------------------------------------------------------------------------------- rank view
def _module(rank: int, world: int, **kwargs):
    strategy = SimpleNamespace(distributed_sampler_kwargs={"rank": rank, "num_replicas": world})
    return SimpleNamespace(trainer=SimpleNamespace(strategy=strategy), **kwargs)


def test_gather_batch_sends_the_slice_on_the_modules_device():
    """gather_batch hands all_gather this rank's rows on the module's device (a collective backend needs them
    there) and returns the global batch on the CPU."""
    rows = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)
    seen = []

    def all_gather(t):
        seen.append(t.device)
        return rows.clone()

    module = _module(0, 2, device=torch.device("meta"), all_gather=all_gather)
    out = gather_batch(module, rows[0])
    assert seen == [torch.device("meta")] and torch.equal(out, rows.reshape(6, 2)) and out.device.type == "cpu"


def test_gather_objects_sends_this_ranks_items(monkeypatch):
    """gather_objects gives all_gather_object this rank's items (as a list) and keeps one copy per group."""
    names = [["a", "b"], ["c", "d"]]

    def all_gather_object(out, obj):
        out[:] = [obj, names[1]]

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert gather_objects(_module(0, 2), ("a", "b")) == ["a", "b", "c", "d"]


def test_local_mini_batch_is_an_int_share_and_a_bad_size_names_the_valid_ones():
    """local_mini_batch: M / W as an int when W divides M and M / W divides the local batch; otherwise ValueError
    naming every valid global size d (a multiple of W dividing W * local, d / W dividing local)."""
    two = _module(0, 2)
    assert local_mini_batch(two, None, 6) == 6
    for m, share in ((2, 1), (4, 2), (6, 3), (12, 6)):
        out = local_mini_batch(two, m, 6)
        assert out == share and type(out) is int
    for bad in (5, 3, 8, 10):
        with pytest.raises(ValueError, match=r"over 2 device\(s\).*use one of \[2, 4, 6, 12\]$"):
            local_mini_batch(two, bad, 6)
    with pytest.raises(ValueError, match=r"batch of 9 samples .* use one of \[1, 3, 9\]$"):
        local_mini_batch(_module(0, 1), 2, 9)


# ---------------------------------------------------------------------------------------------- optimizers
@pytest.fixture
def gloo():
    """A real one-process gloo group (DDP can wrap a module on it)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_role_optimizers_refuse_several_networks_under_ddp_without_unused_parameters(gloo):
    """role_optimizers: one optimizer per factory (``joined`` roles' parameters added to the named one's); several
    factories under DDP without find_unused_parameters are refused naming the fix; one factory, DDP with
    find_unused_parameters, or no DDP (or no trainer) is fine."""
    method = _Method()
    gen, critic, head = _Gen(), nn.Linear(2, 1), nn.Linear(1, 1)
    method.roles.trainable("generator", gen)
    method.roles.trainable("critic", critic)
    method.roles.trainable("head", head)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    opts = role_optimizers(method, joined={"generator": ["head"]}, generator=sgd, critic=sgd)
    assert [[id(p) for p in o.param_groups[0]["params"]] for o in opts] == [
        [id(p) for p in (*gen.transformer.parameters(), *head.parameters())], [id(p) for p in critic.parameters()]]

    def under(ddp):
        method.trainer = SimpleNamespace(strategy=SimpleNamespace(model=ddp))
        return method

    strict = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    loose = nn.parallel.DistributedDataParallel(nn.Linear(2, 2), find_unused_parameters=True)
    with pytest.raises(ValueError, match="find_unused_parameters"):
        role_optimizers(under(strict), generator=sgd, critic=sgd)
    assert len(role_optimizers(under(strict), generator=sgd)) == 1
    assert len(role_optimizers(under(loose), generator=sgd, critic=sgd)) == 2
    assert len(role_optimizers(under(nn.Linear(2, 2)), generator=sgd, critic=sgd)) == 2
    method.trainer = SimpleNamespace()
    assert len(role_optimizers(method, generator=sgd, critic=sgd)) == 2


class _Net(LightningModule):
    """w (1 x 3, no bias) with SGD lr 1 behind a LightningOptimizer whose counted steps are recorded (what
    Lightning's manual loop hooks to advance global_step); records on_before_optimizer_step."""

    def __init__(self, trainer: Trainer | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lin = nn.Linear(3, 1, bias=False)
        nn.init.zeros_(self.lin.weight)
        self.hooks: list[str] = []
        self.register_buffer("iteration", torch.tensor(7))
        self.opt = torch.optim.SGD(self.lin.parameters(), lr=1.0)
        self.lopt = LightningOptimizer(self.opt)
        self.counted: list[int] = []
        self.lopt._on_after_step = lambda: self.counted.append(1)
        if trainer is not None:
            trainer.strategy.connect(self)
            self.trainer = trainer
            self.lopt._strategy = trainer.strategy

    def on_before_optimizer_step(self, optimizer) -> None:
        self.hooks.append("before")

    def delta(self) -> list[float]:
        return self.lin.weight.detach().reshape(-1).tolist()

    def set_grad(self, g) -> None:
        self.lin.weight.grad = torch.tensor([g], dtype=torch.float32)


def test_step_uncounted_steps_through_the_strategy_without_counting():
    """step_uncounted: with a trainer and a Lightning optimizer, the strategy steps the wrapped optimizer (hooks
    run) and no counted step happens; a plain optimizer, or no trainer, is stepped directly."""
    net = _Net(_trainer())
    net.set_grad([1.0, 2.0, 3.0])
    step_uncounted(net, net.lopt)
    assert net.delta() == [-1.0, -2.0, -3.0] and net.hooks == ["before"] and net.counted == []
    step_uncounted(net, net.opt)
    assert net.delta() == [-2.0, -4.0, -6.0] and net.hooks == ["before"]

    alone = _Net()
    alone.set_grad([1.0, 0.0, 0.0])
    alone.opt.step = lambda *a, **k: alone.hooks.append("plain step")
    alone.lopt.step = lambda *a, **k: alone.hooks.append("wrapper step")
    step_uncounted(alone, alone.lopt)
    step_uncounted(alone, alone.opt)
    assert alone.hooks == ["wrapper step", "plain step"]


def test_clip_and_step_clips_to_the_norm_only_when_positive_and_counts_by_default():
    """clip_and_step: max_grad_norm > 0 rescales the gradient to that norm (not by value); 0 (the default) leaves it
    and never asks for clipping; counted (default) is a counted optimizer step, else an uncounted one."""
    net = _Net(_trainer())
    net.set_grad([3.0, 4.0, 0.0])
    clip_and_step(net, net.lopt)
    assert net.delta() == pytest.approx([-3.0, -4.0, 0.0]) and net.counted == [1]
    net.set_grad([3.0, 4.0, 0.0])
    clip_and_step(net, net.lopt, 0.5)
    assert net.delta() == pytest.approx([-3.3, -4.4, 0.0]) and net.counted == [1, 1]
    net.set_grad([3.0, 4.0, 0.0])
    clip_and_step(net, net.lopt, 2.0, counted=False)
    assert net.delta() == pytest.approx([-4.5, -6.0, 0.0]) and net.counted == [1, 1] and net.hooks[-1] == "before"

    by_value = _Net(_trainer(gradient_clip_algorithm="value"))
    by_value.set_grad([3.0, 4.0, 0.0])
    clip_and_step(by_value, by_value.lopt, 0.0)  # no clipping asked: the trainer's value setting is not consulted
    assert by_value.delta() == pytest.approx([-3.0, -4.0, 0.0])
    by_value.set_grad([3.0, 4.0, 0.0])
    with pytest.raises(MisconfigurationException):  # a norm clip is never turned into a value clip
        clip_and_step(by_value, by_value.lopt, 1.0)


def test_backward_step_backpropagates_clips_by_the_hparam_and_steps():
    """backward_step: zero the gradients, back-propagate the loss, clip to hparams.max_grad_norm (no clipping
    without it) and step, counted by default or uncounted."""
    net = _Net(_trainer())
    x = torch.tensor([[3.0, 4.0, 0.0]])
    net.set_grad([100.0, 100.0, 100.0])  # stale: zeroed first
    backward_step(net, net.lopt, net.lin(x).sum(), "generator")
    assert net.delta() == pytest.approx([-3.0, -4.0, 0.0]) and net.counted == [1]
    net.hparams["max_grad_norm"] = 2.0
    backward_step(net, net.lopt, net.lin(x).sum(), "generator")
    assert net.delta() == pytest.approx([-4.2, -5.6, 0.0]) and net.counted == [1, 1]
    backward_step(net, net.lopt, net.lin(x).sum(), "generator", counted=False)
    assert net.delta() == pytest.approx([-5.4, -7.2, 0.0]) and net.counted == [1, 1]


def test_backward_step_refuses_a_non_finite_loss_naming_role_iteration_and_hint():
    """A NaN / inf loss raises FloatingPointError naming the role, the value, the method's iteration and the hint,
    before any update; check_finite passes a finite loss."""
    net = _Net(_trainer())
    net.set_grad([1.0, 1.0, 1.0])
    with pytest.raises(FloatingPointError, match=r"non-finite critic loss nan at iteration 7; lower the critic "
                                                 r"learning rate \(or the cfg\)"):
        backward_step(net, net.lopt, torch.tensor(float("nan")), "critic", " (or the cfg)")
    with pytest.raises(FloatingPointError, match=r"non-finite student loss inf at iteration 7"):
        backward_step(net, net.lopt, torch.tensor(float("inf")), "student")
    assert net.delta() == [0.0, 0.0, 0.0] and net.counted == [] and net.lin.weight.grad.tolist() == [[1.0] * 3]
    check_finite(torch.tensor(1.5), "generator", 3)
    with pytest.raises(FloatingPointError, match="generator loss -inf at iteration 3"):
        check_finite(torch.tensor(-math.inf), "generator", 3)


def test_linear_warmup_ramps_the_learning_rate_per_step():
    """linear_warmup: {"optimizer", "lr_scheduler": {"scheduler", "interval": "step"}}; lr factor
    min(1, (step + 1) / max(1, warmup_steps)); warmup 0 or 1: factor 1 throughout."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    cfg = linear_warmup(opt, 4)
    sched = cfg["lr_scheduler"]["scheduler"]
    assert cfg == {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and sched.optimizer is opt
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0])
    for warmup in (0, 1):
        opt = torch.optim.SGD([p], lr=2.0)
        sched = linear_warmup(opt, warmup)["lr_scheduler"]["scheduler"]
        lrs = []
        for _ in range(3):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert lrs == pytest.approx([2.0, 2.0, 2.0])


# ---------------------------------------------------------------------------------------------- before loading
@pytest.fixture
def checks(monkeypatch):
    """Records check_sample_size / check_prompt_images / family_class calls (a family's is_video: ``wan`` yes)."""
    import genrl.models.loading as loading

    calls = SimpleNamespace(size=[], images=[], family=[])

    def family_class(name):
        calls.family.append(name)
        return SimpleNamespace(is_video=name == "wan")

    monkeypatch.setattr(loading, "check_sample_size", lambda *a, **k: calls.size.append((a, k)))
    monkeypatch.setattr(common, "check_prompt_images", lambda *a: calls.images.append(a))
    monkeypatch.setattr(common, "family_class", family_class)
    return calls


class _DataModule:
    def __init__(self, records=None, val=None) -> None:
        if records is not None:
            self.train_records = [SimpleNamespace(prompt=p) for p in records]
        if val is not None:
            self.val_batches = lambda: [{"prompts": b} for b in val]


def _spec_method(spec, datamodule=..., trainer=...):
    if trainer is ...:
        trainer = SimpleNamespace(datamodule=datamodule) if datamodule is not ... else SimpleNamespace()
    return SimpleNamespace(generator_spec=spec, trainer=trainer)


def test_check_before_loading_checks_the_folders_sizes_and_every_prompt_image(checks, tmp_path):
    """check_before_loading: a diffusers family with a local folder has its sample size checked (frames only for a
    video family; config keys named as ``generator.``), and the datamodule's training and validation prompts' images
    at the generator's height x width."""
    spec = GeneratorSpec(family="wan", pretrained=str(tmp_path), height=64, width=96, num_frames=17)
    check_before_loading(_spec_method(spec, _DataModule(["a", "b"], [["c", "d"], ["e"]])))
    assert checks.family == ["wan"]
    assert checks.size == [((str(tmp_path), 64, 96, 17), {"flag": "generator."})]
    assert checks.images == [(["a", "b", "c", "d", "e"], 64, 96)]

    image = GeneratorSpec(family="sd3", pretrained=str(tmp_path), height=32, width=48)
    check_before_loading(_spec_method(image, _DataModule(None, [["v"]])))
    assert checks.size[-1] == ((str(tmp_path), 32, 48, None), {"flag": "generator."})
    assert checks.images[-1] == (["v"], 32, 48)
    check_before_loading(_spec_method(image, _DataModule(["t"], None)))
    assert checks.images[-1] == (["t"], 32, 48)
    check_before_loading(_spec_method(image, _DataModule(None, None)))
    assert checks.images[-1] == ([], 32, 48)


def test_check_before_loading_skips_what_it_cannot_check(checks, tmp_path):
    """Nothing for genrl's DiT; no size check without a local folder; no image check without a trainer or a
    datamodule (a module under Fabric has a trainer shim without one)."""
    check_before_loading(_spec_method(GeneratorSpec(family="dit", pretrained=str(tmp_path)), _DataModule(["a"])))
    assert (checks.size, checks.images, checks.family) == ([], [], [])
    missing = GeneratorSpec(family="wan", pretrained=str(tmp_path / "absent"), height=16, width=16)
    check_before_loading(_spec_method(missing, _DataModule(["a"])))
    assert checks.size == [] and checks.images == [(["a"], 16, 16)]
    random_init = GeneratorSpec(family="wan", components={"transformer": {}}, height=16, width=16)
    check_before_loading(_spec_method(random_init, trainer=None))
    check_before_loading(_spec_method(random_init))
    assert checks.size == [] and len(checks.images) == 1

    class _Fabric:
        pass

    fabric = _Fabric()
    under_fabric = LightningModule()
    under_fabric.fabric = fabric
    under_fabric.generator_spec = random_init
    check_before_loading(under_fabric)
    assert len(checks.images) == 1


def test_check_no_dropout_refuses_any_active_dropout_and_only_that():
    """reuse_rollout_forward's check: a dropout with p > 0 anywhere (here p = 0.5, nested) raises naming p and the
    layer; p = 0 exactly, and a network without dropout, pass."""

    with pytest.raises(ValueError, match=r"dropout p=0.5 at '1.0'"):
        check_no_dropout(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5))))
    with pytest.raises(ValueError, match=r"dropout p=0.01 at '0'"):
        check_no_dropout(nn.Sequential(nn.Dropout2d(0.01)))
    check_no_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0), nn.Dropout3d(0.0)))
    check_no_dropout(nn.Linear(2, 2))
