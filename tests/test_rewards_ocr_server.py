"""OCR reward (run for real, network disabled), the loopback reward server and its ``remote`` client, per-reward
standardisation, and the ``genrl reward-serve`` / ``genrl rewards check`` commands."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from genrl.cli import GenRLCLI
from genrl.cli import main as genrl_main
from genrl.rewards import RewardManager, RewardModel, build_reward, register_reward
from genrl.rewards.ocr import OCRReward, extract_target, ocr_reward_from_text
from genrl.rewards.remote import RemoteReward, encode_score_request, quantize_uint8
from genrl.rewards.server import RewardServer, RewardService, build_service, check_host

ROOT = Path(__file__).resolve().parents[1]
HELLO = 'a sign that says "Hello World"'
WRONG = 'a sign that says "Quantum Zebra"'


# ---------------------------------------------------------------------------------------------- helpers
def _font(size: int):
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType
    except TypeError:  # pragma: no cover - older Pillow: the bitmap font, drawn large by upscaling below
        return None


def text_image(text: str, w: int = 192, h: int = 96) -> torch.Tensor:
    """Black text on white, float [3, h, w] holding exact k / 255 values."""
    font = _font(h // 3)
    if font is not None:
        img = Image.new("RGB", (w, h), "white")
        ImageDraw.Draw(img).text((8, h // 3), text, fill="black", font=font)
    else:
        small = Image.new("RGB", (w // 4, h // 4), "white")
        ImageDraw.Draw(small).text((2, h // 12), text, fill="black")
        img = small.resize((w, h), Image.NEAREST)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255


@pytest.fixture
def no_network(monkeypatch):
    """Every outgoing connection raises, except to loopback (where the reward server tests listen)."""
    real = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if host not in ("127.0.0.1", "::1"):
            raise OSError(f"network disabled in this test (tried {address!r})")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture(scope="module")
def ocr_reward() -> OCRReward:
    mp = pytest.MonkeyPatch()
    mp.setattr(socket.socket, "connect", lambda *a, **k: (_ for _ in ()).throw(OSError("network disabled")))
    try:
        return OCRReward(num_threads=1)
    finally:
        mp.undo()


@pytest.fixture
def serve():
    """Start RewardServers in background threads; stops them at the end."""
    servers: list[RewardServer] = []

    def start(service: RewardService) -> RewardServer:
        srv = RewardServer(service, "127.0.0.1", 0)
        srv.start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        try:
            srv.stop()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------- OCR
def test_ocr_score_rule_follows_flow_grpo():
    assert extract_target(HELLO) == "Hello World"
    assert extract_target("a \u201ccurly\u201d quote") == "curly"
    assert extract_target("no quotes") is None and extract_target('one " quote') is None
    assert ocr_reward_from_text("HELLOWORLD", "Hello World") == (1.0, 0)           # spaces / case ignored
    assert ocr_reward_from_text("big sign: hello world!!", "hello world") == (1.0, 0)  # substring -> 0
    assert ocr_reward_from_text("hellx world", "hello world") == (1 - 1 / 10, 1)    # n = 10 without the space
    assert ocr_reward_from_text("", "abc") == (0.0, 3)
    assert ocr_reward_from_text("z" * 50, "abc") == (0.0, 3)                        # clipped to n
    with pytest.raises(ValueError, match="empty"):
        ocr_reward_from_text("abc", "   ")


def test_ocr_reads_rendered_text_with_the_network_disabled(ocr_reward, no_network):
    with pytest.raises(OSError, match="network disabled"):
        socket.create_connection(("93.184.216.34", 80), timeout=1)
    img = text_image("Hello World")
    pixels = img[None, None].expand(4, 1, -1, -1, -1).contiguous()   # [4, 1, 3, H, W]
    out = ocr_reward(pixels, [HELLO, WRONG, "a sign with no quoted text", WRONG],
                     target=[None, None, None, "hello world"])
    r = out["reward"]
    assert r[0] > 0.9 and r[0] - r[1] > 0.5, r
    assert out["valid"].tolist() == [True, True, False, True]
    assert math.isnan(float(r[2])) and math.isnan(float(out["edit_distance"][2]))  # no target: NaN, invalid
    assert r[3] == r[0]                                                            # meta target wins
    assert float(out["edit_distance"][0]) <= 1 and float(out["edit_distance"][1]) >= 0.5 * len("QuantumZebra")
    assert not ocr_reward.differentiable and ocr_reward.missing_weights(None) == []


def test_ocr_video_frame_policy_stride_4(ocr_reward, no_network):
    blank, text = torch.ones(3, 96, 192), text_image("Hello World")
    video = torch.stack([text, blank, blank, blank, text])[None]   # frames 0 and 4 show the text
    strided = OCRReward(frames={"frames": "stride", "stride": 4}, num_threads=1)
    assert float(strided(video, [HELLO])["reward"][0]) > 0.9        # scores frames 0 and 4 only
    every = float(ocr_reward(video, [HELLO])["reward"][0])           # all 5 frames: 3 blank ones score 0
    assert every == pytest.approx(float(strided(video, [HELLO])["reward"][0]) * 2 / 5, abs=1e-6)


def test_ocr_bad_input_errors(ocr_reward):
    x = text_image("Hi")[None, None]
    with pytest.raises(ValueError, match=r"\[0, 255\]: use pixels / 255"):
        ocr_reward(x * 255, [HELLO])
    with pytest.raises(ValueError, match="rank 5.*unsqueeze"):
        ocr_reward(x[:, 0], [HELLO])
    with pytest.raises(ValueError, match="2 prompts for a batch of 1"):
        ocr_reward(x, [HELLO, HELLO])
    with pytest.raises(ValueError, match="C in \\(3,\\)"):
        ocr_reward(x[:, :, :1], [HELLO])
    with pytest.raises(ValueError, match="meta target has 2 entries"):
        ocr_reward(x, [HELLO], target=["a", "b"])


# ---------------------------------------------------------------------------------------------- server + client
def test_remote_equals_in_process_on_quantised_input(serve):
    local = build_reward("colorfulness")
    srv = serve(RewardService(build_reward("colorfulness"), batch_size=3))
    info = json.loads(urllib.request.urlopen(srv.url + "/info", timeout=10).read())
    assert info["name"] == "colorfulness" and info["dims"] == ["reward", "frame_min"]
    assert info["differentiable"] is False and info["weights_sha256"] == "none" and info["protocol"] == 1

    torch.manual_seed(0)
    x = torch.rand(7, 2, 3, 16, 16)
    x[3] = 0.5 + 0.5 * x[3] / 3 ** 0.5  # some values between quantisation levels
    prompts = [f"p{i}" for i in range(7)]
    expected = local(quantize_uint8(x).float() / 255, prompts)

    remote = build_reward("remote", url=srv.url, expected_name="colorfulness", batch_size=4, scale=2.0, shift=1.0)
    assert remote.dimensions == ("reward", "frame_min") and not remote.differentiable
    got = remote(x, prompts)
    assert torch.equal(got["reward"], expected["reward"] * 2.0 + 1.0)    # exact: same uint8 frames, same code
    assert torch.equal(got["frame_min"], expected["frame_min"]) and got["valid"].all()

    mgr = RewardManager([{"name": "remote", "kwargs": {"url": srv.url, "batch_size": 2}}, {"name": "colorfulness"}],
                        batch_size=5)
    res = mgr(x, prompts)
    assert torch.equal(res.rewards["remote"], expected["reward"])
    assert torch.equal(res.components["remote/frame_min"], expected["frame_min"]) and res.valid.all()
    assert srv.service.requests == 2 + 4  # 7 videos in chunks of 4, then manager chunks 5 + 2 in requests of 2


def test_ocr_through_the_server_equals_in_process(serve, ocr_reward, no_network):
    svc = build_service("ocr", kwargs={"num_threads": 1})
    assert len(svc.info["weights_sha256"]) == 64 and svc.info["version"].startswith("rapidocr-onnxruntime")
    srv = serve(svc)
    x = torch.stack([text_image("Hello World"), text_image("Quantum")])[:, None]
    prompts = [HELLO, WRONG]
    remote = RemoteReward(srv.url, expected_name="ocr", expected_weights_sha256=svc.info["weights_sha256"])
    got = remote(x, prompts, target=[None, "quantum"])                      # meta travels as JSON
    want = ocr_reward(quantize_uint8(x).float() / 255, prompts, target=[None, "quantum"])
    for key in ("reward", "edit_distance", "valid"):
        assert torch.equal(got[key], want[key]), key
    assert got["reward"][0] > 0.9 and got["reward"][1] > 0.8


def test_remote_bad_input_and_bad_servers(serve):
    srv = serve(RewardService(build_reward("colorfulness")))
    remote = RemoteReward(srv.url, retries=0)
    x = torch.rand(2, 1, 3, 8, 8)
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        remote(x * 255, ["a", "b"])
    with pytest.raises(ValueError, match="rank 5"):
        remote(x[:, 0], ["a", "b"])
    with pytest.raises(ValueError, match="C in \\(3,\\)"):              # channels come from /info
        remote(x[:, :, :1], ["a", "b"])
    with pytest.raises(ValueError, match="3 prompts for a batch of 2"):
        remote(x, ["a", "b", "c"])
    with pytest.raises(TypeError, match="meta 'thing'.*cannot be sent"):
        remote(x, ["a", "b"], thing=object())
    with pytest.raises(ValueError, match="serves reward 'colorfulness', expected 'ocr'"):
        RemoteReward(srv.url, expected_name="ocr")
    with pytest.raises(ValueError, match="url must start with http"):
        RemoteReward("127.0.0.1:1")
    # the server itself rejects malformed bodies with a clear 400
    for body, match in [(b"not safetensors", "not a safetensors"),
                        (encode_score_request(torch.zeros(1, 1, 1, 4, 4, dtype=torch.uint8), ["a"]), "C in")]:
        req = urllib.request.Request(srv.url + "/score", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400 and match in json.loads(err.value.read())["error"]
    with pytest.raises(ValueError, match="refusing to bind '0.0.0.0'.*--allow-remote"):
        check_host("0.0.0.0")
    for ok in ("127.0.0.1", "::1", "localhost"):
        check_host(ok)
    check_host("0.0.0.0", allow_remote=True)
    with pytest.raises(ValueError, match="refusing"):
        RewardServer(RewardService(build_reward("colorfulness")), "0.0.0.0", 0)


def test_unreachable_server_fails_fast_at_build_or_marks_invalid(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ConnectionError, match="genrl reward-serve"):
        RemoteReward(url, retries=1, backoff=0.0)
    lazy = RemoteReward(url, retries=0, connect=False)
    with caplog.at_level(logging.WARNING, logger="genrl.rewards.remote"):
        out = lazy(torch.rand(3, 1, 3, 8, 8), ["a"] * 3)
    assert not out["valid"].any() and torch.isnan(out["reward"]).all()
    assert url in caplog.text and "Connection refused" in caplog.text


def _start_server_process(*args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "genrl", "reward-serve", *args, "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # blocks until the server listens (or exits)
    if "serving reward" not in line:
        proc.kill()
        raise AssertionError(f"server did not start: {line!r} {proc.stderr.read()}")
    return proc, line.split(" at ")[1].split()[0]


def test_killed_server_process_gives_nan_invalid_and_a_logged_error(caplog):
    proc, url = _start_server_process("--reward", "colorfulness", "--batch-size", "2")
    try:
        assert url.startswith("http://127.0.0.1:")
        mgr = RewardManager([{"name": "remote", "kwargs": {"url": url, "retries": 1, "backoff": 0.01}},
                             {"name": "colorfulness"}])
        x = torch.rand(4, 1, 3, 8, 8)
        before = mgr(x, ["a"] * 4)
        assert before.valid.all()
        assert torch.equal(before.rewards["remote"], build_reward("colorfulness")(quantize_uint8(x).float() / 255,
                                                                                  ["a"] * 4)["reward"])
    finally:
        proc.kill()
        proc.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="genrl.rewards.remote"):
        after = mgr(x, ["a"] * 4)  # on_error="raise" manager: the client never raises for a dead server
    assert torch.isnan(after.rewards["remote"]).all() and not after.reward_valid["remote"].any()
    assert after.reward_valid["colorfulness"].all() and torch.isnan(after.total).all()
    assert after.metrics()["remote/invalid_fraction"] == 1.0
    assert url in caplog.text and "marking them invalid" in caplog.text


# ---------------------------------------------------------------------------------------------- GRPO
def _fit(args: list[str], tiny_policy: str, tiny_text_encoder: str) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", str(ROOT / "configs/quickstart.yaml"), "--config", str(ROOT / "configs/tiny/grpo.yaml"),
            "--trainer.enable_progress_bar=false", f"--model.init_args.generator.pretrained={tiny_policy}",
            "--model.init_args.generator.components={}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}"]
    return GenRLCLI(args=["fit", *base, *args])


def test_grpo_step_continues_when_the_server_dies_mid_batch(tmp_path, monkeypatch, caplog, serve, tiny_policy,
                                                            tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    srv = serve(RewardService(build_reward("colorfulness")))
    real = RemoteReward._score_chunk

    def first_chunk_then_kill(self, body, n):
        answer = real(self, body, n)
        srv.stop()  # the server dies after answering the first request of the batch
        return answer

    monkeypatch.setattr(RemoteReward, "_score_chunk", first_chunk_then_kill)
    rewards = [{"name": "shapes"},
               {"name": "remote", "kwargs": {"url": srv.url, "batch_size": 4, "retries": 0,
                                             "expected_name": "colorfulness"}}]
    with caplog.at_level(logging.WARNING, logger="genrl.rewards.remote"):
        cli = _fit(["--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                    f"--model.init_args.rewards={json.dumps(rewards)}"], tiny_policy, tiny_text_encoder)
    m = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 1  # the update ran on the valid half
    assert float(m["reward/remote/invalid_fraction"]) == 0.5 and float(m["reward/invalid_fraction"]) == 0.5
    assert math.isfinite(float(m["reward/total"])) and math.isfinite(float(m["reward/remote/reward"]))
    assert srv.url in caplog.text and "scoring samples 4:8 of 8 failed" in caplog.text


# ---------------------------------------------------------------------------------------------- standardize
def test_per_reward_standardize_and_state():
    specs = [{"name": "colorfulness", "standardize": True, "weight": 2.0}, {"name": "colorfulness", "weight": 0.5}]
    mgr = RewardManager(specs)
    torch.manual_seed(0)
    x1, x2 = torch.rand(6, 1, 3, 8, 8), torch.rand(5, 1, 3, 8, 8) ** 2
    res = mgr(x1, ["a"] * 6)
    r = res.rewards["colorfulness"].double()
    z = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(res.total, (2.0 * z + 0.5 * r).float())
    assert "colorfulness/running_mean" in res.stats and "colorfulness_2/running_mean" not in res.stats
    resumed = RewardManager(specs)
    resumed.load_state_dict(mgr.state_dict())
    assert torch.equal(resumed(x2, ["a"] * 5).total, mgr(x2, ["a"] * 5).total)
    with pytest.raises(ValueError, match="standardize must be true or false"):
        RewardManager([{"name": "colorfulness", "standardize": "yes"}])


# ---------------------------------------------------------------------------------------------- rewards check
@register_reward("test_check_weighted")
class _Weighted(RewardModel):
    weight_files = {"model.safetensors": "the weights", "config.json": "the architecture"}

    def __init__(self, path=None, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)

    def score(self, pixels, prompts, **meta):  # pragma: no cover - never built here
        return {"reward": pixels.mean(dim=(1, 2, 3, 4))}


def test_rewards_check_command(tmp_path, capsys):
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model:\n  init_args:\n    rewards:\n      - name: shapes\n"
                   f"      - name: test_check_weighted\n        path: {weights}\n")
    good = tmp_path / "good.yaml"
    good.write_text("model:\n  init_args:\n    rewards:\n      - {name: shapes}\n      - {name: colorfulness}\n")

    with pytest.raises(SystemExit) as code:
        genrl_main(["rewards", "check", "--config", str(bad)])
    out = capsys.readouterr().out
    assert code.value.code == 1
    assert "model.safetensors" in out and "MISSING" in out and "config.json" in out
    status = {line.split()[3]: line.split()[4] for line in out.splitlines() if "test_check_weighted" in line}
    assert status == {"model.safetensors": "MISSING", "config.json": "ok"}

    with pytest.raises(SystemExit) as code:
        genrl_main(["rewards", "check", "--config", str(good)])
    assert code.value.code == 0 and "MISSING" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as code:  # later files override earlier ones, like the training CLI
        genrl_main(["rewards", "check", "--config", str(bad), "--config", str(good)])
    assert code.value.code == 0
    capsys.readouterr()
    (weights / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit) as code:
        genrl_main(["rewards", "check", "--reward", f"test_check_weighted:{weights}", "--reward", "ocr"])
    assert code.value.code == 0
    with pytest.raises(SystemExit) as code:
        genrl_main(["rewards", "check", "--reward", "no_such_reward", "--reward", "shapes:/tmp"])
    out = capsys.readouterr().out
    assert code.value.code == 1 and "UNKNOWN" in out and "BAD PATH" in out
    with pytest.raises(SystemExit) as code:
        genrl_main(["rewards", "check"])
    assert code.value.code == 2
