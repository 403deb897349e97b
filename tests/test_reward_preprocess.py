"""Reward preprocessing parity (torch vs the PIL reference) and the frame policy of image rewards."""

from __future__ import annotations

import pytest
import torch

from genrl.rewards.image import FramePolicy, ImageRewardModel, select_frames
from genrl.rewards.preprocess import clip_preprocess, pil_reference


@pytest.mark.parametrize("shape", [(2, 3, 64, 48), (2, 3, 300, 420), (1, 3, 16, 16), (1, 3, 224, 224)])
def test_torch_preprocessing_matches_pil_within_one_uint8_step(shape):
    """Random uniform-noise images (the worst case for bicubic overshoot), on the uint8 grid so that PIL's
    input quantisation is exact: at most 0.02 in normalised units (about 1.4 / 255 of a pixel)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(*shape, generator=g) * 255).round() / 255
    ours, ref = clip_preprocess(x), pil_reference(x)
    assert ours.shape == ref.shape == (shape[0], 3, 224, 224)
    assert (ours - ref).abs().max() <= 0.02
    assert (ours - ref).abs().mean() <= 0.006


def test_preprocessing_is_differentiable_and_rejects_bad_input():
    x = torch.rand(1, 3, 40, 60, requires_grad=True)
    clip_preprocess(x, size=32).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        clip_preprocess(torch.rand(1, 1, 3, 40, 60))


def test_frame_policies():
    assert select_frames(9, 2, FramePolicy("all")).tolist() == [list(range(9))] * 2
    assert select_frames(9, 1, FramePolicy("stride", stride=4)).tolist() == [[0, 4, 8]]
    assert select_frames(9, 1, FramePolicy("middle")).tolist() == [[4]]
    assert select_frames(9, 1, FramePolicy("last")).tolist() == [[8]]
    r1 = select_frames(9, 3, FramePolicy("random", num_frames=2, seed=1), call=5)
    r2 = select_frames(9, 3, FramePolicy("random", num_frames=2, seed=1), call=5)
    assert torch.equal(r1, r2) and r1.shape == (3, 2) and all(len(set(row)) == 2 for row in r1.tolist())
    assert not torch.equal(r1, select_frames(9, 3, FramePolicy("random", num_frames=2, seed=1), call=6))
    with pytest.raises(ValueError, match="unknown frames policy"):
        FramePolicy("every")


class _Red(ImageRewardModel):
    """Mean red value of each image; differentiable."""

    differentiable = True

    def score_images(self, images, prompts, **meta):
        assert images.ndim == 4 and len(prompts) == images.shape[0] <= self.max_batch
        return {"reward": images[:, 0].mean(dim=(1, 2))}


def test_image_reward_scores_the_chosen_frames_and_reduces():
    video = torch.zeros(2, 5, 3, 4, 4)
    for t in range(5):
        video[:, t, 0] = t / 10  # frame t has red t / 10
    assert torch.allclose(_Red(max_batch=3)(video, ["a", "b"])["reward"], torch.full((2,), 0.2))
    assert torch.allclose(_Red(frames={"frames": "stride", "stride": 2, "reduce": "min"})(video, ["a", "b"])["reward"],
                          torch.zeros(2))
    assert torch.allclose(_Red(frames={"frames": "last"})(video, ["a", "b"])["reward"], torch.full((2,), 0.4))
    sal = _Red(frames={"frames": "last"}).saliency(video, ["a", "b"])["reward"]
    assert sal.shape == (2, 5, 4, 4) and sal[:, :4].abs().sum() == 0 and (sal[:, 4] > 0).all()


def test_skip_first_scores_the_continuation_and_keeps_advantages():
    """skip_first leaves the given first frame of image-to-video out: indices shift past it, a group whose frame 0
    is one constant image gets the same std-normalised advantages whatever that image is (and the same rewards),
    and a video with no frame left is refused."""
    from genrl.flow.policy import group_advantages

    assert select_frames(5, 1, FramePolicy("all", skip_first=1)).tolist() == [[1, 2, 3, 4]]
    assert select_frames(9, 1, FramePolicy("stride", stride=4, skip_first=1)).tolist() == [[1, 5]]
    assert select_frames(5, 1, FramePolicy("first", skip_first=2)).tolist() == [[2]]
    g = torch.Generator().manual_seed(0)
    group = torch.rand(4, 5, 3, 4, 4, generator=g)
    reward = _Red(frames={"skip_first": 1})
    scores = []
    for first in (0.0, 1.0):  # two different (constant within the group) first frames
        videos = group.clone()
        videos[:, 0] = first
        scores.append(reward(videos, ["a"] * 4)["reward"])
    torch.testing.assert_close(scores[0], scores[1], atol=0, rtol=0)
    adv = group_advantages(scores[0], torch.zeros(4, dtype=torch.long))
    assert torch.isfinite(adv).all() and adv.abs().sum() > 0
    with pytest.raises(ValueError, match="skip_first=5 leaves none"):
        _Red(frames={"skip_first": 5})(group, ["a"] * 4)
