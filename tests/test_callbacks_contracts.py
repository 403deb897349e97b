"""Fast unit contracts of the EMA and DiffusersExport callbacks, called directly with stand-in trainers / modules.

EMA: the documented defaults and decay bounds, one update in closed form, the validation swap hooks, and what a
resume from the callback's checkpoint state creates (which parameters, float32, on the parameters' device, the update
count). DiffusersExport: ``sampling_of`` for each kind of method, and what ``on_train_end`` writes (the weights, the
EMA's when there is one, the serialization format, ``genrl_export.json``, the causal chunk schedule).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from genrl.callbacks.ema import EMA
from genrl.callbacks.export import DiffusersExport, sampling_of
from genrl.models.causal import CausalConfig, ChunkSchedule
from genrl.models.dit import VideoDiT
from genrl.models.loading import CAUSAL_SCHEDULE_FILE, EXPORT_INFO_FILE
from genrl.rollout.sampler import RolloutConfig


class _Module(nn.Module):
    """Two trainable Linear layers ("generator.", "critic.") and one frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.generator = nn.Linear(3, 2)
        self.critic = nn.Linear(2, 1)
        self.frozen_part = nn.Parameter(torch.ones(2), requires_grad=False)


TRAINED = {"generator.weight", "generator.bias", "critic.weight", "critic.bias"}


def _raw(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().clone() for n, p in module.named_parameters()}


def _perturb(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g))


# ================================================================================================ EMA
def test_ema_defaults_and_first_update_closed_form():
    """EMA(): decay 0.999 with warm-up from step 0 (first update d = 1/10), update_every 1; a fresh state is empty."""
    ema = EMA()
    assert (ema.decay, ema.update_every, ema.warmup, ema.validate_with_ema, ema.include, ema.start_step) == (
        0.999, 1, True, True, None, 0)
    assert ema.state_dict() == {"shadow": {}, "num_updates": 0}
    module = _Module()
    ema.on_fit_start(None, module)
    old = _raw(module)
    _perturb(module, 1)
    new = _raw(module)
    ema.on_train_batch_end(SimpleNamespace(global_step=0), module, None, None, 0)
    assert ema.num_updates == 1
    assert set(ema.shadow) == TRAINED
    d = 1 / 10  # min(0.999, (1 + 0) / (10 + 0))
    for n in TRAINED:
        torch.testing.assert_close(ema.shadow[n].double(), d * old[n] + (1 - d) * new[n], rtol=0, atol=1e-6)
    assert ema.current_decay() == pytest.approx(2 / 11, rel=1e-15)


def test_ema_decay_bounds():
    """decay = 0 is allowed (the shadow follows the weights exactly); 1 and above raise a ValueError naming decay."""
    module = _Module()
    ema = EMA(decay=0.0)
    ema.on_fit_start(None, module)
    _perturb(module, 2)
    ema.on_train_batch_end(SimpleNamespace(global_step=0), module, None, None, 0)
    for n, p in module.named_parameters():
        if n in TRAINED:
            assert torch.equal(ema.shadow[n], p.detach())
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"decay must be in \\[0, 1\\), got {bad}"):
            EMA(decay=bad)


def test_ema_validation_hooks_swap_by_default_and_restore():
    """By default validation during fit sees the EMA weights and the raw ones come back; no checkpoint error."""
    module = _Module()
    ema = EMA()
    ema.on_fit_start(None, module)
    for t in range(3):
        _perturb(module, 10 + t)
        ema.on_train_batch_end(SimpleNamespace(global_step=t), module, None, None, 0)
    raw = _raw(module)
    shadow = {n: s.double().clone() for n, s in ema.shadow.items()}
    trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"))
    ema.on_save_checkpoint(trainer, module, {})  # raw weights in place: allowed
    ema.on_validation_epoch_start(trainer, module)
    for n, p in module.named_parameters():
        assert torch.equal(p.detach().double(), shadow[n] if n in TRAINED else raw[n]), n
    with pytest.raises(RuntimeError, match="swapped"):
        ema.on_save_checkpoint(trainer, module, {})
    ema.on_validation_epoch_end(trainer, module)
    assert all(torch.equal(p.detach().double(), raw[n]) for n, p in module.named_parameters())
    ema.on_save_checkpoint(trainer, module, {})


def test_ema_resume_restores_float32_shadow_of_the_trained_parameters_and_count():
    """A resumed EMA holds the checkpoint's shadow of the trained parameters only, as float32, and its update count."""
    module = _Module()
    g = torch.Generator().manual_seed(4)
    saved = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) + 1 / 3 for n, p in module.named_parameters()}
    ema = EMA(decay=0.9, include="generator.")
    ema.load_state_dict({"shadow": saved, "num_updates": 5})
    ema.on_fit_start(None, module)
    assert set(ema.shadow) == {"generator.weight", "generator.bias"}
    for n, s in ema.shadow.items():
        assert s.dtype == torch.float32 and s.device == module.get_parameter(n).device
        assert torch.equal(s, saved[n].float())
    assert ema.num_updates == 5
    assert ema.current_decay() == pytest.approx(6 / 15, rel=1e-15)  # min(0.9, (1 + 5) / (10 + 5))
    old = {n: s.double() for n, s in ema.shadow.items()}
    _perturb(module, 5)
    new = _raw(module)
    ema.on_train_batch_end(SimpleNamespace(global_step=6), module, None, None, 0)
    for n in old:
        torch.testing.assert_close(ema.shadow[n].double(), 0.4 * old[n] + 0.6 * new[n], rtol=0, atol=1e-6)
    assert ema.num_updates == 6
    assert ema.state_dict()["num_updates"] == 6


def test_ema_resume_missing_parameter_names_it():
    """A checkpoint shadow lacking a trained parameter raises a KeyError naming that parameter."""
    module = _Module()
    saved = {n: p.detach().clone() for n, p in module.named_parameters() if n != "critic.bias"}
    ema = EMA()
    ema.load_state_dict({"shadow": saved, "num_updates": 1})
    with pytest.raises(KeyError, match=r"lacks trained parameters \['critic.bias'\]"):
        ema.on_fit_start(None, module)


def test_ema_resume_places_the_shadow_on_the_parameters_device():
    """The resumed shadow (saved on the CPU) goes to the parameters' device (meta here) as float32."""
    module = _Module().to(device="meta", dtype=torch.float64)
    saved = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in module.named_parameters()}
    ema = EMA()
    ema.load_state_dict({"shadow": saved, "num_updates": 2})
    ema.on_fit_start(None, module)
    assert set(ema.shadow) == TRAINED
    assert all(s.device.type == "meta" and s.dtype == torch.float32 for s in ema.shadow.values())


def test_ema_resume_with_no_trained_parameter_keeps_counting():
    """An include prefix matching no parameter resumes to an empty shadow, and later updates keep counting."""
    module = _Module()
    ema = EMA(include="student.")
    ema.load_state_dict({"shadow": {}, "num_updates": 3})
    for step in (4, 5):
        ema.on_train_batch_end(SimpleNamespace(global_step=step), module, None, None, 0)
    assert ema.shadow == {} and ema.num_updates == 5


# ================================================================================================ sampling_of
_EVAL = RolloutConfig(num_steps=12, cfg_scale=4.5, shift=3.0)
_ROLLOUT = RolloutConfig(num_steps=7, cfg_scale=2.0, shift=1.5)
_HPARAMS = {"sample_steps": 9, "cfg_scale": 6, "sample_shift": 2}
_CAUSAL = ChunkSchedule(causal=CausalConfig(chunk_size=2), timesteps=[1000.0, 500.0], shift=1.0)


@pytest.mark.parametrize(("attrs", "expected"), [
    ({"eval_config": _EVAL, "rollout_config": _ROLLOUT, "hparams": _HPARAMS}, {"steps": 12, "cfg_scale": 4.5,
                                                                                 "shift": 3.0}),
    ({"rollout_config": _ROLLOUT, "hparams": _HPARAMS}, {"steps": 7, "cfg_scale": 2.0, "shift": 1.5}),
    ({"eval_config": None, "rollout_config": _ROLLOUT}, {"steps": 7, "cfg_scale": 2.0, "shift": 1.5}),
    ({"hparams": _HPARAMS}, {"steps": 9, "cfg_scale": 6.0, "shift": 2.0}),
    ({"eval_config": SimpleNamespace(cfg_scale=3.0), "hparams": _HPARAMS}, {"steps": 9, "cfg_scale": 6.0,
                                                                            "shift": 2.0}),
    ({"schedule": SimpleNamespace(shift=5.0), "eval_config": _EVAL}, {"steps": 12, "cfg_scale": 4.5, "shift": 3.0}),
    ({"schedule": SimpleNamespace(causal=None), "hparams": _HPARAMS}, {"steps": 9, "cfg_scale": 6.0, "shift": 2.0}),
    ({"schedule": _CAUSAL, "eval_config": _EVAL, "hparams": _HPARAMS}, None),
    ({"hparams": {"lr": 1e-4}}, None),
    ({}, None),
])
def test_sampling_of_each_kind_of_method(attrs, expected):
    """sampling_of: eval_config, else rollout_config, else the pretraining hparams; None for a causal student / none."""
    got = sampling_of(SimpleNamespace(**attrs))
    assert got == expected
    if expected is not None:
        assert [type(v) for v in got.values()] == [int, float, float]


# ================================================================================================ DiffusersExport
def _exportable(**attrs) -> nn.Module:
    """A stand-in method: ``generator.transformer`` is a tiny VideoDiT; other attributes as given."""
    torch.manual_seed(6)
    module = nn.Module()
    module.generator = nn.Module()
    module.generator.transformer = VideoDiT(hidden_size=16, num_layers=1, num_attention_heads=2, text_dim=8,
                                            timestep_embed_dim=16)
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


def _trainer(*callbacks, global_zero: bool = True) -> SimpleNamespace:
    return SimpleNamespace(is_global_zero=global_zero, callbacks=list(callbacks), global_step=7)


PREFIX = "generator.transformer."


def test_export_writes_the_ema_weights_safetensors_and_info(tmp_path, monkeypatch):
    """With an EMA: safetensors of the EMA weights (raw ones untouched); genrl_export.json with ema, step, sampler."""
    monkeypatch.chdir(tmp_path)
    module = _exportable(eval_config=_EVAL, schedule=SimpleNamespace(shift=5.0))  # a flow schedule: not causal
    ema = EMA(decay=0.5)
    ema.on_fit_start(None, module)
    g = torch.Generator().manual_seed(7)
    for s in ema.shadow.values():
        s.add_(torch.randn(s.shape, generator=g))
    raw = {n: p.detach().clone() for n, p in module.named_parameters()}
    out = tmp_path / "export"
    DiffusersExport(str(out)).on_train_end(_trainer(SimpleNamespace(), ema), module)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing written elsewhere
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "diffusion_pytorch_model.safetensors", EXPORT_INFO_FILE])
    weights = load_file(str(out / "diffusion_pytorch_model.safetensors"))
    assert set(weights) == {n[len(PREFIX):] for n in ema.shadow}
    for n, s in ema.shadow.items():
        assert torch.equal(weights[n[len(PREFIX):]], s) and not torch.equal(s, raw[n]), n
    assert all(torch.equal(p.detach(), raw[n]) for n, p in module.named_parameters())
    assert json.loads((out / EXPORT_INFO_FILE).read_text()) == {
        "ema": True, "global_step": 7, "sampling": {"steps": 12, "cfg_scale": 4.5, "shift": 3.0}}
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 16
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {f.name: 0o644 for f in out.iterdir()}


def test_export_without_ema_pickle_and_causal_schedule(tmp_path, monkeypatch):
    """No EMA, safe_serialization=False: the raw weights as a pickle; a causal student's schedule is written."""
    monkeypatch.chdir(tmp_path)
    module = _exportable(schedule=_CAUSAL, eval_config=_EVAL)
    out = tmp_path / "export"
    DiffusersExport(str(out), safe_serialization=False).on_train_end(_trainer(), module)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "diffusion_pytorch_model.bin", EXPORT_INFO_FILE, CAUSAL_SCHEDULE_FILE])
    weights = torch.load(out / "diffusion_pytorch_model.bin", weights_only=True)
    transformer = module.generator.transformer
    assert set(weights) == {n for n, _ in transformer.named_parameters()}
    assert all(torch.equal(weights[n], p.detach()) for n, p in transformer.named_parameters())
    assert json.loads((out / EXPORT_INFO_FILE).read_text()) == {"ema": False, "global_step": 7, "sampling": None}
    assert (out / CAUSAL_SCHEDULE_FILE).read_text() == json.dumps(asdict(_CAUSAL), indent=2)
    assert ChunkSchedule(**{**json.loads((out / CAUSAL_SCHEDULE_FILE).read_text()),
                            "causal": CausalConfig(chunk_size=2)}) == _CAUSAL


def test_export_only_on_global_rank_zero(tmp_path):
    """Ranks other than 0 write nothing."""
    out = tmp_path / "export"
    DiffusersExport(str(out)).on_train_end(_trainer(global_zero=False), _exportable(eval_config=_EVAL))
    assert not out.exists()


def test_ema_include_takes_a_list_of_prefixes():
    """``include`` as a list averages the parameters under any of its prefixes (TMD: student and flow head), and only
    those: a one-prefix list equals the string form."""
    module = _Module()
    both = EMA(include=["generator.", "critic."])
    both.on_fit_start(None, module)
    assert set(both.shadow) == TRAINED
    one = EMA(include=["critic."])
    one.on_fit_start(None, module)
    assert set(one.shadow) == {"critic.weight", "critic.bias"}
    assert set(EMA(include="critic.")._trainable(module)) == set(one.shadow)


def test_role_optimizers_join_roles_into_one_optimizer():
    """``Roles.optimizers(joined=...)``: a joined role's parameters follow the named role's own in its optimizer; a
    joined key that gets no optimizer, or a joined role that is not trainable, is an error naming it."""
    from genrl.models.roles import Roles

    owner = nn.Module()
    roles = Roles(owner)
    roles.trainable("generator", nn.Linear(3, 2))
    roles.trainable("flow_head", nn.Linear(2, 2))
    roles.trainable("critic", nn.Linear(2, 1))
    roles.frozen("teacher", nn.Linear(2, 1))
    opt_g, opt_c = roles.optimizers(joined={"generator": ["flow_head"]}, generator=torch.optim.SGD,
                                    critic=torch.optim.SGD)
    params = opt_g.param_groups[0]["params"]
    assert params == [*owner.generator.parameters(), *owner.flow_head.parameters()]
    assert opt_c.param_groups[0]["params"] == list(owner.critic.parameters())
    with pytest.raises(ValueError, match=r"joined names \['flow'\]"):
        roles.optimizers(joined={"flow": ["flow_head"]}, generator=torch.optim.SGD)
    with pytest.raises(ValueError, match="'teacher': not a trainable role"):
        roles.optimizers(joined={"generator": ["teacher"]}, generator=torch.optim.SGD)
