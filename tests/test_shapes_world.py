"""The shapes world (genrl.data.shapes) and its DataModule, including exact mid-run resume under Lightning."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from genrl.data.shapes import (
    PALETTE,
    ShapeSpec,
    ShapesWorldConfig,
    caption,
    combos,
    heldout_combos,
    heldout_prompts,
    is_heldout,
    parse_caption,
    render,
    sample,
    sample_seed,
    trajectory,
)
from genrl.data.shapes_datamodule import ShapesDataModule, ShapesStream, ShapesTrainLoader, make_batch

WORLD = ShapesWorldConfig()


# ---------------------------------------------------------------------------------------------- samples
def test_sample_is_a_pure_function_of_seed_and_index():
    px, cap, spec = sample(WORLD, seed=3, index=7)
    assert px.shape == (8, 3, 16, 16) and px.dtype == torch.float32
    assert float(px.min()) >= 0.0 and float(px.max()) <= 1.0 and float(px.max()) > 0.9
    px2, cap2, spec2 = sample(WORLD, seed=3, index=7)
    assert torch.equal(px, px2) and cap == cap2 and spec == spec2
    # independent of what else is sampled, and of batch composition
    _ = [sample(WORLD, 3, i) for i in range(20)]
    batch = make_batch(WORLD, 3, [11, 7, 2])
    assert torch.equal(batch["pixels"][1], px) and batch["prompts"][1] == cap
    assert batch["index"].tolist() == [11, 7, 2] and batch["index"].dtype == torch.int64
    # different index or seed -> different sample
    assert not torch.equal(sample(WORLD, 3, 8)[0], px)
    assert not torch.equal(sample(WORLD, 4, 7)[0], px)
    assert sample_seed(3, 7) != sample_seed(7, 3) and 0 <= sample_seed(3, -1) < 2**63


def test_render_geometry_motion_and_antialiasing():
    g = torch.Generator().manual_seed(0)
    ys, xs = torch.meshgrid(torch.arange(16) + 0.5, torch.arange(16) + 0.5, indexing="ij")

    def track(px):
        m = px.amax(1)
        mass = m.sum((-2, -1))
        return torch.stack([(m * xs).sum((-2, -1)) / mass, (m * ys).sum((-2, -1)) / mass], -1), mass

    for d, fast in [("right", "fast"), ("up", "slow"), ("left", "slow"), ("down", "fast")]:
        px = render(ShapeSpec("red", "square", (d,), fast), WORLD, g)
        c, mass = track(px)
        step = (c[1:] - c[:-1]).mean(0)
        unit = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}[d]
        expected = torch.tensor(unit) * WORLD.speeds[fast]
        assert torch.allclose(step, expected.float(), atol=0.05), (d, step)  # 1/4 px supersampling
        assert torch.allclose(mass, torch.full_like(mass, 36.0), atol=1.0)  # never clipped by the frame border
        assert 0 < float(((px > 0) & (px < 1)).float().mean())  # anti-aliased edges (subpixel positions)
    still = render(ShapeSpec("blue", "circle", ("still",)), WORLD, g)
    assert torch.equal(still[0], still[-1])
    tri = render(ShapeSpec("green", "triangle", ("still",)), WORLD, g)[0].amax(0)
    rows = tri.sum(1)[tri.sum(1) > 0]  # pointing up: rows widen from the apex down to the base
    assert (rows[1:] >= rows[:-1]).all() and rows[-1] > 3 * rows[0] and abs(float(tri.sum()) - 18.0) < 0.5
    # multi-step: frames t <= 3.5 follow direction 1, frames t >= 3.5 direction 2 (at the mean speed 0.9)
    multi = render(ShapeSpec("cyan", "circle", ("right", "up")), WORLD, g)
    c, _ = track(multi)
    assert torch.allclose(c[3] - c[0], torch.tensor([2.7, 0.0]), atol=0.03)
    assert torch.allclose(c[7] - c[4], torch.tensor([0.0, -2.7]), atol=0.03)
    end = trajectory(ShapeSpec("red", "circle", ("right", "up")), WORLD)[-1]
    assert torch.allclose(end, torch.tensor([3.15, -3.15]))


def test_caption_round_trip_for_every_combination():
    world = ShapesWorldConfig(colors=list(PALETTE), shapes=["circle", "square", "triangle", "diamond"],
                              speeds={"slow": 0.5, "medium": 0.8, "fast": 1.2})
    n = 0
    for c, s in itertools.product(world.colors, world.shapes):
        specs = [ShapeSpec(c, s)]
        for d in world.directions:
            speeds = [None] if d == "still" else [None, *world.speeds]
            specs += [ShapeSpec(c, s, (d,), sp) for sp in speeds]
        specs += [ShapeSpec(c, s, (a, b)) for a, b in itertools.permutations(world.directions, 2)]
        for spec in specs:
            assert parse_caption(caption(spec), world) == spec, caption(spec)
            n += 1
    assert n == 11 * 4 * (1 + 1 + 4 * 4 + 20)
    assert caption(ShapeSpec("red", "circle", ("left",), "slow")) == "a red circle moving left slowly"
    assert caption(ShapeSpec("red", "circle", ("up",), "fast")) == "a red circle moving up quickly"
    assert caption(ShapeSpec("red", "circle", ("still",))) == "a red circle staying still"
    assert caption(ShapeSpec("red", "circle", ("right", "up"))) == "a red circle moves right, then moves up"
    assert caption(ShapeSpec("orange", "square")) == "an orange square"
    # every caption the default world samples parses back to its spec
    for i in range(100):
        _, cap, spec = sample(WORLD, 0, i, "all")
        assert parse_caption(cap, WORLD) == spec


def test_parse_caption_is_tolerant_and_errors_name_the_word():
    assert parse_caption("  A  Red   CIRCLE moving LEFT slowly. ") == ShapeSpec("red", "circle", ("left",), "slow")
    two = ShapeSpec("red", "circle", ("right", "still"))
    assert parse_caption("an red circle moves right ,then stays still") == two
    assert parse_caption("a red circle moving left") == ShapeSpec("red", "circle", ("left",))
    text = "a purple circle moving left slowly"
    with pytest.raises(ValueError, match=r"unknown color 'purple' in caption .*known colors: red, green, blue"):
        parse_caption(text, WORLD)
    with pytest.raises(ValueError, match=r"unknown shape 'hexagon'.*known shapes: circle, square, triangle"):
        parse_caption("a red hexagon staying still", WORLD)
    with pytest.raises(ValueError, match=r"unknown direction 'sideways'.*known directions: left, right"):
        parse_caption("a red circle moving sideways slowly", WORLD)
    with pytest.raises(ValueError, match=r"unknown speed word 'lazily'.*slowly, quickly"):
        parse_caption("a red circle moving left lazily", WORLD)
    with pytest.raises(ValueError, match="unknown color 'white'"):  # known to the palette, not to this world
        parse_caption("a white circle", WORLD)
    for bad in ["red circle moving left", "a circle moving left", "a red circle moving", "a red circle dancing",
                "a red circle moves left then moves up", "a red circle moving still slowly", ""]:
        with pytest.raises(ValueError, match="malformed caption|unknown"):
            parse_caption(bad, WORLD)


def test_config_validation_messages():
    with pytest.raises(ValueError, match=r"unknown color 'purple'.*known colors: red, green"):
        ShapesWorldConfig(colors=["red", "purple"])
    with pytest.raises(ValueError, match=r"unknown shape 'hexagon'.*known shapes: circle"):
        ShapesWorldConfig(shapes=["hexagon"])
    with pytest.raises(ValueError, match=r"unknown direction 'north'"):
        ShapesWorldConfig(directions=["north"])
    with pytest.raises(ValueError, match=r"unknown speed 'warp'"):
        ShapesWorldConfig(speeds={"warp": 1.0})
    with pytest.raises(ValueError, match="does not fit a 16x16 frame"):
        ShapesWorldConfig(object_size=20.0)
    with pytest.raises(ValueError, match="leaves a 16x16 frame"):
        ShapesWorldConfig(speeds={"slow": 0.6, "fast": 2.0})
    with pytest.raises(ValueError, match="num_frames >= 4"):
        ShapesWorldConfig(num_frames=2)
    with pytest.raises(ValueError, match="distinct"):
        ShapesWorldConfig(speeds={"slow": 1.0, "fast": 1.0})
    with pytest.raises(ValueError, match="duplicates"):
        ShapesWorldConfig(colors=["red", "red"])
    with pytest.raises(ValueError, match="num_frames must be >= 1"):
        ShapesWorldConfig(num_frames=0)
    ShapesWorldConfig(num_frames=2, multi_step_prob=0.0)  # fine
    ShapesWorldConfig(height=32, width=32, speeds={"slow": 1.0, "fast": 3.0})  # fits 7 * 3 + 6 = 27 <= 32


def test_image_mode():
    world = ShapesWorldConfig(num_frames=1)
    px, cap, spec = sample(world, 0, 0)
    assert px.shape == (1, 3, 16, 16)
    assert spec.directions == () and spec.speed is None
    assert parse_caption(cap, world) == spec and len(cap.split()) == 3
    assert all(d is None for *_, d in heldout_combos(world))


# ---------------------------------------------------------------------------------------------- splits
def test_heldout_split_is_fixed_disjoint_and_covers_every_value_in_train():
    held = heldout_combos(WORLD)
    assert len(held) == round(0.15 * 90) == 14
    shuffled = ShapesWorldConfig(colors=WORLD.colors[::-1], shapes=WORLD.shapes[::-1])
    assert set(heldout_combos(shuffled)) == set(held)  # independent of list order (and of any seed)
    train = [c for c in combos(WORLD) if c not in set(held)]
    assert len(train) + len(held) == 90
    for k, values in enumerate([WORLD.colors, WORLD.shapes, WORLD.directions]):
        assert {c[k] for c in train} == set(values)
    for i, j in [(0, 1), (0, 2), (1, 2)]:  # every pair of values also appears in training
        assert {(c[i], c[j]) for c in train} == {(c[i], c[j]) for c in combos(WORLD)}
    for i in range(200):
        assert not is_heldout(sample(WORLD, 0, i, "train")[2], WORLD)
        assert is_heldout(sample(WORLD, 0, i, "heldout")[2], WORLD)
    prompts = heldout_prompts(WORLD, 30, seed=1)
    assert prompts == heldout_prompts(WORLD, 30, seed=1) and prompts != heldout_prompts(WORLD, 30, seed=2)
    specs = [parse_caption(p, WORLD) for p in prompts]
    assert all(is_heldout(s, WORLD) and len(s.directions) == 1 for s in specs)
    assert len({(s.color, s.shape, s.directions[0]) for s in specs}) == 14  # cycles through all of them
    with pytest.raises(ValueError, match="held-out split is empty"):
        sample(ShapesWorldConfig(heldout_fraction=0.0), 0, 0, "heldout")


def test_sample_mix_contains_multi_step_and_still():
    specs = [sample(WORLD, 0, i)[2] for i in range(400)]
    multi = sum(s.multi_step for s in specs) / len(specs)
    assert 0.14 < multi < 0.26
    assert any(s.directions == ("still",) for s in specs)
    assert {s.speed for s in specs} == {None, "slow", "fast"}


# ---------------------------------------------------------------------------------------------- datamodule
def test_stream_batches_are_pure_functions_of_their_number():
    dm = ShapesDataModule(batch_size=4, seed=5, val_size=6)
    loader = dm.train_dataloader()
    it = iter(loader)
    b0, b1, b2 = next(it), next(it), next(it)
    assert set(b0) == {"pixels", "prompts", "index"}
    assert b0["pixels"].shape == (4, 8, 3, 16, 16) and b0["pixels"].dtype == torch.float32
    assert b2["index"].tolist() == [8, 9, 10, 11] and len(b2["prompts"]) == 4
    assert torch.equal(b1["pixels"], make_batch(dm.world, 5, [4, 5, 6, 7])["pixels"])
    assert loader.state_dict() == {"batches_consumed": 3}
    # a new loader restored from that state continues with batch 3
    other = ShapesDataModule(batch_size=4, seed=5).train_dataloader()
    other.load_state_dict(loader.state_dict())
    assert next(iter(other))["index"].tolist() == [12, 13, 14, 15]
    # worker processes give the same stream
    stream = ShapesStream(dm.world, 4, seed=5)
    with_workers = ShapesTrainLoader(stream, num_workers=2)
    it = iter(with_workers)
    got = [next(it) for _ in range(3)]
    del it
    assert [b["index"].tolist() for b in got] == [b["index"].tolist() for b in (b0, b1, b2)]
    assert all(torch.equal(a["pixels"], b["pixels"]) for a, b in zip(got, (b0, b1, b2)))
    # two ranks split the stream without overlap
    r1 = ShapesStream(dm.world, 4, seed=5, rank=1, world_size=2)
    assert r1.batch(0)["index"].tolist() == [4, 5, 6, 7] and r1.batch(1)["index"].tolist() == [12, 13, 14, 15]
    # the data module's batch_size is global: 2 ranks take halves of the batches one rank takes
    one = ShapesDataModule(batch_size=4, seed=5).make_train_loader(0, 1).dataset
    halves = [ShapesDataModule(batch_size=4, seed=5).make_train_loader(r, 2).dataset for r in (0, 1)]
    for b in range(3):
        assert sum((h.batch(b)["index"].tolist() for h in halves), []) == one.batch(b)["index"].tolist()
    with pytest.raises(ValueError, match="batch_size 5 is the global batch.*use 4 or 6"):
        ShapesDataModule(batch_size=5).make_train_loader(0, 2)


def test_val_dataloader_is_fixed_heldout():
    dm = ShapesDataModule(batch_size=4, seed=5, val_size=6)
    batches = list(dm.val_dataloader())
    assert [len(b["prompts"]) for b in batches] == [4, 2]
    assert batches[0]["index"].tolist() == [-1, -2, -3, -4]
    again = list(ShapesDataModule(batch_size=4, seed=5, val_size=6).val_dataloader())
    assert all(torch.equal(a["pixels"], b["pixels"]) and a["prompts"] == b["prompts"] for a, b in zip(batches, again))
    assert all(is_heldout(parse_caption(p, dm.world), dm.world) for b in batches for p in b["prompts"])


def test_datamodule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        ShapesDataModule(split="test")
    with pytest.raises(ValueError, match="batch_size"):
        ShapesDataModule(batch_size=0)


class _Tiny:
    """Factory of a one-Linear LightningModule that records the batch indices it trains on."""

    @staticmethod
    def make(read_estimated_steps: bool = False):
        from lightning.pytorch import LightningModule

        class Tiny(LightningModule):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(1, 1)
                self.seen: list[list[int]] = []

            def training_step(self, batch, batch_idx):
                self.seen.append(batch["index"].tolist())
                return self.lin(batch["pixels"].mean(dim=(1, 2, 3, 4))[:, None]).pow(2).mean()

            def configure_optimizers(self):
                if read_estimated_steps:  # makes Lightning build the train loader before restoring (#20550)
                    assert self.trainer.estimated_stepping_batches == self.trainer.max_steps
                return torch.optim.SGD(self.parameters(), lr=0.01)

        return Tiny()


def _trainer(steps, root, callbacks=(), max_epochs=None):
    from lightning.pytorch import Trainer

    return Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=list(callbacks), enable_checkpointing=bool(callbacks), default_root_dir=str(root),
        num_sanity_val_steps=0, limit_val_batches=0, max_epochs=max_epochs,
    )


@pytest.mark.parametrize("num_workers, early_loader", [(0, False), (2, False), (0, True)])
def test_lightning_resume_continues_the_stream_exactly(tmp_path, num_workers, early_loader):
    """Train 2 steps with ModelCheckpoint, resume with ckpt_path for 2 more == 4 uninterrupted steps.

    ``early_loader``: the module reads ``trainer.estimated_stepping_batches`` with ``max_epochs`` set, so
    Lightning builds the loader before restoring the loops and never passes it its saved state
    (Lightning-AI/pytorch-lightning#20550); the DataModule's own state covers that case.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    def dm():
        return ShapesDataModule(batch_size=2, seed=1, num_workers=num_workers, val_size=0)

    epochs = 100 if early_loader else None
    full = _Tiny.make(early_loader)
    _trainer(4, tmp_path / "full", max_epochs=epochs).fit(full, dm())

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = _Tiny.make(early_loader)
    _trainer(2, tmp_path / "a", [ckpt], max_epochs=epochs).fit(first, dm())
    path = os.path.join(tmp_path / "ckpt", "epoch=0-step=2.ckpt")
    state = torch.load(path, weights_only=True)  # hparams are plain values
    # batches delivered to training_step, not the one Lightning had prefetched
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches_consumed": 2}]
    assert state["ShapesDataModule"] == {"batches_consumed": 2}
    second = _Tiny.make(early_loader)
    _trainer(4, tmp_path / "b", max_epochs=epochs).fit(second, dm(), ckpt_path=path)

    assert full.seen == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert first.seen + second.seen == full.seen
