"""pipelines/continue_video.py: history-conditioned continuation and long rollouts from the command line.

The written videos are exactly ``history_rollout``'s at the same (seed, index) addresses with the rule the flags
declare (one batch or several), the given history frames come back unchanged, the manifest records the rule and its
cost, each flag changes what it should and nothing else, and bad input is refused before the model loads.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from genrl.data.video_io import write_video as real_write  # before the fixture below replaces it

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "assets/shapes-dit")


def _script():
    spec = importlib.util.spec_from_file_location("pipelines_continue_video", ROOT / "pipelines/continue_video.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cont = _script()


@pytest.fixture
def written(monkeypatch):
    """Keep each written video's tensor (an mp4 is lossy) and leave an empty file in its place."""
    import genrl.data.video_io as video_io

    kept: dict[str, torch.Tensor] = {}

    def write_video(path, video, fps):
        kept[Path(path).name] = video.clone()
        Path(path).write_bytes(b"")

    monkeypatch.setattr(video_io, "write_video", write_video)
    return kept


def _reference(prompts, history_pixels, rule, num_frames, steps, seed=0, key_pixels=None, keys=None):
    from genrl.models.loading import load_generator
    from genrl.rollout import RolloutConfig, history_rollout

    gen = load_generator(MODEL).eval()
    with torch.no_grad():
        res = history_rollout(gen, prompts, (3, 16, 16), num_frames, seed, history=gen.encode(history_pixels),
                              guidance=rule, config=RolloutConfig(num_steps=steps, kernel="ode"), window=8,
                              context=4, indices=range(len(prompts)),
                              keyframes=None if key_pixels is None else gen.encode(key_pixels), keyframe_positions=keys)
        return gen.decode(res.video).float().clamp(0, 1), res.calls_per_frame


def test_shapes_history_is_continued_exactly_as_history_rollout_in_any_batching(tmp_path, written):
    from genrl.flow import HistoryGuidance

    argv = ["--model", MODEL, "--history", "shapes:heldout", "--limit", "3", "--history-frames", "4",
            "--num-frames", "12", "--steps", "2", "--batch-size", "2", "--out", str(tmp_path / "a")]
    records = cont.main(argv)  # batches of 2 + 1
    args = cont._parser().parse_args(argv)
    prompts, pixels, sources = cont.history_videos(args)
    assert [r["prompt"] for r in records] == prompts and sources == ["shapes:heldout:wrap"] * 3
    rule = HistoryGuidance("fractional", scale=3.0)  # the flags' defaults: DFoT's k_H 0.4 and stabilization 0.02
    want, calls = _reference(prompts, pixels, rule, 12, 2)
    assert want.shape == (3, 12, 3, 16, 16)
    # other batch sizes: float32 rounding of the matmuls only (up to 1.1e-5 seen with torch 2.14 on an AVX-512 CPU)
    for r, video in zip(records, want, strict=True):
        torch.testing.assert_close(written[r["file"]], video, atol=5e-5, rtol=0)
        torch.testing.assert_close(written[r["file"]][:4], pixels[r["index"]], atol=1e-6, rtol=0)  # history kept
    # 2 windows (each 4 new frames) of 3 views x 2 steps, over 8 generated frames
    assert calls == pytest.approx(2 * 3 * 2 / 8) and records[0]["calls_per_frame"] == pytest.approx(calls)
    lines = [json.loads(x) for x in (tmp_path / "a/manifest.jsonl").read_text().splitlines()]
    assert lines == records and {(r["rule"], r["scale"], round(r["fractional_sigma"], 5), round(r["stabilization"], 5),
                                  r["text_scale"]) for r in lines} == {("fractional", 3.0, 0.42458, 0.04016, 1.0)}


def test_each_flag_changes_what_it_should(tmp_path, written):
    base = ["--model", MODEL, "--history", "shapes:heldout", "--limit", "2", "--history-frames", "4",
            "--num-frames", "12", "--steps", "2"]

    def run(tag, *extra):
        recs = cont.main(base + list(extra) + ["--out", str(tmp_path / tag)])
        return torch.stack([written[r["file"]] for r in recs]), recs

    frac, _ = run("frac")
    cond, rc = run("cond", "--rule", "conditional")
    van, rv = run("van", "--rule", "vanilla", "--scale", "3")
    stab, _ = run("stab", "--stabilization", "0.3")
    seed, _ = run("seed", "--seed", "1")
    assert rc[0]["text_scale"] == 3.0 and rc[0]["calls_per_frame"] == pytest.approx(2 * 2 * 2 / 8)
    assert rv[0]["calls_per_frame"] == pytest.approx(2 * 2 * 2 / 8)
    for other in (cond, van, seed):
        assert float((other[:, 4:] - frac[:, 4:]).abs().max()) > 1e-3
    # stabilization only reaches generated history: the first window (real history) is the same, the second not
    torch.testing.assert_close(stab[:, :8], frac[:, :8], atol=0, rtol=0)
    assert float((stab[:, 8:] - frac[:, 8:]).abs().max()) > 1e-3


def test_keyframes_are_taken_from_the_video_and_kept_in_place(tmp_path, written):
    from genrl.flow import HistoryGuidance

    argv = ["--model", MODEL, "--history", "shapes:heldout", "--limit", "2", "--history-frames", "4",
            "--num-frames", "16", "--steps", "2", "--rule", "conditional", "--keyframes", "15", "14"]
    plain = [written[r["file"]] for r in cont.main(argv[:-3] + ["--out", str(tmp_path / "p")])]
    records = cont.main(argv + ["--out", str(tmp_path / "k")])  # (written is keyed by file name)
    prompts, pixels, _ = cont.history_videos(cont._parser().parse_args(argv))
    assert pixels.shape[1] == 16 and records[0]["keyframes"] == [14, 15]
    want, calls = _reference(prompts, pixels[:, :4], HistoryGuidance("conditional", text_scale=3.0), 16, 2,
                             key_pixels=pixels[:, 14:16], keys=[14, 15])
    for r, p, video in zip(records, plain, want, strict=True):
        got = written[r["file"]]
        torch.testing.assert_close(got, video, atol=1e-6, rtol=0)
        torch.testing.assert_close(got[14:], pixels[r["index"], 14:], atol=1e-6, rtol=0)  # the real keyframes
        torch.testing.assert_close(got[:12], p[:12], atol=0, rtol=0)  # the windows before them
        assert float((got[12:14] - p[12:14]).abs().max()) > 1e-3
    # 3 windows of 2 views x 2 steps over 10 generated frames (12 after the history, 2 of them given)
    assert records[0]["calls_per_frame"] == pytest.approx(calls) == pytest.approx(3 * 2 * 2 / 10)


def test_mp4_history_with_sidecar_captions_or_prompts(tmp_path, written, monkeypatch):
    from genrl.data.shapes import ShapesWorldConfig, parse_caption, render
    from genrl.data.video_io import read_video
    from genrl.flow import HistoryGuidance

    world = ShapesWorldConfig(num_frames=8)
    clips = tmp_path / "clips"
    clips.mkdir()
    captions = ["a red circle moving left slowly", "a green square moving up quickly"]
    for i, c in enumerate(captions):
        real_write(clips / f"c{i}.mp4", render(parse_caption(c, world), world, torch.Generator().manual_seed(i)), fps=8)
        (clips / f"c{i}.txt").write_text(c + "\n")
    records = cont.main(["--model", MODEL, "--history", str(clips), "--history-frames", "2", "--num-frames", "8",
                         "--steps", "2", "--rule", "conditional", "--out", str(tmp_path / "o")])
    assert [r["prompt"] for r in records] == captions
    assert [r["history"] for r in records] == [str(clips / "c0.mp4"), str(clips / "c1.mp4")]
    pixels = torch.stack([read_video(clips / f"c{i}.mp4", num_frames=2, size=(16, 16)) for i in range(2)]).float()
    want, _ = _reference(captions, pixels, HistoryGuidance("conditional", text_scale=3.0), 8, 2)
    for r, video in zip(records, want, strict=True):
        torch.testing.assert_close(written[r["file"]], video, atol=1e-6, rtol=0)
    one = cont.main(["--model", MODEL, "--history", str(clips / "c1.mp4"), "--prompt", "a blue circle staying still",
                     "--history-frames", "2", "--num-frames", "8", "--steps", "2", "--out", str(tmp_path / "p")])
    assert one[0]["prompt"] == "a blue circle staying still"
    with pytest.raises(ValueError, match="shorter than the 12 frames that --history-frames 2 and --keyframes up to 11"):
        cont.main(["--model", MODEL, "--history", str(clips), "--history-frames", "2", "--num-frames", "12",
                   "--keyframes", "10", "11", "--out", str(tmp_path / "q")])
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("extra, error, match", [
    (["--history", "shapes:heldout", "--history-frames", "8"], SystemExit, None),
    (["--history", "shapes:heldout", "--num-frames", "4"], SystemExit, None),
    (["--history", "shapes:valid"], ValueError, "use shapes:heldout or shapes:train"),
    (["--history", "/no/such.mp4"], FileNotFoundError, "does not exist"),
    (["--history", "shapes:heldout", "--history", "x.mp4"], ValueError, "give it alone"),
    (["--history", "shapes:heldout", "--rule", "vanilla", "--scale", "-1"], ValueError, "scale must be"),
    (["--history", "shapes:heldout", "--keyframes", "2", "3"], SystemExit, None),
    (["--history", "shapes:heldout", "--keyframes", "16", "17"], SystemExit, None),
    (["--history", "shapes:heldout", "--keyframes", "8", "8"], SystemExit, None),
    (["--history", "shapes:heldout", "--keyframes", "8", "9", "11"], ValueError, r"whole patches .*for 11: 10 11"),
    (["--history", "shapes:heldout", "--history-frames", "3"], ValueError, "--history-frames 3: .* multiples of 2"),
    (["--history", "shapes:heldout", "--context", "3"], ValueError, "--context 3: .* multiples of 2"),
    (["--history", "shapes:heldout", "--world", "inside", "--num-frames", "16", "--keyframes", "12", "13"],
     ValueError, "use --world wrap"),
    ([], ValueError, "give --history"),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, extra, error, match, capsys):
    out = tmp_path / "never"
    with pytest.raises(error, match=match):
        cont.main(["--model", MODEL, *extra, "--out", str(out)])
    assert not out.exists()


def test_prompts_that_do_not_match_the_videos_are_refused(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(2):
        (clips / f"c{i}.mp4").write_bytes(b"")
    with pytest.raises(ValueError, match="2 history videos and 0 --prompt"):
        cont.main(["--model", MODEL, "--history", str(clips), "--out", str(tmp_path / "o")])
