"""Offline Diffusion-DPO: the preference-pair data module (pairs.jsonl in file order, scores.jsonl under the tie rule,
per-epoch shuffling, rank slices, exact resume, bad input) and genrl.methods.DPO's offline path through the real CLI
(log 2 at the reference, the learned preference follows the labels, resume equals uninterrupted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.data.preference_pairs import PreferencePairDataModule, load_pair_set
from genrl.data.video_io import read_video, write_video

pytest.importorskip("decord")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["--config", str(ROOT / "configs/base/shapes.yaml"),
           "--config", str(ROOT / "configs/dpo/offline_shapes.yaml")]
PROMPTS = ["a red circle moving left slowly", "a blue square moving up quickly", "a green triangle staying still"]


def grey(level: int, frames: int = 8, size: tuple[int, int] = (16, 16)) -> torch.Tensor:
    """[T, 3, H, W] of one grey level (level / 255): a decoded clip tells which file it came from."""
    return torch.full((frames, 3, *size), level / 255)


def level_of(pixels: torch.Tensor) -> int:
    """The grey level of a decoded clip, to the nearest multiple of 10 (the levels written; the codec moves them by
    a unit or two)."""
    return round(float(pixels.mean()) * 25.5) * 10


def write_folder(root: Path, videos: dict[str, torch.Tensor], lines: list[dict], name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for file, pixels in videos.items():
        write_video(root / file, pixels, fps=8)
    (root / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def scored_folder(root: Path) -> Path:
    """Four prompts: a clear order; all equal; NaN members; one valid score only."""
    rows = [("a0", "a", 0.2), ("a1", "a", 0.9), ("a2", "a", 0.5),
            ("b0", "b", 0.5), ("b1", "b", 0.5),
            ("c0", "c", None), ("c1", "c", 0.3), ("c2", "c", 0.7), ("c3", "c", float("nan")),
            ("d0", "d", None), ("d1", "d", 0.4)]
    videos = {f"{f}.mp4": grey(10 + 20 * i) for i, (f, _, _) in enumerate(rows)}
    lines = [{"file": f"{f}.mp4", "prompt": p, "score": s} for f, p, s in rows]
    return write_folder(root, videos, lines, "scores.jsonl")  # a failed score as null and as Python's NaN


def test_scored_pairs_follow_the_tie_rule_and_never_pair_nan(tmp_path):
    folder = scored_folder(tmp_path / "s")
    got = lambda **kw: [(p.prompt, p.chosen, p.rejected) for p in load_pair_set(folder, **kw)]  # noqa: E731
    assert got() == [("a", "a1.mp4", "a0.mp4"), ("c", "c2.mp4", "c1.mp4")]  # b tied (skip), d one valid score
    # arbitrary: the all-equal prompt gives (last, first) of the stable order, i.e. (b1, b0)
    assert got(tie="arbitrary") == [("a", "a1.mp4", "a0.mp4"), ("b", "b1.mp4", "b0.mp4"), ("c", "c2.mp4", "c1.mp4")]
    pairs = load_pair_set(folder)
    assert [p.margin for p in pairs] == pytest.approx([0.7, 0.4])
    # every strictly ordered pair, in line order; ties and NaN never; a margin threshold drops the close ones
    assert got(pairs="all") == [("a", "a1.mp4", "a0.mp4"), ("a", "a1.mp4", "a2.mp4"), ("a", "a2.mp4", "a0.mp4"),
                                ("c", "c2.mp4", "c1.mp4")]
    assert got(pairs="all", min_margin=0.35) == [("a", "a1.mp4", "a0.mp4"), ("a", "a1.mp4", "a2.mp4"),
                                                 ("c", "c2.mp4", "c1.mp4")]
    assert got(min_margin=0.5) == [("a", "a1.mp4", "a0.mp4")]


def labelled_folder(root: Path, n: int = 3) -> Path:
    videos = {f"v{i}.mp4": grey(20 + 30 * i) for i in range(n + 1)}
    lines = [{"prompt": PROMPTS[i % len(PROMPTS)], "chosen": f"v{i}.mp4", "rejected": f"v{i + 1}.mp4"}
             for i in range(n)]
    return write_folder(root, videos, lines, "pairs.jsonl")


def _dm(folder, **kw) -> PreferencePairDataModule:
    return PreferencePairDataModule(str(folder), num_frames=8, height=16, width=16, **kw)


def test_labelled_pairs_come_in_file_order_as_pixel_batches(tmp_path):
    folder = labelled_folder(tmp_path / "p", n=3)
    dm = _dm(folder, batch_size=2, shuffle=False, val="pairs")
    dm.setup("fit")
    it = iter(dm.make_train_loader())
    batches = [next(it) for _ in range(3)]  # 6 slots: pairs 0 1 2 0 1 2 (epochs continue across batches)
    assert [b["pair"].tolist() for b in batches] == [[0, 1], [2, 0], [1, 2]]
    assert [b["index"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]]
    b = batches[0]
    assert b["chosen"].shape == b["rejected"].shape == (2, 8, 3, 16, 16) and b["chosen"].dtype == torch.float32
    assert b["index"].dtype == torch.int64 and b["prompts"] == PROMPTS[:2]
    assert [level_of(x) for x in b["chosen"]] == [20, 50] and [level_of(x) for x in b["rejected"]] == [50, 80]
    assert b["chosen_file"] == ["v0.mp4", "v1.mp4"] and math.isnan(float(b["margin"][0]))
    # validation: the pairs' distinct prompts as prompt batches with negative ids
    val = dm.val_batches()
    assert [v["prompts"] for v in val] == [PROMPTS[:2], PROMPTS[2:]] and val[0]["index"].tolist() == [-1, -2]
    assert _dm(folder, val="shapes:heldout", val_size=3).val_batches()[0]["prompts"][0].startswith("a ")


def test_shuffle_is_per_epoch_deterministic_sliced_over_ranks_and_resumes(tmp_path):
    folder = labelled_folder(tmp_path / "p", n=6)

    def order(seed: int = 0, start: int = 0, rank: int = 0, world: int = 1, n: int = 4) -> list[int]:
        it = iter(_dm(folder, batch_size=3, seed=seed).make_train_loader(rank, world, start))
        return [j for _ in range(n) for j in next(it)["pair"].tolist()]

    full = order()
    epochs = full[:6], full[6:]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(6)) and epochs[0] != epochs[1]
    assert order() == full and order(seed=1) != full  # a pure function of (seed, epoch)
    assert order(start=2, n=2) == full[6:]  # a resumed loader continues at its batch
    # two ranks: contiguous slices of every global batch (3 is not divisible by 2: refused)
    with pytest.raises(ValueError, match="divisible"):
        order(world=2)
    it0, it1 = (iter(_dm(folder, batch_size=4).make_train_loader(r, 2)) for r in (0, 1))
    glob = iter(_dm(folder, batch_size=4).make_train_loader())
    for _ in range(2):
        b0, b1, g = next(it0), next(it1), next(glob)
        assert b0["pair"].tolist() + b1["pair"].tolist() == g["pair"].tolist()
        assert torch.equal(torch.cat([b0["chosen"], b1["chosen"]]), g["chosen"])


def test_bad_folders_fail_with_the_file_line_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="make_pair_folder"):
        load_pair_set(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="pairs.jsonl.*scores.jsonl"):
        load_pair_set(tmp_path / "empty")
    v = {"x.mp4": grey(40), "y.mp4": grey(90)}
    f = write_folder(tmp_path / "key", v, [{"prompt": "p", "chosen": "x.mp4"}], "pairs.jsonl")
    with pytest.raises(ValueError, match=r"line 1: missing key 'rejected'"):
        load_pair_set(f)
    f = write_folder(tmp_path / "gone", v, [{"prompt": "p", "chosen": "x.mp4", "rejected": "z.mp4"}], "pairs.jsonl")
    with pytest.raises(FileNotFoundError, match=r"line 1: rejected file .*z.mp4"):
        load_pair_set(f)
    f = write_folder(tmp_path / "same", v, [{"prompt": "p", "chosen": "x.mp4", "rejected": "x.mp4"}], "pairs.jsonl")
    with pytest.raises(ValueError, match="same file"):
        load_pair_set(f)
    (f / "scores.jsonl").write_text("")
    with pytest.raises(ValueError, match="both.*set source"):
        load_pair_set(f)
    f = write_folder(tmp_path / "one", {**v, "z.mp4": grey(140)}, [{"file": "x.mp4", "prompt": "p", "score": 1},
                     {"file": "y.mp4", "prompt": "p", "score": 0}, {"file": "z.mp4", "prompt": "q", "score": 0}],
                     "scores.jsonl")
    with pytest.raises(ValueError, match=r"line 3: prompt 'q' has a single video"):
        load_pair_set(f)
    f = write_folder(tmp_path / "json", v, [], "scores.jsonl")
    (f / "scores.jsonl").write_text('{"file": "x.mp4", "prompt": "p", "score": 1}\n{"file": \n')
    with pytest.raises(ValueError, match="line 2: malformed JSON"):
        load_pair_set(f)
    # every prompt tied under tie: skip: no pair, an error at setup naming the fix
    f = write_folder(tmp_path / "tied", v, [{"file": "x.mp4", "prompt": "p", "score": 1},
                                            {"file": "y.mp4", "prompt": "p", "score": 1}], "scores.jsonl")
    with pytest.raises(ValueError, match="tie: arbitrary"):
        _dm(f).setup("fit")
    assert len(_dm(f, tie="arbitrary").pair_set) == 1
    # members of different sizes / lengths read at their own size: refused when the batch is built, naming both files
    v2 = {"x.mp4": grey(40), "y.mp4": grey(90, size=(80, 80)), "z.mp4": grey(90, frames=6)}
    lines = [{"prompt": "p", "chosen": "x.mp4", "rejected": "y.mp4"}, {"prompt": "p", "chosen": "x.mp4",
                                                                         "rejected": "z.mp4"}]
    f = write_folder(tmp_path / "size", v2, lines, "pairs.jsonl")
    with pytest.raises(ValueError, match=r"pairs.jsonl line 1.*'x.mp4'.*'y.mp4'.*set num_frames, height and width"):
        next(iter(PreferencePairDataModule(str(f), batch_size=1, shuffle=False).make_train_loader()))
    stream = PreferencePairDataModule(str(f), batch_size=1, shuffle=False, height=16, width=16).make_train_loader()
    with pytest.raises(ValueError, match=r"pairs.jsonl line 2.*\(8, 3, 16, 16\).*\(6, 3, 16, 16\)"):
        [next(it) for it in [iter(stream)] for _ in range(2)]
    for bad in (dict(height=16), dict(fps=8.0), dict(batch_size=0), dict(tie="never"), dict(min_margin=-1.0)):
        with pytest.raises(ValueError):
            PreferencePairDataModule(str(f), **bad)


# ---------------------------------------------------------------------------------------------- DPO's offline path
def _fit(tiny_policy, tiny_text_encoder, folder: Path, args: list[str], run: bool = True) -> GenRLCLI:
    import genrl.methods  # noqa: F401

    base = CONFIGS + ["--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
                      "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: "
                      "{dirpath: runs/shapes/checkpoints, save_last: true, every_n_train_steps: 1}}]",
                      f"--model.init_args.generator.pretrained={tiny_policy}",
                      f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
                      "--model.init_args.rewards=[{name: colorfulness}]", "--model.init_args.num_draws=2",
                      "--model.init_args.optimizer.init_args.lr=0.003", f"--data.init_args.folder={folder}",
                      "--data.init_args.source=auto", "--data.init_args.batch_size=2"]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _params(cli) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters()}


def test_first_offline_step_is_log2_and_resume_equals_uninterrupted(tmp_path, monkeypatch, tiny_policy,
                                                                    tiny_text_encoder):
    folder = labelled_folder(tmp_path / "pairs", n=3)
    for d in "abc":
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    val = ["--trainer.limit_val_batches=1", "--trainer.val_check_interval=1", "--data.init_args.val_size=2"]
    one = _fit(tiny_policy, tiny_text_encoder, folder, ["--trainer.max_steps=1", *val])
    m = one.trainer.logged_metrics
    # theta = reference at the first update: z = 0 for every pair, L = log 2 exactly
    assert float(m["train/loss"]) == pytest.approx(math.log(2), rel=1e-6)
    assert float(m["train/z_mean"]) == 0.0 and float(m["pairs/count"]) == 2
    assert "val/total" in m  # validation sampled the data module's prompts (flat_validation_step)

    monkeypatch.chdir(tmp_path / "b")
    full = _params(_fit(tiny_policy, tiny_text_encoder, folder, ["--trainer.max_steps=4"]))
    monkeypatch.chdir(tmp_path / "c")
    three = _params(_fit(tiny_policy, tiny_text_encoder, folder, ["--trainer.max_steps=3"]))
    resumed = _params(_fit(tiny_policy, tiny_text_encoder, folder, ["--trainer.max_steps=4", "--ckpt_path=last"]))
    for k, v in resumed.items():  # 3 pairs in batches of 2: the resumed step's batch spans two epochs
        assert torch.allclose(full[k], v, atol=1e-6, rtol=0), k
    assert sum(not torch.equal(full[k], three[k]) for k in full) > len(full) // 2, "DPO steps did not change weights"


def _implicit_z(model, bright: torch.Tensor, dark: torch.Tensor) -> float:
    """z of (bright, dark) at fresh draws under the trained weights (z > 0: the policy prefers bright)."""
    gen = model.generator
    n = 8
    x_b, x_d = (gen.encode(v.expand(n, *v.shape)).float() for v in (bright, dark))
    cond = gen.encode_prompts([PROMPTS[i % 3] for i in range(n)] * 2)
    with torch.no_grad():
        _, stats = model.pair_loss(x_b, x_d, torch.arange(1000, 1000 + n), cond, it=77, draw=0)
    return float(stats["z_mean"])


@pytest.mark.parametrize("bright_wins", [True, False])
def test_offline_dpo_learns_the_labelled_preference(bright_wins, tmp_path, monkeypatch, tiny_policy,
                                                    tiny_text_encoder):
    """Every pair opposes the same bright and dark clips; after a few steps the policy's implicit reward prefers the
    chosen one, and swapping the labels flips the sign (a chosen / rejected swap in the code fails here)."""
    videos = {"bright.mp4": grey(200), "dark.mp4": grey(40)}
    w, lo = ("bright.mp4", "dark.mp4") if bright_wins else ("dark.mp4", "bright.mp4")
    lines = [{"prompt": p, "chosen": w, "rejected": lo} for p in PROMPTS]
    folder = write_folder(tmp_path / "pairs", videos, lines, "pairs.jsonl")
    monkeypatch.chdir(tmp_path)
    cli = _fit(tiny_policy, tiny_text_encoder, folder, ["--trainer.max_steps=3"])
    bright, dark = (read_video(folder / f, 8, size=(16, 16)) for f in ("bright.mp4", "dark.mp4"))
    z = _implicit_z(cli.model, bright, dark)
    assert (z > 0) == bright_wins and abs(z) > 1e-3, z
