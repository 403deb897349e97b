"""Shared method plumbing (genrl.methods.phases): a video batch as data latents with addressed sample ids, and
caption dropout addressed per sample."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from genrl.methods.phases import caption_dropout, video_batch
from genrl.noise import rand_per_sample


class _Codec:
    def encode(self, pixels):
        return (2 * pixels - 1).double()


def _method(step: int = 0, rank: int = 0, world: int = 1):
    trainer = SimpleNamespace(global_step=step, world_size=world, global_rank=rank, strategy=None)
    return SimpleNamespace(generator=_Codec(), trainer=trainer, _trainer=trainer)


def test_video_batch_encodes_and_keeps_or_makes_unique_ids(monkeypatch):
    """x0 = the generator's encoding in float32 without gradients; the batch's own ids are kept; without ids they are
    (step * world + rank) * B + arange(B): disjoint across steps and ranks; non-5-D pixels are refused."""
    import genrl.methods.phases as common

    pixels = torch.rand(3, 2, 3, 4, 4, requires_grad=True)
    batch = {"pixels": pixels, "prompts": ("a", "b", "c"), "index": torch.tensor([7, 3, 11])}
    monkeypatch.setattr(common, "world_of", lambda m: (m.trainer.global_rank, m.trainer.world_size))
    monkeypatch.setattr(common, "trainer_of", lambda m: m.trainer)
    x0, prompts, idx = video_batch(_method(), batch)
    assert x0.dtype == torch.float32 and not x0.requires_grad
    torch.testing.assert_close(x0, (2 * pixels.detach() - 1).float())
    assert prompts == ["a", "b", "c"] and idx.tolist() == [7, 3, 11]
    del batch["index"]
    seen = set()
    for step in range(3):
        for rank in range(2):
            ids = video_batch(_method(step, rank, 2), batch)[2].tolist()
            assert ids == [(step * 2 + rank) * 3 + j for j in range(3)]
            assert not seen & set(ids)
            seen |= set(ids)
    with pytest.raises(ValueError, match=r"\[B, T, C, H, W\] in \[0, 1\], got \(3, 4, 4\)"):
        video_batch(_method(), {"pixels": torch.rand(3, 4, 4), "prompts": ["a"] * 3})


def test_caption_dropout_is_addressed_per_sample():
    """Sample i is dropped iff rand(seed, index[i], stream) < p, whatever else is in the batch; p = 0 drops nothing,
    and the dropped fraction over many samples is near p."""
    idx = torch.arange(2000)
    prompts = [f"p{i}" for i in range(2000)]
    out = caption_dropout(prompts, 0.25, seed=5, index=idx, stream=9, null_prompt="<null>")
    want = (rand_per_sample((), 5, idx, stream=9) < 0.25).tolist()
    assert [o == "<null>" for o in out] == want
    assert abs(sum(want) / 2000 - 0.25) < 0.03
    part = caption_dropout(prompts[100:110], 0.25, seed=5, index=idx[100:110], stream=9, null_prompt="<null>")
    assert part == out[100:110]
    assert caption_dropout(prompts[:5], 0.0, 5, idx[:5], 9) == prompts[:5]
    assert caption_dropout(prompts[:50], 0.25, 5, idx[:50], 10, "<null>") != out[:50]  # another stream
