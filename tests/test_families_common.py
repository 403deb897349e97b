"""What every diffusers family shares: an incomplete weights folder is refused before anything loads, with
a message that names the missing file and the expected layout; the tiny pipelines reload bit-identically."""

from __future__ import annotations

import shutil

import pytest
import torch
from families_util import save_tiny_pipeline

from genrl.models.families import FAMILIES, GeneratorSpec, build_generator, family_class
from genrl.models.families.base import CONFIG_FILES
from genrl.testing.families import TINY, TINY_SIZE


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_folder(request, tmp_path_factory):
    return request.param, save_tiny_pipeline(request.param, tmp_path_factory.mktemp(request.param) / "pipe")


def _spec(family, folder):
    return GeneratorSpec(family=family, pretrained=str(folder), **TINY_SIZE[family])


def test_every_missing_part_is_named(family_folder, tmp_path):
    family, folder = family_folder
    layout = f"expected the diffusers {family} layout"
    for name, kind in family_class(family).components.items():
        broken = tmp_path / f"no_{name}"
        shutil.copytree(folder, broken)
        if kind == "model":
            for f in (broken / name).glob("*.safetensors"):
                f.unlink()
            what = rf"missing weights in .*{name}'"
        elif kind == "tokenizer":
            for f in (broken / name).iterdir():
                f.unlink()
            what = rf"missing tokenizer files in .*{name}'"
        else:  # a config-only folder: scheduler / guider
            (broken / name / CONFIG_FILES[kind]).unlink()
            what = rf"missing .*{name}/{CONFIG_FILES[kind]}"
        with pytest.raises(FileNotFoundError, match=rf"{what}.*{layout}"):
            build_generator(_spec(family, broken))
        shutil.rmtree(broken / name)
        with pytest.raises(FileNotFoundError, match=rf"missing the folder .*{name}'"):
            build_generator(_spec(family, broken))
    (tmp_path / "no_index").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"model_index.json; {layout}"):
        build_generator(_spec(family, tmp_path / "no_index"))
    with pytest.raises(FileNotFoundError, match=rf"no {family} weights folder at .*nowhere"):
        build_generator(_spec(family, tmp_path / "nowhere"))


def _prompts(family: str, texts: list[str]) -> list[str]:
    """``texts``, each with a (seeded, sample-sized) conditioning image when the family needs one."""
    from genrl.models.conditions import Prompt

    if not family_class(family).requires_image:
        return texts
    size = TINY_SIZE[family]
    gen = torch.Generator().manual_seed(0)
    return [Prompt(t, torch.rand(3, size["height"], size["width"], generator=gen)) for t in texts]


def test_reload_equals_the_saved_model(family_folder):
    family, folder = family_folder
    built = family_class(family).from_config(TINY[family], seed=0, **TINY_SIZE[family])
    loaded = build_generator(_spec(family, folder))
    saved = dict(built.transformer.state_dict())
    for key, value in loaded.transformer.state_dict().items():
        assert torch.equal(value, saved[key]), key
    prompts = _prompts(family, ["a red circle moving left", ""])
    a, b = built.encode_prompts(prompts), loaded.encode_prompts(prompts)
    assert torch.equal(a.hidden_states, b.hidden_states) and torch.equal(a.attention_mask, b.attention_mask)


def test_disk_prompt_cache_serves_a_new_process(family_folder, tmp_path, monkeypatch):
    family, folder = family_folder
    spec = GeneratorSpec(family=family, pretrained=str(folder), prompt_cache_dir=str(tmp_path / "cache"),
                         **TINY_SIZE[family])
    prompts = _prompts(family, ["a red circle moving left", "a blue square staying still", ""])
    first = build_generator(spec).encode_prompts(prompts)
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 3
    fresh = build_generator(spec)

    def no_encoder(*args, **kwargs):
        raise AssertionError("the text encoders ran although every prompt is cached on disk")

    monkeypatch.setattr(fresh, "_encode_uncached", no_encoder)
    again = fresh.encode_prompts(prompts)
    assert torch.equal(first.hidden_states, again.hidden_states)
    assert first.extras.keys() == again.extras.keys()
    assert all(torch.equal(first.extras[k], again.extras[k]) for k in first.extras)
    assert (first.pooled is None) == (again.pooled is None)
    if first.pooled is not None:
        assert torch.equal(first.pooled, again.pooled)


def test_bf16_weights_and_gradient_checkpointing(family_folder):
    """bf16 weights give a bf16 velocity close to the float32 one; LoRA weights stay float32; gradient
    checkpointing changes memory, not gradients."""
    from genrl.models.lora import LoraSpec
    from genrl.rollout.noise import randn_per_sample

    family, folder = family_folder
    full = build_generator(_spec(family, folder))
    half = build_generator(GeneratorSpec(family=family, pretrained=str(folder), torch_dtype="bfloat16",
                                         **TINY_SIZE[family]))
    prompts = _prompts(family, ["a red circle moving left", "a blue square staying still"])
    x = randn_per_sample(full.latent_shape, seed=0, indices=[0, 1])
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        v32 = full.velocity(x, sigma, full.encode_prompts(prompts)).float()
        v16 = half.velocity(x, sigma, half.encode_prompts(prompts))
    assert v16.dtype == torch.bfloat16 and half.dtype == torch.bfloat16
    assert (v16.float() - v32).abs().max() <= 0.05 * v32.abs().max() + 0.05
    LoraSpec(rank=2, alpha=2, init_lora_weights=True).add_to(half)
    trainable = [p for p in half.transformer.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)

    grads = []
    for checkpointing in (False, True):
        gen = build_generator(GeneratorSpec(family=family, pretrained=str(folder), gradient_checkpointing=checkpointing,
                                            **TINY_SIZE[family]))
        assert gen.transformer.is_gradient_checkpointing == checkpointing
        gen.train()
        gen.velocity(x, sigma, gen.encode_prompts(prompts)).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in gen.transformer.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)
