"""Contracts of the video-folder DataModule (issue 51, mutation survivors of genrl/data/video_folder.py).

Fast unit tests that call each piece directly on tiny folders: the extension normalisation, the argument checks and
defaults of ``VideoFolderDataModule``, the recursive scan (hidden entries, symlinked folders), the caption lookup
(sidecar, JSON-lines index, UTF-8 whatever the locale), the line numbers of index errors, ``skip_bad``'s probe at the
requested rate, the seeded train / validation split, and the two dataloaders (batch size, seeded shuffle, validation in
file order with the same clip parameters). Setup-only tests use placeholder files (nothing is decoded before loading);
the loader tests use 8-frame 16x16 clips written with ``write_video``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from locale_util import ascii_locale
from torch.utils.data import DataLoader

from genrl.data.video_folder import (
    DEFAULT_VIDEO_EXTENSIONS,
    VideoFolderDataModule,
    VideoFolderDataset,
    _normalise_extensions,
)
from genrl.data.video_io import read_video, write_video

NUM_CLIPS = 8


def _placeholders(root: Path, names: list[str]) -> list[Path]:
    """Create files with the given relative names (not decodable: setup() never decodes without skip_bad)."""
    out = []
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not decoded before loading")
        out.append(path)
    return out


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    """NUM_CLIPS real clips clip0.mp4 ... (8 frames at 8 fps, 16x16, content differs per clip and frame), each with
    a sidecar caption "caption i"."""
    root = tmp_path_factory.mktemp("clips")
    for i in range(NUM_CLIPS):
        frames = torch.zeros(8, 3, 16, 16)
        for t in range(8):
            frames[t, 0] = (i + 1) / (NUM_CLIPS + 1)
            frames[t, 1, :, : 2 * t + 1] = 1.0
        write_video(root / f"clip{i}.mp4", frames, fps=8)
        (root / f"clip{i}.txt").write_text(f"caption {i}\n")
    return root




# --------------------------------------------------------------------------- extensions


def test_normalise_extensions_lowercases_adds_dot_skips_blanks_and_dedupes():
    """A single string is one suffix; each suffix is stripped, lower-cased and given a leading dot; blanks are
    skipped (not the end of the list); duplicates are dropped in first-seen order; nothing left is an error."""
    assert _normalise_extensions("MP4") == (".mp4",)
    assert _normalise_extensions(".WebM") == (".webm",)
    assert _normalise_extensions([" WebM ", "", ".MP4", "mp4", "  ", "mkv"]) == (".webm", ".mp4", ".mkv")
    with pytest.raises(ValueError, match="at least one file suffix"):
        _normalise_extensions(["", " "])
    dm = VideoFolderDataModule("unused", extensions="MOV")
    assert dm.extensions == (".mov",)


# --------------------------------------------------------------------------- __init__


def test_init_defaults_and_unset_datasets():
    """The documented defaults (num_frames 16, 64x64, batch 4, seed 0, ...) and no dataset before setup()."""
    dm = VideoFolderDataModule("unused")
    assert (dm.num_frames, dm.fps, dm.height, dm.width) == (16, None, 64, 64)
    assert (dm.batch_size, dm.num_workers, dm.seed) == (4, 0, 0)
    assert (dm.caption_ext, dm.default_caption, dm.extensions) == (".txt", None, DEFAULT_VIDEO_EXTENSIONS)
    assert (dm.val_fraction, dm.start, dm.skip_bad) == (0.0, 0.0, False)
    assert dm.train_dataset is None
    assert dm.val_dataset is None
    ds = VideoFolderDataset([("a.mp4", "a")], 2, None, (4, 4))
    assert ds.start == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_frames": 0}, r"^num_frames must be an int >= 1, got 0$"),
        ({"num_frames": 2.0}, r"^num_frames must be an int >= 1, got 2\.0$"),
        ({"num_frames": True}, r"^num_frames must be an int >= 1, got True$"),
        ({"height": 0}, r"^height must be an int >= 1, got 0$"),
        ({"width": 0}, r"^width must be an int >= 1, got 0$"),
        ({"batch_size": 0}, r"^batch_size must be an int >= 1, got 0$"),
        ({"batch_size": 2.0}, r"^batch_size must be an int >= 1"),
        ({"num_workers": -1}, r"^num_workers must be an int >= 0, got -1$"),
        ({"fps": 0}, r"^fps must be > 0"),
        ({"fps": -2.0}, r"^fps must be > 0"),
        ({"val_fraction": 1.0}, r"^val_fraction must be in \[0, 1\)"),
        ({"val_fraction": 1.5}, r"^val_fraction must be in \[0, 1\)"),
        ({"val_fraction": -0.1}, r"^val_fraction must be in \[0, 1\)"),
        ({"start": -0.5}, r"^start must be >= 0"),
    ],
)
def test_init_rejects_out_of_range_naming_the_argument(kwargs, message):
    """Each out-of-range argument (including a bool or a float where an int is required) is a ValueError whose
    message starts with the argument's name and its bound."""
    with pytest.raises(ValueError, match=message):
        VideoFolderDataModule("unused", **kwargs)


def test_init_accepts_the_boundary_values():
    """The smallest legal values are accepted and stored: 1 frame of 1x1, batch 1, 0 workers, any fps > 0 (also
    below 1), val_fraction 0 and just below 1, start 0."""
    dm = VideoFolderDataModule("unused", num_frames=1, height=1, width=1, batch_size=1, num_workers=0, fps=0.5,
                               val_fraction=0.99, start=0)
    assert (dm.num_frames, dm.height, dm.width, dm.batch_size, dm.num_workers) == (1, 1, 1, 1, 0)
    assert (dm.fps, dm.val_fraction, dm.start) == (0.5, 0.99, 0.0)
    assert VideoFolderDataModule("unused", fps=1e-3, val_fraction=0.0).fps == 1e-3


def test_caption_ext_without_dot_gets_one(tmp_path):
    """caption_ext "md" means ".md": clip.mp4's caption is read from clip.md (a dotted caption_ext is kept)."""
    _placeholders(tmp_path, ["clip.mp4"])
    (tmp_path / "clip.md").write_text("  from clip.md\n")
    (tmp_path / "clip.txt").write_text("from clip.txt")
    assert VideoFolderDataModule(str(tmp_path), caption_ext=".md").caption_ext == ".md"
    dm = VideoFolderDataModule(str(tmp_path), caption_ext="md")
    assert dm.caption_ext == ".md"
    dm.setup()
    assert dm.train_dataset.samples == [(str(tmp_path / "clip.mp4"), "from clip.md")]


# --------------------------------------------------------------------------- scan


def test_find_videos_skips_hidden_entries_and_follows_symlinked_folders(tmp_path):
    """The scan is recursive, matches suffixes case-insensitively, ignores hidden files and hidden folders, follows
    a symlinked folder, and returns the paths sorted."""
    root = tmp_path / "root"
    _placeholders(root, ["b.mp4", ".hidden.mp4", ".cache/in_hidden_dir.mp4", "sub/c.MP4", "sub/notes.txt",
                         "a.webm"])
    outside = tmp_path / "outside"
    _placeholders(outside, ["linked_clip.mp4"])
    (root / "linked").symlink_to(outside, target_is_directory=True)
    dm = VideoFolderDataModule(str(root))
    found = dm._find_videos(root)
    assert found == [root / "a.webm", root / "b.mp4", root / "linked" / "linked_clip.mp4", root / "sub" / "c.MP4"]
    assert VideoFolderDataModule(str(root), extensions=["webm"])._find_videos(root) == [root / "a.webm"]


# --------------------------------------------------------------------------- captions


def test_caption_index_keys_blank_lines_and_priority(tmp_path):
    """captions.jsonl / metadata.jsonl: blank lines are skipped (later lines still read), "file_name" stands in for
    "file", "\\" separators and "./" are normalised to the scan's keys, and captions.jsonl wins over metadata.jsonl."""
    lines = [
        "",
        json.dumps({"file_name": "sub/b.mp4", "caption": "B via file_name"}),
        "   ",
        json.dumps({"file": "sub\\c.mp4", "caption": "C with a backslash"}),
        json.dumps({"file": "./a.mp4", "caption": "A from captions"}),
        "",
    ]
    (tmp_path / "captions.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    meta = [{"file": "a.mp4", "caption": "A loses"}, {"file": "d.mp4", "caption": "D from metadata"}]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(x) for x in meta) + "\n", encoding="utf-8")
    index = VideoFolderDataModule._read_caption_index(tmp_path)
    assert index == {"sub/b.mp4": "B via file_name", "sub/c.mp4": "C with a backslash", "a.mp4": "A from captions",
                     "d.mp4": "D from metadata"}

    _placeholders(tmp_path, ["a.mp4", "d.mp4", "sub/b.mp4", "sub/c.mp4"])
    dm = VideoFolderDataModule(str(tmp_path))
    dm.setup()
    got = {Path(p).relative_to(tmp_path).as_posix(): c for p, c in dm.train_dataset.samples}
    assert got == index


@pytest.mark.parametrize(
    ("third_line", "message"),
    [
        ("not json", r"captions\.jsonl' line 3: expected a JSON object"),
        ('["a list"]', r"captions\.jsonl' line 3: expected a JSON object"),
        ('{"file": "x.mp4"}', r"captions\.jsonl' line 3: expected a JSON object"),
        ('{"file": "x.mp4", "caption": 3}', r"captions\.jsonl' line 3: 'file' \(or 'file_name'\) and 'caption'"),
        ('{"file": 3, "caption": "x"}', r"captions\.jsonl' line 3: 'file' \(or 'file_name'\) and 'caption'"),
        ('{"caption": "no file key"}', r"captions\.jsonl' line 3: 'file' \(or 'file_name'\) and 'caption'"),
    ],
)
def test_caption_index_errors_give_the_one_based_line(tmp_path, third_line, message):
    """A malformed line, or a non-string file or caption (either one), is a ValueError naming the index file and
    the 1-based line number (blank lines count)."""
    good = json.dumps({"file": "a.mp4", "caption": "a"})
    (tmp_path / "captions.jsonl").write_text(f"{good}\n\n{third_line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        VideoFolderDataModule._read_caption_index(tmp_path)


def test_captions_are_read_as_utf8_whatever_the_locale(tmp_path):
    """Sidecar captions and caption indexes are decoded as UTF-8 even when the locale's encoding is ASCII."""
    _placeholders(tmp_path, ["side.mp4", "indexed.mp4"])
    (tmp_path / "side.txt").write_bytes("  café, naïve ✓ \n".encode())
    (tmp_path / "captions.jsonl").write_bytes(
        json.dumps({"file": "indexed.mp4", "caption": "über 🎥"}, ensure_ascii=False).encode() + b"\n")
    (tmp_path / "metadata.jsonl").write_bytes(
        json.dumps({"file": "other.mp4", "caption": "ñ"}, ensure_ascii=False).encode() + b"\n")
    with ascii_locale():
        with pytest.raises(UnicodeDecodeError):  # the locale default really is not UTF-8 here
            (tmp_path / "side.txt").read_text()
        dm = VideoFolderDataModule(str(tmp_path))
        dm.setup()
        index = VideoFolderDataModule._read_caption_index(tmp_path)
    assert dict((Path(p).name, c) for p, c in dm.train_dataset.samples) == {"indexed.mp4": "über 🎥",
                                                                            "side.mp4": "café, naïve ✓"}
    assert index == {"indexed.mp4": "über 🎥", "other.mp4": "ñ"}


# --------------------------------------------------------------------------- skip_bad and split


def test_skip_bad_probes_at_the_requested_fps(tmp_path):
    """skip_bad checks each file against the clip actually requested: 4 frames at 2 fps span 1.5 s, so an 8-frame
    clip at 8 fps (1 s) is dropped while a 16-frame one (2 s) is kept; at the native rate both are long enough."""
    write_video(tmp_path / "short.mp4", torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0)), fps=8)
    write_video(tmp_path / "long.mp4", torch.rand(16, 3, 16, 16, generator=torch.Generator().manual_seed(1)), fps=8)
    dm = VideoFolderDataModule(str(tmp_path), num_frames=4, fps=2.0, default_caption="c", skip_bad=True)
    dm.setup()
    assert [Path(p).name for p, _ in dm.train_dataset.samples] == ["long.mp4"]
    native = VideoFolderDataModule(str(tmp_path), num_frames=4, fps=None, default_caption="c", skip_bad=True)
    native.setup()
    assert [Path(p).name for p, _ in native.train_dataset.samples] == ["long.mp4", "short.mp4"]


def test_split_that_leaves_no_training_video_is_an_error(tmp_path):
    """val_fraction > 0 holds out max(1, round(n * val_fraction)) videos; holding out all n is a ValueError."""
    _placeholders(tmp_path / "one", ["a.mp4"])
    with pytest.raises(ValueError, match="holds out 1 of 1 videos"):
        VideoFolderDataModule(str(tmp_path / "one"), default_caption="c", val_fraction=0.5).setup()
    _placeholders(tmp_path / "two", ["a.mp4", "b.mp4"])
    with pytest.raises(ValueError, match="holds out 2 of 2 videos"):
        VideoFolderDataModule(str(tmp_path / "two"), default_caption="c", val_fraction=0.75).setup()
    dm = VideoFolderDataModule(str(tmp_path / "two"), default_caption="c", val_fraction=0.5)
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (1, 1)


def test_split_is_seeded_and_ignores_the_global_rng(tmp_path):
    """The held-out set is the first n_val of torch.randperm(n) under a Generator seeded with `seed` (whatever the
    global RNG), both sides keep file order, they partition the videos, and another seed gives another split."""
    files = [str(p) for p in _placeholders(tmp_path, [f"v{i:02d}.mp4" for i in range(10)])]
    order = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
    want_val = [f for i, f in enumerate(files) if i in set(order[:3])]
    want_train = [f for i, f in enumerate(files) if i not in set(order[:3])]
    for global_seed in (0, 1):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(global_seed)
            dm = VideoFolderDataModule(str(tmp_path), default_caption="c", val_fraction=0.3, seed=7)
            dm.setup()
        assert [p for p, _ in dm.val_dataset.samples] == want_val
        assert [p for p, _ in dm.train_dataset.samples] == want_train
    other = VideoFolderDataModule(str(tmp_path), default_caption="c", val_fraction=0.3, seed=10)
    other.setup()
    assert [Path(p).name for p, _ in other.val_dataset.samples] == ["v04.mp4", "v06.mp4", "v07.mp4"]
    assert sorted(p for p, _ in other.val_dataset.samples + other.train_dataset.samples) == files


# --------------------------------------------------------------------------- dataloaders


def test_train_loader_batch_size_and_seeded_shuffle(clip_dir):
    """train_dataloader() batches `batch_size` clips, shuffled in the order of a DataLoader seeded with `seed`
    (whatever the global RNG), with each clip's caption and decoded pixels."""
    files = sorted(str(p) for p in clip_dir.glob("*.mp4"))
    ref = DataLoader(range(NUM_CLIPS), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3))
    want = [i for batch in ref for i in batch.tolist()]
    assert want != list(range(NUM_CLIPS))
    dm = VideoFolderDataModule(str(clip_dir), num_frames=2, height=8, width=8, batch_size=3, seed=3)
    for global_seed in (0, 1):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(global_seed)
            batches = list(dm.train_dataloader())
        assert [tuple(b["pixels"].shape) for b in batches] == [(3, 2, 3, 8, 8)] * 2 + [(2, 2, 3, 8, 8)]
        paths = [p for b in batches for p in b["path"]]
        assert paths == [files[i] for i in want]
    prompts = [c for b in batches for c in b["prompts"]]
    assert prompts == [f"caption {Path(p).stem[len('clip'):]}" for p in paths]
    torch.testing.assert_close(batches[0]["pixels"][1], read_video(paths[1], 2, size=(8, 8)))
    assert dm.train_dataloader().num_workers == 0
    assert VideoFolderDataModule(str(clip_dir), num_workers=2).train_dataloader().num_workers == 2


def test_val_loader_in_file_order_with_the_train_clip_parameters(clip_dir):
    """val_dataloader() yields the held-out clips in file order (not shuffled), batched, decoded with the same
    num_frames, fps, size and start as training; with no held-out clip it is []."""
    dm = VideoFolderDataModule(str(clip_dir), num_frames=3, fps=4.0, height=8, width=12, batch_size=3,
                               val_fraction=0.5, seed=0, start=0.25)
    dm.setup()
    for ds in (dm.train_dataset, dm.val_dataset):
        assert (ds.num_frames, ds.fps, ds.size, ds.start) == (3, 4.0, (8, 12), 0.25)
    val_paths = [p for p, _ in dm.val_dataset.samples]
    assert len(val_paths) == NUM_CLIPS // 2 and val_paths == sorted(val_paths)
    batches = list(dm.val_dataloader())
    assert [p for b in batches for p in b["path"]] == val_paths
    assert [tuple(b["pixels"].shape) for b in batches] == [(3, 3, 3, 8, 12), (1, 3, 3, 8, 12)]
    for k, path in enumerate(val_paths):
        want = read_video(path, 3, fps=4.0, start=0.25, size=(8, 12))
        torch.testing.assert_close(batches[k // 3]["pixels"][k % 3], want)
    assert VideoFolderDataModule(str(clip_dir), num_frames=2).val_dataloader() == []
