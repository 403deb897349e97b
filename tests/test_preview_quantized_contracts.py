"""Contracts of Sol-RL's candidate preview (genrl/methods/preview.py) and of the low-precision rollout copy
(genrl/models/quantized.py), written for the mutation survivors of issue 51: fast unit tests that call the functions
directly on tiny inputs (no Trainer, no CLI).

* preview: the config's validation bounds and its mapping form, the preview rollout config (steps, micro-batch, SDE
  window clipped), the declaration of the rollout copy, ``select_batch`` on a tiny stand-in method (a real rollout of a
  per-row toy generator, real roles and rollout copy): the copy refreshed under the given weights, the preview rolled
  out at the iteration's SDE window without recording a trajectory, validity (scorer's mask and finite rewards), the
  kept rows and their rewards, the logged statistics and their batch size, the random selection's seed address;
  ``log_proxy_fidelity`` against hand-computed Spearman / overlaps / reward gap.
* quantized: the layer policy's fp8 block rule, ``QuantizedLinear``'s formats, dtypes, devices (under a default-device
  context), frozen parameters and bias handling, the output / input dtypes and the exact refresh delta; LoRA detection,
  merging (dtype, device, bias, adapter markers dropped) and the effective weight (dtype of the delta, sharded
  tensors gathered on their device); the torchao config's compute-capability gates; the slow-cast warning's guards;
  the hardware path's layer filter (torchao's ``quantize_`` faked); the copy's report and frozen parameters.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

import genrl.methods.preview as preview_module
from genrl.flow.selection import select_candidates
from genrl.methods.preview import PreviewConfig, Selection, configure_preview, log_proxy_fidelity, preview_config
from genrl.models import quantized as q
from genrl.models.quantized import QuantizedLinear, RolloutPrecision
from genrl.models.roles import Roles
from genrl.models.text_encoder import Conditioning
from genrl.noise import mix_seed, stream_id
from genrl.rollout.sampler import RolloutConfig, rollout, sde_mask

# ================================================================================================ preview


def test_preview_config_bounds_and_mapping_precision():
    """PreviewConfig accepts its documented lower bounds (keep = 1, num_steps = 1, micro_batch_size = 1) and every
    selection mode, rejects the values just below, and builds a RolloutPrecision from a plain mapping."""
    cfg = PreviewConfig(keep=1, num_steps=1, micro_batch_size=1)
    assert (cfg.keep, cfg.num_steps, cfg.micro_batch_size) == (1, 1, 1)
    for mode in ("best_worst", "max_variance", "mean_deviation", "random"):
        assert PreviewConfig(selection=mode).selection == mode
    for bad in ({"keep": 0}, {"num_steps": 0}, {"micro_batch_size": 0}, {"selection": "top"}):
        with pytest.raises(ValueError):
            PreviewConfig(**bad)
    mapped = PreviewConfig(precision={"format": "fake_fp8", "skip": [], "activations": False})
    assert isinstance(mapped.precision, RolloutPrecision)
    assert (mapped.precision.format, mapped.precision.skip, mapped.precision.activations) == ("fake_fp8", [], False)


def test_preview_config_resets_a_window_start_past_the_preview_steps():
    """A preview with fewer steps than the rollout: window_end is clipped to the preview's steps and a window_start at
    or past them becomes 0 (the window then starts at the first step); a start below them is kept."""
    base = RolloutConfig(num_steps=10, sde_steps="window", num_sde_steps=1, window_start=5, window_end=8)
    cfg = preview_config(base, PreviewConfig(keep=2, num_steps=3))
    assert (cfg.num_steps, cfg.window_start, cfg.window_end, cfg.schedule) == (3, 0, 3, None)
    at = preview_config(RolloutConfig(num_steps=10, sde_steps="window", num_sde_steps=1, window_start=3),
                        PreviewConfig(keep=2, num_steps=3))
    assert at.window_start == 0 and at.window_end is None  # start == steps: reset; an unset end stays unset
    below = preview_config(base, PreviewConfig(keep=2, num_steps=6))
    assert (below.window_start, below.window_end) == (5, 6)


def test_configure_preview_declares_the_rollout_copy_only_for_a_previewing_method():
    """A method without a ``preview`` attribute (or with None) declares nothing; one with a preview gets the
    ``"rollout"`` copy in the preview's precision."""
    bare = _Method(None)
    del bare.preview
    configure_preview(bare, bare.generator)
    assert "rollout" not in bare.roles.table
    off = _Method(None)
    configure_preview(off, off.generator)
    assert "rollout" not in off.roles.table
    on = _Method(PreviewConfig(keep=2, precision=RolloutPrecision("fp64")))
    configure_preview(on, on.generator)
    assert on.roles.table["rollout"].kind == "rollout"
    assert on.frozen["rollout"].module.lin.weight.dtype == torch.float64


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():  # multiples of 1/16: exact sums below
            self.lin.weight.copy_((torch.arange(16.0).reshape(4, 4) - 7.0) / 16)
            self.lin.bias.copy_(torch.tensor([0.125, -0.25, 0.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Gen(nn.Module):
    """A per-row toy generator: v = transformer(x) + len(prompt) / 10 (no batch mixing)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Transformer()

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def encode_prompts(self, prompts):
        h = torch.stack([torch.full((2, 4), float(len(p)) / 10) for p in prompts])
        return Conditioning(h, torch.ones(len(prompts), 2, dtype=torch.bool), list(prompts))

    def velocity(self, x, sigma, cond, **kwargs):
        return self.transformer(x) + cond.hidden_states[:, 0, 0].reshape(-1, 1, 1)

    def decode(self, latents):
        return latents.clone()


class _Method(LightningModule):
    """What select_batch needs of a method: generator, roles with the rollout copy, scorer, preview, latent_shape,
    hparams.seed; log_dict records what it is given."""

    def __init__(self, preview: PreviewConfig | None, seed: int = 3, scorer=None) -> None:
        super().__init__()
        self.save_hyperparameters({"seed": seed})
        self.preview = preview
        self.roles = Roles(self)
        self.roles.trainable("generator", _Gen())
        self.latent_shape = (2, 4)
        self.scorer = scorer
        self.logged: list[tuple[dict, object]] = []

    def log_dict(self, stats, batch_size=None, **kwargs):  # noqa: D102
        self.logged.append((dict(stats), batch_size))


PROMPTS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g", "hh"]
INDEX = torch.arange(20, 28)
GROUP = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
CONFIG = RolloutConfig(num_steps=4, kernel="flow_grpo", sde_steps="window", num_sde_steps=1, skip_last_step=False,
                       micro_batch_size=8)


def _scorer(invalid_rows=(), nan_rows=()):
    """Reward = mean of the decoded sample; rows ``invalid_rows`` flagged invalid by the scorer (finite value), rows
    ``nan_rows`` NaN while flagged valid."""

    def score(pixels, prompts):
        total = pixels.flatten(1).mean(1).double()
        total[list(nan_rows)] = float("nan")
        valid = torch.ones(len(prompts), dtype=torch.bool)
        valid[list(invalid_rows)] = False
        return SimpleNamespace(total=total, valid=valid)

    return score


def _previewing(selection="best_worst", keep=2, scorer=None, seed=3) -> _Method:
    m = _Method(PreviewConfig(keep=keep, selection=selection, precision=RolloutPrecision("fp32")), seed=seed,
                scorer=scorer or _scorer())
    configure_preview(m, m.generator)
    return m


def _reference_totals(method: _Method, iteration: int) -> torch.Tensor:
    """The preview rewards computed by hand: a rollout of the live generator (the fp32 copy is bitwise the live one)
    at the preview config and the iteration's SDE window, scored by the method's scorer (NaN where invalid)."""
    x0 = rollout(method.generator, PROMPTS, method.latent_shape, method.hparams.seed, INDEX,
                 preview_config(CONFIG, method.preview), rollout_id=iteration, record=False).final
    r = method.scorer(x0.clone(), PROMPTS)
    return torch.where(r.valid & torch.isfinite(r.total), r.total.float(), float("nan"))


def test_select_batch_keeps_best_and_worst_valid_rows_and_logs_the_pool_statistics(monkeypatch):
    """select_batch on 2 prompts x 4 candidates (K = 2, best / worst): the preview is rolled out at the iteration's
    SDE window (its mask differs from rollout 0's here) without recording the trajectory; a row is valid only when the
    scorer says so AND its reward is finite; per prompt the best and the worst valid row are kept (by hand); the
    selection carries those rows, their rewards and the logged statistics (pool mean over the valid rows, kept
    mean, invalid fraction, a preview time within the call's wall time), logged with the batch size."""
    method = _previewing(scorer=_scorer(invalid_rows=(1,), nan_rows=(6,)))
    iteration = 2
    preview_cfg = preview_config(CONFIG, method.preview)
    assert not torch.equal(sde_mask(preview_cfg, 3, iteration), sde_mask(preview_cfg, 3, 0))
    seen = []
    real = preview_module.rollout

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(preview_module, "rollout", spy)
    expected = _reference_totals(method, iteration)
    t0 = time.perf_counter()
    prompts, index, group, sel = preview_module.select_batch(method, PROMPTS, INDEX, GROUP, CONFIG, iteration)
    wall = time.perf_counter() - t0
    (traj,) = seen
    assert torch.equal(traj.sde_mask, sde_mask(preview_cfg, 3, iteration))
    assert traj.latents.numel() == 0 and traj.noises.numel() == 0  # only the final sample is kept
    valid = torch.isfinite(expected)
    assert valid.tolist() == [True, False, True, True, True, True, False, True]
    rows = []
    for g in range(2):
        cols = [4 * g + c for c in range(4) if valid[4 * g + c]]
        ranked = sorted(cols, key=lambda i: float(expected[i]))
        rows += sorted([ranked[0], ranked[-1]])
    assert sel.rows.tolist() == rows and sel.keep == 2
    assert torch.equal(sel.preview_rewards, expected[rows])
    assert prompts == [PROMPTS[i] for i in rows] and torch.equal(index, INDEX[rows]) and torch.equal(group, GROUP[rows])
    stats = sel.stats
    assert set(stats) == {"preview/reward", "preview/selected_reward", "preview/invalid_fraction",
                          "preview/refresh_seconds", "preview/max_weight_change", "preview/seconds"}
    assert stats["preview/reward"] == pytest.approx(float(expected[valid].double().mean()), rel=1e-6)
    assert stats["preview/selected_reward"] == pytest.approx(float(expected[rows].double().mean()), rel=1e-6)
    assert stats["preview/invalid_fraction"] == 0.25
    assert 0.0 <= stats["preview/seconds"] <= wall
    assert stats["preview/max_weight_change"] == 0.0
    assert method.logged == [(stats, 8)]


def test_select_batch_refreshes_the_copy_under_the_given_weights():
    """``policy`` (RAM's lagged weights) is applied while the rollout copy is refreshed: the copy holds those weights
    afterwards (the refresh reports their change), the live weights are restored."""
    method = _previewing()
    live_w = method.generator.transformer.lin.weight.detach().clone()

    @contextlib.contextmanager
    def shifted():
        with torch.no_grad():
            method.generator.transformer.lin.weight.add_(0.25)
        try:
            yield
        finally:
            with torch.no_grad():
                method.generator.transformer.lin.weight.sub_(0.25)

    *_, sel = preview_module.select_batch(method, PROMPTS, INDEX, GROUP, CONFIG, 0, policy=shifted)
    assert torch.equal(method.frozen["rollout"].module.lin.weight, live_w + 0.25)
    assert torch.equal(method.generator.transformer.lin.weight, live_w)
    assert sel.stats["preview/max_weight_change"] == 0.25


def test_random_selection_is_addressed_by_seed_iteration_and_first_index():
    """The random selection draws from the generator seeded by mix_seed(seed, iteration, stream "preview.select",
    index[0]) (noise registry): equal to select_candidates with that generator at each of 5 iterations,
    reproducible, and changing with the iteration."""
    method = _previewing(selection="random", keep=2)
    drawn = []
    for iteration in range(5, 10):  # 36 possible selections each: several iterations rule out a coincidence
        expected = _reference_totals(method, iteration)
        rng = torch.Generator().manual_seed(mix_seed(3, iteration, stream_id("preview.select"), int(INDEX[0])))
        cols = select_candidates(expected.reshape(2, 4).double(), 2, "random", generator=rng)
        rows = (cols + torch.tensor([[0], [4]])).reshape(-1)
        *_, sel = preview_module.select_batch(method, PROMPTS, INDEX, GROUP, CONFIG, iteration)
        assert sel.rows.tolist() == rows.tolist(), iteration
        drawn.append(sel.rows.tolist())
    *_, again = preview_module.select_batch(method, PROMPTS, INDEX, GROUP, CONFIG, 9)
    assert again.rows.tolist() == drawn[-1]
    assert len({tuple(r) for r in drawn}) > 1  # the iteration changes the draw


def _fidelity(prev: list[float], full: list[float], keep: int) -> dict:
    method = _Method(None)
    sel = Selection(torch.arange(len(prev)), torch.tensor(prev), keep)
    out = log_proxy_fidelity(method, sel, torch.tensor(full), torch.ones(len(full), dtype=torch.bool))
    assert method.logged == [(out, len(full))]
    return out


def test_log_proxy_fidelity_hand_values():
    """K = 4, 2 prompts, overlaps of k = K // 2 = 2: prompt 1 preview [.1 .2 .3 .4] vs full [.2 .1 .5 .45] (Spearman
    1 - 6 * 4 / (4 * 15) = 0.6, same top-2 and bottom-2 sets although the top-1 / bottom-1 differ), prompt 2 full =
    preview + 1 (rho 1); reward gap = mean(full - preview) = 4.25 / 8. K = 2: k = 1 and the best / worst are swapped
    (overlaps 0, rho -1). Logged with the number of kept rows as batch size; None logs nothing."""
    out = _fidelity([0.1, 0.2, 0.3, 0.4, 0.0, 1.0, 2.0, 3.0], [0.2, 0.1, 0.5, 0.45, 1.0, 2.0, 3.0, 4.0], 4)
    assert out["preview/spearman"] == pytest.approx(0.8)
    assert out["preview/top_overlap"] == 1.0 and out["preview/bottom_overlap"] == 1.0
    assert out["preview/reward_gap"] == pytest.approx(4.25 / 8, rel=1e-6)
    two = _fidelity([0.1, 0.2], [0.3, 0.2], 2)
    assert two["preview/spearman"] == pytest.approx(-1.0)
    assert two["preview/top_overlap"] == 0.0 and two["preview/bottom_overlap"] == 0.0
    assert two["preview/reward_gap"] == pytest.approx(0.1, rel=1e-6)
    assert log_proxy_fidelity(_Method(None), None, torch.zeros(2), torch.ones(2, dtype=torch.bool)) == {}


# ================================================================================================ quantized


def test_fp8_layer_policy_needs_out_features_a_multiple_of_16():
    """fp8 (torchao row-wise kernels): in_features a multiple of 16 AND out_features a multiple of 16; the simulated
    formats only check in_features against their block."""
    fp8 = RolloutPrecision("fp8", skip=[])
    assert fp8.eligible("blocks.0.ff", nn.Linear(16, 32))[0]
    assert fp8.eligible("blocks.0.ff", nn.Linear(16, 48))[0]
    ok, why = fp8.eligible("blocks.0.ff", nn.Linear(16, 24))
    assert not ok and "block" in why
    assert not fp8.eligible("blocks.0.ff", nn.Linear(24, 32))[0]
    assert RolloutPrecision("fake_nvfp4", skip=[]).eligible("blocks.0.ff", nn.Linear(16, 24))[0]


def test_quantized_linear_formats_dtypes_and_frozen_parameters():
    """QuantizedLinear takes cast and simulated formats only (a hardware format is refused); a cast format stores
    weight and bias in its dtype, a simulated one in float32 (whatever the default dtype); the parameters never
    require gradients; a bias-less Linear stays bias-less."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 8)
    for fmt, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp64", torch.float64)):
        layer = QuantizedLinear(lin, fmt)
        assert layer.weight.dtype == dtype and layer.bias.dtype == dtype
        assert torch.equal(layer.weight, lin.weight.detach().to(dtype))
        assert not layer.weight.requires_grad and not layer.bias.requires_grad
    with pytest.raises(ValueError, match="format"):
        QuantizedLinear(lin, "nvfp4")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        fake = QuantizedLinear(lin, "fake_mxfp8")
    finally:
        torch.set_default_dtype(old)
    assert fake.weight.dtype == torch.float32 and fake.bias.dtype == torch.float32
    bare = QuantizedLinear(nn.Linear(32, 8, bias=False), "fake_fp8")
    assert bare.bias is None and not bare.weight.requires_grad
    assert torch.equal(bare(torch.ones(2, 32)), bare(torch.ones(2, 32)))


def test_quantized_linear_parameters_follow_the_layer_device_not_the_default_device():
    """Built under a default-device context (here the meta device), the quantized weight and bias are made on the
    live layer's device (the CPU) and hold its values."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 4)
    with torch.device("meta"):
        layer = QuantizedLinear(lin, "bf16")
    assert layer.weight.device.type == "cpu" and layer.bias.device.type == "cpu"
    assert torch.equal(layer.weight, lin.weight.detach().bfloat16())
    assert torch.equal(layer.bias, lin.bias.detach().bfloat16())


def test_quantized_linear_io_dtypes_and_exact_refresh_delta():
    """A bf16 layer casts a float32 input to bf16 and returns float32 (the input's dtype) equal to the bf16 product;
    refresh returns max |new - old| of the STORED weight: 0.0 for the weight it was built from, and the bf16 change
    for a new one."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 4)
    layer = QuantizedLinear(lin, "bf16")
    x = torch.randn(3, 16)
    y = layer(x)
    ref = torch.nn.functional.linear(x.bfloat16(), lin.weight.detach().bfloat16(), lin.bias.detach().bfloat16())
    assert y.dtype == torch.float32 and torch.equal(y, ref.float())
    assert layer.quantize_weight(lin.weight).dtype == torch.bfloat16
    assert layer.refresh(lin.weight, lin.bias) == 0.0
    new = lin.weight.detach() + 0.5
    delta = float((new.bfloat16().float() - lin.weight.detach().bfloat16().float()).abs().max())
    assert layer.refresh(new, lin.bias) == delta


class _FakeLora(nn.Module):
    """peft's LoRA-layer interface as effective_linear reads it: base_layer, lora_A, get_delta_weight(name),
    active_adapters, disable_adapters, merged."""

    def __init__(self, base: nn.Linear, delta: torch.Tensor) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Identity()})
        self.delta = delta
        self.active_adapters = ["default"]
        self.disable_adapters = False
        self.merged = False

    def get_delta_weight(self, name: str) -> torch.Tensor:
        return self.delta


def test_lora_layers_are_recognised_by_all_three_attributes():
    """A LoRA layer has base_layer, get_delta_weight and lora_A; a module with only some of them is not one."""
    full = _FakeLora(nn.Linear(2, 2), torch.zeros(2, 2))
    assert q._is_lora_layer(full)
    for keep in ("base_layer", "get_delta_weight", "lora_A"):
        partial = nn.Module()
        setattr(partial, keep, nn.Linear(2, 2) if keep != "get_delta_weight" else (lambda n: None))
        assert not q._is_lora_layer(partial), keep


def test_merge_lora_makes_a_plain_linear_in_the_weight_dtype_and_device_and_drops_adapter_markers():
    """_merge_lora replaces a LoRA layer by a plain Linear holding W0 + delta in W0's dtype (float64 here) on W0's
    device (even under a default-device context), without a bias when the base has none, and removes the
    ``_hf_peft_config_loaded`` / ``peft_config`` markers (the copy carries no adapter)."""
    torch.manual_seed(0)
    base = nn.Linear(3, 2, bias=False).double()
    delta = torch.randn(2, 3, dtype=torch.float64)
    root = nn.Module()
    root.block = nn.Module()
    root.block.proj = _FakeLora(base, delta)
    root._hf_peft_config_loaded = True
    root.peft_config = {"default": object()}
    with torch.device("meta"):
        q._merge_lora(root)
    lin = root.block.proj
    assert type(lin) is nn.Linear and lin.bias is None
    assert lin.weight.dtype == torch.float64 and lin.weight.device.type == "cpu"
    assert torch.equal(lin.weight, base.weight.detach() + delta)
    assert "_hf_peft_config_loaded" not in vars(root) and "peft_config" not in vars(root)


def test_effective_linear_casts_the_delta_to_the_base_dtype_and_returns_detached_tensors():
    """A bf16 base with a float32 delta: W0 + delta.to(bf16), in bf16; the bias of a bias-less Linear is None; a
    plain Linear gives its own weight, detached."""
    base = nn.Linear(4, 2, bias=False).bfloat16()
    delta = torch.full((2, 4), 1.0 / 3)
    w, b = q.effective_linear(_FakeLora(base, delta))
    assert w.dtype == torch.bfloat16 and b is None
    assert torch.equal(w, base.weight.detach() + delta.bfloat16())
    lin = nn.Linear(4, 2)
    w, b = q.effective_linear(lin)
    assert torch.equal(w, lin.weight) and torch.equal(b, lin.bias) and not w.requires_grad and not b.requires_grad


def test_effective_linear_gathers_sharded_tensors_whole(one_process_mesh):
    """A Linear whose weight and bias are DTensors (FSDP2) gives plain whole tensors with the values."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.weight = nn.Parameter(distribute_tensor(w0, one_process_mesh, [Shard(0)]))
    lin.bias = nn.Parameter(distribute_tensor(b0, one_process_mesh, [Shard(0)]))
    w, b = q.effective_linear(lin)
    assert type(w) is torch.Tensor and type(b) is torch.Tensor
    assert torch.equal(w, w0) and torch.equal(b, b0)


def test_effective_linear_puts_a_gathered_tensor_on_the_sharded_tensors_device(monkeypatch):
    """The gathered copy (full_tensor returns it on the CPU) is moved back to the sharded tensor's device: a stand-in
    DTensor on the meta device gives a meta tensor."""
    import genrl.models.sharding as sharding

    class DTensor(torch.Tensor):  # the name is what effective_linear dispatches on
        pass

    monkeypatch.setattr(sharding, "full_tensor", lambda t: torch.zeros(t.shape))
    lin = nn.Linear(4, 2, bias=False)
    lin.weight = nn.Parameter(torch.empty(2, 4, device="meta").as_subclass(DTensor))
    w, _ = q.effective_linear(lin)
    assert w.device.type == "meta" and type(w) is torch.Tensor


def test_base_layer_name_inserts_base_layer_before_the_leaf():
    """``a.b.weight`` -> ``a.b.base_layer.weight`` (the last dot only); a top-level name is unchanged."""
    assert q._base_layer_name("a.b.weight") == "a.b.base_layer.weight"
    assert q._base_layer_name("blocks.0.to_q.bias") == "blocks.0.to_q.base_layer.bias"
    assert q._base_layer_name("weight") == "weight"


def test_hardware_names_are_the_linears_with_a_tensor_subclass_weight():
    """Plain Linears are not hardware-quantized; a Linear whose weight data is a tensor subclass (torchao's) is."""

    class _Quantized(torch.Tensor):
        pass

    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert q._hardware_names(net) == set()
    net[2].weight = nn.Parameter(net[2].weight.detach().as_subclass(_Quantized))
    assert q._hardware_names(net) == {"2"}


@pytest.mark.parametrize("fmt, cc, ok", [("fp8", (8, 9), True), ("fp8", (8, 6), False), ("fp8", (9, 0), True),
                                         ("nvfp4", (10, 0), True), ("nvfp4", (9, 0), False),
                                         ("nvfp4", (12, 0), False)])
def test_torchao_config_compute_capability_gates(monkeypatch, fmt, cc, ok):
    """fp8 needs compute capability >= 8.9 (8.9 itself included); nvfp4 needs a 10.x GPU (not 9.0, not 12.0). CUDA is
    faked: only the config is built."""
    pytest.importorskip("torchao")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    if ok:
        assert q._torchao_config(RolloutPrecision(fmt)) is not None
    else:
        with pytest.raises(RuntimeError, match="compute capability"):
            q._torchao_config(RolloutPrecision(fmt))


def test_slow_cast_warning_skips_parameterless_and_non_cpu_modules(monkeypatch, caplog):
    """The no-AMX warning is about CPU matmuls: a module without parameters or on another device (meta here) builds
    without it; a CPU module warns."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level("WARNING", logger="genrl.models.quantized"):
        q._warn_slow_cpu_cast(nn.ReLU(), RolloutPrecision("bf16"))
        q._warn_slow_cpu_cast(nn.Linear(2, 2, device="meta"), RolloutPrecision("bf16"))
    assert not [r for r in caplog.records if "without AMX" in r.getMessage()]
    with caplog.at_level("WARNING", logger="genrl.models.quantized"):
        q._warn_slow_cpu_cast(nn.Linear(2, 2), RolloutPrecision("bf16"))
    assert [r for r in caplog.records if "without AMX" in r.getMessage()]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.time_embed = nn.Linear(16, 16)  # kept by the default layer policy
        self.ff = nn.Linear(16, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x):
        return self.out(self.ff(x + self.time_embed(x)))


def test_hardware_copy_quantizes_exactly_the_eligible_linears(monkeypatch):
    """fp8 / nvfp4: torchao's quantize_ is given the copy, the format's config and a filter that picks the eligible
    Linears only (the layer policy's kept ones stay plain). torchao and CUDA are faked: the fake quantize_ marks the
    modules its filter picks (torchao's default filter, none given, picks every Linear)."""
    import torchao.quantization as tq

    config = object()
    calls = []

    def fake_quantize(model, cfg, filter_fn=None, device=None):
        picked = [n for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) and (filter_fn is None or filter_fn(m, n))]
        calls.append((model, cfg, picked))

    monkeypatch.setattr(tq, "quantize_", fake_quantize)
    monkeypatch.setattr(q, "_torchao_config", lambda precision: config)
    module, report = q.build_rollout_module(_Net(), RolloutPrecision("fp8"))
    (model, cfg, picked), = calls
    assert model is module and cfg is config
    assert picked == ["ff", "out"] == report.replaced and list(report.kept) == ["time_embed"]


def test_built_copy_report_names_its_format_and_is_frozen():
    """The report of a build names the precision's format and lists each kept layer with its reason; every parameter
    of the copy (the QuantizedLinears' included) is frozen; a weight-only precision builds weight-only
    QuantizedLinears."""
    module, report = q.build_rollout_module(_Net(), RolloutPrecision("fake_fp8", activations=False))
    assert report.format == "fake_fp8"
    lines = str(report).splitlines()  # a summary line, then one line per kept layer with its reason
    assert lines[0].startswith("rollout copy in fake_fp8: 2 Linear layers quantized, 1 kept")
    assert lines[1:] == ["  kept time_embed: name matches 'embed'"]
    assert isinstance(module.ff, QuantizedLinear) and not module.ff.activations and not module.out.activations
    assert not any(p.requires_grad for p in module.parameters())
    x = torch.randn(3, 16)
    assert torch.equal(module.ff(x), torch.nn.functional.linear(x, module.ff.weight, module.ff.bias))
