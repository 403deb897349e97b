"""Contracts of the offline preference-pair data (genrl.data.preference_pairs) that its mutation survivors showed
untested (issue 51, stage 3): the JSON-lines reader (blank lines skipped, a UTF-8 BOM accepted, a valid example line
in its errors), errors naming the file, line and key, backslash paths, load_pair_set's option checks and float64
score comparison, PairStream's defaults, batch fields and dtypes, image reading (channels, scaling, modes, resize and
clamp) and video reading at num_frames / fps, and the data module's argument checks, defaults, world, validation
batches, validation loader and train loader (delivery tracking, workers). Every test uses tiny PNG files or
two-frame-rate 16x16 videos in tmp_path; nothing is downloaded."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from genrl.data.preference_pairs import PairStream, PreferencePair, PreferencePairDataModule, load_pair_set
from genrl.data.prompts import load_prompts
from genrl.data.shapes import ShapesWorldConfig

GREY_A = np.full((2, 2, 3), 40, dtype=np.uint8)
GREY_B = np.full((2, 2, 3), 200, dtype=np.uint8)


def _png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def _jsonl(path: Path, rows: list, prefix: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prefix + "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _labelled(root: Path, prompts: list[str]) -> Path:
    """A pairs.jsonl folder: one (a.png, b.png) pair per prompt."""
    _png(root / "a.png", GREY_A)
    _png(root / "b.png", GREY_B)
    _jsonl(root / "pairs.jsonl", [{"prompt": p, "chosen": "a.png", "rejected": "b.png"} for p in prompts])
    return root


def _message(info: pytest.ExceptionInfo) -> str:
    return str(info.value)


# ---------------------------------------------------------------------------------------------- JSON-lines reading
def test_blank_lines_are_skipped_not_the_end_and_a_bom_is_accepted(tmp_path):
    """_lines skips blank lines (the lines after them are still read, with their own numbers) and reads the file
    as utf-8-sig, so a byte-order mark before the first object is not a JSON error."""
    _labelled(tmp_path, [])
    rows = [{"prompt": "first", "chosen": "a.png", "rejected": "b.png"},
            {"prompt": "second", "chosen": "b.png", "rejected": "a.png"}]
    (tmp_path / "pairs.jsonl").write_text("\ufeff" + json.dumps(rows[0]) + "\n\n   \n" + json.dumps(rows[1]) + "\n",
                                          encoding="utf-8")
    pairs = load_pair_set(tmp_path)
    assert [(p.prompt, p.chosen, p.rejected, p.where) for p in pairs] == [
        ("first", "a.png", "b.png", "pairs.jsonl line 1"), ("second", "b.png", "a.png", "pairs.jsonl line 4")]
    assert all(math.isnan(p.margin) for p in pairs)


@pytest.mark.parametrize("layout", ["pairs", "scores"])
def test_missing_key_error_shows_a_valid_example_line(tmp_path, layout):
    """A line missing a key is refused with the expected form: the example after "expected" is itself a valid line
    of that file (a JSON object with exactly the file's keys)."""
    _png(tmp_path / "a.png", GREY_A)
    if layout == "pairs":
        keys, name, row = {"prompt", "chosen", "rejected"}, "pairs.jsonl", {"prompt": "p", "chosen": "a.png"}
    else:
        keys, name, row = {"file", "prompt", "score"}, "scores.jsonl", {"file": "a.png", "prompt": "p"}
    _jsonl(tmp_path / name, [row])
    with pytest.raises(ValueError, match="line 1: missing key") as info:
        load_pair_set(tmp_path)
    example = json.loads(_message(info).rsplit("expected ", 1)[1])
    assert isinstance(example, dict) and set(example) == keys
    if layout == "scores":
        assert isinstance(example["score"], float) and isinstance(example["file"], str)


# ---------------------------------------------------------------------------------------------- errors name the line
def test_labelled_line_errors_name_the_file_line_and_key(tmp_path):
    """pairs.jsonl errors start with the file (repr) and line, and name the member ('chosen' / 'rejected'); a
    non-string or blank path and a non-string or blank prompt are ValueErrors, a missing file FileNotFoundError."""
    _labelled(tmp_path, [])
    path = tmp_path / "pairs.jsonl"
    head = re.escape(f"{str(path)!r} line 2: ")
    ok = {"prompt": "p", "chosen": "a.png", "rejected": "b.png"}
    cases = [({"chosen": 5}, ValueError, "'chosen' must be a file path"),
             ({"chosen": "  "}, ValueError, "'chosen' must be a file path"),
             ({"rejected": ""}, ValueError, "'rejected' must be a file path"),
             ({"chosen": "nope.png"}, FileNotFoundError, "chosen file "),
             ({"rejected": "nope.png"}, FileNotFoundError, "rejected file "),
             ({"prompt": "   "}, ValueError, "'prompt' must be a non-empty string"),
             ({"prompt": 3}, ValueError, "'prompt' must be a non-empty string")]
    for change, err, text in cases:
        _jsonl(path, [ok, {**ok, **change}])
        with pytest.raises(err, match=head + re.escape(text)):
            load_pair_set(tmp_path)
    _jsonl(path, [{**ok, "prompt": "  padded  "}])
    assert load_pair_set(tmp_path)[0].prompt == "padded"


def test_scored_line_errors_name_the_file_line_and_key(tmp_path):
    """scores.jsonl errors start with the file (repr) and line: a bad 'file', a file listed again (naming the first
    line), a blank prompt, and a score that is a bool or a string (only numbers and null are scores)."""
    for name in "abc":
        _png(tmp_path / f"{name}.png", GREY_A)
    path = tmp_path / "scores.jsonl"
    first = {"file": "a.png", "prompt": "p", "score": 0.1}
    cases = [({"file": 7}, ValueError, "line 2: 'file' must be a file path"),
             ({"file": " "}, ValueError, "line 2: 'file' must be a file path"),
             ({"file": "missing.png"}, FileNotFoundError, "line 2: file file "),
             ({"prompt": ""}, ValueError, "line 2: 'prompt' must be a non-empty string"),
             ({"score": True}, ValueError, "line 2: 'score' must be a number or null"),
             ({"score": "0.5"}, ValueError, "line 2: 'score' must be a number or null")]
    for change, err, text in cases:
        _jsonl(path, [first, {"file": "b.png", "prompt": "p", "score": 0.2, **change}])
        with pytest.raises(err, match=re.escape(f"{str(path)!r} {text}")):
            load_pair_set(tmp_path)
    _jsonl(path, [first, {"file": "b.png", "prompt": "p", "score": 0.2}, {"file": "a.png", "prompt": "p", "score": 1}])
    with pytest.raises(ValueError, match=re.escape(f"{str(path)!r} line 3: 'a.png' is listed again (first on line 1)")):
        load_pair_set(tmp_path)


def test_backslash_paths_are_read_as_posix_paths(tmp_path):
    """A Windows-style relative path ("sub\\a.png") names the file sub/a.png and is returned with "/" separators,
    in both layouts."""
    _png(tmp_path / "sub" / "a.png", GREY_A)
    _png(tmp_path / "b.png", GREY_B)
    _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "sub\\a.png", "rejected": "b.png"}])
    assert [(p.chosen, p.rejected) for p in load_pair_set(tmp_path)] == [("sub/a.png", "b.png")]
    (tmp_path / "pairs.jsonl").unlink()
    _jsonl(tmp_path / "scores.jsonl", [{"file": "sub\\a.png", "prompt": "p", "score": 2.0},
                                       {"file": "b.png", "prompt": "p", "score": 1.0}])
    assert [(p.chosen, p.rejected) for p in load_pair_set(tmp_path)] == [("sub/a.png", "b.png")]


# ---------------------------------------------------------------------------------------------- load_pair_set
def test_load_pair_set_sources_and_option_checks(tmp_path):
    """source "pairs" / "scores" read that file when both are present; a bad source, pairs or tie alone (the other
    two valid) is refused by the option check."""
    _labelled(tmp_path, ["labelled"])
    _jsonl(tmp_path / "scores.jsonl", [{"file": "a.png", "prompt": "scored", "score": 0.0},
                                       {"file": "b.png", "prompt": "scored", "score": 1.0}])
    labelled = load_pair_set(tmp_path, source="pairs")
    assert [(p.prompt, p.where) for p in labelled] == [("labelled", "pairs.jsonl line 1")]
    got = load_pair_set(tmp_path, source="scores")
    assert [(p.prompt, p.chosen, p.rejected, p.margin) for p in got] == [("scored", "b.png", "a.png", 1.0)]
    for bad in (dict(source="both"), dict(source="scores", pairs="best"), dict(source="scores", tie="never")):
        with pytest.raises(ValueError, match="^need source auto"):
            load_pair_set(tmp_path, **bad)


def test_scores_are_compared_in_float64_and_pairs_say_where_they_came_from(tmp_path):
    """Scores that differ only below float32 resolution (1 and 1 + 2**-30) are still ordered (a float32 copy would
    tie them and tie: skip would drop the pair); the pair's margin is the exact difference and its `where` names both
    lines of scores.jsonl (chosen first)."""
    _png(tmp_path / "a.png", GREY_A)
    _png(tmp_path / "b.png", GREY_B)
    _jsonl(tmp_path / "scores.jsonl", [{"file": "a.png", "prompt": "p", "score": 1.0},
                                       {"file": "b.png", "prompt": "p", "score": 1.0 + 2**-30}])
    assert load_pair_set(tmp_path) == [PreferencePair("p", "b.png", "a.png", 2**-30, "scores.jsonl lines 2 / 1")]


# ---------------------------------------------------------------------------------------------- PairStream
def test_pair_stream_defaults_are_seed_0_shuffled_rank_0_of_1(tmp_path):
    """PairStream's defaults (seed 0, shuffle, rank 0, world size 1) give exactly the batches of those explicit
    arguments: the whole global batch, in seed 0's per-epoch permutation."""
    prompts = [f"p{j}" for j in range(5)]
    folder = _labelled(tmp_path, prompts)
    pairs = load_pair_set(folder)

    def order(**kw) -> list[list[int]]:
        s = PairStream(folder, pairs, 2, **kw)
        return [s.batch(b)["pair"].tolist() for b in range(5)]

    explicit = order(seed=0, shuffle=True, rank=0, world_size=1)
    assert explicit != order(seed=1) and explicit != order(shuffle=False)  # the defaults are observable
    assert order() == explicit
    assert sorted(j for b in explicit for j in b) == sorted(list(range(5)) * 2)


def test_pair_stream_batch_fields_and_dtypes(tmp_path):
    """A batch carries both members' files and pixels, the pair numbers as int64 and the margins as float32, also
    under a float64 default dtype (the documented batch format)."""
    for name, level in zip("abcd", (10, 90, 170, 250), strict=True):
        _png(tmp_path / f"{name}.png", np.full((2, 2, 3), level, dtype=np.uint8))
    _jsonl(tmp_path / "scores.jsonl", [{"file": "a.png", "prompt": "p", "score": 0.25},
                                       {"file": "b.png", "prompt": "p", "score": 0.75},
                                       {"file": "c.png", "prompt": "q", "score": 1.0},
                                       {"file": "d.png", "prompt": "q", "score": 0.0}])
    stream = PairStream(tmp_path, load_pair_set(tmp_path), 2, shuffle=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b = stream.batch(0)
    finally:
        torch.set_default_dtype(old)
    assert b["prompts"] == ["p", "q"] and b["index"].tolist() == [0, 1]
    assert b["chosen_file"] == ["b.png", "c.png"] and b["rejected_file"] == ["a.png", "d.png"]
    assert b["pair"].dtype == torch.int64 and b["pair"].tolist() == [0, 1]
    assert b["margin"].dtype == torch.float32 and b["margin"].tolist() == [0.5, 1.0]
    assert b["chosen"].shape == b["rejected"].shape == (2, 1, 3, 2, 2) and b["chosen"].dtype == torch.float32
    levels = [round(float(x.mean()) * 255) for x in (*b["chosen"], *b["rejected"])]
    assert levels == [90, 170, 10, 250]


def test_read_image_channels_scale_and_modes(tmp_path):
    """An image file (suffix matched case-insensitively) is read as float32 [1, 3, H, W] = its RGB bytes / 255 in
    (channel, row, column) order; a grey (L) image gives three equal channels and RGBA drops the alpha."""
    rgb = np.array([[[0, 128, 255], [10, 20, 30], [255, 255, 255]],
                    [[1, 2, 3], [40, 50, 60], [7, 8, 9]]], dtype=np.uint8)  # H = 2, W = 3
    grey = np.array([[0, 100, 255], [30, 60, 90]], dtype=np.uint8)
    rgba = np.concatenate([rgb, np.array([[[0], [80], [255]], [[1], [2], [3]]], dtype=np.uint8)], axis=-1)
    _png(tmp_path / "rgb.PNG", rgb)
    _png(tmp_path / "grey.png", grey)
    _png(tmp_path / "rgba.png", rgba)
    stream = PairStream(tmp_path, [PreferencePair("p", "rgb.PNG", "grey.png", math.nan, "x")], 1)
    expect = torch.from_numpy(rgb).double().permute(2, 0, 1)[None] / 255
    for name, ref in (("rgb.PNG", expect), ("rgba.png", expect),
                      ("grey.png", torch.from_numpy(grey).double()[None, None].expand(1, 3, 2, 3) / 255)):
        got = stream.read(name)
        assert got.dtype == torch.float32 and got.shape == (1, 3, 2, 3), name
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-7)
    got = stream.read("rgb.PNG")
    assert float(got[0, 2, 0, 0]) == 1.0 and float(got[0, 0, 0, 0]) == 0.0  # 255 -> exactly 1, 0 -> exactly 0


def test_read_image_resizes_to_height_width_and_clamps_to_unit_range(tmp_path):
    """With height / width an image is resized and center-cropped to that size and clamped to [0, 1]: a white 2x7
    image read at 1x6 is exactly 1 everywhere (antialiased bilinear overshoots 1 by an ulp there), a black one exactly
    0; an exact 2x shrink is a box average; without a size the image keeps its own."""
    white, black = np.full((2, 7, 3), 255, dtype=np.uint8), np.zeros((2, 7, 3), dtype=np.uint8)
    halves = np.zeros((2, 8, 3), dtype=np.uint8)
    halves[:, 4:] = 255
    for name, pixels in (("white.png", white), ("black.png", black), ("halves.png", halves)):
        _png(tmp_path / name, pixels)
    pair = [PreferencePair("p", "white.png", "black.png", math.nan, "x")]
    small = PairStream(tmp_path, pair, 1, height=1, width=6)
    w, k = small.read("white.png"), small.read("black.png")
    assert w.shape == k.shape == (1, 3, 1, 6)
    assert bool((w == 1.0).all()) and bool((k == 0.0).all())
    box = PairStream(tmp_path, pair, 1, height=1, width=4).read("halves.png")
    assert box.tolist() == [[[[0.0, 0.0, 1.0, 1.0]]] * 3]
    own = PairStream(tmp_path, pair, 1).read("white.png")
    assert own.shape == (1, 3, 2, 7) and bool((own == 1.0).all())


def test_videos_are_read_at_num_frames_and_fps(tmp_path):
    """The data module's num_frames and fps reach the reader: two frames at 4 fps of an 8 fps clip are its frames 0
    and 2 (not 0 and 1), for both members of the batch."""
    pytest.importorskip("decord")
    from genrl.data.video_io import write_video

    levels = {"up.mp4": (0, 60, 120, 180), "down.mp4": (180, 120, 60, 0)}
    for name, lv in levels.items():
        write_video(tmp_path / name, torch.stack([torch.full((3, 16, 16), v / 255) for v in lv]), fps=8)
    _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "up.mp4", "rejected": "down.mp4"}])
    dm = PreferencePairDataModule(str(tmp_path), num_frames=2, fps=4.0, height=16, width=16, batch_size=1,
                                  shuffle=False, val=None)
    b = next(iter(dm.make_train_loader()))
    assert b["chosen"].shape == b["rejected"].shape == (1, 2, 3, 16, 16)
    got = [[float(f.mean()) * 255 for f in b[k][0]] for k in ("chosen", "rejected")]
    for g, want in zip(got, ([0, 120], [180, 60]), strict=True):
        assert g == pytest.approx(want, abs=4), got


# ---------------------------------------------------------------------------------------------- the data module
@pytest.mark.parametrize(("name", "low", "optional"), [
    ("batch_size", 1, False), ("val_size", 0, False), ("num_workers", 0, False),
    ("num_frames", 1, True), ("height", 1, True), ("width", 1, True), ("val_batch_size", 1, True)])
def test_int_arguments_are_checked_by_name_with_inclusive_bounds(name, low, optional):
    """Each int argument is refused below its bound (and as a bool or a float) with a message starting with its
    name, and accepted at the bound; the optional ones (None allowed) are checked too when given."""
    pair = {"height": "width", "width": "height"}

    def make(value):
        kw = {name: value}
        if name in pair:
            kw[pair[name]] = 4
        return PreferencePairDataModule("unused", **kw)

    for bad in (low - 1, True, float(low + 1)):
        with pytest.raises(ValueError, match=f"^{name} must be an int >= {low}{' or null' if optional else ''}, got"):
            make(bad)
    assert make(low).hparams[name] == low


def test_fps_range_and_option_names_at_construction():
    """fps must be > 0 (0 refused, 0.5 accepted) and needs num_frames; source "pairs" / "scores" and pairs "all"
    are accepted, and a bad source alone is refused at construction."""
    ok = PreferencePairDataModule("unused", fps=0.5, num_frames=2)
    assert ok.hparams.fps == 0.5
    assert PreferencePairDataModule("unused", fps=8.0, num_frames=2).hparams.fps == 8.0
    for bad in (dict(fps=0.0, num_frames=2), dict(fps=-1.0, num_frames=2), dict(fps=8.0)):
        with pytest.raises(ValueError, match="^fps must be > 0"):
            PreferencePairDataModule("unused", **bad)
    for good in (dict(source="pairs"), dict(source="scores"), dict(pairs="all"), dict(tie="arbitrary")):
        assert PreferencePairDataModule("unused", **good).hparams[next(iter(good))] == next(iter(good.values()))
    for bad in (dict(source="both"), dict(pairs="best"), dict(tie="never")):
        with pytest.raises(ValueError, match="^need source auto"):
            PreferencePairDataModule("unused", **bad)


def test_defaults_read_runs_pairs_shapes_in_batches_of_8_with_64_val_prompts(tmp_path, monkeypatch):
    """With no arguments the module reads runs/pairs/shapes (benchmarks/make_pair_folder.py's default output),
    batches 8 pairs in seed 0's shuffled order with no worker process, and validates on the first 64 distinct pair
    prompts in batches of 8."""
    monkeypatch.chdir(tmp_path)
    prompts = [f"prompt {j:02d}" for j in range(65)]
    _labelled(tmp_path / "runs" / "pairs" / "shapes", prompts)
    dm = PreferencePairDataModule()
    assert len(dm.pair_set) == 65
    loader = dm.make_train_loader()
    assert loader.num_workers == 0 and dm.hparams.num_workers == 0
    first = next(iter(loader))["pair"].tolist()

    def first_batch(seed: int) -> list[int]:
        return next(iter(PreferencePairDataModule(seed=seed).make_train_loader()))["pair"].tolist()

    assert first_batch(0) != first_batch(1)
    assert len(first) == 8 and first == first_batch(0)
    val = dm.val_batches()
    assert [len(v["prompts"]) for v in val] == [8] * 8
    assert [p for v in val for p in v["prompts"]] == prompts[:64]


def test_world_is_kept_saved_and_used_for_shapes_validation(tmp_path):
    """The given world is the module's .world, saved in hparams as a dict that rebuilds the same module (a
    checkpoint's datamodule hyperparameters), and is the world of a "shapes:*" validation source; the
    hyperparameters handed to the loggers hold no ShapesWorldConfig object."""
    world = ShapesWorldConfig(colors=["red"], shapes=["circle"], directions=["left", "right"])
    folder = _labelled(tmp_path, ["p"])
    dm = PreferencePairDataModule(str(folder), world=world, val="shapes:all", val_batch_size=64)
    assert dm.world == world and dm.hparams["world"] == asdict(world)
    assert PreferencePairDataModule(**dict(dm.hparams)).world == world
    # the hyperparameters as collected for the loggers (hparams_initial) hold no ShapesWorldConfig object
    assert not any(is_dataclass(v) for v in dm.hparams_initial.values())
    got = [p for v in dm.val_batches() for p in v["prompts"]]
    want = [r.prompt for r in load_prompts("shapes:all", world=world)][:64]
    assert got == want and len(got) > 0 and all("red circle" in p for p in got)


def test_validation_sources_sizes_and_loader_order(tmp_path):
    """val None or val_size 0 give no validation batch ([]); val_size 1 one prompt; a prompt file is read with
    prompt_key; the validation loader yields val_batches() as they are (no collation), in order."""
    folder = _labelled(tmp_path / "f", [f"p{j}" for j in range(8)])

    def dm(**kw):
        return PreferencePairDataModule(str(folder), **kw)

    assert dm(val=None).val_batches() == [] and dm(val_size=0).val_batches() == []
    assert [v["prompts"] for v in dm(val_size=1).val_batches()] == [["p0"]]
    prompts = _jsonl(tmp_path / "val.jsonl", [{"caption": "x0"}, {"caption": "x1"}])
    assert [v["prompts"] for v in dm(val=str(prompts), prompt_key="caption").val_batches()] == [["x0", "x1"]]
    one = dm(val_batch_size=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        got = list(one.val_dataloader())
    want = one.val_batches()
    assert [g["prompts"] for g in got] == [[f"p{j}"] for j in range(8)] == [w["prompts"] for w in want]
    assert [g["index"].tolist() for g in got] == [[-(j + 1)] for j in range(8)]


def test_train_loader_counts_yielded_batches_unless_tracking_delivery(tmp_path):
    """make_train_loader counts yielded batches by default and only delivered ones (mark_delivered) with
    track_delivery=True; it starts at local batch `start` and passes num_workers on."""
    folder = _labelled(tmp_path, [f"p{j}" for j in range(4)])
    dm = PreferencePairDataModule(str(folder), batch_size=1, shuffle=False, val=None)
    plain = dm.make_train_loader()
    next(iter(plain))
    assert plain.state_dict() == {"batches_consumed": 1}
    tracked = dm.make_train_loader(track_delivery=True)
    b = next(iter(tracked))
    assert tracked.state_dict() == {"batches_consumed": 0}
    tracked.mark_delivered(b)
    assert tracked.state_dict() == {"batches_consumed": 1}
    assert next(iter(dm.make_train_loader(start=3)))["index"].tolist() == [3]
    assert PreferencePairDataModule(str(folder), num_workers=1).make_train_loader().num_workers == 1
