"""RewardHackingMonitor (genrl/callbacks/hacking.py) with a real ``lightning.Trainer`` and tiny dummy modules whose
validation videos change in a known way while the logged training reward ``val/total`` rises (or not)."""

from __future__ import annotations

import json
import logging

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from genrl.callbacks import RewardHackingMonitor
from genrl.data.shapes import ShapesWorldConfig, real_videos
from genrl.eval.gold import frame_statistics

N, T, H, W = 8, 3, 4, 4


def balanced_patterns(n: int = N, seed: int = 0) -> torch.Tensor:
    """n grey videos [n, T, 3, H, W] whose pixels are 0.5 +- 0.2 in a random but exactly balanced pattern (mean
    brightness exactly 0.5, saturation 0, static frames), different for every video."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.tensor([1.0, -1.0]).repeat(H * W // 2)
    out = []
    for _ in range(n):
        frame = (0.5 + 0.2 * signs[torch.randperm(H * W, generator=g)]).reshape(1, 1, H, W)
        out.append(frame.expand(T, 3, H, W))
    return torch.stack(out).double()


class Dummy(L.LightningModule):
    """Validation at global_step g returns ``base - darken * g`` (clamped to [0, 1]) and logs ``val/total =
    0.5 + reward_slope * g``; ``collapse_at``: from that step on every video equals the first."""

    def __init__(self, darken: float = 0.05, reward_slope: float = 0.1, collapse_at: int | None = None,
                 prompts: list[str] | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.darken, self.reward_slope, self.collapse_at = darken, reward_slope, collapse_at
        self.base = balanced_patterns()
        self.prompts = prompts or [f"prompt {i}" for i in range(len(self.base))]

    def training_step(self, batch, batch_idx):
        return (self.w - 1.0).square().sum()

    def validation_step(self, batch, batch_idx):
        g = self.global_step
        videos = (self.base - self.darken * g).clamp(0, 1)
        if self.collapse_at is not None and g >= self.collapse_at:
            videos = videos[:1].expand_as(videos).clone()
        self.log("val/total", 0.5 + self.reward_slope * g, batch_size=len(videos))
        return {"videos": videos.float(), "prompts": list(self.prompts)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path, module: L.LightningModule, monitor: RewardHackingMonitor, steps: int = 6, sanity: bool = True):
    trainer = L.Trainer(
        max_steps=steps, val_check_interval=1, check_val_every_n_epoch=None, limit_val_batches=1,
        num_sanity_val_steps=-1 if sanity else 0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[monitor],
    )
    trainer.fit(module, DataLoader(torch.zeros(64, 1), batch_size=1), DataLoader(torch.zeros(1, 1), batch_size=1))
    return trainer


def hack_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "possible reward hacking" in r.getMessage()]


def test_darkening_with_rising_reward_is_flagged_once_at_the_first_validation_past_the_threshold(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="genrl.callbacks.hacking")
    monitor = RewardHackingMonitor()
    trainer = fit(tmp_path, Dummy(), monitor)
    # brightness 0.5 - 0.05 g: relative drift 0.1 g from the sanity-check baseline at step 0 -> past 0.25 at g = 3
    assert monitor.baseline["iteration"] == 0 and monitor.baseline["source"] == "sanity_check"
    assert monitor.baseline["metrics"]["brightness"] == pytest.approx(0.5, abs=1e-12)
    assert monitor.flagged == ["brightness"]
    flag = monitor.flags[0]
    assert flag["iteration"] == 3
    assert flag["first"] == pytest.approx(0.5, abs=1e-12) and flag["current"] == pytest.approx(0.35, abs=1e-7)
    assert flag["reward_change"] == pytest.approx(0.3, abs=1e-6)
    messages = hack_warnings(caplog)
    assert len(messages) == 1  # once, although steps 4-6 are past the threshold too
    assert "'brightness'" in messages[0] and "iteration 3" in messages[0]
    assert "0.5 at iteration 0 -> 0.35" in messages[0] and "val/total" in messages[0] and "+0.3" in messages[0]
    # logged next to the training reward
    assert float(trainer.callback_metrics["gold/brightness"]) == pytest.approx(0.2, abs=1e-6)
    assert float(trainer.callback_metrics["gold/saturation"]) == 0.0
    # the record a driver reads
    record = json.loads((tmp_path / "hacking.json").read_text())
    assert [f["metric"] for f in record["flags"]] == ["brightness"] and record["flags"][0]["iteration"] == 3
    assert [h["iteration"] for h in record["history"]] == [0, 1, 2, 3, 4, 5, 6]
    assert record["history"][3]["metrics"]["brightness"] == pytest.approx(0.35, abs=1e-7)
    assert record["history"][3]["reward"] == pytest.approx(0.8, abs=1e-6)
    assert record["stopped"] is False and record["checkpoint"] is None
    assert trainer.global_step == 6


def test_without_a_sanity_check_the_first_validation_is_the_baseline(tmp_path):
    monitor = RewardHackingMonitor()
    fit(tmp_path, Dummy(), monitor, sanity=False)
    # baseline 0.45 at step 1; drift 0.05 (g - 1) / 0.45 > 0.25 first at g = 4
    assert monitor.baseline["iteration"] == 1 and monitor.baseline["source"] == "validation"
    assert monitor.baseline["metrics"]["brightness"] == pytest.approx(0.45, abs=1e-7)
    assert [(f["metric"], f["iteration"]) for f in monitor.flags] == [("brightness", 4)]


def test_honest_run_triggers_nothing(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="genrl.callbacks.hacking")
    monitor = RewardHackingMonitor(stop_on_hack=True)
    trainer = fit(tmp_path, Dummy(darken=0.0), monitor)
    assert monitor.flags == [] and hack_warnings(caplog) == []
    assert trainer.global_step == 6 and not (tmp_path / "checkpoints").exists()
    assert json.loads((tmp_path / "hacking.json").read_text())["flags"] == []


def test_darkening_without_a_reward_rise_is_not_flagged(tmp_path):
    monitor = RewardHackingMonitor()
    fit(tmp_path, Dummy(reward_slope=-0.05), monitor)
    assert monitor.flags == []


def test_stop_on_hack_saves_a_checkpoint_and_stops(tmp_path):
    monitor = RewardHackingMonitor(stop_on_hack=True)
    trainer = fit(tmp_path, Dummy(), monitor, steps=10)
    assert trainer.global_step == 3  # stopped right after the flagging validation
    ckpt = tmp_path / "checkpoints" / "hacking.ckpt"
    assert ckpt.is_file() and not (tmp_path / "checkpoints" / "hacking.ckpt.tmp").exists()
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3
    state = next(v for k, v in saved["callbacks"].items() if "RewardHackingMonitor" in k)
    assert state["stopped"] is True and state["flags"][0]["metric"] == "brightness"
    record = json.loads((tmp_path / "hacking.json").read_text())
    assert record["stopped"] is True and record["checkpoint"] == str(ckpt)


def test_diversity_collapse_is_flagged_whatever_the_reward(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="genrl.callbacks.hacking")
    monitor = RewardHackingMonitor()
    fit(tmp_path, Dummy(darken=0.0, reward_slope=0.0, collapse_at=2), monitor)
    assert [(f["metric"], f["iteration"]) for f in monitor.flags] == [("diversity_batch", 2)]
    assert monitor.flags[0]["current"] == 0.0 and monitor.flags[0]["first"] > 0.1
    assert "collapsed" in hack_warnings(caplog)[0]
    # repeated prompts: the within-prompt diversity is the one tracked
    monitor = RewardHackingMonitor()
    prompts = [f"prompt {i // 2}" for i in range(N)]
    fit(tmp_path / "within", Dummy(darken=0.0, reward_slope=0.0, collapse_at=4, prompts=prompts), monitor)
    assert [(f["metric"], f["iteration"]) for f in monitor.flags] == [("diversity_within_prompt", 4)]


@pytest.mark.parametrize(("knobs", "expected"), [
    ({"brightness_drift": 0.45}, [("brightness", 5)]),   # drift 0.1 g > 0.45 first at g = 5
    ({"reward_rise": 0.35}, [("brightness", 4)]),        # reward rise 0.1 g > 0.35 first at g = 4
    ({"reward_rise": 1.0}, []),                          # the reward never rises by 1
])
def test_each_threshold_knob_moves_the_flag(tmp_path, knobs, expected):
    monitor = RewardHackingMonitor(**knobs)
    fit(tmp_path, Dummy(), monitor)
    assert [(f["metric"], f["iteration"]) for f in monitor.flags] == expected


class Scripted(Dummy):
    """Validation at global_step g returns ``video_fn(g)`` and logs ``val/total = 0.5 + 0.1 g``."""

    def __init__(self, video_fn, prompts: list[str] | None = None) -> None:
        super().__init__(prompts=prompts)
        self.video_fn = video_fn

    def validation_step(self, batch, batch_idx):
        videos = self.video_fn(self.global_step)
        self.log("val/total", 0.5 + 0.1 * self.global_step, batch_size=len(videos))
        return {"videos": videos.float(), "prompts": list(self.prompts)}


def test_constant_frames_diversity_and_saturation_knobs(tmp_path):
    base = balanced_patterns()

    def fade(g):  # towards flat grey: per-channel pixel std 0.2 (1 - 0.25 g), diversity x (1 - 0.25 g)
        return 0.5 + max(0.0, 1.0 - 0.25 * g) * (base - 0.5)

    monitor = RewardHackingMonitor(diversity_drop=0.7)
    fit(tmp_path / "a", Scripted(fade), monitor)
    # std < 0.02 first at g = 4 (std 0); diversity fall 0.25 g > 0.7 first at g = 3
    assert {f["metric"]: f["iteration"] for f in monitor.flags} == {"diversity_batch": 3, "constant_frames": 4}
    monitor = RewardHackingMonitor(diversity_drop=0.9, constant_std=0.06, constant_frames_rise=0.5)
    fit(tmp_path / "b", Scripted(fade), monitor)
    # std 0.05 < 0.06 at g = 3: every frame constant (rise 1 > 0.5); diversity fall 1.0 > 0.9 at g = 4
    assert {f["metric"]: f["iteration"] for f in monitor.flags} == {"constant_frames": 3, "diversity_batch": 4}

    def desaturate(g):  # red channel 0.3 / 0.7, green = blue = red * 0.1 g: saturation exactly 1 - 0.1 g
        v = base.clone()
        v[:, :, 1] = v[:, :, 2] = v[:, :, 0] * 0.1 * g
        return v

    for drift, step in ((0.25, 3), (0.45, 5)):
        monitor = RewardHackingMonitor(saturation_drift=drift, brightness_drift=100.0)
        fit(tmp_path / f"s{drift}", Scripted(desaturate), monitor)
        assert [(f["metric"], f["iteration"]) for f in monitor.flags] == [("saturation", step)]
        assert monitor.flags[0]["first"] == pytest.approx(1.0, abs=1e-12)


def test_gold_rewards_and_real_shapes_videos(tmp_path):
    world = ShapesWorldConfig()
    prompts = ["a red circle moving left slowly", "a blue square staying still", "a green triangle moving up quickly",
               "a yellow circle moving right slowly"]
    videos = real_videos(world, prompts, seed=5).double()
    b0 = float(frame_statistics(videos)["brightness"].mean())

    def dim(g):  # every pixel x (1 - 0.1 g): mean luma b0 (1 - 0.1 g)
        return videos * (1.0 - 0.1 * g)

    monitor = RewardHackingMonitor(gold_rewards=[{"name": "brightness"}, {"name": "shapes"}], real="shapes",
                                   fd_reference=64, gold_reward_drop=0.25 * b0, brightness_drift=100.0,
                                   fd_rise=1e9, flicker_gap_rise=1.0)
    trainer = fit(tmp_path, Scripted(dim, prompts=prompts), monitor, steps=4)
    metrics = trainer.callback_metrics
    for key in ("gold/fd", "gold/flicker_gap", "gold/shapes/color", "gold/shapes/direction", "gold/shapes/all_correct",
                "gold/brightness/reward", "gold/brightness/brightness"):
        assert key in metrics, key
    first = monitor.history[0]["metrics"]
    assert first["flicker_gap"] < 0.01  # real videos of the same prompts from other starts
    assert first["shapes/color"] > 0.9 and first["shapes/all_correct"] == 1.0
    assert first["brightness/reward"] == pytest.approx(b0, rel=1e-5)
    # the gold brightness reward falls by 0.1 g b0: past 0.25 b0 first at g = 3 (both of its keys); the shapes
    # verifier reads chroma and motion, which dimming keeps: not flagged
    assert {f["metric"]: f["iteration"] for f in monitor.flags} == {"brightness/reward": 3, "brightness/brightness": 3}


def test_argument_checks():
    with pytest.raises(ValueError, match="real"):
        RewardHackingMonitor(real="kinetics")
    with pytest.raises(ValueError, match="brightness_drift"):
        RewardHackingMonitor(brightness_drift=-1.0)
    with pytest.raises(ValueError, match="unknown reward"):
        RewardHackingMonitor(gold_rewards=[{"name": "no_such_reward"}])


def test_the_fd_reference_fit_is_shared_within_a_process():
    """Two monitors on the same world, prompts, seed and dims reuse one PCA fit (the same object); another seed fits
    anew."""
    from genrl.callbacks.hacking import _reference_fd
    from genrl.data.shapes import ShapesWorldConfig

    world, prompts = ShapesWorldConfig(), ("a red circle moving left slowly", "a blue square")
    a = _reference_fd(world, prompts * 8, 5, 4)
    assert _reference_fd(ShapesWorldConfig(), prompts * 8, 5, 4) is a
    assert _reference_fd(world, prompts * 8, 6, 4) is not a
