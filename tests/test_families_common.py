"""What every diffusers family shares: an incomplete weights folder is refused before anything loads, with
a message that names the missing file and the expected layout; the tiny pipelines reload bit-identically."""

from __future__ import annotations

import shutil

import pytest
import torch

from families_util import save_tiny_pipeline
from genrl.models.families import FAMILIES, GeneratorSpec, build_generator, family_class
from genrl.models.families.tiny import TINY, TINY_SIZE


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
        else:
            (broken / name / "scheduler_config.json").unlink()
            what = rf"missing .*{name}/scheduler_config.json"
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


def test_reload_equals_the_saved_model(family_folder):
    family, folder = family_folder
    built = family_class(family).from_config(TINY[family], seed=0, **TINY_SIZE[family])
    loaded = build_generator(_spec(family, folder))
    saved = dict(built.transformer.state_dict())
    for key, value in loaded.transformer.state_dict().items():
        assert torch.equal(value, saved[key]), key
    prompts = ["a red circle moving left", ""]
    a, b = built.encode_prompts(prompts), loaded.encode_prompts(prompts)
    assert torch.equal(a.hidden_states, b.hidden_states) and torch.equal(a.attention_mask, b.attention_mask)
