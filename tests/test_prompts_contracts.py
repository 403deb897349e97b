"""Contracts of the prompt sources, the grouped prompt stream and the prompt DataModule (genrl/data/prompts.py), written
for the mutation survivors of that module (issue 51, stage 5): the multi-step shapes sources
``"shapes:<split>:steps2"`` / ``":steps3"`` (every caption of moving directions with consecutive directions distinct,
in config order, split by whether any of its (color, shape, direction) combinations is held out, with the spec's
fields as metadata; any other step suffix refused), the file readers (UTF-8 with or without a byte-order mark, the
prompt key of ``.json`` lists and of the built-in suites, errors naming the file and the item or prompt), the
training stream (default seed, salted permutations, argument checks, private metadata copies, worker split, local
batch numbers), the validation batches' private metadata copies, and the DataModule (its train loader's defaults and
shuffling, its validation set's prompt key, world and ``val_size``).

Each test calls the functions directly with a tiny shapes world, a few in-memory records or a tiny prompt file under
``tmp_path``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, is_dataclass
from types import SimpleNamespace

import pytest
import torch

import genrl.data.prompts as prompts_module
from genrl.data.prompts import PromptDataModule, PromptRecord, PromptStream, load_prompts, val_prompt_batches
from genrl.data.shapes import ShapesWorldConfig, heldout_combos, sample_seed


def _world() -> ShapesWorldConfig:
    """2 colors x 2 shapes x (left, right, still), half held out: (red, circle, left), (red, circle, still),
    (green, square, right), (green, square, still) (checked in the first test)."""
    return ShapesWorldConfig(colors=["red", "green"], shapes=["circle", "square"],
                             directions=["left", "right", "still"], heldout_fraction=0.5)


def _meta(color: str, shape: str, dirs: list[str]) -> dict:
    return {"color": color, "shape": shape, "directions": dirs, "speed": None}


# (color, shape, directions) of every multi-step caption of _world(), in config order; held out iff a combination
# of it is: red circle (left held) and green square (right held) are held out, the other two pairs are not.
_TWO = [["left", "right"], ["right", "left"]]
_THREE = [["left", "right", "left"], ["right", "left", "right"]]
_PAIRS = [("red", "circle"), ("red", "square"), ("green", "circle"), ("green", "square")]
_HELD_PAIRS = {("red", "circle"), ("green", "square")}


def _caption(color: str, shape: str, dirs: list[str]) -> str:
    return f"a {color} {shape} " + ", then ".join(f"moves {d}" for d in dirs)


def _expected(split: str, steps: list[list[str]]) -> list[tuple[str, dict]]:
    return [(_caption(c, s, d), _meta(c, s, d)) for c, s in _PAIRS for d in steps
            if split == "all" or (((c, s) in _HELD_PAIRS) == (split == "heldout"))]


def _pairs(records: list[PromptRecord]) -> list[tuple[str, dict]]:
    return [(r.prompt, r.metadata) for r in records]


@pytest.mark.parametrize("split", ["train", "heldout", "all"])
def test_two_step_sources_are_every_caption_of_distinct_moving_directions(split):
    """``shapes:<split>:steps2``: for each (color, shape) in config order, every ordered pair of distinct *moving*
    directions (never "still", never a direction twice in a row), as the caption "a red square moves left, then
    moves right"; train keeps the captions none of whose combinations is held out, heldout those with one held
    out, all both; metadata are the spec's fields with ``directions`` a list and no speed."""
    world = _world()
    assert heldout_combos(world) == [("red", "circle", "left"), ("red", "circle", "still"),
                                     ("green", "square", "right"), ("green", "square", "still")]
    records = load_prompts(f"shapes:{split}:steps2", world=world)
    assert all(type(r) is PromptRecord for r in records)
    assert _pairs(records) == _expected(split, _TWO)
    assert all(type(r.metadata["directions"]) is list for r in records)
    assert len(records) == {"train": 4, "heldout": 4, "all": 8}[split]


@pytest.mark.parametrize("split", ["train", "heldout", "all"])
def test_three_step_sources_alternate_directions(split):
    """``shapes:<split>:steps3``: three segments, consecutive directions distinct (so, with two moving directions,
    only left-right-left and right-left-right), split as for two steps."""
    records = load_prompts(f"shapes:{split}:steps3", world=_world())
    assert _pairs(records) == _expected(split, _THREE)
    assert records[0].prompt in (
        "a red circle moves left, then moves right, then moves left",  # all / heldout
        "a red square moves left, then moves right, then moves left",  # train
    )


def test_multi_step_heldout_needs_only_one_held_combination():
    """A multi-step caption is held out as soon as *one* of its (color, shape, direction) combinations is: the red
    circle holds out only "left", yet both of its captions (left first or right first) are held out; a pair with no
    held-out moving direction (red square) stays in training entirely."""
    world = _world()
    held = load_prompts("shapes:heldout:steps2", world=world)
    assert "a red circle moves right, then moves left" in [r.prompt for r in held]
    assert not [r for r in held if r.metadata["shape"] == "square" and r.metadata["color"] == "red"]
    train = load_prompts("shapes:train:steps2", world=world)
    assert {(r.metadata["color"], r.metadata["shape"]) for r in train} == {("red", "square"), ("green", "circle")}


def test_multi_step_source_of_a_world_with_nothing_held_out():
    """With nothing held out (one color and shape: no combination can go without leaving a direction untrained),
    train and all are every caption and heldout is empty (a ValueError naming the source)."""
    world = ShapesWorldConfig(colors=["blue"], shapes=["triangle"], directions=["up", "still", "down", "left"])
    assert heldout_combos(world) == []
    dirs = [["up", "down"], ["up", "left"], ["down", "up"], ["down", "left"], ["left", "up"], ["left", "down"]]
    expected = [(_caption("blue", "triangle", d), _meta("blue", "triangle", d)) for d in dirs]
    assert _pairs(load_prompts("shapes:train:steps2", world=world)) == expected
    assert _pairs(load_prompts("shapes:all:steps2", world=world)) == expected
    with pytest.raises(ValueError, match="shapes:heldout:steps2"):
        load_prompts("shapes:heldout:steps2", world=world)
    three = load_prompts("shapes:train:steps3", world=world)
    assert len(three) == 3 * 2 * 2
    assert three[0].prompt == "a blue triangle moves up, then moves down, then moves up"
    assert three[-1].metadata == _meta("blue", "triangle", ["left", "down", "left"])


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl", "p.json"])
def test_files_are_utf8_with_an_optional_byte_order_mark(tmp_path, name):
    """Prompt files are read as UTF-8 and a leading byte-order mark (as Windows editors write) is dropped: the first
    prompt does not start with U+FEFF (and a .json / .jsonl file still parses); non-ASCII text is kept."""
    prompts = ["café au lait", "naïve"]
    body = {"p.txt": "\n".join(prompts) + "\n",
            "p.jsonl": "".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts),
            "p.json": json.dumps(prompts, ensure_ascii=False)}[name]
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    assert [r.prompt for r in load_prompts(path)] == prompts
    path.write_bytes(body.encode("utf-8"))
    assert [r.prompt for r in load_prompts(path)] == prompts


def test_json_list_objects_use_the_prompt_key(tmp_path):
    """In a ``.json`` list, objects take their prompt from ``prompt_key`` (not the default "prompt"), keeping the whole
    object as metadata; a text file's records have empty metadata."""
    path = tmp_path / "l.json"
    path.write_text(json.dumps([{"prompt": "default", "text": "chosen"}, {"text": "second"}]))
    assert load_prompts(path, prompt_key="text") == [PromptRecord("chosen", {"prompt": "default", "text": "chosen"}),
                                                     PromptRecord("second", {"text": "second"})]
    txt = tmp_path / "t.txt"
    txt.write_text("x\n")
    assert load_prompts(txt)[0].metadata == {}


def test_json_list_errors_name_the_file_and_item(tmp_path):
    """An object of a ``.json`` list without the prompt key raises a ValueError naming the file and the item's index
    (and the keys present)."""
    path = tmp_path / "items.json"
    path.write_text(json.dumps([{"prompt": "ok"}, {"text": "no key"}]))
    where = re.escape(f"{str(path)!r} item 1: ")
    with pytest.raises(ValueError, match=where + r".*'prompt'.*'prompt_en'.* key; keys present: 'text'"):
        load_prompts(path)


def test_image_errors_name_the_file_and_the_prompt(tmp_path):
    """A non-path ``image`` raises a ValueError naming the prompt file and the prompt it belongs to."""
    path = tmp_path / "i2v.jsonl"
    path.write_text('{"prompt": "a car", "image": "car.png"}\n{"prompt": "a red cat", "image": 5}\n')
    with pytest.raises(ValueError, match=re.escape(f"{str(path)!r}, the prompt 'a red cat': image=5 is not a file")):
        load_prompts(path)


def test_val_batches_hold_private_metadata_copies():
    """Each validation sample's metadata is a deep copy: changing a nested value of a batch's metadata (a method
    annotating it) leaves the records, and so every later validation pass, untouched."""
    records = [PromptRecord("a", {"tag": ["x"], "inner": {"k": 1}}), PromptRecord("b", {"tag": ["y"]})]
    batches = val_prompt_batches(records, 1)
    assert [b["prompts"] for b in batches] == [["a"], ["b"]]
    assert [b["index"].tolist() for b in batches] == [[-1], [-2]]
    assert all(b["index"].dtype == torch.int64 and b["group"].dtype == torch.int64 for b in batches)
    meta = batches[0]["metadata"][0]
    assert meta == records[0].metadata and meta is not records[0].metadata
    meta["tag"].append("changed")
    meta["inner"]["k"] = 2
    assert records[0].metadata == {"tag": ["x"], "inner": {"k": 1}}
    assert val_prompt_batches(records, 2)[0]["metadata"] == [{"tag": ["x"], "inner": {"k": 1}}, {"tag": ["y"]}]


def test_datamodule_validation_reads_its_prompt_key(tmp_path):
    """The validation set is loaded with the DataModule's ``prompt_key`` (not the default "prompt" key)."""
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"default {i}", "caption": f"chosen {i}"}) + "\n" for i in range(3)))
    dm = PromptDataModule(train="ocr", val=str(path), prompts_per_batch=1, group_size=2, val_size=3,
                          prompt_key="caption")
    batches = dm.val_batches()
    assert [b["prompts"] for b in batches] == [["chosen 0", "chosen 1"], ["chosen 2"]]
    assert batches[1]["metadata"] == [{"prompt": "default 2", "caption": "chosen 2"}]


def test_datamodule_validation_uses_its_world():
    """A ``"shapes:*"`` validation source is read in the DataModule's world (not the default world)."""
    world = _world()
    dm = PromptDataModule(train="ocr", val="shapes:heldout", prompts_per_batch=2, group_size=2, world=world)
    prompts = sum((b["prompts"] for b in dm.val_batches()), [])
    assert prompts == [r.prompt for r in load_prompts("shapes:heldout", world=world)]
    assert prompts != [r.prompt for r in load_prompts("shapes:heldout")][: len(prompts)]
    assert all(p.split()[1] in ("red", "green") for p in prompts)


def test_datamodule_val_size_one_is_one_prompt():
    """``val_size=1`` validates on exactly the first prompt of the source (only 0 disables validation)."""
    world = _world()
    dm = PromptDataModule(train="ocr", val="shapes:all:steps2", prompts_per_batch=2, group_size=2, val_size=1,
                          world=world)
    batches = dm.val_batches()
    assert len(batches) == 1
    assert batches[0]["prompts"] == ["a red circle moves left, then moves right"]
    assert batches[0]["index"].tolist() == [-1]
    assert len(list(dm.val_dataloader())) == 1


def test_make_train_loader_defaults_to_the_whole_stream_from_batch_zero():
    """``make_train_loader()`` without arguments is rank 0 of 1 in the main process, starting at batch 0, counting
    yielded batches (no delivery tracking): its first batch is the whole global batch 0 (ids 0 .. P*K - 1, groups in
    file order without shuffling) and after it one batch is consumed. Explicit arguments give that rank's slice of
    batch ``start``."""
    world = _world()
    records = load_prompts("shapes:train", world=world)
    dm = PromptDataModule(train="shapes:train", val=None, prompts_per_batch=2, group_size=2, world=world,
                          shuffle=False)
    loader = dm.make_train_loader()
    assert (loader.dataset.rank, loader.dataset.world_size) == (0, 1)
    assert loader.batches_consumed == 0 and loader.track_delivery is False
    assert loader.num_workers == 0  # in the main process
    batch = next(iter(loader))
    assert batch["index"].tolist() == [0, 1, 2, 3] and batch["group"].tolist() == [0, 0, 1, 1]
    assert batch["prompts"] == [records[0].prompt] * 2 + [records[1].prompt] * 2
    assert loader.batches_consumed == 1

    other = dm.make_train_loader(1, 2, 3, True)
    assert other.track_delivery is True and other.batches_consumed == 3
    batch = next(iter(other))
    assert batch["index"].tolist() == [14, 15] and batch["prompts"] == [records[7].prompt] * 2
    assert other.batches_consumed == 3  # counted only when marked delivered


def test_make_train_loader_shuffles_by_default_with_the_seed():
    """The DataModule's train stream shuffles by default (``shuffle=True``), seeded by its ``seed``: the loader's first
    batch is batch 0 of ``PromptStream(records, P, K, seed, shuffle=True)``, not the file order."""
    world = _world()
    records = load_prompts("shapes:train", world=world)
    dm = PromptDataModule(train="shapes:train", val=None, prompts_per_batch=2, group_size=2, seed=5, world=world)
    loader = dm.make_train_loader()
    assert loader.dataset.shuffle is True and loader.dataset.seed == 5
    prompts = next(iter(loader))["prompts"]
    assert prompts == PromptStream(records, 2, 2, seed=5, shuffle=True).batch(0)["prompts"]
    assert prompts != [records[0].prompt] * 2 + [records[1].prompt] * 2


def test_builtin_suites_read_an_explicit_prompt_key():
    """An explicit ``prompt_key`` applies to the built-in suites too: GenEval read with ``prompt_key="tag"`` gives the
    tags as prompts, and a key the VBench objects lack raises (no fallback to "prompt_en" when a key is given), also
    for a ``"vbench:<dimension>"`` source."""
    tags = load_prompts("geneval", prompt_key="tag")
    assert tags[0].prompt == "counting" and tags[0].metadata["prompt"] == "a photo of two wine glasses"
    assert [r.prompt for r in tags] == [r.metadata["tag"] for r in tags]
    for source in ("vbench", "vbench:color"):
        with pytest.raises(ValueError, match=r"no 'prompt' key; keys present: 'prompt_en', 'dimension'"):
            load_prompts(source, prompt_key="prompt")


def test_stream_iteration_takes_every_nth_batch_in_a_worker(monkeypatch):
    """Iterating a PromptStream yields batches start, start + 1, ... in the main process, and in DataLoader worker w
    of n batches start + w, start + w + n, ... (no worker duplicates another's batches)."""
    stream = PromptStream([PromptRecord(f"p{i}") for i in range(3)], 1, 2, shuffle=False)
    stream.start = 5
    it = iter(stream)
    assert [next(it)["index"].tolist() for _ in range(2)] == [[10, 11], [12, 13]]
    monkeypatch.setattr(prompts_module, "get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2))
    it = iter(stream)
    assert [next(it)["group"].tolist() for _ in range(3)] == [[6, 6], [8, 8], [10, 10]]


def test_local_batch_is_the_integer_floor_of_the_global_batch():
    """The local (= global) batch number of a first sample id i is i // (P * K), an int, for every rank's slice."""
    stream = PromptStream([PromptRecord("a"), PromptRecord("b")], 2, 2, rank=1, world_size=2)
    got = [stream.local_batch(i) for i in (0, 2, 3, 5, 8, 14)]
    assert got == [0, 0, 0, 1, 2, 3] and all(type(g) is int for g in got)
    assert stream.local_batch(int(stream.batch(3)["index"][0])) == 3


@pytest.mark.parametrize("source", ["shapes:train:steps1", "shapes:all:steps4", "shapes:heldout:steps",
                                    "shapes:train:x", "shapes:train:steps2:steps3"])
def test_unknown_shapes_step_counts_are_refused(source):
    """Only ``:steps2`` / ``:steps3`` follow a shapes split; any other suffix (one step, four, none, another word, two
    suffixes) is refused with the "unknown shapes split" ValueError naming the source, before any caption is built."""
    with pytest.raises(ValueError, match="unknown shapes split in " + re.escape(repr(source))):
        load_prompts(source, world=_world())


PERM_SALT = 0x50524F4D5054  # "PROMPT": the permutation seeds of every stored run depend on it


def test_stream_default_seed_is_zero_and_permutations_are_the_salted_draws():
    """A PromptStream's default seed is 0 and epoch e's order is ``torch.randperm(N)`` from a CPU generator seeded with
    ``sample_seed(seed ^ 0x50524F4D5054, e)``; group g is prompt ``perm(g // N)[g % N]``."""
    records = [PromptRecord(f"p{i}") for i in range(7)]
    stream = PromptStream(records, 2, 2)
    assert stream.seed == 0 and stream.shuffle is True
    for e in range(2):
        g = torch.Generator().manual_seed(sample_seed(0 ^ PERM_SALT, e))
        assert stream.permutation(e) == torch.randperm(7, generator=g).tolist()
    want = stream.permutation(0) + stream.permutation(1)
    assert [stream.prompt_of_group(g).prompt for g in range(14)] == [f"p{i}" for i in want]
    assert stream.permutation(0) != list(range(7))


@pytest.mark.parametrize("kwargs", [dict(prompts_per_batch=0, group_size=2), dict(prompts_per_batch=2, group_size=0),
                                    dict(prompts_per_batch=2, group_size=2, rank=2, world_size=2),
                                    dict(prompts_per_batch=2, group_size=2, rank=-1, world_size=2)])
def test_stream_refuses_empty_batches_and_ranks_out_of_range(kwargs):
    """P >= 1 and K >= 1 each (either one zero is refused), and 0 <= rank < world_size (rank == world_size is out of
    range); a valid last rank is accepted."""
    records = [PromptRecord("a")]
    with pytest.raises(ValueError, match="must be >= 1|out of range"):
        PromptStream(records, **kwargs)
    assert PromptStream(records, 1, 2, rank=1, world_size=2).batch(0)["index"].tolist() == [1]


def test_stream_batches_hold_private_metadata_copies():
    """Each training sample's metadata is a deep copy of its record's: changing a nested value in one sample's dict
    leaves the record, the other samples of its group and later batches untouched."""
    records = [PromptRecord("a", {"tag": ["x"], "inner": {"k": 1}})]
    stream = PromptStream(records, 1, 2, shuffle=False)
    batch = stream.batch(0)
    assert batch["index"].dtype == torch.int64 and batch["group"].dtype == torch.int64
    batch["metadata"][0]["tag"].append("changed")
    batch["metadata"][0]["inner"]["k"] = 2
    assert batch["metadata"][1] == {"tag": ["x"], "inner": {"k": 1}}
    assert records[0].metadata == {"tag": ["x"], "inner": {"k": 1}}
    assert stream.batch(0)["metadata"] == [{"tag": ["x"], "inner": {"k": 1}}] * 2


def test_stream_batch_sizes_are_ints():
    """The global batch size is P * K and each rank's share P * K / W, both ints (usable as sizes: ``range``,
    ``torch.empty``), and each batch holds that many samples."""
    stream = PromptStream([PromptRecord("a"), PromptRecord("b")], 3, 2, rank=1, world_size=2)
    assert (stream.global_batch_size, stream.local_batch_size) == (6, 3)
    assert type(stream.global_batch_size) is int and type(stream.local_batch_size) is int
    assert stream.batch(1)["index"].tolist() == list(range(9, 12))


def test_datamodule_defaults():
    """PromptDataModule() trains on "shapes:train" and validates on the first 64 "shapes:heldout" prompts, with P = 8
    prompts of K = 4 samples per batch, seed 0, shuffled, the default prompt key and the default world."""
    h = PromptDataModule().hparams
    assert (h.train, h.val, h.prompts_per_batch, h.group_size, h.val_size, h.seed, h.prompt_key, h.shuffle) == (
        "shapes:train", "shapes:heldout", 8, 4, 64, 0, None, True)
    assert h.world == asdict(ShapesWorldConfig())


def test_datamodule_keeps_the_world_as_a_plain_dict():
    """The given world is used and stored in the hyperparameters as a dict of its fields; the hyperparameters as
    collected (hparams_initial, what loggers record) hold no ShapesWorldConfig object; a dict world is accepted."""
    world = _world()
    dm = PromptDataModule(train="shapes:train:steps2", world=world)
    assert dm.world == world and dm.hparams["world"] == asdict(world)
    assert not any(is_dataclass(v) for v in dm.hparams_initial.values())
    assert [r.prompt for r in dm.train_records] == [c for c, _ in _expected("train", _TWO)]
    assert PromptDataModule(world=asdict(world)).world == world
