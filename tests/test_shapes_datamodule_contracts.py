"""Contracts of the shapes-world training data module (genrl/data/shapes_datamodule.py), written for the mutation
survivors of that module (issue 51, stage 4): the stream's defaults and argument checks, its batches of the chosen
split, the local batch number of a delivered batch (an int, so the loader resumes after it), the DataModule's defaults
and argument checks, the world in the hyperparameters, the train loader it builds, the validation loader's order,
and the delivery hook (batches marked only while training with a tracking loader; the module's own hook after it).

Each test calls the classes directly with a tiny image-mode world (4x4 pixels, one frame): no Trainer (a stand-in
with `training` and `lightning_module` for the hook), no workers.
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import SequentialSampler

from genrl.data.shapes import ShapesWorldConfig
from genrl.data.shapes_datamodule import ShapesDataModule, ShapesStream, ShapesTrainLoader, make_batch

TINY = dict(height=4, width=4, num_frames=1, object_size=2.0)


def _world() -> ShapesWorldConfig:
    return ShapesWorldConfig(**TINY)


def _same_batch(a: dict, b: dict) -> bool:
    return (torch.equal(a["pixels"], b["pixels"]) and a["prompts"] == b["prompts"]
            and torch.equal(a["index"], b["index"]))


# ---------------------------------------------------------------------------------------------- stream
def test_stream_defaults_are_seed_0_train_rank_0_of_1_from_batch_0():
    """ShapesStream(world, B): seed 0, the train split, rank 0 of 1, start 0, and iterating the stream itself (no
    loader) yields batches 0, 1, ... of samples sample(world, 0, i, "train")."""
    w = _world()
    s = ShapesStream(w, 2)
    assert (s.seed, s.split, s.rank, s.world_size, s.start) == (0, "train", 0, 1, 0)
    it = iter(s)
    first, second = next(it), next(it)
    assert _same_batch(first, make_batch(w, 0, [0, 1], "train"))
    assert second["index"].tolist() == [2, 3]
    assert not _same_batch(first, make_batch(w, 1, [0, 1], "train"))  # the seed matters


def test_stream_checks_batch_size_and_rank():
    """batch_size >= 1 (1 is valid) and 0 <= rank < world_size (rank == world_size is refused)."""
    w = _world()
    assert ShapesStream(w, 1).batch(3)["index"].tolist() == [3]
    assert ShapesStream(w, 1, rank=1, world_size=2).batch(1)["index"].tolist() == [3]
    for kw in (dict(batch_size=0), dict(batch_size=1, rank=1, world_size=1), dict(batch_size=1, rank=2, world_size=2),
               dict(batch_size=1, rank=-1)):
        with pytest.raises(ValueError):
            ShapesStream(w, **kw)


def test_stream_batch_draws_from_its_split():
    """A stream of split "heldout" gives the held-out samples of its indices (make_batch(..., "heldout")), which
    differ from the train samples of the same indices."""
    w = _world()
    b = ShapesStream(w, 2, seed=3, split="heldout").batch(1)
    assert _same_batch(b, make_batch(w, 3, [2, 3], "heldout"))
    assert b["prompts"] != make_batch(w, 3, [2, 3], "train")["prompts"]


def test_local_batch_is_the_int_inverse_of_global_batch():
    """For rank r of W with local batch B, local_batch(first index of local batch b) == b, an int; after
    mark_delivered(batch b) the next iter() of the loader starts at local batch b + 1 (an integer position)."""
    w = _world()
    s = ShapesStream(w, 2, rank=1, world_size=2)
    firsts = [int(s.batch(b)["index"][0]) for b in range(4)]
    assert firsts == [2, 6, 10, 14]
    got = [s.local_batch(f) for f in firsts]
    assert got == [0, 1, 2, 3] and all(type(g) is int for g in got)
    loader = ShapesTrainLoader(s, track_delivery=True)
    loader.mark_delivered(s.batch(2))
    assert loader.batches_consumed == 3 and type(loader.state_dict()["batches_consumed"]) is int
    assert next(iter(loader))["index"].tolist() == [14, 15]


# ---------------------------------------------------------------------------------------------- datamodule
def test_datamodule_defaults():
    """ShapesDataModule(): the default world, global batch 32, seed 0, main-process loading, 64 validation samples,
    the train split."""
    h = ShapesDataModule().hparams
    assert (h.batch_size, h.seed, h.num_workers, h.val_size, h.split) == (32, 0, 0, 64, "train")
    assert h.world == asdict(ShapesWorldConfig())


def test_datamodule_checks_its_sizes():
    """batch_size >= 1 (1 is valid), num_workers >= 0, val_size >= 0 and a known split."""
    dm = ShapesDataModule(_world(), batch_size=1, val_size=2)
    assert [b["index"].tolist() for b in dm.val_batches()] == [[-1], [-2]]
    for kw in (dict(batch_size=0), dict(num_workers=-1), dict(val_size=-1), dict(split="test")):
        with pytest.raises(ValueError):
            ShapesDataModule(_world(), **kw)


def test_datamodule_keeps_the_world_as_a_plain_dict():
    """The given world is used and stored in the hyperparameters as a dict of its fields; the hyperparameters as
    collected (hparams_initial, what loggers record) hold no ShapesWorldConfig object."""
    w = _world()
    dm = ShapesDataModule(w)
    assert dm.world == w and dm.hparams["world"] == asdict(w)
    assert not any(is_dataclass(v) for v in dm.hparams_initial.values())
    assert ShapesDataModule(asdict(w)).world == w


def test_make_train_loader_defaults_start_and_delivery():
    """make_train_loader() is rank 0 of 1 (the whole global batch), in the main process, from batch 0, counting
    yielded batches; num_workers, start, track_delivery and the rank's share are honoured."""
    w = _world()
    dm = ShapesDataModule(w, batch_size=2, seed=4)
    loader = dm.make_train_loader()
    s = loader.dataset
    assert (s.rank, s.world_size, s.batch_size, s.seed, s.split) == (0, 1, 2, 4, "train")
    assert loader.num_workers == 0 and loader.track_delivery is False and loader.batches_consumed == 0
    first = next(iter(loader))
    assert _same_batch(first, make_batch(w, 4, [0, 1])) and loader.batches_consumed == 1
    tracked = dm.make_train_loader(track_delivery=True)
    assert tracked.track_delivery is True
    assert next(iter(dm.make_train_loader(start=3)))["index"].tolist() == [6, 7]
    assert next(iter(dm.make_train_loader(1, 2)))["index"].tolist() == [1]
    assert ShapesDataModule(w, batch_size=2, num_workers=2).make_train_loader().num_workers == 2


def test_val_dataloader_yields_the_val_batches_in_order():
    """val_dataloader yields val_batches unchanged and in order (a sequential sampler, never shuffled): held-out
    samples -1, -2, ... in batches of batch_size, the last one short."""
    w = _world()
    dm = ShapesDataModule(w, batch_size=2, seed=5, val_size=9)
    loader = dm.val_dataloader()
    assert isinstance(loader.sampler, SequentialSampler)
    got = list(loader)
    assert [b["index"].tolist() for b in got] == [[-1, -2], [-3, -4], [-5, -6], [-7, -8], [-9]]
    assert all(_same_batch(a, b) for a, b in zip(got, dm.val_batches(), strict=True))
    assert _same_batch(got[1], make_batch(w, 5, [-3, -4], "heldout"))


# ---------------------------------------------------------------------------------------------- delivery hook
class _HookModule(LightningModule):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        return {**batch, "seen_by_module": dataloader_idx}


def _hook_dm(track: bool, training: bool | None, module=None):
    """A data module with a train loader (tracking delivery or not) and a stand-in Trainer (None: no Trainer)."""
    dm = ShapesDataModule(world=_world(), batch_size=2)
    dm._train_loader = dm.make_train_loader(track_delivery=track)
    if training is not None:
        dm.trainer = SimpleNamespace(training=training, lightning_module=module)
    return dm, next(iter(dm._train_loader))


def test_delivery_is_marked_only_for_a_tracking_loader_while_training():
    """on_before_batch_transfer marks a batch delivered (batches_consumed 0 -> 1) only with a Trainer that is
    training and a loader that tracks delivery; without a Trainer, outside training, or with a loader that counts
    yielded batches itself, the count is untouched. The batch comes back unchanged when no module overrides the
    hook. Before any train loader exists the state is empty."""
    assert ShapesDataModule(world=_world()).state_dict() == {}
    dm, batch = _hook_dm(track=True, training=True)
    assert dm.on_before_batch_transfer(batch, 0) is batch and dm._train_loader.batches_consumed == 1
    assert dm.state_dict() == dm._train_loader.state_dict()
    for track, training in [(True, None), (True, False)]:
        dm, batch = _hook_dm(track=track, training=training)
        assert dm.on_before_batch_transfer(batch, 0) is batch and dm._train_loader.batches_consumed == 0
    dm, batch = _hook_dm(track=False, training=True)
    before = dm._train_loader.batches_consumed
    dm.on_before_batch_transfer(batch, 0)
    assert dm._train_loader.batches_consumed == before == 1


def test_the_modules_own_hook_runs_after_marking():
    """With a LightningModule that overrides on_before_batch_transfer, the data module's hook marks the batch and
    returns what the module's hook returns (here the batch with an added key naming the dataloader index)."""
    dm, batch = _hook_dm(track=True, training=True, module=_HookModule())
    out = dm.on_before_batch_transfer(batch, 3)
    assert out["seen_by_module"] == 3 and out["prompts"] == batch["prompts"]
    assert dm._train_loader.batches_consumed == 1


@pytest.mark.parametrize("kind", ["shapes", "prompts", "ode_pairs", "preference_pairs", "teacher_videos"])
def test_every_stream_datamodule_gives_loggers_its_world(kind):
    """Every shapes-world data module records its world, as a plain dict of its fields, in ``hparams_initial``
    (what Lightning's loggers record) as well as in ``hparams`` (checkpoints), with the other arguments."""
    from genrl.data.ode_pairs import ODEPairsDataModule
    from genrl.data.preference_pairs import PreferencePairDataModule
    from genrl.data.prompts import PromptDataModule
    from genrl.data.teacher_videos import TeacherVideoDataModule

    w = _world()
    make = {"shapes": lambda: ShapesDataModule(w, batch_size=3),
            "prompts": lambda: PromptDataModule(world=w, seed=3),
            "ode_pairs": lambda: ODEPairsDataModule("x.pt", world=w, batch_size=3),
            "preference_pairs": lambda: PreferencePairDataModule("x", world=w, batch_size=3),
            "teacher_videos": lambda: TeacherVideoDataModule("x", world=w, seed=3)}[kind]
    dm = make()
    assert dm.hparams_initial["world"] == asdict(w) and dm.hparams["world"] == asdict(w)
    assert dict(dm.hparams_initial) == dict(dm.hparams)
    assert dm.hparams_initial["batch_size" if "batch_size" in dm.hparams else "seed"] == 3


# ---------------------------------------------------------------------------------------------- train_dataloader
def _step_plain(self, batch, batch_idx):
    return None


def _step_iter(self, dataloader_iter):
    return None


def _step_varargs(self, *args):
    return None


def test_train_dataloader_takes_the_trainers_rank_and_tracks_unless_the_step_pulls_batches():
    """train_dataloader builds this rank's slice (data-parallel rank and size from the strategy) and tracks delivery
    exactly when the module's training_step takes batches (not an explicit ``dataloader_iter``; ``*args`` is not
    one); without a Trainer it is rank 0 of 1 and does not track (track_delivery is False, not just falsy)."""
    dm = ShapesDataModule(world=_world(), batch_size=2)
    loader = dm.train_dataloader()
    assert (loader.dataset.rank, loader.dataset.world_size) == (0, 1) and loader.track_delivery is False
    for step, track in ((_step_plain, True), (_step_iter, False), (_step_varargs, True)):
        dm = ShapesDataModule(world=_world(), batch_size=2)
        dm.trainer = SimpleNamespace(datamodule=dm, lightning_module=SimpleNamespace(training_step=step),
                                     strategy=SimpleNamespace(distributed_sampler_kwargs={"rank": 1,
                                                                                          "num_replicas": 2}),
                                     global_rank=1, world_size=2)
        loader = dm.train_dataloader()
        assert loader.track_delivery is track, step.__name__
        assert (loader.dataset.rank, loader.dataset.world_size) == (1, 2)
        assert next(iter(loader))["index"].tolist() == [1]


def test_mark_delivered_ignores_batches_without_an_index():
    """mark_delivered counts a batch by its first sample index; a batch that is not a dict, a dict without
    "index" or with an empty index tensor leaves the count unchanged (no error)."""
    loader = ShapesDataModule(world=_world(), batch_size=2).make_train_loader(track_delivery=True)
    for batch in ([1, 2], {"prompts": ["a"]}, {"index": torch.zeros(0, dtype=torch.long)}):
        loader.mark_delivered(batch)
        assert loader.batches_consumed == 0
    loader.mark_delivered({"index": torch.tensor([6, 7])})
    assert loader.batches_consumed == 4


def _trainer_for(dm, step=_step_iter):
    """A stand-in Trainer of one process whose module's training_step is ``step``."""
    return SimpleNamespace(datamodule=dm, lightning_module=SimpleNamespace(training_step=step),
                           strategy=SimpleNamespace(distributed_sampler_kwargs=None), global_rank=0, world_size=1)


def test_train_dataloader_continues_the_stream_only_within_one_trainer():
    """A second train_dataloader() for the same Trainer (a loader reload) starts where the first loader stopped; a
    new Trainer, or no Trainer at all, starts at batch 0 again."""
    dm = ShapesDataModule(world=_world(), batch_size=2)
    trainer = _trainer_for(dm)
    dm.trainer = trainer
    it = iter(dm.train_dataloader())
    next(it), next(it)  # two batches consumed (counted as yielded: the step pulls its own batches)
    assert next(iter(dm.train_dataloader()))["index"].tolist() == [4, 5]  # the reload continues
    dm.trainer = _trainer_for(dm)  # another run
    assert next(iter(dm.train_dataloader()))["index"].tolist() == [0, 1]
    dm = ShapesDataModule(world=_world(), batch_size=2)  # no Trainer
    it = iter(dm.train_dataloader())
    next(it), next(it)
    assert next(iter(dm.train_dataloader()))["index"].tolist() == [0, 1]


@pytest.mark.parametrize("key", ["batch_size", "sampler", "batch_sampler", "shuffle", "persistent_workers",
                                 "collate_fn"])
def test_train_loader_refuses_batching_arguments_it_sets_itself(key):
    """ShapesTrainLoader batches in its stream: each DataLoader argument that would change batching, order or worker
    lifetime is refused with a ValueError naming it when set (True or a value), accepted and dropped when None or
    False. Its own defaults: main process, no delivery tracking."""
    stream = ShapesDataModule(world=_world(), batch_size=2).make_train_loader().dataset
    with pytest.raises(ValueError, match=f"does not take {key}=True"):
        ShapesTrainLoader(stream, **{key: True})
    for off in (None, False):
        loader = ShapesTrainLoader(stream, **{key: off})
        assert next(iter(loader))["index"].tolist() == [0, 1]
    loader = ShapesTrainLoader(stream)
    assert loader.num_workers == 0 and loader.track_delivery is False


def test_train_loader_counts_only_its_newest_iterator_and_passes_other_arguments():
    """Without delivery tracking a batch counts when the newest iterator yields it: an iterator made before the
    latest iter() call still yields but no longer counts (the Trainer's reloads leave stale iterators behind).
    DataLoader arguments other than the refused ones reach the DataLoader."""
    stream = ShapesDataModule(world=_world(), batch_size=2).make_train_loader().dataset
    assert ShapesTrainLoader(stream, timeout=7.0).timeout == 7.0
    loader = ShapesTrainLoader(stream)
    old = iter(loader)
    next(old)
    assert loader.batches_consumed == 1
    new = iter(loader)  # starts after the counted batch
    next(old)
    assert loader.batches_consumed == 1
    assert next(new)["index"].tolist() == [2, 3] and loader.batches_consumed == 2
