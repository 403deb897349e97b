"""Roles (genrl.models.roles): frozen networks are registered children that are never checkpointed or trained;
lagged copies hold only the trainable tensors (the adapter under LoRA) and update in closed form; the reference
context is the adapter-disabled model under LoRA and the frozen copy otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from genrl.models.lora import LoraSpec
from genrl.models.precision import fake_fp8
from genrl.models.quantized import RolloutPrecision
from genrl.models.roles import FrozenRoles, LaggedCopy, Roles, RolloutCopy


class _Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.roles = Roles(self)


class _Gen(nn.Module):
    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def velocity(self, x):
        return self.transformer(x)


def _owner_with(net: nn.Module) -> _Owner:
    owner = _Owner()
    owner.roles.trainable("generator", _Gen(net))
    return owner


def test_frozen_roles_are_children_but_never_trained_or_checkpointed():
    torch.manual_seed(0)
    owner = _owner_with(nn.Linear(3, 3))
    teacher = owner.roles.frozen("teacher", nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)))
    # a registered child: .to() / strategies see it, named_parameters lists it
    assert any(n.startswith("frozen.teacher.") for n, _ in owner.named_parameters())
    assert not any(p.requires_grad for p in teacher.parameters())
    owner.train()
    assert not teacher.training and owner.generator.training
    owner.to(torch.float64)
    assert next(teacher.parameters()).dtype == torch.float64
    sd = owner.state_dict()
    assert set(sd) == {"generator.transformer.weight", "generator.transformer.bias"}
    # a fresh owner whose teacher differs loads the checkpoint strictly and keeps its own teacher
    other = _owner_with(nn.Linear(3, 3))
    other.roles.frozen("teacher", nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)))
    before = copy.deepcopy(other.frozen.teacher.state_dict())
    result = other.load_state_dict(sd, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(other.generator.transformer.weight, owner.generator.transformer.weight.float())
    assert all(torch.equal(v, before[k]) for k, v in other.frozen.teacher.state_dict().items())
    # a trainable key still missing from the checkpoint is reported
    sd.pop("generator.transformer.bias")
    with pytest.raises(RuntimeError, match="generator.transformer.bias"):
        other.load_state_dict(sd, strict=True)


def test_role_table_and_errors():
    owner = _owner_with(nn.Linear(2, 2))
    owner.roles.frozen("teacher", nn.Linear(2, 2))
    assert {r.name: (r.kind, r.checkpointed) for r in owner.roles.table.values()} == {
        "generator": ("trainable", True), "teacher": ("frozen", False)}
    with pytest.raises(KeyError, match="declared"):
        owner.roles.get("critic")
    with pytest.raises(ValueError, match="declared as frozen"):
        owner.roles.trainable("teacher", nn.Linear(2, 2))
    assert set(owner.roles.shardable()) == {"generator", "teacher"}
    assert isinstance(owner.frozen, FrozenRoles)


def test_lagged_copy_swap_equals_a_deep_copy_and_updates_in_closed_form():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    owner = _owner_with(net)
    lagged = owner.roles.lagged("old_policy", net)
    frozen_copy = copy.deepcopy(net)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad(), owner.roles.swap(owner.generator, "old_policy") as gen:
        old_out = gen.velocity(x)
    assert torch.equal(old_out, frozen_copy(x))  # the lagged weights, bit for bit
    live = {n: p.detach().clone() for n, p in net.named_parameters()}
    assert torch.equal(net(x), torch.func.functional_call(net, live, (x,)))  # swapped back
    # one EMA step in closed form: old <- d old + (1 - d) theta
    d = 0.25
    old = {n: t.clone() for n, t in lagged.tensors().items()}
    owner.roles.update_lagged("old_policy", d)
    for n, t in lagged.tensors().items():
        assert torch.allclose(t, d * old[n] + (1 - d) * live[n], atol=1e-15, rtol=0)
    assert set(owner.state_dict()) >= {f"old_policy.{n.replace('.', '__')}" for n in live}
    with pytest.raises(ValueError, match="decay"):
        lagged.update(net, 1.5)


def _tiny_wan():
    from genrl.models.families import family_class
    from genrl.testing.families import TINY, TINY_SIZE

    return family_class("wan").from_config(TINY["wan"], seed=0, **TINY_SIZE["wan"])


def test_lagged_copy_under_lora_holds_only_the_adapter_and_reference_disables_it():
    gen = _tiny_wan()
    full_copy = sum(p.numel() for p in copy.deepcopy(gen.transformer).parameters())  # the old policy before
    LoraSpec(rank=4, alpha=4.0).add_to(gen)
    adapter = sum(p.numel() for n, p in gen.transformer.named_parameters() if "lora_" in n)
    owner = _Owner()
    owner.roles.trainable("generator", gen)
    owner.roles.reference_copy(gen)  # under LoRA: nothing stored
    lagged = owner.roles.lagged("old_policy", gen.transformer)
    assert lagged.numel() == adapter and 0 < adapter < full_copy / 5
    assert "reference" not in owner.frozen
    base_weight = gen.transformer.blocks[0].attn1.to_q.base_layer.weight
    with torch.no_grad():
        for n, p in gen.transformer.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)  # a non-zero adapter: the policy differs from the base model
    x = torch.randn(1, *gen.latent_shape)
    cond = gen.encode_prompts(["a red circle"])
    sigma = torch.tensor([0.5])
    with torch.no_grad():
        v = gen.velocity(x, sigma, cond)
        with owner.roles.reference(gen):
            v_ref = gen.velocity(x, sigma, cond)
        gen.transformer.disable_adapters()
        v_base = gen.velocity(x, sigma, cond)
        gen.transformer.enable_adapters()
        with owner.roles.swap(gen, "old_policy"):
            v_old = gen.velocity(x, sigma, cond)
    assert torch.equal(v_ref, v_base) and not torch.allclose(v, v_ref)
    assert not torch.allclose(v_old, v)  # the lagged adapter is the one from before the change
    assert torch.equal(gen.transformer.blocks[0].attn1.to_q.base_layer.weight, base_weight)


def test_reference_copy_without_lora_is_frozen_initial_weights():
    torch.manual_seed(0)
    net = nn.Linear(3, 3)
    owner = _owner_with(net)
    owner.roles.reference_copy(owner.generator)
    ref = owner.roles.get("reference")
    init = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.add_(1.0)
    x = torch.randn(2, 3)
    with torch.no_grad(), owner.roles.reference(owner.generator) as gen:
        assert torch.allclose(gen.velocity(x), nn.functional.linear(x, init, net.bias))
    assert owner.generator.transformer is net and torch.equal(ref.weight, init)
    assert isinstance(LaggedCopy(net), LaggedCopy)


def test_one_optimizer_per_trainable_role():
    owner = _owner_with(nn.Linear(3, 3))
    owner.roles.trainable("critic", nn.Linear(3, 2))
    owner.roles.frozen("teacher", nn.Linear(3, 3))
    opt_g, opt_c = owner.roles.optimizers(generator=torch.optim.SGD, critic=lambda p: torch.optim.Adam(p, lr=0.1))
    assert [p for g in opt_g.param_groups for p in g["params"]] == list(owner.generator.transformer.parameters())
    assert [p for g in opt_c.param_groups for p in g["params"]] == list(owner.critic.parameters())
    assert isinstance(opt_c, torch.optim.Adam) and opt_c.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match="not a trainable role"):
        owner.roles.optimizers(teacher=torch.optim.SGD)
    owner.generator.transformer.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters in the 'generator'"):
        owner.roles.optimizers(generator=torch.optim.SGD)


def test_rollout_copy_is_a_synced_low_precision_policy_never_checkpointed():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    owner = _owner_with(net)
    ro = owner.roles.rollout_copy("rollout", owner.generator, "bf16")
    assert owner.roles.table["rollout"].kind == "rollout" and not owner.roles.table["rollout"].checkpointed
    assert not any(k.startswith("frozen.") for k in owner.state_dict())  # a function of the policy: not stored
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in ro.parameters())
    owner.train()
    assert not ro.module.training and owner.generator.training
    # an update of the policy: the copy lags until synced, then holds exactly the bf16 cast of the live tensors
    with torch.no_grad():
        net[0].weight.add_(0.37)
        net[1].running_mean.add_(1.5)
    assert not torch.equal(ro.module[0].weight, net[0].weight.to(torch.bfloat16))
    owner.roles.sync("rollout")
    assert torch.equal(ro.module[0].weight, net[0].weight.to(torch.bfloat16))
    assert torch.equal(ro.module[1].running_mean, net[1].running_mean.to(torch.bfloat16))
    # the swap evaluates the generator with the copy (bf16 arithmetic), then restores the live transformer
    x = torch.randn(3, 4)
    owner.eval()
    with torch.no_grad(), owner.roles.swap(owner.generator, "rollout") as gen:
        y = gen.velocity(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and owner.generator.transformer is net
    with torch.no_grad():
        assert torch.allclose(y.float(), net(x), atol=0.1) and not torch.equal(y.float(), net(x))
    assert "rollout" not in owner.roles.shardable()  # each rank holds a whole rollout copy
    # a simulated format: the copy holds the fake-quantized weights, refreshed in place on every sync
    q = owner.roles.rollout_copy("rollout_q", owner.generator, RolloutPrecision("fake_fp8", skip=[]))
    w = q.module[0].weight
    with torch.no_grad():
        net[0].weight.add_(2.2)
    stats = owner.roles.sync("rollout_q")
    assert q.module[0].weight is w and torch.equal(w, fake_fp8(net[0].weight.detach()))
    assert stats["max_weight_change"] > 2.0
    with pytest.raises(KeyError, match="another module"):
        RolloutCopy(nn.Linear(2, 2)).sync(nn.Sequential(nn.Linear(2, 2)))


def test_a_planner_is_a_frozen_role():
    """TempAct's planner (a local language model) is declared frozen: registered, sharded, never stored or trained."""
    owner = _owner_with(nn.Linear(2, 2))
    planner = owner.roles.frozen("planner", nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)))
    assert owner.roles.shardable()["planner"] is planner and not any(p.requires_grad for p in planner.parameters())
    assert set(owner.state_dict()) == {"generator.transformer.weight", "generator.transformer.bias"}


def test_shardable_gives_transformers_and_skips_lagged_copies():
    """shardable() maps a generator to its transformer, skips lagged copies and still lists the roles after them."""
    net = nn.Linear(3, 3)
    owner = _Owner()
    owner.roles.trainable("generator", _Gen(net))
    owner.roles.lagged("old_policy", net)
    teacher = owner.roles.frozen("teacher", nn.Linear(3, 3))
    critic = owner.roles.trainable("critic", nn.Linear(3, 2))
    out = owner.roles.shardable()
    assert list(out) == ["generator", "teacher", "critic"]
    assert out["generator"] is net and out["teacher"] is teacher and out["critic"] is critic


class _Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, *, shift: float = 0.0):
        return self.lin(x) + shift


def test_rollout_copy_forwards_arguments_and_stays_frozen_after_a_quantized_sync():
    """A rollout copy computes module(*args, **kwargs) and holds no trainable tensor, also after a sync."""
    torch.manual_seed(0)
    live = _Affine()
    ro = RolloutCopy(live, "fp64")
    assert not any(p.requires_grad for p in ro.parameters())
    x = torch.randn(4, 2, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(ro(x, shift=2.5), live.double()(x) + 2.5)
    ro.sync(live)
    assert not any(p.requires_grad for p in ro.parameters())


def _tiny_adapted() -> nn.Module:
    """A stand-in transformer with diffusers' add_adapter (peft): two projections and one layer LoRA leaves alone."""
    from diffusers.loaders import PeftAdapterMixin

    class _TinyAdapted(nn.Module, PeftAdapterMixin):
        def __init__(self) -> None:
            super().__init__()
            self.to_q, self.to_k, self.other = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 4)

    return _TinyAdapted()


def test_lora_spec_reaches_the_layers_rank_alpha_init_and_float32_adapter():
    """LoraSpec.add_to adapts the generator's lora_target_modules with rank r (A [r, in], B [out, r]), scaling
    alpha / r, the spec's init (gaussian / True: B = 0; False: B random) in float32 over bfloat16 base weights."""
    from types import SimpleNamespace

    from genrl.models.roles import has_lora

    for init in ("gaussian", True, False):
        torch.manual_seed(0)
        gen = SimpleNamespace(transformer=_tiny_adapted().to(torch.bfloat16), lora_target_modules=["to_q"])
        assert not has_lora(gen.transformer)
        LoraSpec(rank=2, alpha=6.0, init_lora_weights=init).add_to(gen)
        t = gen.transformer
        assert has_lora(t) and t.peft_config["default"].init_lora_weights == init
        assert (t.peft_config["default"].r, t.peft_config["default"].lora_alpha) == (2, 6.0)
        a, b = t.to_q.lora_A["default"].weight, t.to_q.lora_B["default"].weight
        assert a.shape == (2, 4) and b.shape == (6, 2) and t.to_q.scaling["default"] == 3.0
        assert a.dtype == b.dtype == torch.float32 and t.to_q.base_layer.weight.dtype == torch.bfloat16
        assert a.requires_grad and b.requires_grad and bool(b.any()) == (init is False)
        assert isinstance(t.to_k, nn.Linear) and isinstance(t.other, nn.Linear)  # not targeted


def test_optimizers_take_a_generators_transformer_parameters_only():
    """For a generator role the optimizer gets its transformer's trainable parameters, not the generator's other
    trainable ones (e.g. a conditioning head); a plain module's own parameters otherwise."""

    class _GenWithHead(_Gen):
        def __init__(self, transformer: nn.Module) -> None:
            super().__init__(transformer)
            self.head = nn.Linear(2, 2)

    owner = _Owner()
    owner.roles.trainable("generator", _GenWithHead(nn.Linear(3, 3)))
    owner.roles.trainable("critic", nn.Linear(3, 1))
    opt_g, opt_c = owner.roles.optimizers(generator=torch.optim.SGD, critic=torch.optim.SGD)
    assert [p for g in opt_g.param_groups for p in g["params"]] == list(owner.generator.transformer.parameters())
    assert [p for g in opt_c.param_groups for p in g["params"]] == list(owner.critic.parameters())


def test_frozen_roles_load_like_a_module_stray_keys_and_pre_hooks():
    """Loading through FrozenRoles keeps nn.Module's contract: a stray key under frozen. is unexpected under strict
    loading, and a load pre-hook on the container sees strict and the real key / error lists (its error is raised)."""
    owner = _owner_with(nn.Linear(2, 2))
    owner.roles.frozen("teacher", nn.Linear(2, 2))
    sd = owner.state_dict()
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "frozen.stray"'):
        owner.load_state_dict({**sd, "frozen.stray": torch.zeros(1)}, strict=True)
    seen = []

    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        seen.append((prefix, strict, type(missing_keys), type(unexpected_keys), type(error_msgs)))
        error_msgs.append("the teacher's spec changed")

    owner.frozen.register_load_state_dict_pre_hook(hook)
    with pytest.raises(RuntimeError, match="the teacher's spec changed"):
        owner.load_state_dict(sd, strict=True)
    assert seen == [("frozen.", True, list, list, list)]


def test_lagged_copy_of_another_module_names_the_missing_parameters():
    """update / applied with a module lacking the lagged parameters raise a KeyError naming them."""
    lagged = LaggedCopy(nn.Linear(2, 2))
    other = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(KeyError, match=r"no parameter\(s\) \['weight', 'bias'\]: the lagged copy belongs to another"):
        lagged.update(other, 0.5)
    with pytest.raises(KeyError, match=r"no parameter\(s\) \['weight', 'bias'\]"), lagged.applied(other):
        pass
