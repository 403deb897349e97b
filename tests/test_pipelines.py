"""pipelines/generate.py and pipelines/export.py, and genrl.models.loading.load_generator behind them.

generate: a VBench slice with the shipped shapes model (VBench names, decodable mp4s, manifest, resume without
regeneration, batch-independent samples), a tiny Wan folder and a Wan GRPO checkpoint. export: a tiny Wan
pipeline trained 2 GRPO LoRA steps, exported as a LoRA and as a merged full pipeline, both loaded by diffusers'
WanPipeline and equal to genrl's trained transformer; a DiT LoRA checkpoint the same way; clear errors.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from families_util import grpo_two_steps, save_tiny_pipeline, tiny_pipeline_fixture

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle moving left", "a blue square staying still"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"pipelines_{name}", ROOT / "pipelines" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _script("generate")
export = _script("export")


def _manifest(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines() if line.strip()]


def _stat(folder: Path) -> dict[str, tuple[int, int]]:
    return {f.name: (f.stat().st_mtime_ns, f.stat().st_ino) for f in folder.glob("*.mp4")}


# ---------------------------------------------------------------------------------------------- generate
def test_generate_vbench_slice_with_the_shapes_model_and_resume(tmp_path):
    from genrl.data.prompts import load_prompts
    from genrl.data.video_io import read_video

    out = tmp_path / "vbench"
    argv = ["--prompts", "vbench", "--limit", "3", "--samples-per-prompt", "2", "--steps", "2", "--vbench-names",
            "--batch-size", "4", "--out", str(out)]  # batches of 4 + 2 (the last one padded)
    records = generate.main(argv)
    prompts = [r.prompt for r in load_prompts("vbench")[:3]]
    names = {f"{p}-{k}.mp4" for p in prompts for k in range(2)}
    assert {f.name for f in out.glob("*.mp4")} == names
    lines = _manifest(out)
    assert len(lines) == 6 and {r["file"] for r in lines} == names and lines == records
    first = lines[0]
    assert first["prompt"] == prompts[0] and first["sample"] == 0 and first["index"] == 0 and first["seed"] == 0
    assert (first["steps"], first["cfg_scale"], first["shift"], first["kernel"]) == (2, 3.0, 1.0, "ode")
    assert (first["height"], first["width"], first["num_frames"]) == (16, 16, 8)
    assert first["metadata"]["dimension"] and first["model"] == "assets/shapes-dit"
    assert [r["index"] for r in lines] == list(range(6))
    videos = {}
    for name in names:
        video = read_video(out / name, num_frames=8, size=(16, 16))
        assert video.shape == (8, 3, 16, 16) and 0 <= video.min() and video.max() <= 1
        videos[name] = video
    assert not torch.allclose(videos[f"{prompts[0]}-0.mp4"], videos[f"{prompts[0]}-1.mp4"], atol=0.05)

    # a rerun generates nothing: files untouched, manifest not duplicated
    before = _stat(out)
    again = generate.main(argv)
    assert _stat(out) == before and len(_manifest(out)) == 6 and again == records
    # a deleted file is regenerated alone (batch of 1, padded) and equals the first run's sample
    victim = f"{prompts[1]}-1.mp4"
    (out / victim).unlink()
    generate.main(argv)
    after = _stat(out)
    assert set(after) == names and {k: v for k, v in after.items() if k != victim} == {
        k: v for k, v in before.items() if k != victim}
    torch.testing.assert_close(read_video(out / victim, num_frames=8, size=(16, 16)), videos[victim],
                               atol=0.03, rtol=0)
    assert _manifest(out) == records
    assert not list(out.glob(".*tmp"))  # no temporary files left behind


def test_vbench_names_are_sanitized_and_bounded():
    assert generate.vbench_name("a cat/dog on a mat", 3) == "a cat_dog on a mat-3.mp4"
    long = "x" * 300
    assert generate.vbench_name(long, 0) == "x" * 180 + "-0.mp4"


wan_folder = tiny_pipeline_fixture("wan")


def test_generate_with_a_wan_pipeline_folder(wan_folder, tmp_path):
    from genrl.data.video_io import read_video

    out = tmp_path / "wan"
    records = generate.main(["--model", str(wan_folder), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                             "--height", "16", "--width", "16", "--frames", "5", "--steps", "2", "--batch-size", "2",
                             "--out", str(out)])
    assert [r["file"] for r in records] == ["00000.mp4", "00001.mp4"]
    r = records[0]
    got = (r["kind"], r["num_frames"], r["height"], r["shift"], r["cfg_scale"], r["fps"])
    assert got == ("wan", 5, 16, 3.0, 5.0, 16)
    for rec in records:
        assert read_video(out / rec["file"], num_frames=5, size=(16, 16)).shape == (5, 3, 16, 16)
    assert len(_manifest(out)) == 2


def test_generate_image_to_video_with_image_flags(tmp_path, monkeypatch):
    """--image gives each --prompt its first frame (Wan2.2-TI2V: the video starts at the image, within the VAE's and
    the mp4 codec's error); the manifest records the image; an image-to-video model without images, an image of
    another size (before anything is written) and a missing file (before the model loads) are refused."""
    import numpy as np
    from PIL import Image

    from genrl.data.video_io import read_video

    folder = save_tiny_pipeline("wan22_ti2v", tmp_path / "ti2v")
    pixels = np.zeros((32, 32, 3), dtype=np.uint8)
    pixels[8:24, 8:24] = (220, 40, 40)  # a red square on black: easy for the codec
    Image.fromarray(pixels).save(tmp_path / "first.png")
    Image.fromarray(pixels[:16, :16]).save(tmp_path / "small.png")
    common = ["--model", str(folder), "--height", "32", "--width", "32", "--frames", "5", "--steps", "2"]
    records = generate.main(common + ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--image",
                                      str(tmp_path / "first.png"), "--out", str(tmp_path / "out")])
    assert [r["metadata"]["image"] for r in records] == [str(tmp_path / "first.png")] * 2
    assert [r["image"] for r in records] == [str((tmp_path / "first.png").resolve())] * 2
    from evaluation.run import main as evaluate  # the manifest leads evaluation/ to each video's image

    scored = evaluate(["--videos", str(tmp_path / "out"), "--dimension", "first_frame_fidelity", "--no-report"])
    assert scored["dimensions"]["first_frame_fidelity"]["n"] == 2 and not scored["skipped"]
    video = read_video(tmp_path / "out" / records[0]["file"], num_frames=5, size=(32, 32))
    from genrl.models.loading import load_generator

    gen = load_generator(str(folder), height=32, width=32, num_frames=5)
    image = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
    round_trip = gen.decode(gen.encode(image[None, None]))[0, 0]  # the tiny random VAE's own (large) error
    assert (video[0] - round_trip).abs().mean() < 0.03  # what is left is the mp4 codec's
    with pytest.raises(ValueError, match="is 16x16 .* samples 32x32"):
        generate.main(common + ["--prompt", PROMPTS[0], "--image", str(tmp_path / "small.png"),
                                "--out", str(tmp_path / "small")])
    assert not list((tmp_path / "small").glob("*.mp4"))
    i2v = save_tiny_pipeline("wan_i2v", tmp_path / "i2v")
    with pytest.raises(ValueError, match="image-to-video model: give each prompt its first frame"):
        generate.main(["--model", str(i2v), "--height", "16", "--width", "16", "--frames", "5", "--steps", "2",
                       "--prompt", PROMPTS[0], "--out", str(tmp_path / "none")])
    import genrl.models.loading as loading

    monkeypatch.setattr(loading, "load_generator", lambda *a, **k: pytest.fail("loaded before checking the image"))
    with pytest.raises(FileNotFoundError, match="missing.png"):
        generate.main(common + ["--prompt", PROMPTS[0], "--image", str(tmp_path / "missing.png"),
                                "--out", str(tmp_path / "missing")])


def test_generate_with_an_image_family_writes_pngs(tmp_path):
    """Runs once an image family (sd3 / flux / sana) has its tiny components in genrl.testing.families."""
    from genrl.testing.families import TINY, TINY_SIZE

    family = next((f for f in ("sd3", "flux", "sana") if f in TINY), None)
    if family is None:
        pytest.skip("no image family adapter with tiny components yet")
    folder = save_tiny_pipeline(family, tmp_path / family)
    size = TINY_SIZE[family]
    out = tmp_path / "images"
    records = generate.main(["--model", str(folder), "--prompt", PROMPTS[0], "--height", str(size["height"]),
                             "--width", str(size["width"]), "--steps", "2", "--cfg-scale", "1", "--out", str(out)])
    from PIL import Image

    assert records[0]["file"] == "00000.png" and records[0]["num_frames"] == 1
    assert Image.open(out / "00000.png").size == (size["width"], size["height"])


# ---------------------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def wan_lora_run(wan_folder, tmp_path_factory):
    """2 GRPO LoRA steps on the tiny Wan folder, saved as a Lightning checkpoint."""
    model, _, _ = grpo_two_steps("wan", wan_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))
    ckpt = tmp_path_factory.mktemp("wan_run") / "last.ckpt"
    model.trainer.save_checkpoint(str(ckpt))
    return model, ckpt


def _wan_input(transformer, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 2, 2, 2, generator=g)
    text = torch.randn(2, 16, 32, generator=g)
    t = torch.tensor([300.0, 800.0])
    with torch.no_grad():
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]


def test_export_wan_lora_and_full_match_the_trained_transformer(wan_folder, wan_lora_run, tmp_path):
    from diffusers import WanPipeline

    from genrl.models.loading import has_lora, load_generator

    model, ckpt = wan_lora_run
    trained = model.generator.transformer.eval()
    expected = _wan_input(trained)
    base = _wan_input(WanPipeline.from_pretrained(str(wan_folder), local_files_only=True).transformer)
    assert (expected - base).abs().max() > 1e-4  # the adapter trained to something

    loaded = load_generator(str(ckpt))  # the checkpoint path of load_generator itself
    assert has_lora(loaded)
    torch.testing.assert_close(_wan_input(loaded.transformer), expected, atol=1e-4, rtol=0)

    result = export.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "lora")])  # default mode: lora
    assert result["mode"] == "lora" and (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    pipe = WanPipeline.from_pretrained(str(wan_folder), local_files_only=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    torch.testing.assert_close(_wan_input(pipe.transformer), expected, atol=1e-4, rtol=0)

    result = export.main(["--ckpt", str(ckpt), "--mode", "full", "--out", str(tmp_path / "full")])
    assert result["mode"] == "full" and (tmp_path / "full" / "model_index.json").is_file()
    assert {oct(f.stat().st_mode & 0o777) for f in (tmp_path / "full").rglob("*") if f.is_file()} == {"0o644"}
    pipe = WanPipeline.from_pretrained(str(tmp_path / "full"), local_files_only=True)
    assert not any("lora" in k or "base_layer" in k for k in pipe.transformer.state_dict())
    torch.testing.assert_close(_wan_input(pipe.transformer), expected, atol=1e-4, rtol=0)
    # the export is a pipeline folder generate.py / load_generator take
    assert not has_lora(load_generator(str(tmp_path / "full"), height=16, width=16, num_frames=5))
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(FileExistsError, match="--overwrite"):
        export.main(["--ckpt", str(ckpt), "--mode", "full", "--out", str(tmp_path / "full")])
    export.main(["--ckpt", str(ckpt), "--mode", "lora", "--out", str(tmp_path / "full"), "--overwrite"])
    assert not (tmp_path / "full" / "model_index.json").exists()


def test_checkpoint_ema_and_moved_base_model(wan_folder, wan_lora_run, tmp_path):
    """EMA shadow over the raw weights (and --no-ema), and a checkpoint whose recorded base folder is gone."""
    from genrl.models.loading import load_generator

    model, ckpt = wan_lora_run
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    lora_keys = [k for k in state["state_dict"] if "lora_B" in k]
    shadow = {k: state["state_dict"][k] + 0.5 for k in lora_keys}
    state["callbacks"] = {"EMA{'decay': 0.999}": {"shadow": shadow, "num_updates": 2}}
    state["hyper_parameters"]["generator"]["pretrained"] = str(tmp_path / "moved_away")  # plain values
    moved = tmp_path / "moved.ckpt"
    torch.save(state, moved)
    with pytest.raises(FileNotFoundError, match=r"moved_away.*do not exist here.*pretrained="):
        load_generator(str(moved))
    ema_gen = load_generator(str(moved), pretrained=str(wan_folder))
    raw_gen = load_generator(str(moved), pretrained=str(wan_folder), use_ema=False)
    assert ema_gen.load_info["ema"] and not raw_gen.load_info["ema"] and ema_gen.load_info["lora"]
    ema, raw = ema_gen.transformer.state_dict(), raw_gen.transformer.state_dict()
    key = lora_keys[0][len("generator.transformer."):]
    torch.testing.assert_close(ema[key], shadow[lora_keys[0]])
    torch.testing.assert_close(raw[key], state["state_dict"][lora_keys[0]])


def test_generate_with_a_family_checkpoint(wan_lora_run, tmp_path):
    _, ckpt = wan_lora_run
    records = generate.main(["--model", str(ckpt), "--prompt", PROMPTS[0], "--steps", "2", "--cfg-scale", "1",
                             "--out", str(tmp_path / "ckpt")])
    assert records[0]["num_frames"] == 5 and (tmp_path / "ckpt" / "00000.mp4").is_file()


@pytest.fixture
def dit_lora_ckpt(tiny_policy, tiny_text_encoder, tmp_path):
    """A checkpoint as GRPO saves it for genrl's DiT with a LoRA (adapter weights made non-zero)."""
    from genrl.models.generator import DiTGenerator
    from genrl.models.lora import LoraSpec
    from genrl.models.spec import ModelSpec
    from genrl.models.text_encoder import TextEncoder

    gen = DiTGenerator(ModelSpec(pretrained=tiny_policy).build(), TextEncoder.from_pretrained(tiny_text_encoder))
    lora = LoraSpec(rank=2, alpha=4.0, init_lora_weights=True)
    lora.add_to(gen)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in gen.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    state = {"generator.transformer." + k: v for k, v in gen.transformer.state_dict().items()}
    hp = dict(transformer=ModelSpec(pretrained=tiny_policy), text_encoder=tiny_text_encoder, max_text_length=32,
              lora=dict(rank=2, alpha=4.0, init_lora_weights=True))
    path = tmp_path / "dit.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": hp, "callbacks": {}}, path)
    return gen.eval(), path


def _dit_out(transformer):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 3, 8, 8, generator=g)
    text = torch.randn(2, 5, 16, generator=g)
    with torch.no_grad():
        return transformer(x, torch.tensor([0.3, 0.7]), text, torch.ones(2, 5, dtype=torch.bool))


def test_export_dit_lora_checkpoint_full_and_lora(dit_lora_ckpt, tiny_policy, tmp_path):
    from genrl.models import VideoDiT

    gen, ckpt = dit_lora_ckpt
    expected = _dit_out(gen.transformer)
    assert (expected - _dit_out(VideoDiT.from_pretrained(tiny_policy))).abs().max() > 1e-4
    export.main(["--ckpt", str(ckpt), "--mode", "full", "--out", str(tmp_path / "full")])
    merged = VideoDiT.from_pretrained(str(tmp_path / "full"))
    torch.testing.assert_close(_dit_out(merged), expected, atol=1e-4, rtol=0)
    export.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "lora")])
    with_adapter = VideoDiT.from_pretrained(tiny_policy)
    with_adapter.load_lora_adapter(str(tmp_path / "lora"), prefix=None, use_safetensors=True)
    torch.testing.assert_close(_dit_out(with_adapter), expected, atol=1e-4, rtol=0)
    # a full-weights run has no adapter: --mode lora says so and leaves nothing behind
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    state["hyper_parameters"]["lora"] = None
    state["state_dict"] = {"generator.transformer." + k: v for k, v in merged.state_dict().items()}
    torch.save(state, tmp_path / "full.ckpt")
    with pytest.raises(ValueError, match="no LoRA adapter"):
        export.main(["--ckpt", str(tmp_path / "full.ckpt"), "--mode", "lora", "--out", str(tmp_path / "nothing")])
    assert not (tmp_path / "nothing").exists() and not list(tmp_path.glob(".nothing*"))


# ---------------------------------------------------------------------------------------------- errors
def test_clear_errors(tmp_path):
    from genrl.models.loading import load_generator

    with pytest.raises(FileNotFoundError, match=r"no model at .*nowhere.*genrl DiT folder.*model_index.json.*ckpt"):
        load_generator(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        generate.main(["--model", str(tmp_path / "nowhere"), "--prompt", "x", "--out", str(tmp_path / "o")])
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"model.weight": torch.zeros(2)}, "epoch": 0}, other)
    with pytest.raises(ValueError, match=r"not a genrl generator one.*model.weight"):
        load_generator(str(other))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable PyTorch checkpoint"):
        export.main(["--ckpt", str(garbage), "--out", str(tmp_path / "x")])
    sdxl = tmp_path / "sdxl"
    sdxl.mkdir()
    (sdxl / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError, match=r"StableDiffusionXLPipeline.*WanPipeline.*SanaPipeline"):
        load_generator(str(sdxl))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without model_index.json or config.json"):
        load_generator(str(tmp_path / "empty"))


# ---------------------------------------------------------------------------------------------- fail early, no mixing
def _no_model(monkeypatch):
    import genrl.models.loading as loading

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load_generator", refuse)


def test_generate_resume_with_another_layout_errors_before_loading_and_keeps_every_file(tmp_path, monkeypatch):
    out = tmp_path / "o"
    argv = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--steps", "1", "--frames", "2", "--height", "8",
            "--width", "8", "--out", str(out)]
    generate.main(argv)
    settings = json.loads((out / generate.SETTINGS_FILE).read_text())
    assert settings["samples_per_prompt"] == 1 and settings["height"] == 8 and settings["seed"] == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert sorted(before) == ["00000.mp4", "00001.mp4", "generate_settings.json", "manifest.jsonl"]
    _no_model(monkeypatch)
    with pytest.raises(ValueError) as err:
        generate.main([*argv, "--samples-per-prompt", "2", "--seed", "3"])
    msg = str(err.value)
    assert "--samples-per-prompt: 1 in the folder, 2 now" in msg and "--seed: 0 in the folder, 3 now" in msg
    with pytest.raises(ValueError, match=r"--fps: the model's default \(not given\) in the folder, 4 now"):
        generate.main([*argv, "--fps", "4"])
    assert "new --out" in msg and "--height" not in msg
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # nothing lost, nothing added


def test_bad_height_errors_before_any_model_and_leaves_no_folder(tmp_path, monkeypatch):
    import subprocess
    import sys

    _no_model(monkeypatch)
    out = tmp_path / "new" / "o"
    with pytest.raises(ValueError, match=r"--height 15: .*multiple of 2 \(the DiT's patch_size \[2, 2, 2\]\); use 14 "
                                         r"or 16"):
        generate.main(["--prompt", "x", "--height", "15", "--out", str(out)])
    assert not (tmp_path / "new").exists()
    # as a script: one line naming the value and the fix, no traceback, exit code 1, no folder
    run = subprocess.run([sys.executable, str(ROOT / "pipelines/generate.py"), "--prompt", "x", "--width", "9",
                          "--out", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("error: --width 9: ") and "use 8 or 10" in run.stderr
    assert not (tmp_path / "new").exists()


def test_ode_pairs_and_export_check_inputs_before_any_model(tmp_path, monkeypatch):
    _no_model(monkeypatch)
    ode_pairs = _script("ode_pairs")
    out = tmp_path / "pairs" / "p.pt"
    with pytest.raises(ValueError, match=r"--width 7: .*multiple of 2 .*use 6 or 8"):
        ode_pairs.main(["--width", "7", "--num", "2", "--out", str(out)])
    with pytest.raises(SystemExit):  # parser.error: the message names the flag and the fix
        export.main(["--ckpt", "assets/shapes-dit", "--pretrained", str(tmp_path / "nope"), "--out",
                     str(tmp_path / "exp")])
    assert not (tmp_path / "pairs").exists() and not (tmp_path / "exp").exists()


def test_recorded_sampler_is_the_default_of_generate_and_shapes_eval(tiny_policy, tiny_text_encoder, tmp_path):
    """An export's genrl_export.json names its validation sampler; generate.py and shapes_eval.py sample with it
    unless a flag says otherwise."""
    import shutil

    model = tmp_path / "export"
    shutil.copytree(tiny_policy, model)
    (model / "genrl_export.json").write_text(json.dumps(
        {"ema": False, "global_step": 4, "sampling": {"steps": 3, "cfg_scale": 1.0, "shift": 2.0}}))
    args = ["--model", str(model), "--text-encoder", tiny_text_encoder, "--prompt", "a red circle", "--device", "cpu"]
    rec = generate.main([*args, "--out", str(tmp_path / "a")])[0]
    assert (rec["steps"], rec["cfg_scale"], rec["shift"]) == (3, 1.0, 2.0)
    rec = generate.main([*args, "--out", str(tmp_path / "b"), "--cfg-scale", "2.5", "--steps", "2"])[0]
    assert (rec["steps"], rec["cfg_scale"], rec["shift"]) == (2, 2.5, 2.0)
    (model / "genrl_export.json").unlink()  # a folder without the record: the DiT's defaults
    rec = generate.main([*args, "--out", str(tmp_path / "c")])[0]
    assert (rec["steps"], rec["cfg_scale"], rec["shift"]) == (20, 3.0, 1.0)
    shapes_eval = importlib.util.spec_from_file_location("shapes_eval", ROOT / "evaluation" / "shapes_eval.py")
    module = importlib.util.module_from_spec(shapes_eval)
    shapes_eval.loader.exec_module(module)
    (model / "genrl_export.json").write_text(json.dumps({"sampling": {"steps": 2, "cfg_scale": 1.0, "shift": 1.5}}))
    out = module.main(["--model", str(model), "--text-encoder", tiny_text_encoder, "--num-prompts", "2"])
    assert (out["steps"], out["cfg_scale"], out["shift"]) == (2, 1.0, 1.5)


def test_limit_beyond_the_prompt_source_says_so_and_a_limit_below_one_is_refused(tmp_path, monkeypatch, capsys):
    """--limit larger than the source prints how many prompts are used; --limit 0 fails before anything loads."""
    from genrl.data.prompts import load_prompts

    _no_model(monkeypatch)
    held_out = len(load_prompts("shapes:heldout"))
    # stop right after the prompts are read: a --pretrained that is not a folder fails before any model
    with pytest.raises(SystemExit):
        generate.main(["--prompts", "shapes:heldout", "--limit", str(held_out + 100), "--pretrained",
                       str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert f"--limit {held_out + 100} asks for more prompts than --prompts 'shapes:heldout' holds ({held_out})" in err
    assert f"using all {held_out}" in err
    with pytest.raises(SystemExit):
        generate.main(["--prompts", "shapes:heldout", "--limit", "0", "--out", str(tmp_path / "o")])
    assert "--limit must be >= 1, got 0" in capsys.readouterr().err
    # a limit within the source is silent
    with pytest.raises(SystemExit):
        generate.main(["--prompts", "shapes:heldout", "--limit", str(held_out), "--pretrained",
                       str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert "asks for more prompts" not in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _tmd_export(tiny_policy: str, folder: Path) -> Path:
    """A TMD export of the tiny policy: its transformer plus an open-gate flow head with random weights (so the head
    changes the samples), M 2 x N 2."""
    import shutil

    from genrl.models import DiTGenerator, ModelSpec
    from genrl.models.trunk import FlowHead, save_head, trunk_adapter

    shutil.copytree(tiny_policy, folder)
    from types import SimpleNamespace

    gen = DiTGenerator(ModelSpec(pretrained=tiny_policy).build(), SimpleNamespace(hidden_size=16))  # no prompts here
    torch.manual_seed(0)
    head = FlowHead(trunk_adapter(gen), num_layers=1, gate_init=0.0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_head(head, folder, {"head_layers": 1, "head_time": "inner", "gate_init": 0.0, "parameterization": "denoiser",
                             "outer_steps": 2, "inner_steps": 2, "outer_shift": 10.0, "inner_shift": 10.0,
                             "t_max": 0.999})
    return folder


def test_generate_samples_a_tmd_export_with_its_transition_sampler(tmp_path, monkeypatch, tiny_policy,
                                                                   tiny_text_encoder):
    """A TMD export (flow_head.json beside the transformer) is sampled by the run's transition sampler: the written
    videos are exactly load_transition_model + transition_rollout's at the same (seed, index) addresses, the manifest
    records M, N and the effective NFE; --inner-steps changes the samples; ODE flags are refused for a TMD export
    and --outer-steps / --inner-steps for a plain model, before anything loads or is written."""
    import genrl.data.video_io as video_io
    from genrl.rollout.transition import load_transition_model, transition_rollout

    export = _tmd_export(tiny_policy, tmp_path / "export")
    written = {}
    def write_video(path, video, fps):  # keep the tensor (an mp4 is lossy), leave a file for the manifest
        written[Path(path).name] = video
        Path(path).write_bytes(b"")

    monkeypatch.setattr(video_io, "write_video", write_video)
    base = ["--model", str(export), "--text-encoder", tiny_text_encoder, "--prompt", PROMPTS[0], "--prompt",
            PROMPTS[1], "--seed", "4"]
    records = generate.main(base + ["--out", str(tmp_path / "a")])
    assert [r["kernel"] for r in records] == ["transition"] * 2
    assert records[0]["steps"] == 2 and records[0]["inner_steps"] == 2 and records[0]["cfg_scale"] == 1.0
    assert records[0]["effective_nfe"] == pytest.approx(2 * (1 + 1 / 2))  # L = 2, H = 1
    gen, student, config = load_transition_model(export, text_encoder=tiny_text_encoder)
    with torch.no_grad():
        out = transition_rollout(student, gen.encode_prompts(PROMPTS), (8, 3, 16, 16), 4, torch.tensor([0, 1]),
                                 config)
        want = gen.decode(out.latents).float()
    for r, video in zip(records, want, strict=True):
        torch.testing.assert_close(written[r["file"]], video, atol=1e-6, rtol=0)
    three = generate.main(base + ["--inner-steps", "3", "--out", str(tmp_path / "b")])
    assert three[0]["inner_steps"] == 3
    assert float((written[three[0]["file"]] - want[0]).abs().max()) > 1e-4  # the same address, another N
    with pytest.raises(ValueError, match="is a TMD export.*--steps, --cfg-scale do not apply"):
        generate.main(base + ["--steps", "4", "--cfg-scale", "2", "--out", str(tmp_path / "c")])
    with pytest.raises(ValueError, match="--outer-steps / --inner-steps apply to a TMD export"):
        generate.main(["--model", tiny_policy, "--outer-steps", "2", "--prompt", "a", "--out", str(tmp_path / "d")])
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
