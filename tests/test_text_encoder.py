"""Text encoders load from local folders only: the bundled MiniLM, and tiny random BERTs in tests."""

from __future__ import annotations

import pytest
import torch

from genrl.models import MINILM, Conditioning, TextEncoder


@pytest.fixture(scope="module")
def minilm() -> TextEncoder:
    return TextEncoder.from_pretrained(MINILM)


def test_real_minilm_loads_offline_and_embeds(minilm):
    import os

    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: any hub access would fail
    cond = minilm(["a red circle moving left slowly", "a blue square staying still", ""])
    assert minilm.hidden_size == 384
    assert cond.hidden_states.shape[0] == 3 and cond.hidden_states.shape[2] == 384
    assert cond.attention_mask.sum(1).tolist()[2] == 2  # the null prompt is [CLS] [SEP]
    assert torch.isfinite(cond.hidden_states).all()
    # real weights, not random: the two captions share words but are different sentences
    a, b = cond.hidden_states[0, 1], cond.hidden_states[1, 1]
    assert not torch.allclose(a, b)
    # all-MiniLM-L6-v2's first token state for "a" differs from its "[CLS]" state
    assert (cond.hidden_states[0, 0] - cond.hidden_states[0, 1]).abs().max() > 0.1


def test_minilm_separates_captions_that_differ_in_one_word(minilm):
    cond = minilm(["a red circle moving left slowly", "a red circle moving right slowly"])
    left, right = cond.hidden_states[0], cond.hidden_states[1]
    # same tokenisation length; the per-token states at the direction word differ clearly
    assert cond.attention_mask[0].sum() == cond.attention_mask[1].sum()
    diff = (left - right).norm(dim=-1)
    assert diff.max() > 0.5 * left.norm(dim=-1).mean()


def test_cache_returns_identical_states(minilm):
    first = minilm(["a green triangle moving up quickly"])
    second = minilm(["a green triangle moving up quickly"])
    assert torch.equal(first.hidden_states, second.hidden_states)


def test_tiny_encoder_and_conditioning_cat(tiny_text_encoder):
    enc = TextEncoder.from_pretrained(tiny_text_encoder)
    a = enc(["a red circle"])
    b = enc(["a blue square moving left slowly", ""])
    both = Conditioning.cat([a, b])
    assert both.hidden_states.shape == (3, 32, 16)  # padded to max_length: fixed shapes
    assert both.attention_mask.sum(1).tolist() == [5, 8, 2]
    assert both.prompts == ["a red circle", "a blue square moving left slowly", ""]


def test_bad_inputs(tmp_path, tiny_text_encoder):
    with pytest.raises(FileNotFoundError, match="text encoder folder"):
        TextEncoder.from_pretrained(tmp_path / "nope")
    enc = TextEncoder.from_pretrained(tiny_text_encoder)
    with pytest.raises(TypeError, match="list of strings"):
        enc("a red circle")
