"""Invariant (issue 51): every rollout copy computes the function of the live model it copies.

A tiny live transformer with peft LoRA adapters (rank 4, alpha 12: scale 3, so a dropped scale shows) is copied by
:meth:`genrl.models.roles.Roles.rollout_copy` over the cross product of every precision format the module supports
(cast: bitwise the live weights in that dtype; simulated: the live weights quantized by the format's own quantizers),
every layer policy (the default skips, layers kept by name, layers kept by size, everything eligible) and the
adapters merged or not on the live side. The reference is built by hand from the raw tensors (W0 + s B A with the
hand-written s; the format quantizers of :mod:`genrl.models.precision`), never from genrl.models.quantized, and the
copy must equal it bitwise: its weights, its layer types and its output. After a training step and a perturbation
of every live tensor, :meth:`Roles.sync` must make the copy bitwise equal to a freshly built copy (same parameter
objects and storage) and to the new hand reference; the stale output is the canary.

The lagged old-policy copy (the only other copy :class:`Roles` holds: a copy of the trainable tensors, the LoRA
adapter) is checked the same way: after ``update_lagged`` its tensors are the EMA in closed form, the swap computes
the live model with those tensors, and a rollout copy synced inside the swap is the fresh copy of the old policy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from genrl.models.precision import fake_fp8, fake_mx, fake_nvfp4
from genrl.models.quantized import (
    CAST_FORMATS,
    FAKE_FORMATS,
    HARDWARE_FORMATS,
    QuantizedLinear,
    RolloutPrecision,
    build_rollout_module,
)
from genrl.models.roles import Roles

RANK, ALPHA = 4, 12.0
SCALE = ALPHA / RANK  # written by hand: the reference must not read peft's scaling
LORA_TARGETS = ["to_q", "to_k"]
WIDTH = 32

# the format's weight / activation quantizer, written from genrl.models.precision (None: a cast format)
_QUANT = {"fake_fp8": lambda t: fake_fp8(t, "row"), "fake_fp8:tensor": lambda t: fake_fp8(t, "tensor"),
          "fake_nvfp4": fake_nvfp4, "fake_mxfp4": lambda t: fake_mx(t, "fp4"),
          "fake_mxfp8": lambda t: fake_mx(t, "fp8")}
FORMATS = [*CAST_FORMATS, *FAKE_FORMATS, "fake_fp8:tensor", *HARDWARE_FORMATS]

_LINEARS = ["time_embed", *(f"blocks.{i}.{n}" for i in range(2) for n in ("modulation", "to_q", "to_k", "mlp",
                                                                            "mlp_out")), "proj_out"]
_DEFAULT_KEPT = {"time_embed", "blocks.0.modulation", "blocks.1.modulation", "proj_out"}
# policy name -> (RolloutPrecision keywords, the Linear layers it keeps in the live precision, written by hand)
POLICIES = {
    "default": ({}, _DEFAULT_KEPT),
    "by_name": ({"skip": ["to_k", "PROJ_OUT"]}, {"blocks.0.to_k", "blocks.1.to_k", "proj_out"}),
    "by_size": ({"min_dim": WIDTH}, _DEFAULT_KEPT | {f"blocks.{i}.{n}" for i in range(2) for n in ("to_q", "to_k")}),
    "everything": ({"skip": []}, set()),
}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.modulation = nn.Linear(WIDTH, 2 * WIDTH)  # nested and kept by default: a prefix match would miss it
        self.to_q, self.to_k = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp, self.mlp_out = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(h).chunk(2, dim=-1)
        h = h + self.to_q(h) * torch.tanh(self.to_k(h)) * (1 + scale) + shift
        return h + self.mlp_out(F.gelu(self.mlp(h)))


def _live_class():
    from diffusers.loaders import PeftAdapterMixin

    class _Live(nn.Module, PeftAdapterMixin):
        """A stand-in transformer: an embedder, two blocks (modulation, two adapted projections, an MLP), a norm with
        parameters (copied by name, not a Linear) and an output projection."""

        def __init__(self) -> None:
            super().__init__()
            self.time_embed = nn.Linear(WIDTH, WIDTH)
            self.blocks = nn.ModuleList([_Block() for _ in range(2)])
            self.norm_out = nn.LayerNorm(WIDTH)
            self.proj_out = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            h = x + self.time_embed(t)[:, None]
            for block in self.blocks:
                h = block(h)
            return self.proj_out(self.norm_out(h))

    return _Live


class _Gen(nn.Module):
    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer


class _Owner(nn.Module):
    def __init__(self, live: nn.Module) -> None:
        super().__init__()
        self.roles = Roles(self)
        self.roles.trainable("generator", _Gen(live))


def _live(merged: bool, seed: int = 0) -> nn.Module:
    """The live model: random weights, a LoRA adapter with a non-zero B on to_q / to_k; ``merged``: peft merges the
    adapters into the base weights (the same function)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(seed)
    live = _live_class()()
    with torch.no_grad():
        for p in live.parameters():
            p.normal_(0.0, 0.2)
    live.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=LORA_TARGETS, init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, p in live.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    if merged:
        expected = _effective(live)
        for m in live.modules():
            if isinstance(m, BaseTunerLayer):
                m.merge()
        assert all(live.get_submodule(n).merged for n in _LINEARS if n.rsplit(".", 1)[-1] in LORA_TARGETS)
        for name, (w, _) in _effective(live).items():  # peft's merge is the hand sum, bit for bit
            assert torch.equal(w, expected[name][0]), name
    return live.eval()


def _effective(live: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{Linear name: (weight, bias)} the live model computes with, by hand from the raw tensors: W0 + (B @ A) * s
    for an unmerged adapted layer (peft's order of operations), the base weight alone for a merged one."""
    out = {}
    for name in _LINEARS:
        m = live.get_submodule(name)
        if hasattr(m, "base_layer"):
            w = m.base_layer.weight.detach()
            if not m.merged:
                w = w + (m.lora_B["default"].weight.detach() @ m.lora_A["default"].weight.detach()) * SCALE
            out[name] = (w.clone(), m.base_layer.bias.detach().clone())
        else:
            out[name] = (m.weight.detach().clone(), m.bias.detach().clone())
    return out


class _HandQuantized(nn.Module):
    """F.linear(q(x), q(W), b): the simulated format's Linear written from the quantizers."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor, quant) -> None:
        super().__init__()
        self.w, self.b, self.quant = quant(w.float()), b.float(), quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quant(x.float()), self.w, self.b).to(x.dtype)


def _reference(live: nn.Module, fmt: str, kept: set[str]) -> nn.Module:
    """The copy the invariant asks for, built by hand: a plain (adapter-free) model holding the effective weights,
    each quantized Linear replaced by :class:`_HandQuantized`, cast whole for a cast format."""
    ref = _live_class()().eval()
    eff = _effective(live)
    with torch.no_grad():
        for name, (w, b) in eff.items():
            ref.get_submodule(name).weight.copy_(w)
            ref.get_submodule(name).bias.copy_(b)
        ref.norm_out.weight.copy_(live.norm_out.weight)
        ref.norm_out.bias.copy_(live.norm_out.bias)
    if fmt in CAST_FORMATS:
        return ref.to(CAST_FORMATS[fmt])
    for name in _LINEARS:
        if name not in kept:
            parent, _, leaf = name.rpartition(".")
            w, b = eff[name]
            setattr(ref.get_submodule(parent) if parent else ref, leaf, _HandQuantized(w, b, _QUANT[fmt]))
    return ref


def _inputs(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, WIDTH, generator=g).to(dtype), torch.randn(3, WIDTH, generator=g).to(dtype)


def _precision(fmt: str, policy: str) -> RolloutPrecision:
    base, _, gran = fmt.partition(":")
    return RolloutPrecision(base, granularity=gran or "row", **POLICIES[policy][0])


def _check_equals_reference(copy_: nn.Module, live: nn.Module, fmt: str, kept: set[str]) -> torch.Tensor:
    """Weights, layer types and output of ``copy_`` bitwise those of the hand reference; returns the output."""
    ref = _reference(live, fmt, kept)
    dtype = CAST_FORMATS.get(fmt, torch.float32)
    for name in _LINEARS:
        got, want = copy_.get_submodule(name), ref.get_submodule(name)
        quantized = isinstance(want, _HandQuantized)
        assert isinstance(got, QuantizedLinear) == quantized, (name, type(got).__name__)
        w_want, b_want = (want.w, want.b) if quantized else (want.weight, want.bias)
        assert got.weight.dtype == w_want.dtype == (torch.float32 if quantized else dtype), name
        assert torch.equal(got.weight, w_want), name
        assert torch.equal(got.bias, b_want), name
    assert torch.equal(copy_.norm_out.weight, ref.norm_out.weight.to(dtype))
    x, t = _inputs(dtype)
    with torch.no_grad():
        out, want = copy_(x, t), ref(x, t)
    assert out.dtype == dtype and torch.equal(out, want)
    return out


def _train_and_perturb(live: nn.Module, seed: int) -> None:
    """One SGD step on the live model's trainable tensors (the adapters), then a perturbation of every tensor (base
    weights, biases, the norm, the adapters) as a full fine-tune or a merged adapter's training would make."""
    params = [p for p in live.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    x, t = _inputs(torch.float32, seed=seed)
    live.train()
    loss = live(x, t).square().mean()
    if loss.requires_grad:  # merged adapters take no gradient (peft runs the base layer alone)
        loss.backward()
        opt.step()
    live.eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in live.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_rollout_copy_is_the_live_function_before_and_after_a_sync(fmt, policy, merged):
    if fmt in HARDWARE_FORMATS:
        pytest.skip(f"{fmt!r} runs torchao's CUDA kernels (fp8: compute capability >= 8.9, nvfp4: 10.x); the hand "
                    f"reference covers the cast and simulated formats, its rounding is the simulated twin's")
    if fmt in CAST_FORMATS and policy in ("by_name", "by_size"):
        with pytest.raises(ValueError, match="casts the whole copy"):
            _precision(fmt, policy)
        return
    precision = _precision(fmt, policy)
    kept = set() if fmt in CAST_FORMATS else POLICIES[policy][1]
    live = _live(merged)
    owner = _Owner(live)
    ro = owner.roles.rollout_copy("rollout", owner.generator, precision)
    # the layer policy, as the report says it and as the copy holds it
    if fmt not in CAST_FORMATS:
        assert set(ro.report.kept) == kept and set(ro.report.replaced) == set(_LINEARS) - kept
    assert not any("lora" in n for n, _ in ro.module.named_parameters())
    stale = _check_equals_reference(ro.module, live, fmt, kept)
    if fmt in ("fp32", "fp64"):  # the same function as the live (unmerged) model, up to the merge's rounding
        x, t = _inputs(torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(stale.float(), live(x, t), atol=1e-5, rtol=1e-5)

    # a training step and a perturbation of every live tensor, then the sync
    before = {n: (p, p.data_ptr()) for n, p in ro.module.named_parameters()}
    _train_and_perturb(live, seed=7)
    stats = owner.roles.sync("rollout")
    assert stats["max_weight_change"] > 0
    fresh, _ = build_rollout_module(live, precision)
    got, want = dict(ro.module.named_parameters()), dict(fresh.named_parameters())
    assert set(got) == set(want)
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
        assert p is before[name][0] and p.data_ptr() == before[name][1], name  # in place, never rebound
    out = _check_equals_reference(ro.module, live, fmt, kept)
    assert not torch.equal(out, stale)  # the canary: the stale copy is detectably stale


@pytest.mark.parametrize("decay", [0.0, 0.3, 1.0])
def test_lagged_old_policy_is_the_ema_and_a_rollout_copy_of_it_is_its_fresh_copy(decay):
    """The lagged copy holds the adapter only; after ``update_lagged(d)`` its tensors are d old + (1 - d) new (exactly
    new at d = 0, exactly old at d = 1), the swap computes the live model with them (bitwise, against
    ``functional_call``), and a rollout copy synced inside the swap is the fresh copy of that old policy."""
    live = _live(merged=False)
    owner = _Owner(live)
    lagged = owner.roles.lagged("old_policy", live)
    trainable = {n: p.detach().clone() for n, p in live.named_parameters() if p.requires_grad}
    assert set(lagged.tensors()) == set(trainable) and all("lora_" in n for n in trainable)
    old = {n: t.clone() for n, t in lagged.tensors().items()}
    _train_and_perturb(live, seed=3)
    new = {n: p.detach().clone() for n, p in live.named_parameters() if p.requires_grad}
    assert all(not torch.equal(old[n], new[n]) for n in new)
    assert owner.roles.update_lagged("old_policy", decay) == decay
    for n, t in lagged.tensors().items():
        if decay in (0.0, 1.0):
            assert torch.equal(t, new[n] if decay == 0.0 else old[n]), n
        else:
            torch.testing.assert_close(t, decay * old[n] + (1 - decay) * new[n], atol=1e-6, rtol=0)
    x, t_in = _inputs(torch.float32)
    with torch.no_grad():
        want = torch.func.functional_call(live, {**dict(live.named_parameters()), **lagged.tensors()}, (x, t_in))
        live_out = live(x, t_in)
        with owner.roles.swap(owner.generator, "old_policy") as gen:
            old_out = gen.transformer(x, t_in)
        assert torch.equal(old_out, want)
        assert torch.equal(live(x, t_in), live_out)  # swapped back
        assert torch.equal(old_out, live_out) == (decay == 0.0)
    # a rollout copy refreshed from the old policy (Roles.sync inside the swap) is the old policy's fresh copy
    precision = RolloutPrecision("fake_nvfp4")
    ro = owner.roles.rollout_copy("rollout", owner.generator, precision)
    with owner.roles.swap(owner.generator, "old_policy") as gen:
        owner.roles.sync("rollout")
        fresh, _ = build_rollout_module(gen.transformer, precision)
        _check_equals_reference(ro.module, gen.transformer, "fake_nvfp4", POLICIES["default"][1])
    for (n, p), (n_f, p_f) in zip(ro.module.named_parameters(), fresh.named_parameters(), strict=True):
        assert n == n_f and torch.equal(p, p_f), n
