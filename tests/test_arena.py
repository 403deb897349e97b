"""The method arena (evaluation/arena.py): config checks before any training, the budget probe, and a tiny arena end
to end through `genrl fit` and the evaluation runner: a finished arena rereads to the identical leaderboard.json, and
an entrant added by one config line appears in the table while finished runs are not retrained."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation import arena as A  # noqa: E402


def _write(tmp_path: Path, body: dict) -> Path:
    path = tmp_path / "arena.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _base(tmp_path: Path, **over) -> dict:
    body = {
        "name": "t", "out": str(tmp_path / "out"), "start": {"path": str(ROOT / "assets/shapes-dit")},
        "budget": 100, "seeds": [0],
        "entrants": {"grpo": "configs/quickstart.yaml", "ram": "configs/ram/shapes.yaml"},
        "evaluation": {"prompts": "shapes:heldout", "seeds": [1000], "gold": "shapes/all_correct"},
    }
    body.update(over)
    return body


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("track", sorted(p.name for p in (ROOT / "configs/arena").glob("*.yaml")))
def test_shipped_tracks_pass_every_static_check(track):
    arena = A.load_arena(ROOT / "configs/arena" / track)
    assert len(arena.entrants) >= 5 and len(arena.seeds) >= 2
    assert arena.evaluation["gold"].startswith("shapes/") and arena.evaluation["real"] == "shapes"


def test_a_good_config_parses_with_one_line_per_entrant(tmp_path):
    arena = A.load_arena(_write(tmp_path, _base(tmp_path, entrants={
        "grpo": "configs/quickstart.yaml --trainer.val_check_interval=10",
        "nft": "configs/ram/shapes.yaml --config configs/ram/nft_shapes.yaml"})))
    assert [e.name for e in arena.entrants] == ["grpo", "nft"]
    assert arena.entrants[1].configs == ["configs/ram/shapes.yaml", "configs/ram/nft_shapes.yaml"]
    assert A.method_of(arena.entrants[0]) == "genrl.methods.GRPO"
    assert A.method_of(arena.entrants[1]) == "genrl.methods.RAM"
    cmd = A._fit_command(arena, arena.entrants[0], tmp_path / "r", 7, budget=100, max_steps=50, resume=True)
    assert cmd[-2:] == ["--ckpt_path", "last"]
    assert "--seed_everything=7" in cmd and "--compute_budget=100" in cmd and "--trainer.max_steps=50" in cmd
    assert f"--model.init_args.generator.pretrained={arena.start}" in cmd
    # the hash ignores formatting and key order, follows content
    again = A.load_arena(_write(tmp_path, dict(reversed(list(_base(tmp_path, entrants={
        "grpo": "configs/quickstart.yaml --trainer.val_check_interval=10",
        "nft": "configs/ram/shapes.yaml --config configs/ram/nft_shapes.yaml"}).items())))))
    assert again.config_hash == arena.config_hash
    assert A.load_arena(_write(tmp_path, _base(tmp_path))).config_hash != arena.config_hash


@pytest.mark.parametrize("over, words", [
    ({"entrants": {"mystery": "configs/quickstart.yaml --model.class_path=genrl.methods.NoSuchMethod"}},
     ["'mystery'", "unknown method", "NoSuchMethod"]),
    ({"entrants": {"broken": "configs/quickstart.yaml --model.class_path=no_such_package.Method"}},
     ["'broken'", "cannot import 'no_such_package'", "ModuleNotFoundError"]),
    ({"entrants": {"lost": "configs/nope.yaml"}}, ["'lost'", "configs/nope.yaml", "not found"]),
    ({"start": {"path": "assets/no-such-model"}}, ["assets/no-such-model", "does not exist"]),
    ({"start": {"path": str(ROOT / "assets/shapes-dit"), "keys": ["model.init_args.student.pretrained"]}},
     ["'grpo'", "model.init_args.student.pretrained"]),
    ({"budget": 0}, ["budget 0", "positive"]),
    ({"budget": "lots"}, ["budget 'lots'"]),
    ({"seeds": []}, ["seeds"]),
    ({"entrants": {"grpo": "configs/quickstart.yaml --run_dir=/tmp/x"}}, ["'grpo'", "--run_dir", "set by the arena"]),
    ({"evaluation": {"prompts": "shapes:heldout", "seeds": [0], "gold": "shapes/all_correct"}},
     ["evaluation.seeds [0]", "training seeds"]),
])
def test_bad_configs_fail_before_training_naming_the_entrant(tmp_path, over, words):
    with pytest.raises(A.ArenaConfigError) as err:
        A.load_arena(_write(tmp_path, _base(tmp_path, **over)))
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written


def test_a_start_made_by_a_prepare_step_is_accepted(tmp_path):
    made = tmp_path / "student"
    body = _base(tmp_path, start={"path": str(made)},
                 prepare=[{"name": "student", "command": f"mkdir -p {made}", "creates": str(made)}])
    arena = A.load_arena(_write(tmp_path, body))
    assert A.prepare(arena) == [f"mkdir -p {made}"] and made.is_dir()


def test_probe_refuses_a_budget_no_entrant_can_reach(tmp_path, monkeypatch):
    """The probe runs one iteration per entrant; with 40 and 100 forward-equivalents per iteration (one optimizer
    step each) and max_steps 10, a budget of 1,001 is out of reach for both, 999 for one only."""
    costs = {"grpo": 40.0, "ram": 100.0}

    def fake_run(cmd, log):
        folder = Path(next(c for c in cmd if c.startswith("--run_dir=")).split("=", 1)[1])
        name = folder.name
        A.write_record(folder / "compute.json", {"finished": True, "forward_equivalents": costs[name],
                                                "iterations": 1, "global_step": 1})

    monkeypatch.setattr(A, "_run", fake_run)
    arena = A.load_arena(_write(tmp_path, _base(tmp_path, budget=1001, max_steps=10)))
    with pytest.raises(A.ArenaConfigError, match=r"budget 1001 cannot be reached.*grpo reaches 400.*ram reaches 1000"):
        A.probe(arena)
    arena = A.load_arena(_write(tmp_path, _base(tmp_path, budget=999, max_steps=10)))
    got = A.probe(arena)
    assert got["grpo"]["forward_equivalents_per_iteration"] == 40.0
    assert got["ram"]["optimizer_steps_per_iteration"] == 1


def _tiny_arena(tmp_path: Path, tiny_policy: str, tiny_text_encoder: str, entrants: dict) -> Path:
    body = {
        "name": "tiny", "out": str(tmp_path / "out"), "start": {"path": tiny_policy}, "budget": 100,
        "seeds": [0], "seed_flags": ["--seed_everything", "--model.init_args.seed"],
        "common": ["--config", str(ROOT / "configs/tiny/grpo.yaml"), "--model.init_args.generator.components={}",
                   f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.val_check_interval=1",
                   "--trainer.logger=false", "--trainer.enable_progress_bar=false"],
        "entrants": entrants,
        "evaluation": {"prompts": "shapes:heldout", "limit": 2, "samples_per_prompt": 2, "seeds": [1000],
                       "samplers": {"recorded": "", "common": "--steps 2 --cfg-scale 1"},
                       "generate_flags": f"--text-encoder {tiny_text_encoder}",
                       "start_recorded": "--steps 3 --cfg-scale 1",
                       "rewards": ["shapes"], "dimensions": ["temporal_flickering"], "real": "shapes",
                       "gold": "shapes/reward", "training_reward": "shapes/reward"},
    }
    return _write(tmp_path, body)


def test_tiny_arena_end_to_end_rerun_identical_and_one_line_entrant(tmp_path, tiny_policy, tiny_text_encoder):
    config = _tiny_arena(tmp_path, tiny_policy, tiny_text_encoder, {"grpo": "configs/quickstart.yaml"})
    board = A.main(["--config", str(config), "--no-probe"])
    out = tmp_path / "out"
    first = (out / "leaderboard.json").read_bytes()
    row = board["entrants"][0]
    assert row["name"] == "grpo" and row["rank"] == 1 and row["standing"] == "winner"
    compute = json.loads((out / "runs/grpo/s0/compute.json").read_text())
    # tiny GRPO: 2 prompts x 4 rollouts x 4 steps x CFG 2 = 64 forwards + 48 backpropagated (x2) = 160 per iteration
    assert compute["stopped_by_budget"] and compute["forward_equivalents"] == 160 and compute["iterations"] == 1
    assert row["compute"]["forward_equivalents"]["mean"] == compute["forward_equivalents"]
    assert row["samplers"]["recorded"]["shapes/reward"]["mean"] is not None
    assert "fd" in row["samplers"]["recorded"] and "brightness" in row["samplers"]["common"]
    assert row["hacking"]["score"] == pytest.approx(0.0, abs=1e-12)  # training reward == gold here
    for name in ("leaderboard.md", "leaderboard.html", "plots/reward_vs_compute.png", "plots/final_metrics.png",
                 "plots/strips.png"):
        assert (out / name).is_file(), name
    assert board["protocol"]["config_hash"] == A.load_arena(config).config_hash
    start_eval = json.loads((out / "eval/start/arena_eval.json").read_text())
    assert start_eval["recorded"]["settings"]["steps"] == 3  # start_recorded: the start recorded no sampler
    assert start_eval["common"]["settings"]["steps"] == 2 and start_eval["recorded"]["metrics"]["nfe"]["mean"] == 3

    # a finished arena rereads to the identical leaderboard.json (nothing retrained, nothing re-evaluated)
    A.main(["--config", str(config), "--report"])
    assert (out / "leaderboard.json").read_bytes() == first
    mtime = (out / "runs/grpo/s0/compute.json").stat().st_mtime

    # one more line: a second entrant appears; the finished one is skipped
    config = _tiny_arena(tmp_path, tiny_policy, tiny_text_encoder, {
        "grpo": "configs/quickstart.yaml", "grpo_lr": "configs/quickstart.yaml "
        "--model.init_args.optimizer.init_args.lr=0.1"})
    board = A.main(["--config", str(config), "--no-probe"])
    assert sorted(r["name"] for r in board["entrants"]) == ["grpo", "grpo_lr"]
    fd = {r["name"]: r["samplers"]["recorded"]["fd"]["mean"] for r in board["entrants"]}
    assert fd["grpo"] != fd["grpo_lr"]  # the entrant's own flag (lr 0.1) wins over the common config's lr
    assert (out / "runs/grpo/s0/compute.json").stat().st_mtime == mtime
    assert "grpo_lr" in (out / "leaderboard.md").read_text()


def test_only_and_locks_share_the_work_between_processes(tmp_path, monkeypatch):
    """A run folder whose arena.lock names another live process is left to it (this pid's own lock and a dead pid's
    are not locks); --only with a name that is not an entrant fails before anything runs, naming it."""
    import os
    import subprocess

    folder = tmp_path / "run"
    folder.mkdir()
    assert not A._locked(folder)  # no lock file
    (folder / "arena.lock").write_text(str(os.getpid()))
    assert not A._locked(folder)  # this process's own lock
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (folder / "arena.lock").write_text(str(other.pid))
        assert A._locked(folder)
    finally:
        other.kill()
        other.wait()
    assert not A._locked(folder)  # the process is gone
    config = _write(tmp_path, _base(tmp_path))
    with pytest.raises(A.ArenaConfigError, match=r"--only names \['dmd'\], which are not entrants"):
        A.main(["--config", str(config), "--only", "grpo,dmd"])
    assert not (tmp_path / "out").exists()


def test_evaluate_skips_a_run_another_process_still_trains(tmp_path, monkeypatch):
    """With --only, a run another process has not finished (no finished compute.json, no export yet) is skipped, not
    an error; a finished run without an export is still an error naming the callback to add."""
    arena = A.load_arena(_write(tmp_path, _base(tmp_path)))
    seen = []
    monkeypatch.setattr(A, "evaluate_model", lambda arena, model, dest, flags="": seen.append(Path(model)) or {})
    done = A.run_dir(arena, "grpo", 0)
    (done / "runs/x/export").mkdir(parents=True)
    (done / "runs/x/export/config.json").write_text("{}")
    A.write_record(done / "compute.json", {"finished": True})
    A.write_record(A.run_dir(arena, "ram", 0) / "compute.json", {"finished": False})
    out = A.evaluate(arena, ["grpo", "ram"])
    assert list(out["runs"]) == ["grpo"] and seen[1:] == [done / "runs/x/export"]
    A.write_record(A.run_dir(arena, "ram", 0) / "compute.json", {"finished": True})
    with pytest.raises(FileNotFoundError, match="'ram' seed 0: no export .*DiffusersExport"):
        A.evaluate(arena, ["ram"])


def test_report_without_stored_runs_says_they_are_not_committed(tmp_path):
    """--report on a checkout without the run folders (they are not committed) names the published leaderboard and
    the command that trains the runs, instead of calling them unfinished."""
    config = _write(tmp_path, _base(tmp_path, publish=str(tmp_path / "pub")))
    with pytest.raises(RuntimeError, match=r"no stored runs under .*pub/leaderboard.json.*python -m evaluation arena"):
        A.main(["--config", str(config), "--report"])
