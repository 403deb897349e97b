"""Prompt loaders (real suites, file formats, shapes captions), the grouped prompt stream and exact resume."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

import genrl
from genrl.data import PromptDataModule, PromptRecord, ShapeSpec, ShapesWorldConfig, load_prompts
from genrl.data.prompts import PromptStream, assets_dir
from genrl.data.shapes import caption, is_heldout

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "prompts"


# ---------------------------------------------------------------------------------------------- formats
def test_real_suites_parse_with_metadata():
    vb = load_prompts(ASSETS / "vbench_full_info.json")
    assert len(vb) == 946 and len({r.prompt for r in vb}) == 944
    assert vb[0] == PromptRecord("In a still frame, a stop sign", {"prompt_en": "In a still frame, a stop sign",
                                                                 "dimension": ["temporal_flickering"]})
    dims = Counter(d for r in vb for d in r.metadata["dimension"])
    assert len(dims) == 16 and dims["human_action"] == 100 and dims["temporal_flickering"] == 75
    assert all(r.prompt == r.metadata["prompt_en"] for r in vb)

    ge = load_prompts(ASSETS / "geneval_test_metadata.jsonl")
    assert len(ge) == 2212  # 2,211 newlines: the last line has none
    assert ge[0].prompt == "a photo of two wine glasses"
    assert ge[0].metadata["tag"] == "counting"
    assert ge[0].metadata["include"] == [{"class": "wine glass", "count": 2}]
    assert Counter(r.metadata["tag"] for r in ge)["position"] == 400
    assert set(Counter(r.prompt for r in ge).values()) == {4}

    ocr = load_prompts(ASSETS / "ocr_test.txt")
    assert len(ocr) == 1018 and ocr[0].metadata == {}
    assert '"Spring Collection 2024"' in ocr[0].prompt

    # aliases resolve to the shipped files
    assert assets_dir() == ASSETS.parent
    assert load_prompts("vbench") == vb and load_prompts("geneval") == ge and load_prompts("ocr") == ocr


def test_small_files_in_every_format(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("  a cat \n\n\t\na dog\n")
    assert load_prompts(str(txt)) == [PromptRecord("a cat", {}), PromptRecord("a dog", {})]

    jl = tmp_path / "p.jsonl"
    jl.write_text('{"caption": "x", "k": 1}\n\n{"caption": "y"}\n')
    assert load_prompts(jl, prompt_key="caption") == [
        PromptRecord("x", {"caption": "x", "k": 1}), PromptRecord("y", {"caption": "y"})
    ]

    js = tmp_path / "s.json"
    js.write_text(json.dumps(["one", "two", "  "]))
    assert [r.prompt for r in load_prompts(js)] == ["one", "two"]
    jo = tmp_path / "o.json"
    jo.write_text(json.dumps([{"prompt": "p1", "dimension": ["color"]}, {"prompt_en": "p2"}]))
    assert load_prompts(jo) == [PromptRecord("p1", {"prompt": "p1", "dimension": ["color"]}),
                                PromptRecord("p2", {"prompt_en": "p2"})]


def test_shapes_sources_are_exact_captions_and_disjoint():
    world = ShapesWorldConfig()
    train, held = load_prompts("shapes:train", world=world), load_prompts("shapes:heldout", world=world)
    assert train and held
    tp, hp = [r.prompt for r in train], [r.prompt for r in held]
    assert len(set(tp)) == len(tp) and len(set(hp)) == len(hp) and not set(tp) & set(hp)
    for r in train + held:
        spec = ShapeSpec(**r.metadata)
        assert caption(spec) == r.prompt
        assert is_heldout(spec, world) == (r in held)
    # each combination x speed (2 speeds), still combinations once: 90 combos, 18 still
    assert len(tp) + len(hp) == 18 + 72 * 2
    assert train[0] == PromptRecord("a red circle moving left slowly",
                                    {"color": "red", "shape": "circle", "directions": ["left"], "speed": "slow"})
    assert load_prompts("shapes:train", world=world) == train  # fixed order
    assert len(load_prompts("shapes:all", world=world)) == len(tp) + len(hp)
    img = load_prompts("shapes:train", world=ShapesWorldConfig(num_frames=1, multi_step_prob=0))
    assert img[0] == PromptRecord("a red circle", {"color": "red", "shape": "circle", "directions": [], "speed": None})


def test_errors_name_the_file_line_and_key(tmp_path, monkeypatch):
    for name, text in [("e.txt", ""), ("b.txt", "\n  \n"), ("e.jsonl", "\n"), ("e.json", "[]"), ("z.json", "")]:
        f = tmp_path / name
        f.write_text(text)
        with pytest.raises(ValueError, match=f"no prompts in .*{name}"):
            load_prompts(f)
    missing = tmp_path / "missing.txt"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_prompts(missing)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"malformed JSON in .*bad\.jsonl.* line 2"):
        load_prompts(bad)
    badj = tmp_path / "bad.json"
    badj.write_text('[\n"a",\n"b"\n"c"]')
    with pytest.raises(ValueError, match=r"malformed JSON in .*bad\.json.* line 4"):
        load_prompts(badj)
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"prompt": "ok"}\n{"text": "hi", "tag": "x"}\n')
    with pytest.raises(ValueError, match=r"nokey\.jsonl.* line 2.*'prompt'.*keys present: 'text', 'tag'"):
        load_prompts(nokey)
    with pytest.raises(ValueError, match=r"'caption'.*keys present: 'prompt'"):
        load_prompts(nokey, prompt_key="caption")
    csv = tmp_path / "p.csv"
    csv.write_text("a\n")
    with pytest.raises(ValueError, match=r"p\.csv.*\.txt, \.jsonl, \.json"):
        load_prompts(csv)
    with pytest.raises(ValueError, match="shapes:heldout"):
        load_prompts("shapes:heldout", world=ShapesWorldConfig(heldout_fraction=0.0))
    with pytest.raises(ValueError, match="unknown shapes split"):
        load_prompts("shapes:val")
    monkeypatch.setattr(genrl, "__file__", str(tmp_path / "site" / "genrl" / "__init__.py"))
    with pytest.raises(FileNotFoundError, match="assets folder is missing"):
        load_prompts("vbench")


# ---------------------------------------------------------------------------------------------- stream
def _records(n):
    return [PromptRecord(f"prompt {i}", {"i": i}) for i in range(n)]


def _batches(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_stream_is_deterministic_grouped_and_unique():
    P, K, N = 3, 4, 7
    a = _batches(PromptStream(_records(N), P, K, seed=5), 10)
    b = _batches(PromptStream(_records(N), P, K, seed=5), 10)
    c = _batches(PromptStream(_records(N), P, K, seed=6), 10)
    assert [x["prompts"] for x in a] == [x["prompts"] for x in b]
    assert [x["prompts"] for x in a] != [x["prompts"] for x in c]
    for bi, batch in enumerate(a):
        assert len(batch["prompts"]) == len(batch["metadata"]) == P * K
        assert batch["index"].dtype == batch["group"].dtype == torch.int64
        assert batch["index"].tolist() == list(range(bi * P * K, (bi + 1) * P * K))
        assert batch["group"].tolist() == [bi * P + p for p in range(P) for _ in range(K)]
        for p in range(P):
            group = batch["prompts"][p * K : (p + 1) * K]
            assert len(set(group)) == 1
            assert all(m == {"i": int(group[0].split()[1])} for m in batch["metadata"][p * K : (p + 1) * K])
    slots = [x["prompts"][p * K] for x in a for p in range(P)]  # 30 slots = 4 full epochs + 2
    for e in range(4):
        assert sorted(slots[e * N : (e + 1) * N]) == sorted(r.prompt for r in _records(N))
    assert slots[:N] != slots[N : 2 * N]  # a new permutation each epoch
    ordered = _batches(PromptStream(_records(N), P, K, shuffle=False), 3)
    assert [x["prompts"][p * K] for x in ordered for p in range(P)] == [f"prompt {i % N}" for i in range(9)]
    # metadata are copies: editing one sample's dict leaves the others alone
    a[0]["metadata"][0]["i"] = -1
    assert a[0]["metadata"][1]["i"] != -1


def test_two_ranks_cover_each_global_batch_exactly_once():
    dm = PromptDataModule(train="shapes:train", val=None, prompts_per_batch=3, group_size=2, seed=3)
    full, r0, r1 = (iter(dm.make_train_loader(rank=r, world_size=w)) for r, w in [(0, 1), (0, 2), (1, 2)])
    for _ in range(3):
        g, a, b = next(full), next(r0), next(r1)
        assert len(a["prompts"]) == len(b["prompts"]) == 3
        for key in ("index", "group"):
            assert torch.equal(torch.cat([a[key], b[key]]), g[key])
        assert a["prompts"] + b["prompts"] == g["prompts"]
        assert a["metadata"] + b["metadata"] == g["metadata"]
        assert a["group"][-1] == b["group"][0]  # group 1 of each batch spans the two ranks
    with pytest.raises(ValueError, match=r"3 \* 3 = 9 .*world size 2"):
        PromptDataModule(prompts_per_batch=3, group_size=3).make_train_loader(rank=1, world_size=2)


def test_datamodule_arguments_and_validation_set():
    for kwargs in [dict(prompts_per_batch=0), dict(group_size=0), dict(val_size=-1)]:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            PromptDataModule(**kwargs)
    with pytest.warns(UserWarning, match="group_size=1.*zero"):
        PromptDataModule(group_size=1)

    dm = PromptDataModule(train="ocr", val="vbench", prompts_per_batch=2, group_size=2, val_size=10)
    batches = list(dm.val_dataloader())
    assert [len(b["prompts"]) for b in batches] == [4, 4, 2]
    assert sum((b["prompts"] for b in batches), []) == [r.prompt for r in load_prompts("vbench")[:10]]
    assert torch.cat([b["index"] for b in batches]).tolist() == [-(i + 1) for i in range(10)]
    assert all(torch.equal(b["index"], b["group"]) for b in batches)
    assert batches[0]["metadata"][0]["dimension"] == ["temporal_flickering"]
    # val_size beyond the list: every prompt once
    held = load_prompts("shapes:heldout")
    dm = PromptDataModule(val_size=1000)
    assert sum((b["prompts"] for b in dm.val_batches()), []) == [r.prompt for r in held]
    assert len(list(PromptDataModule(val=None).val_dataloader())) == 0
    assert len(list(PromptDataModule(val_size=0).val_dataloader())) == 0


# ---------------------------------------------------------------------------------------------- resume
def _tiny():
    from lightning.pytorch import LightningModule

    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)
            self.seen: list[list[int]] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["index"].tolist())
            assert len(batch["prompts"]) == len(batch["metadata"]) == batch["index"].numel()
            return self.lin(batch["index"].float()[:, None]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return Tiny()


def _trainer(steps, root, callbacks=()):
    from lightning.pytorch import Trainer

    return Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=list(callbacks), enable_checkpointing=bool(callbacks), default_root_dir=str(root),
        num_sanity_val_steps=0, limit_val_batches=0,
    )


def test_lightning_resume_continues_the_stream_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def dm():
        return PromptDataModule(train="geneval", val=None, prompts_per_batch=2, group_size=2, seed=1)

    full = _tiny()
    _trainer(4, tmp_path / "full").fit(full, dm())

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    first = _tiny()
    _trainer(2, tmp_path / "a", [ckpt]).fit(first, dm())
    path = os.path.join(tmp_path / "ckpt", "last.ckpt")
    state = torch.load(path, weights_only=True)  # hparams are plain values
    # batches delivered to training_step, not the one Lightning had prefetched
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches_consumed": 2}]
    assert state["PromptDataModule"] == {"batches_consumed": 2}
    second = _tiny()
    _trainer(4, tmp_path / "b").fit(second, dm(), ckpt_path=path)

    assert full.seen == [list(range(4 * b, 4 * b + 4)) for b in range(4)]
    assert first.seen + second.seen == full.seen


def test_vbench_dimension_source_selects_the_prompts_tagged_with_it():
    from genrl.data.prompts import load_prompts

    full = load_prompts("vbench")
    dyn = load_prompts("vbench:dynamic_degree")
    assert len(dyn) == 72 and all("dynamic_degree" in r.metadata["dimension"] for r in dyn)
    assert [r.prompt for r in dyn] == [r.prompt for r in full if "dynamic_degree" in r.metadata["dimension"]]
    assert len(load_prompts("vbench:temporal_flickering")) == 75
    with pytest.raises(ValueError, match="no VBench prompts for dimension 'flicker'.*temporal_flickering"):
        load_prompts("vbench:flicker")


def test_image_lines_make_image_prompts_relative_to_the_file(tmp_path, monkeypatch):
    """A .jsonl / .json line with an ``image`` is a Prompt carrying that file, a relative path taken from the prompt
    file's folder (not the working directory); lines without one stay plain strings; a non-string image is refused."""
    from genrl.data.prompts import PromptStream
    from genrl.models.conditions import Prompt, prompt_image

    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "i2v.jsonl").write_text('{"prompt": "a car", "image": "frames/car.png"}\n{"prompt": "a dog"}\n'
                                      '{"prompt": "a cat", "image": "/abs/cat.png"}\n')
    monkeypatch.chdir(tmp_path)
    recs = load_prompts(str(folder / "i2v.jsonl"))
    assert isinstance(recs[0].prompt, Prompt) and recs[0].prompt == Prompt("a car", str(folder / "frames/car.png"))
    assert prompt_image(recs[0].prompt) == str(folder / "frames" / "car.png") and recs[0].metadata["image"]
    assert type(recs[1].prompt) is str and prompt_image(recs[2].prompt) == "/abs/cat.png"
    (folder / "list.json").write_text('[{"prompt": "a car", "image": "car.png"}]')
    assert prompt_image(load_prompts(str(folder / "list.json"))[0].prompt) == str(folder / "car.png")
    batch = PromptStream(recs, 3, 2, 0, False, 0, 1).batch(0)  # a group repeats the Prompt object, image included
    assert [prompt_image(p) for p in batch["prompts"][:2]] == [str(folder / "frames/car.png")] * 2
    (folder / "bad.jsonl").write_text('{"prompt": "a car", "image": 3}\n')
    with pytest.raises(ValueError, match="image=3 is not a file path"):
        load_prompts(str(folder / "bad.jsonl"))
