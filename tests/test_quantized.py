"""Rollout copies in low precision (Sol-RL): the layer policy, QuantizedLinear against the format quantizers, the
in-place refresh contract (bitwise equal to a fresh build, storage unchanged, stale canary, LoRA merged first)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from genrl.models.precision import fake_fp8, fake_mx, fake_nvfp4
from genrl.models.quantized import (
    DEFAULT_SKIP,
    FAKE_FORMATS,
    QuantizedLinear,
    RolloutPrecision,
    build_rollout_module,
    effective_linear,
    refresh_rollout_module,
)
from genrl.models.roles import RolloutCopy

_REF = {"fake_fp8": lambda t: fake_fp8(t, "row"), "fake_nvfp4": fake_nvfp4,
        "fake_mxfp4": lambda t: fake_mx(t, "fp4"), "fake_mxfp8": lambda t: fake_mx(t, "fp8")}


def _dit(seed: int = 0, hidden: int = 64):
    from genrl.models import VideoDiT

    torch.manual_seed(seed)
    dit = VideoDiT(hidden_size=hidden, num_layers=2, num_attention_heads=2, text_dim=32)
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0.0, 0.05)
    return dit.eval()


def _inputs(seed: int = 1, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, 3, 8, 8, generator=g)
    text = torch.randn(batch, 5, 32, generator=g)
    sigma = torch.rand(batch, generator=g)
    return x, sigma, text


def _run(module, inputs):
    x, sigma, text = inputs
    with torch.no_grad():
        return module(x, sigma, text).float()


@pytest.mark.parametrize("fmt", FAKE_FORMATS)
def test_quantized_linear_computes_the_format_quantizers_product(fmt):
    """forward(x) = linear(q_a(x), q_w(W), b) with the format's own quantizers; the stored weight is on the grid
    (idempotent); weight-only skips the activation quantizer."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = QuantizedLinear(lin, fmt)
    ref = _REF[fmt]
    assert torch.equal(q.weight, ref(lin.weight.detach()))
    assert torch.equal(ref(q.weight), q.weight)  # on the grid: quantizing again changes nothing
    x = torch.randn(3, 7, 64)
    with torch.no_grad():
        assert torch.equal(q(x), F.linear(ref(x), ref(lin.weight), lin.bias))
        w_only = QuantizedLinear(lin, fmt, activations=False)
        assert torch.equal(w_only(x), F.linear(x, ref(lin.weight), lin.bias))
        assert not torch.equal(q(x), w_only(x))
        err = float((q(x) - lin(x)).norm() / lin(x).norm())
    assert 1e-4 < err < 0.2, err


def test_fp8_granularity_changes_the_scales():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    with torch.no_grad():
        lin.weight[0].mul_(50.0)  # one large row: per-tensor scaling crushes the other rows
    row, tensor = QuantizedLinear(lin, "fake_fp8", "row"), QuantizedLinear(lin, "fake_fp8", "tensor")
    assert torch.equal(tensor.weight, fake_fp8(lin.weight.detach(), "tensor"))
    err = [float((q.weight[1:] - lin.weight[1:]).abs().max()) for q in (row, tensor)]
    assert err[0] < err[1]


def test_layer_policy_keeps_embedders_modulation_and_the_final_layer():
    dit = _dit()
    _, report = build_rollout_module(dit, RolloutPrecision("fake_nvfp4"))
    kept = set(report.kept)
    assert {"patch_embed", "time_embed.0", "time_embed.2", "text_proj.1", "pooled_proj.1", "proj_out",
            "ada_ln_out.1", "blocks.0.ada_ln.1"} <= kept
    assert "blocks.1.attn.to_q" in report.replaced and "blocks.0.mlp.2" in report.replaced
    assert not kept & set(report.replaced)
    assert "name matches 'embed'" in report.kept["patch_embed"] and "kept" in str(report)
    # min_dim keeps the 64 x 64 projections and quantizes only the 256-wide MLP layers
    _, by_size = build_rollout_module(dit, RolloutPrecision("fake_nvfp4", min_dim=64))
    assert sorted(by_size.replaced) == [f"blocks.{i}.mlp.{j}" for i in range(2) for j in (0, 2)]
    # skip [] quantizes every Linear whose input dim fits the block: the patch embedder (in 24) does not (16 | 24 no)
    _, everything = build_rollout_module(dit, RolloutPrecision("fake_nvfp4", skip=[]))
    assert list(everything.kept) == ["patch_embed"] and "block 16" in everything.kept["patch_embed"]
    _, mx = build_rollout_module(dit, RolloutPrecision("fake_mxfp4", skip=[]))
    assert "patch_embed" in mx.kept and "block 32" in mx.kept["patch_embed"]
    assert "ada_ln" in DEFAULT_SKIP


def test_bad_precisions_name_the_fix():
    with pytest.raises(ValueError, match="unknown"):
        RolloutPrecision("int3")
    with pytest.raises(ValueError, match="casts the whole copy"):
        RolloutPrecision("bf16", skip=["embed"])
    with pytest.raises(ValueError, match="granularity"):
        RolloutPrecision("fake_fp8", granularity="block")
    if not torch.cuda.is_available():
        for fmt in ("fp8", "nvfp4"):
            with pytest.raises(RuntimeError, match="CUDA GPU.*bf16"):
                build_rollout_module(nn.Sequential(nn.Linear(32, 32)), RolloutPrecision(fmt, skip=[]))


def test_bf16_copy_casts_the_whole_network_and_stays_close():
    dit = _dit()
    copy_, report = build_rollout_module(dit, RolloutPrecision("bf16"))
    assert not report.kept and all(p.dtype == torch.bfloat16 for p in copy_.parameters())
    assert not any(p.requires_grad for p in copy_.parameters()) and not copy_.training
    inputs = _inputs()
    ref, low = _run(dit, inputs), _run(copy_, inputs)
    rel = float((low - ref).norm() / ref.norm())
    assert 1e-4 < rel < 0.03, rel


@pytest.mark.parametrize("fmt", ["bf16", "fake_fp8", "fake_nvfp4", "fake_mxfp4"])
def test_refresh_in_place_equals_a_fresh_build_and_a_stale_copy_differs(fmt):
    """After an update of the live weights, the refreshed copy equals a freshly built one bitwise (weights and
    output), every parameter keeps its object and storage, and the copy before the refresh (the canary) differs."""
    live = _dit()
    precision = RolloutPrecision(fmt)
    copy_, _ = build_rollout_module(live, precision)
    before = {n: (p, p.data_ptr()) for n, p in copy_.named_parameters()}
    inputs = _inputs()
    stale_out = _run(copy_, inputs)
    with torch.no_grad():  # an optimizer step's worth of change
        for p in live.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fresh, _ = build_rollout_module(live, precision)
    assert not torch.equal(stale_out, _run(fresh, inputs))  # the canary: a stale copy is detectably stale
    stats = refresh_rollout_module(copy_, live, precision)
    assert stats["max_weight_change"] > 0 and stats["seconds"] >= 0
    for (name, p), (name_f, p_f) in zip(copy_.named_parameters(), fresh.named_parameters(), strict=True):
        assert name == name_f and torch.equal(p, p_f), name
        assert p is before[name][0] and p.data_ptr() == before[name][1], name
    assert torch.equal(_run(copy_, inputs), _run(fresh, inputs))
    assert refresh_rollout_module(copy_, live, precision)["max_weight_change"] == 0.0  # nothing new: no change


def test_lora_is_merged_before_quantizing():
    """The copy of a LoRA policy holds q(W0 + s B A) (closed form, s = alpha / r), and a refresh after the adapter
    moved holds the new merged sum; disabling the adapters gives q(W0)."""
    from diffusers.loaders import PeftAdapterMixin
    from peft import LoraConfig

    class Net(nn.Module, PeftAdapterMixin):
        def __init__(self) -> None:
            super().__init__()
            self.to_q, self.other = nn.Linear(32, 16), nn.Linear(32, 32)

        def forward(self, x):
            return self.to_q(self.other(x))

    torch.manual_seed(0)
    net = Net()
    w0 = net.to_q.weight.detach().clone()
    net.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"], init_lora_weights="gaussian"))
    with torch.no_grad():
        net.to_q.lora_B["default"].weight.normal_(0.0, 0.1)
    a, b = net.to_q.lora_A["default"].weight.detach(), net.to_q.lora_B["default"].weight.detach()
    merged = w0 + 2.0 * b @ a
    w, bias = effective_linear(net.to_q)
    assert torch.allclose(w, merged, atol=1e-6) and torch.equal(bias, net.to_q.base_layer.bias)
    precision = RolloutPrecision("fake_nvfp4", skip=[])
    copy_, report = build_rollout_module(net, precision)
    assert "to_q" in report.replaced and isinstance(copy_.to_q, QuantizedLinear)
    assert not any("lora" in n for n, _ in copy_.named_parameters())
    assert torch.equal(copy_.to_q.weight, fake_nvfp4(w))
    with torch.no_grad():
        net.to_q.lora_A["default"].weight.add_(0.2)
    refresh_rollout_module(copy_, net, precision)
    w_new, _ = effective_linear(net.to_q)
    assert not torch.equal(w_new, w) and torch.equal(copy_.to_q.weight, fake_nvfp4(w_new))
    net.disable_adapters()
    refresh_rollout_module(copy_, net, precision)
    assert torch.equal(copy_.to_q.weight, fake_nvfp4(w0))
    with pytest.raises(KeyError, match="another module"):
        refresh_rollout_module(copy_, nn.Sequential(nn.Linear(32, 32)), precision)


def test_rollout_copy_role_defaults_to_the_live_dtype_and_syncs_in_place():
    live = _dit()
    ro = RolloutCopy(live)
    assert ro.precision.format == "fp32" and not ro.report.kept
    assert torch.equal(_run(ro.module, _inputs()), _run(live, _inputs()))  # same precision: bitwise the policy
    w = ro.module.blocks[0].attn.to_q.weight
    with torch.no_grad():
        live.blocks[0].attn.to_q.weight.add_(1.0)
    stats = ro.sync(live)
    assert ro.last_sync is stats and stats["max_weight_change"] == pytest.approx(1.0)
    assert ro.module.blocks[0].attn.to_q.weight is w and torch.equal(w, live.blocks[0].attn.to_q.weight)


@pytest.mark.compile_count
def test_a_compiled_copy_is_not_traced_again_after_a_refresh():
    """precision.compile: the copy is compiled once; refreshes mutate its parameters (graph inputs), so the next call
    reuses the graph and computes with the new weights (equal to a fresh eager build)."""
    from genrl.models.compile import CompileCounter

    torch.manual_seed(0)
    live = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    precision = RolloutPrecision("fake_fp8", skip=[], compile=True)
    copy_, _ = build_rollout_module(live, precision)
    x = torch.randn(4, 32)
    with torch.no_grad():
        copy_(x)
        with CompileCounter() as counter:  # noqa: SIM117
            for _ in range(2):
                for p in live.parameters():
                    p.add_(0.05)
                refresh_rollout_module(copy_, live, precision)
                out = copy_(x)
        eager, _ = build_rollout_module(live, RolloutPrecision("fake_fp8", skip=[]))
        assert counter.graphs == 0
        assert torch.allclose(out, eager(x), atol=1e-6, rtol=1e-6)
        assert not torch.allclose(out, copy.deepcopy(live)(x), atol=1e-4)


@pytest.mark.parametrize("capability, fmt, warns", [("AVX2", "bf16", True), ("AVX2", "fp16", True),
                                                     ("AVX512_AMX", "bf16", False), ("AVX2", "fp32", False),
                                                     ("AVX2", "fake_nvfp4", False)])
def test_a_half_precision_copy_on_a_cpu_without_amx_warns(monkeypatch, caplog, capability, fmt, warns):
    """bf16 / fp16 matmuls are emulated (and slower than float32) on CPUs without AMX: building such a copy there
    says so and names the fix."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    with caplog.at_level("WARNING", logger="genrl.models.quantized"):
        build_rollout_module(nn.Sequential(nn.Linear(32, 32)), RolloutPrecision(fmt))
    hit = [r.getMessage() for r in caplog.records if "without AMX" in r.getMessage()]
    assert bool(hit) == warns
    if warns:
        assert capability in hit[0] and "'fp32'" in hit[0]


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_hardware_fp8_config_leaves_inductor_settings_alone(monkeypatch, granularity):
    """torchao's fp8 config for the rollout copy must not rewrite inductor's global settings (its default turns on
    coordinate-descent tuning: a 188 s first compile of the Wan2.1-1.3B copy on an H200, and a changed compile of
    every other model in the process). CUDA is faked: only the config is built here, nothing runs."""
    pytest.importorskip("torchao")
    import torch._inductor.config as inductor_config
    from torchao.quantization import PerRow, PerTensor, quantize_

    from genrl.models.quantized import _torchao_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    config = _torchao_config(RolloutPrecision("fp8", granularity=granularity))
    assert config.set_inductor_config is False
    assert isinstance(config.granularity[0] if isinstance(config.granularity, (list, tuple)) else config.granularity,
                      PerRow if granularity == "row" else PerTensor)
    saved = inductor_config.save_config()
    before = inductor_config.coordinate_descent_tuning
    try:
        with contextlib.suppress(Exception):  # the float8 kernels need a real GPU; the settings would be set first
            quantize_(nn.Sequential(nn.Linear(32, 32)), config)
        assert inductor_config.coordinate_descent_tuning == before
    finally:
        inductor_config.load_config(saved)
