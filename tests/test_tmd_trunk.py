"""TMD's backbone / flow-head split (genrl.models.trunk): the split reproduces each family's velocity at every split
point, the closed-gate head is the teacher, the gate and the time knobs act, gradients reach every part, and the
head owns only its new parameters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from genrl.models.causal import CausalConfig
from genrl.models.dit import VideoDiT
from genrl.models.generator import DiTGenerator
from genrl.models.text_encoder import Conditioning
from genrl.models.trunk import DiTTrunk, FlowHead, SD3Trunk, TransitionModel, TrunkState, WanTrunk, trunk_adapter
from genrl.testing.families import tiny_family

LAYERS = 4
FAMILIES = ["dit", "dit_rope", "wan", "sd3"]


def _dit(rope: int = 0) -> DiTGenerator:
    torch.manual_seed(0)
    dit = VideoDiT(hidden_size=32, num_layers=LAYERS, num_attention_heads=2, text_dim=16, rope_temporal_dim=rope)
    with torch.no_grad():  # zero-initialised adaLN / output layers would make the equalities trivial
        for p in dit.parameters():
            p.normal_(0.0, 0.1)
    # the velocity never encodes prompts: a stand-in with the width DiTGenerator checks
    return DiTGenerator(dit.eval(), SimpleNamespace(hidden_size=16))


def _family(name: str):
    size = dict(height=32, width=32) if name == "wan" else {}  # Wan: 2 x 2 tokens per latent frame, 2 latent frames
    return tiny_family(name, num_layers=LAYERS, **size)


@pytest.fixture(scope="module")
def generators() -> dict:
    return {"dit": _dit(), "dit_rope": _dit(rope=4), "wan": _family("wan"), "sd3": _family("sd3")}


def _inputs(name: str, gen, b: int = 2, seed: int = 0):
    """(x, sigma [B], cond) in the generator's native layout, float32."""
    g = torch.Generator().manual_seed(seed)
    if name.startswith("dit"):
        x = torch.randn(b, 4, 3, 8, 8, generator=g)
        text = torch.randn(b, 5, 16, generator=g)
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)[:b]
        cond = Conditioning(text, mask, ["a"] * b)
    elif name == "wan":
        x = torch.randn(b, *gen.latent_shape, generator=g)
        cond = Conditioning(torch.randn(b, 16, 32, generator=g), torch.ones(b, 16, dtype=torch.bool), ["a"] * b)
    else:
        x = torch.randn(b, *gen.latent_shape, generator=g)
        cond = Conditioning(torch.randn(b, 32, 32, generator=g), torch.ones(b, 32, dtype=torch.bool), ["a"] * b,
                            pooled=torch.randn(b, 64, generator=g))
    sigma = torch.rand(b, generator=g) * 0.9 + 0.05
    return x, sigma, cond


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- T1: golden split
@pytest.mark.parametrize("name", FAMILIES)
def test_split_at_every_block_equals_the_velocity(generators, name):
    gen = generators[name]
    adapter = trunk_adapter(gen)
    assert type(adapter) is {"dit": DiTTrunk, "dit_rope": DiTTrunk, "wan": WanTrunk, "sd3": SD3Trunk}[name]
    assert adapter.num_layers == LAYERS
    x, sigma, cond = _inputs(name, gen)
    with torch.no_grad():
        v = gen.velocity(x, sigma, cond)
        state0 = adapter.embed(x, sigma, cond)
        assert isinstance(state0, TrunkState) and state0.h.shape[-1] == adapter.hidden_size
        for k in range(LAYERS + 1):
            mid = adapter.run_blocks(state0, 0, k)
            out = adapter.finalize(adapter.run_blocks(mid, k, LAYERS))
            assert out.shape == v.shape and out.dtype == v.dtype
            _close(out, v)
            # recomputing the time branch at the same sigma without delta changes nothing
            _close(adapter.finalize(adapter.run_blocks(adapter.time_cond(mid, sigma), k, LAYERS)), v)
        # the token stream of y = x is the model's own patch embedding (positions included where the model adds them)
        _close(adapter.patch_embed(x), state0.h)


@pytest.mark.parametrize("name", ["dit", "wan"])
def test_split_with_a_per_frame_sigma(generators, name):
    """A per-frame sigma (DiT [B, T] equal within a temporal patch; Wan [B, F]) is supported like the velocity."""
    gen = generators[name]
    adapter = trunk_adapter(gen)
    x, _, cond = _inputs(name, gen)
    sigma = torch.tensor([[0.2, 0.2, 0.7, 0.7], [0.9, 0.9, 0.4, 0.4]]) if name == "dit" else torch.tensor(
        [[0.2, 0.7], [0.9, 0.4]])
    with torch.no_grad():
        v = gen.velocity(x, sigma, cond)
        mid = adapter.run_blocks(adapter.embed(x, sigma, cond), 0, 2)
        _close(adapter.finalize(adapter.run_blocks(mid, 2, LAYERS)), v)
        _close(adapter.finalize(adapter.run_blocks(adapter.time_cond(mid, sigma), 2, LAYERS)), v)


@pytest.mark.parametrize("name", ["dit", "wan", "sd3"])
def test_time_cond_recomputes_only_the_time_branch(generators, name):
    """time_cond at another sigma equals embedding at that sigma with the same tokens; a delta is added before the
    per-block modulation (it changes the output, and equals shifting the time embedding by hand)."""
    gen = generators[name]
    adapter = trunk_adapter(gen)
    x, sigma, cond = _inputs(name, gen)
    other = 1 - sigma
    with torch.no_grad():
        moved = adapter.time_cond(adapter.embed(x, sigma, cond), other)
        _close(adapter.finalize(adapter.run_blocks(moved, 0, LAYERS)), gen.velocity(x, other, cond))
        state = adapter.embed(x, sigma, cond)
        delta = 0.3 * torch.randn(x.shape[0], adapter.time_dim, generator=torch.Generator().manual_seed(1))
        shifted = adapter.time_cond(state, sigma, delta)
        assert torch.equal(shifted.h, state.h)
        base = adapter.finalize(adapter.run_blocks(state, 0, LAYERS))
        out = adapter.finalize(adapter.run_blocks(shifted, 0, LAYERS))
        assert (out - base).abs().max() > 1e-3
        # the delta sits in the time embedding that feeds every block's modulation
        expect = state.temb + (delta[:, None, None] if name == "dit" else delta)
        _close(shifted.temb, expect)
        if name == "wan":  # and the blocks' projected modulation is re-derived from it
            ce = gen.transformer.condition_embedder
            _close(shifted.extra["timestep_proj"], ce.time_proj(ce.act_fn(expect)).unflatten(1, (6, -1)))
        with pytest.raises(ValueError, match="delta has shape"):
            adapter.time_cond(state, sigma, delta[:, :-1])


@pytest.mark.parametrize("name", ["dit", "wan", "sd3"])
def test_run_blocks_honours_gradient_checkpointing(generators, name):
    gen = generators[name]
    adapter = trunk_adapter(gen)
    tr = gen.transformer
    x, sigma, cond = _inputs(name, gen)
    calls = []
    tr.enable_gradient_checkpointing()
    inner = tr._gradient_checkpointing_func
    tr._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or inner(*a, **k)
    try:
        with torch.no_grad():
            adapter.run_blocks(adapter.embed(x, sigma, cond), 0, LAYERS)
        assert not calls  # as in the model's forward: only with gradients
        out = adapter.finalize(adapter.run_blocks(adapter.embed(x, sigma, cond), 1, 3))
        assert len(calls) == 2
        out.square().mean().backward()
        assert tr.gradient_checkpointing
    finally:
        del tr._gradient_checkpointing_func
        tr.disable_gradient_checkpointing()
        tr.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- T2: head at init
@pytest.mark.parametrize("name", ["dit", "wan", "sd3"])
def test_closed_gate_head_is_the_teacher(generators, name):
    """Gate closed (alpha = -inf), delta embedder at zero: with head_time="outer" the head is the teacher's velocity
    at t whatever y, s, r; with "inner" its blocks see s instead (the velocity at s when the features are taken at
    s too; the backbone at t and the head blocks at s otherwise)."""
    gen = generators[name]
    x, t, cond = _inputs(name, gen)
    g = torch.Generator().manual_seed(3)
    y = torch.randn(x.shape, generator=g)
    s = torch.rand(x.shape[0], generator=g)
    r = s * torch.rand(x.shape[0], generator=g)
    outer = TransitionModel(gen, FlowHead(trunk_adapter(gen), 1, head_time="outer"))
    inner = TransitionModel(gen, FlowHead(trunk_adapter(gen), 1, head_time="inner"))
    adapter = outer.adapter
    with torch.no_grad():
        outer.flow_head.alpha.fill_(float("-inf"))
        inner.flow_head.alpha.fill_(float("-inf"))
        feats = outer.features(x, t, cond)
        v_t = gen.velocity(x, t, cond)
        _close(outer.head(y, s, r, feats, t), v_t)
        _close(outer(torch.randn(x.shape, generator=g), 0.9, 0.1, feats, t), v_t)
        _close(outer.velocity(x, t, cond), v_t)
        out_inner = inner.head(y, s, r, feats, t)
        _close(out_inner, adapter.finalize(adapter.run_blocks(adapter.time_cond(feats, s), LAYERS - 1, LAYERS)))
        assert (out_inner - v_t).abs().max() > 1e-4  # the knob acts
        _close(inner.head(y, s, r, inner.features(x, s, cond), t), gen.velocity(x, s, cond))


@pytest.mark.parametrize("name", ["dit", "wan"])
def test_open_gate_mixes_in_the_inner_variable(generators, name):
    gen = generators[name]
    x, t, cond = _inputs(name, gen)
    model = TransitionModel(gen, FlowHead(trunk_adapter(gen), 2, head_time="outer", gate_init=0.0))
    g = torch.Generator().manual_seed(4)
    y1, y2 = torch.randn(x.shape, generator=g), torch.randn(x.shape, generator=g)
    s = torch.full((x.shape[0],), 0.6)
    r = torch.full((x.shape[0],), 0.2)
    with torch.no_grad():
        feats = model.features(x, t, cond)
        out1, out2 = model.head(y1, s, r, feats, t), model.head(y2, s, r, feats, t)
        assert (out1 - gen.velocity(x, t, cond)).abs().max() > 1e-3
        assert (out1 - out2).abs().max() > 1e-3
        # the fused tokens are the gate's interpolation m + sigmoid(alpha) (z - m); at alpha = 0 the midpoint
        head = model.flow_head
        e = model.adapter.patch_embed(y1)
        _close(head.fuse(e, feats.h, s, r), 0.5 * (feats.h + e))  # z = e: zero-initialised modulation


@pytest.mark.parametrize("name", ["dit", "wan", "sd3"])
def test_gradients_reach_head_parts_head_blocks_and_backbone(generators, name):
    gen = generators[name]
    tr = gen.transformer
    x, t, cond = _inputs(name, gen)
    model = TransitionModel(gen, FlowHead(trunk_adapter(gen), 2, gate_init=0.0))
    head = model.flow_head
    g = torch.Generator().manual_seed(5)
    y = torch.randn(x.shape, generator=g)
    s, r = torch.full((x.shape[0],), 0.7), torch.full((x.shape[0],), 0.3)

    def grads():
        head.zero_grad(set_to_none=True)
        tr.zero_grad(set_to_none=True)
        model.head(y, s, r, model.features(x, t, cond), t).square().mean().backward()
        return {n: p.grad for n, p in head.named_parameters()}

    at_init = grads()
    assert at_init["alpha"].abs().item() > 0 and at_init["fusion_mod.1.weight"].abs().max() > 0
    assert at_init["delta_embed.2.weight"].abs().max() > 0  # the zero last layer itself learns
    assert at_init["delta_embed.0.weight"].abs().max() == 0  # nothing behind it yet
    with torch.no_grad():
        head.delta_embed[2].weight.normal_(0.0, 0.1)
        head.fusion_mod[1].weight.normal_(0.0, 0.1)
    after = grads()
    for n, gr in after.items():
        assert gr is not None and gr.abs().max() > 0, n
    blocks = tr.blocks if hasattr(tr, "blocks") else tr.transformer_blocks
    for i, block in enumerate(blocks):  # backbone blocks 0, 1 and head blocks 2, 3 all learn
        grads_i = [p.grad for p in block.parameters() if p.grad is not None]
        assert grads_i and max(gr.abs().max() for gr in grads_i) > 0, i
    tr.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- ownership, errors
def test_head_owns_only_its_new_parameters(generators):
    gen = generators["wan"]
    adapter = trunk_adapter(gen)
    head = FlowHead(adapter, 2)
    model = TransitionModel(gen, head)
    transformer_ids = {id(p) for p in gen.parameters()}
    head_ids = {id(p) for p in head.parameters()}
    assert head_ids and not head_ids & transformer_ids
    assert {n.split(".")[0] for n, _ in head.named_parameters()} == {
        "fusion_time", "fusion_mlp", "fusion_mod", "alpha", "delta_embed"}
    # the student holds the head as its only child; the generator is not registered (the method owns it)
    assert [id(p) for p in model.parameters()] == [id(p) for p in head.parameters()]
    assert all(k.startswith("flow_head.") for k in model.state_dict())
    assert model.generator is gen and model.num_layers == LAYERS and model.head_layers == 2
    assert head.alpha.item() == -4.0 and head.head_time == "inner"
    assert torch.equal(head.delta(torch.rand(3), torch.rand(3)), torch.zeros(3, adapter.time_dim))
    assert TransitionModel(gen, 3).head_layers == 3


def test_clear_errors(generators):
    gen = generators["dit"]
    adapter = trunk_adapter(gen)
    for h in (0, LAYERS, LAYERS + 1):
        with pytest.raises(ValueError, match="out of range"):
            FlowHead(adapter, h)
    with pytest.raises(ValueError, match="head_time"):
        FlowHead(adapter, 1, head_time="middle")
    with pytest.raises(ValueError, match=r"supported families: dit .*wan .*sd3"):
        trunk_adapter(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="0 <= i <= j <= L"):
        adapter.run_blocks(None, 2, LAYERS + 1)
    with pytest.raises(ValueError, match="built for L = 4, D = 32"):  # Wan's tiny width is 24
        TransitionModel(generators["wan"], FlowHead(adapter, 1))
    with pytest.raises(ValueError, match="built for L = 4, D = 32"):
        FlowHead(adapter, 1)(trunk_adapter(generators["wan"]), None, None, 0.5, 0.5)
    x, t, cond = _inputs("dit", gen)
    model = TransitionModel(gen, FlowHead(adapter, 1, head_time="outer"))
    with torch.no_grad():
        feats = model.features(x, t, cond)
        with pytest.raises(ValueError, match="needs the outer time"):
            model.head(x, t, t, feats)
        with pytest.raises(ValueError, match="s has shape"):
            model.head(x, torch.rand(3), t, feats, t)
    causal = _dit()
    causal.causal = CausalConfig(chunk_size=2)
    with pytest.raises(ValueError, match="bidirectional attention only"):
        trunk_adapter(causal)


def test_closed_gate_outer_student_samples_like_the_teachers_euler(generators):
    """With the transition sampler (genrl.rollout.transition): a closed-gate, head_time="outer" student's M outer
    transitions are the teacher's M-step Euler sampler on the same grid, whatever the N inner jumps."""
    from genrl.rollout.transition import TransitionConfig, transition_rollout

    gen = generators["dit"]
    _, _, cond = _inputs("dit", gen)
    model = TransitionModel(gen, FlowHead(trunk_adapter(gen), 1, head_time="outer"))
    with torch.no_grad():
        model.flow_head.alpha.fill_(float("-inf"))
    config = TransitionConfig(outer_steps=2, inner_steps=3)
    res = transition_rollout(model, cond, (4, 3, 8, 8), seed=0, indices=[0, 1], config=config, record=True)
    grid = config.outer_grid(dtype=torch.float32, device="cpu")
    x = res.trajectory[:, 0]
    with torch.no_grad():
        for i in range(2):
            x = x - (grid[i] - grid[i + 1]) * gen.velocity(x, torch.full((2,), float(grid[i])), cond)
    _close(res.latents, x)
    assert res.head_calls == 6 and res.backbone_calls == 2


# ---------------------------------------------------------------------------------------------- GAN feature taps
@pytest.mark.parametrize("name", ["dit", "wan", "sd3"])
def test_feature_grid_puts_each_token_at_its_patch_and_features_at_taps_the_blocks(generators, name):
    """feature_grid unpatchifies the token stream: the token of frame patch f, row i, column j lands at [:, :, f, i, j]
    (Wan: exactly the model's own patch-embedding convolution output); features_at(layers) equals the grids of the
    states after k blocks, in the order asked, embedding once; layers outside 1 .. L are refused."""
    gen = generators[name]
    adapter = trunk_adapter(gen)
    x, sigma, cond = _inputs(name, gen)
    with torch.no_grad():
        state = adapter.embed(x, sigma, cond)
        grid = adapter.feature_grid(state)
        b, d, f, gh, gw = grid.shape
        assert b == 2 and d == adapter.hidden_size
        for fi, i, j in [(0, 0, 0), (f - 1, gh - 1, gw - 1), (f // 2, gh - 1, 0), (0, 0, gw - 1)]:
            token = state.h[:, fi, i * gw + j] if name == "dit" else state.h[:, (fi * gh + i) * gw + j]
            assert torch.equal(grid[:, :, fi, i, j], token)
        if name == "wan":
            assert torch.equal(grid, gen.transformer.patch_embedding(x))
        if name == "sd3":
            assert f == 1
        taps = adapter.features_at(x, sigma, cond, [LAYERS, 1, 3])
        for k, got in zip([LAYERS, 1, 3], taps, strict=True):
            _close(got, adapter.feature_grid(adapter.run_blocks(adapter.embed(x, sigma, cond), 0, k)))
    with pytest.raises(ValueError, match=r"block counts in 1 \.\. L = 4, got \[0, 2\]"):
        adapter.features_at(x, sigma, cond, [0, 2])
    with pytest.raises(ValueError, match=r"got \[5\]"):
        adapter.features_at(x, sigma, cond, [LAYERS + 1])
