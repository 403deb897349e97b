"""The built-in video DiT: per-frame sigma, block-causal attention, image mode, checkpointing, IO, errors."""

from __future__ import annotations

import pytest
import torch

from genrl.models import ModelSpec, VideoDiT


def _randomised(model: VideoDiT, std: float = 0.2) -> VideoDiT:
    # zero-initialised adaLN / output layers would make the invariance tests trivially true
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


@pytest.fixture
def dit64() -> VideoDiT:
    return _randomised(
        VideoDiT(hidden_size=32, num_layers=2, num_attention_heads=2, text_dim=16, causal_chunk_size=2).double()
    )


def _inputs(b=2, t=8, h=8, w=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, t, 3, h, w, generator=g, dtype=dtype)
    text = torch.randn(b, 5, 16, generator=g, dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)[:b]
    return x, text, mask


def test_equal_per_frame_sigma_equals_scalar_sigma(dit64):
    x, text, mask = _inputs()
    sigma = torch.tensor([0.3, 0.8], dtype=torch.float64)
    scalar = dit64(x, sigma, text, mask)
    per_frame = dit64(x, sigma[:, None].expand(2, 8).contiguous(), text, mask)
    assert torch.equal(scalar, per_frame)
    # and per-frame sigma is actually used: changing one frame group's sigma changes the output
    other = sigma[:, None].expand(2, 8).clone()
    other[:, 6:] = 0.05
    assert (dit64(x, other, text, mask) - scalar).abs().max() > 1e-3


@pytest.mark.parametrize("k", [0, 1, 2])
def test_block_causal_chunks_ignore_the_future(dit64, k):
    x, text, mask = _inputs()
    sigma = torch.rand(2, 4, dtype=torch.float64).repeat_interleave(2, dim=1)  # per temporal patch
    chunk = 2  # latent frames per chunk
    y = x.clone()
    y[:, (k + 1) * chunk : (k + 2) * chunk] += torch.randn_like(y[:, (k + 1) * chunk : (k + 2) * chunk])
    a = dit64(x, sigma, text, mask, attention="block_causal")
    b = dit64(y, sigma, text, mask, attention="block_causal")
    past = slice(0, (k + 1) * chunk)
    assert (a[:, past] - b[:, past]).abs().max() <= 1e-10
    assert (a[:, (k + 1) * chunk :] - b[:, (k + 1) * chunk :]).abs().max() > 1e-3
    # bidirectional attention does see the future
    a_bi = dit64(x, sigma, text, mask)
    b_bi = dit64(y, sigma, text, mask)
    assert (a_bi[:, past] - b_bi[:, past]).abs().max() > 1e-6


def test_text_padding_is_ignored(dit64):
    x, text, mask = _inputs()
    sigma = torch.tensor([0.5, 0.5], dtype=torch.float64)
    out = dit64(x, sigma, text, mask)
    text2 = text.clone()
    text2[1, 3:] = 100.0  # padded positions of sample 1
    assert torch.allclose(out, dit64(x, sigma, text2, mask), atol=1e-12, rtol=0)


def test_image_mode_t1():
    model = _randomised(VideoDiT(patch_size=(1, 2, 2), hidden_size=32, num_layers=1, num_attention_heads=2,
                                 text_dim=16))
    x = torch.randn(3, 1, 3, 8, 8)
    out = model(x, torch.rand(3), torch.randn(3, 4, 16))
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_gradient_checkpointing_same_gradients():
    torch.manual_seed(0)
    a = _randomised(VideoDiT(hidden_size=32, num_layers=2, num_attention_heads=2, text_dim=16))
    b = _randomised(VideoDiT(hidden_size=32, num_layers=2, num_attention_heads=2, text_dim=16))
    b.enable_gradient_checkpointing()
    x, text, mask = _inputs(dtype=torch.float32)
    sigma = torch.tensor([0.2, 0.7])
    for m in (a, b):
        m(x, sigma, text, mask).square().mean().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), name
    assert any(p.grad.abs().sum() > 0 for p in a.blocks[0].parameters())


def test_save_pretrained_round_trip(tmp_path):
    model = _randomised(VideoDiT(hidden_size=32, num_layers=1, num_attention_heads=2, text_dim=16))
    model.save_pretrained(tmp_path / "dit")
    loaded = ModelSpec(pretrained=str(tmp_path / "dit")).build()
    x, text, mask = _inputs(dtype=torch.float32)
    sigma = torch.tensor([0.4, 0.6])
    assert torch.equal(model(x, sigma, text, mask), loaded(x, sigma, text, mask))


def test_bad_inputs_raise_clear_errors(dit64, tmp_path):
    x, text, mask = _inputs()
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        dit64(torch.randn(2, 8, 3, 9, 8, dtype=torch.float64), torch.rand(2, dtype=torch.float64), text, mask)
    with pytest.raises(ValueError, match=r"\[B, T, C, H, W\]"):
        dit64(x[:, 0], torch.rand(2, dtype=torch.float64), text, mask)
    with pytest.raises(ValueError, match="inside a temporal patch"):
        dit64(x, torch.rand(2, 8, dtype=torch.float64), text, mask)
    with pytest.raises(ValueError, match="sigma has shape"):
        dit64(x, torch.rand(3, dtype=torch.float64), text, mask)
    with pytest.raises(ValueError, match="causal_chunk_size"):
        VideoDiT(hidden_size=32, num_layers=1, num_attention_heads=2, text_dim=16)(
            x.float(), torch.rand(2), text.float(), mask, attention="block_causal"
        )
    with pytest.raises(FileNotFoundError, match="no model weights"):
        ModelSpec(pretrained=str(tmp_path / "missing")).build()
    with pytest.raises(ValueError, match="unknown config keys"):
        ModelSpec(config={"hidden_sise": 32}).build()
