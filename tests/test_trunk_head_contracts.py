"""Contracts of genrl/models/trunk.py written for its mutation survivors (issue 51, stage 2): the DiT trunk (dtypes
and devices of every stage, the text mask and its pooling, the bit-exact split), the flow head (FlowHead: its
default width, the fusion block and the delta embedder against a float64 reference, its dtype handling, the devices
of its inner times), the head's save / load, TrunkAdapter's root-call and checkpointing helpers, and
TransitionModel's teacher velocity.

Tiny models, called directly (no Trainer): each test runs well under a second on a CPU. A "meta" device stands in
for an accelerator: a tensor left on the CPU next to meta tensors is an error, as it is next to CUDA tensors.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from genrl.models.dit import VideoDiT, rope_cos_sin, timestep_embedding
from genrl.models.generator import DiTGenerator
from genrl.models.text_encoder import Conditioning
from genrl.models.trunk import (
    HEAD_CONFIG_FILE,
    HEAD_WEIGHTS_FILE,
    DiTTrunk,
    FlowHead,
    TransitionModel,
    TrunkAdapter,
    TrunkState,
    _per_sample,
    load_head,
    save_head,
)

META = torch.device("meta")


def _dit(rope: int = 0, patch=(2, 2, 2), dtype=torch.float32) -> DiTGenerator:
    torch.manual_seed(0)
    dit = VideoDiT(hidden_size=16, num_layers=2, num_attention_heads=2, text_dim=8, rope_temporal_dim=rope,
                   patch_size=patch)
    with torch.no_grad():  # zero-initialised adaLN / output layers would make the equalities trivial
        for p in dit.parameters():
            p.normal_(0.0, 0.1)
    return DiTGenerator(dit.eval().to(dtype), SimpleNamespace(hidden_size=8))


def _inputs(mask=((1, 1, 1), (1, 1, 0)), t: int = 2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, t, 3, 4, 4, generator=g)
    text = torch.randn(2, 3, 8, generator=g)
    m = None if mask is None else torch.tensor(mask, dtype=torch.bool)
    return x, torch.tensor([0.3, 0.7]), Conditioning(text, m, ["a", "b"])


def _split(adapter: DiTTrunk, x, sigma, cond) -> torch.Tensor:
    return adapter.finalize(adapter.run_blocks(adapter.embed(x, sigma, cond), 0, adapter.num_layers))


# ---------------------------------------------------------------------------------------------- DiT trunk
def test_bf16_model_split_keeps_the_model_dtype_inside_and_the_input_dtype_outside():
    """A bfloat16 DiT fed float32 latents / text: every stage computes in the model's dtype (tokens, time embedding,
    text, a float32 ``delta`` folded into a bf16 time embedding) and the split returns the velocity in the dtype
    of x, bit for bit what ``generator.velocity`` returns."""
    gen = _dit(dtype=torch.bfloat16)
    adapter = DiTTrunk(gen)
    x, sigma, cond = _inputs()
    with torch.no_grad():
        state = adapter.embed(x, sigma, cond)
        assert state.h.dtype == state.temb.dtype == state.extra["text"].dtype == torch.bfloat16
        assert state.extra["out_dtype"] == torch.float32
        out = adapter.finalize(adapter.run_blocks(state, 0, 2))
        assert out.dtype == torch.float32
        assert torch.equal(out, gen.velocity(x, sigma, cond))
        delta = torch.randn(2, 16)
        shifted = adapter.time_cond(state, sigma, delta)
        assert shifted.temb.dtype == torch.bfloat16
        expected = (state.temb.float() + delta.to(torch.bfloat16).float()[:, None, None]).to(torch.bfloat16)
        torch.testing.assert_close(shifted.temb, expected, atol=0.02, rtol=0.02)
        assert adapter.finalize(adapter.run_blocks(shifted, 0, 2)).dtype == torch.float32


def test_split_runs_on_the_model_device_with_cpu_sigma_and_mask():
    """Model and latents on an accelerator-like device ("meta"), sigma and the text mask given on the CPU: embed moves
    sigma and the mask to the latents' device and puts the position table there, so every stage (and the flow
    head fed float / CPU inner times) runs on that device."""
    gen = _dit()
    gen.transformer.to(META)
    adapter = DiTTrunk(gen)
    x, sigma, cond = _inputs()
    cond = Conditioning(cond.hidden_states.to(META), cond.attention_mask, cond.prompts)
    with torch.no_grad():
        state = adapter.embed(x.to(META), sigma, cond)
        assert state.h.device == state.temb.device == state.extra["text_mask"].device == META
        out = adapter.finalize(adapter.run_blocks(state, 0, 2))
        assert out.device == META and out.shape == x.shape
        assert adapter.patch_embed(x.to(META)).device == META
        head = FlowHead(adapter, 1, freq_dim=8).to(META)
        y = head(adapter, adapter.run_blocks(state, 0, 1), x.to(META), 0.5, torch.tensor([0.25, 0.1]))
        assert y.device == META and y.shape == x.shape


def test_rope_model_split_runs_on_the_model_device():
    """With a temporal rotary embedding the bidirectional attention context puts its rotary tables on the latents'
    device (built on the CPU, moved to ``x.device``): the model's own velocity and the trunk's split both run on
    an accelerator-like device ("meta")."""
    gen = _dit(rope=4, patch=(1, 2, 2))
    gen.transformer.to(META)
    adapter = DiTTrunk(gen)
    x, sigma, cond = _inputs(t=3)
    x, cond = x.to(META), Conditioning(cond.hidden_states.to(META), cond.attention_mask.to(META), cond.prompts)
    with torch.no_grad():
        assert gen.velocity(x, sigma.to(META), cond).device == META
        state = adapter.embed(x, sigma.to(META), cond)
        assert state.extra["ctx"].q_rope[0].device == META
        assert _split(adapter, x, sigma.to(META), cond).device == META


def test_missing_mask_means_every_text_token_and_a_non_bool_mask_is_read_as_bool():
    """``attention_mask=None`` attends to (and pools) every text token, exactly like an all-True mask; an integer
    0 / 1 mask is used as a boolean mask (``extra['text_mask']`` is bool), not as an additive bias."""
    adapter = DiTTrunk(_dit())
    x, sigma, cond = _inputs(mask=((1, 1, 1), (1, 1, 1)))
    none = Conditioning(cond.hidden_states, None, cond.prompts)
    with torch.no_grad():
        s_none, s_ones = adapter.embed(x, sigma, none), adapter.embed(x, sigma, cond)
        assert s_none.extra["text_mask"].dtype == torch.bool and s_none.extra["text_mask"].shape == (2, 1, 1, 3)
        assert torch.equal(s_none.extra["pooled"], s_ones.extra["pooled"])
        assert torch.equal(_split(adapter, x, sigma, none), _split(adapter, x, sigma, cond))
        x, sigma, cond = _inputs()
        as_long = Conditioning(cond.hidden_states, cond.attention_mask.long(), cond.prompts)
        state = adapter.embed(x, sigma, as_long)
        assert state.extra["text_mask"].dtype == torch.bool
        assert torch.equal(state.extra["text_mask"][:, 0, 0], cond.attention_mask)
        assert torch.equal(_split(adapter, x, sigma, as_long), _split(adapter, x, sigma, cond))


def test_pooled_text_is_the_mean_over_the_masked_tokens():
    """The pooled text is ``pooled_proj`` of the mean of the unmasked tokens: one valid token -> that token itself,
    two -> their average. The text has a tiny variance so that ``pooled_proj``'s leading LayerNorm (scale-invariant
    up to its eps) sees the scale of the mean."""
    adapter = DiTTrunk(_dit())
    tr = adapter.transformer
    x, sigma, cond = _inputs(mask=((1, 0, 0), (1, 1, 0)))
    text = 1e-3 * cond.hidden_states
    cond = Conditioning(text, cond.attention_mask, cond.prompts)
    with torch.no_grad():
        pooled = adapter.embed(x, sigma, cond).extra["pooled"]
        torch.testing.assert_close(pooled[0], tr.pooled_proj(text[0, 0]), atol=1e-6, rtol=0)
        torch.testing.assert_close(pooled[1], tr.pooled_proj(text[1, :2].mean(0)), atol=1e-6, rtol=0)


def test_rope_split_with_one_frame_patches_is_bit_exact():
    """Golden property, bit for bit, with a temporal rotary embedding and temporal patch 1: the trunk builds the same
    rotary tables as the model's own forward, those of frame groups 0 .. F-1 (start frame 0), each repeated over the
    group's S tokens."""
    gen = _dit(rope=4, patch=(1, 2, 2))
    adapter = DiTTrunk(gen)
    x, sigma, cond = _inputs(t=3)
    with torch.no_grad():
        ctx = adapter.embed(x, sigma, cond).extra["ctx"]
        cos, sin = rope_cos_sin(torch.arange(3).repeat_interleave(4), 4)  # F = 3 groups of S = 2 x 2 tokens
        for table in (ctx.q_rope, ctx.k_rope):
            assert torch.equal(table[0], cos) and torch.equal(table[1], sin)
        assert torch.equal(_split(adapter, x, sigma, cond), gen.velocity(x, sigma, cond))


def test_dit_trunk_accepts_a_generator_without_a_causal_attribute():
    """A generator object with no ``causal`` attribute at all is bidirectional: DiTTrunk accepts it (only a set
    ``causal`` is refused)."""
    gen = _dit()
    duck = SimpleNamespace(transformer=gen.transformer)
    adapter = DiTTrunk(duck)
    assert adapter.num_layers == 2 and adapter.hidden_size == 16
    gen.causal = object()
    with pytest.raises(ValueError, match="bidirectional attention only"):
        DiTTrunk(gen)


# ---------------------------------------------------------------------------------------------- TrunkAdapter helpers
def _fsdp_like(module: nn.Module) -> nn.Module:
    """The class swap FSDP2's fully_shard does: the module becomes an FSDPModule of its own class."""
    module.__class__ = type("FSDPFake" + type(module).__name__, (FSDPModule, type(module)), {})
    return module


def _counted(module: nn.Module) -> list:
    calls = []
    module.register_forward_pre_hook(lambda mod, args: calls.append(args))
    return calls


def test_in_root_calls_a_plain_transformer_function_directly():
    """A plain (non-FSDP) transformer: ``_in_root`` returns ``fn(*args)`` without calling the module (no hooks run,
    no forward attribute left behind)."""
    tr = nn.Linear(2, 2)
    calls = _counted(tr)
    out = TrunkAdapter._in_root(SimpleNamespace(transformer=tr), lambda a, b: a * 10 + b, 3, 4)
    assert out == 34 and calls == [] and "forward" not in vars(tr)


def test_in_root_runs_fn_as_the_fsdp_roots_forward_and_restores_it():
    """An FSDP2 root: ``fn`` runs as the module's forward (its pre-forward hooks, where FSDP gathers the root's
    parameters, see the arguments), the result is fn's, and the temporary forward is removed afterwards."""
    tr = _fsdp_like(nn.Linear(2, 2))
    assert isinstance(tr, FSDPModule)
    calls = _counted(tr)
    out = TrunkAdapter._in_root(SimpleNamespace(transformer=tr), lambda a, b: a * 10 + b, 3, 4)
    assert out == 34 and calls == [(3, 4)] and "forward" not in vars(tr)
    x = torch.ones(1, 2)
    torch.testing.assert_close(tr(x), F.linear(x, tr.weight, tr.bias))  # the class's forward is back


def test_in_root_inside_the_roots_call_calls_fn_directly():
    """Already inside the root's call (an instance ``forward`` set): ``fn`` is called directly, the hooks do not
    run again and the outer call's forward stays in place."""
    tr = _fsdp_like(nn.Linear(2, 2))
    calls = _counted(tr)

    def outer(*args):
        return args

    tr.forward = outer
    out = TrunkAdapter._in_root(SimpleNamespace(transformer=tr), lambda a: a + 1, 1)
    assert out == 2 and calls == [] and vars(tr)["forward"] is outer


def test_checkpointed_uses_the_checkpoint_function_only_when_the_flag_is_on():
    """``_checkpointed``: a transformer without a ``gradient_checkpointing`` attribute runs the block directly; with
    the flag on and gradients enabled the block goes through ``_gradient_checkpointing_func``; with gradients
    disabled it runs directly again."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)

    def block(v):
        return v * 3

    plain = SimpleNamespace(transformer=nn.Identity())
    with torch.enable_grad():
        assert torch.equal(TrunkAdapter._checkpointed(plain, block, x), torch.tensor([3.0, 6.0]))
    seen = []
    tr = nn.Identity()
    tr.gradient_checkpointing = True
    tr._gradient_checkpointing_func = lambda fn, *args: seen.append(fn) or fn(*args) + 1
    flagged = SimpleNamespace(transformer=tr)
    with torch.enable_grad():
        assert torch.equal(TrunkAdapter._checkpointed(flagged, block, x), torch.tensor([4.0, 7.0]))
    assert seen == [block]
    with torch.no_grad():
        assert torch.equal(TrunkAdapter._checkpointed(flagged, block, x), torch.tensor([3.0, 6.0]))
    assert seen == [block]


# ---------------------------------------------------------------------------------------------- flow head
def _sizes(layers: int = 2, d: int = 8, td: int = 6):
    return SimpleNamespace(num_layers=layers, hidden_size=d, time_dim=td)


def test_per_sample_puts_a_float_time_on_the_requested_device():
    """``_per_sample``: a float, a 0-d or a [B] CPU tensor becomes a float32 [B] tensor on the requested device."""
    for v in (0.5, torch.tensor(0.5), torch.tensor([0.5, 0.5], dtype=torch.float64)):
        out = _per_sample(v, 2, META, "s")
        assert out.device == META and out.dtype == torch.float32 and out.shape == (2,)
    assert torch.equal(_per_sample(0.25, 3, "cpu", "s"), torch.full((3,), 0.25))


def test_flow_head_default_fusion_mlp_is_four_times_wider():
    """FlowHead's fusion MLP has hidden width ``int(D * mlp_ratio)``, mlp_ratio 4 by default."""
    head = FlowHead(_sizes(d=8), 1, freq_dim=4)
    assert head.fusion_mlp[0].out_features == 32 and head.fusion_mlp[-1].in_features == 32
    head = FlowHead(_sizes(d=8), 1, freq_dim=4, mlp_ratio=2.0)
    assert head.fusion_mlp[0].out_features == 16


def _random_head(dtype=torch.float64, freq: int = 6) -> FlowHead:
    torch.manual_seed(3)
    head = FlowHead(_sizes(), 1, freq_dim=freq, gate_init=0.3)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.5)
    return head.to(dtype)


def test_fuse_and_delta_match_a_float64_reference():
    """``fuse`` is ``m + sigmoid(alpha) (z - m)`` with ``z = e + g MLP(LN(e) (1 + scale) + shift)``, LN without
    affine at eps 1e-6, MLP Linear-GELU(tanh)-Linear, (shift, scale, g) = Linear(SiLU(c)) and
    c = Linear(SiLU(Linear([emb(1000 s), emb(1000 (s - r))]))); ``delta`` is Linear(SiLU(Linear(emb(1000 (s - r))))).
    Checked against a float64 reference written from the parameters, with tokens of tiny variance (where eps
    matters)."""
    head = _random_head()
    g = torch.Generator().manual_seed(4)
    e = 1e-3 * torch.randn(2, 2, 3, 8, generator=g, dtype=torch.float64)
    m = torch.randn(2, 2, 3, 8, generator=g, dtype=torch.float64)
    s, r = torch.tensor([0.9, 0.6], dtype=torch.float64), torch.tensor([0.3, 0.5], dtype=torch.float64)

    def emb(v):
        return timestep_embedding(1000.0 * v, 6).double()

    def lin(mod, v):
        return F.linear(v, mod.weight, mod.bias)

    ft, fm, mlp = head.fusion_time, head.fusion_mod, head.fusion_mlp
    c = lin(ft[2], F.silu(lin(ft[0], torch.cat([emb(s), emb(s - r)], -1))))
    shift, scale, gg = lin(fm[1], F.silu(c))[:, None, None].chunk(3, -1)
    ln = (e - e.mean(-1, keepdim=True)) / torch.sqrt(e.var(-1, unbiased=False, keepdim=True) + 1e-6)
    z = e + gg * lin(mlp[2], F.gelu(lin(mlp[0], ln * (1 + scale) + shift), approximate="tanh"))
    expected = m + torch.sigmoid(head.alpha) * (z - m)
    with torch.no_grad():
        torch.testing.assert_close(head.fuse(e, m, s, r), expected, atol=1e-10, rtol=1e-10)
        de = head.delta_embed
        torch.testing.assert_close(head.delta(s, r), lin(de[2], F.silu(lin(de[0], emb(s - r)))), atol=1e-10,
                                   rtol=1e-10)


def test_fuse_computes_in_the_head_dtype_and_mixes_in_float32_at_least():
    """A float64 head fed float32 tokens computes z in float64 (e and the time features cast to the head's dtype),
    mixes in float32 (gate and z cast to m's float32) and returns m's dtype; bf16 tokens are mixed in float32
    (gate not rounded to bf16) and returned as bf16."""
    head = _random_head()
    g = torch.Generator().manual_seed(5)
    e, m = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    s, r = torch.tensor([0.9, 0.6]), torch.tensor([0.3, 0.5])

    def z_of(e_in):  # the fusion block's own ops, in the head's dtype
        c = head.fusion_time(torch.cat([head._features(s), head._features(s - r)], dim=-1))
        shift, scale, gg = head.fusion_mod(c).view(2, 1, -1).chunk(3, dim=-1)
        e64 = e_in.to(torch.float64)
        return e64 + gg * head.fusion_mlp(head.fusion_norm(e64) * (1 + scale) + shift)

    with torch.no_grad():
        assert head._features(s).dtype == torch.float64
        z = z_of(e)
        out = head.fuse(e, m, s, r)
        assert out.dtype == torch.float32
        assert torch.equal(out, m + head.gate.float() * (z.float() - m))
        mb, eb = m.to(torch.bfloat16), e.to(torch.bfloat16)
        outb = head.fuse(eb, mb, s, r)
        assert outb.dtype == torch.bfloat16
        zb = z_of(eb)
        assert torch.equal(outb, (mb.float() + head.gate.float() * (zb.float() - mb.float())).to(torch.bfloat16))


def test_flow_head_rejects_a_misshapen_r_naming_it():
    """FlowHead.forward checks both inner times; a wrong-shaped r is reported as ``r``."""
    adapter = DiTTrunk(_dit())
    head = FlowHead(adapter, 1, freq_dim=8)
    state = TrunkState(torch.zeros(2, 1, 4, 16), torch.zeros(2, 1, 1, 16))
    with pytest.raises(ValueError, match=r"^r has shape \(3,\)"):
        head(adapter, state, torch.zeros(2, 2, 3, 4, 4), 0.5, torch.zeros(3))
    with pytest.raises(ValueError, match=r"^s has shape \(3,\)"):
        head(adapter, state, torch.zeros(2, 2, 3, 4, 4), torch.zeros(3), 0.5)


# ---------------------------------------------------------------------------------------------- save / load, model
def test_save_head_creates_missing_parent_folders_and_load_round_trips(tmp_path):
    """``save_head`` creates the export folder with its missing parents and writes weights + config; ``load_head``
    restores the weights and returns the config, or ``{}`` when the folder holds no config file."""
    head = _random_head(torch.float32)
    folder = tmp_path / "run" / "export" / "head"
    path = save_head(head, folder, {"head_layers": 1, "freq_dim": 6})
    assert path == folder / HEAD_WEIGHTS_FILE and path.is_file()
    assert json.loads((folder / HEAD_CONFIG_FILE).read_text()) == {"head_layers": 1, "freq_dim": 6}
    other = FlowHead(_sizes(), 1, freq_dim=6, gate_init=0.3)
    assert load_head(other, folder) == {"head_layers": 1, "freq_dim": 6}
    for k, v in head.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)
    (folder / HEAD_CONFIG_FILE).unlink()
    assert load_head(other, folder) == {}


def test_transition_model_velocity_forwards_keyword_arguments():
    """TransitionModel.velocity is the generator's own velocity with every keyword argument passed through."""
    gen = _dit()
    model = TransitionModel(gen, 1)
    seen = {}

    def velocity(x, t, cond, **kwargs):
        seen.update(kwargs)
        return x * 2

    gen.velocity = velocity
    x = torch.ones(1, 2)
    assert torch.equal(model.velocity(x, torch.zeros(1), None, start_frame=2, attention="bidirectional"), x * 2)
    assert seen == {"start_frame": 2, "attention": "bidirectional"}
