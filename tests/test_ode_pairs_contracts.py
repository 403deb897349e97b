"""Contracts of the teacher ODE-pair data (genrl/data/ode_pairs.py), written for the mutation survivors of that module
(issue 51, stage 3): the layout check of :class:`ODEPairs` and its file payload, saving and loading (errors naming
the path and what was found, weights-only reads even where the environment would allow pickles, GPU-saved tensors
mapped to the CPU, memory-mapped latents), the training stream (defaults, the seeded per-epoch permutations, rank and
worker slices, the permutation cache), the stateful train loader's delivery count, the DataModule (defaults, argument
checks, the world in the hyperparameters, the train loader it builds, the validation prompt batches), and the
regression helpers (the addressed per-chunk state draw, the frame spread, the state selection, the sigma check).

Each test calls the functions directly with tiny in-memory pairs or a tiny file under ``tmp_path``.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, is_dataclass
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
import torch.serialization

import genrl.data.ode_pairs as ode_pairs
from genrl.data.ode_pairs import (
    ODE_PAIRS_FORMAT,
    ODE_PAIRS_VERSION,
    ODEPairs,
    ODEPairsDataModule,
    ODEPairsStream,
    ODEPairsTrainLoader,
    check_pair_sigmas,
    chunk_states_to_frames,
    draw_chunk_states,
    load_ode_pairs,
    regression_inputs,
    save_ode_pairs,
    select_states,
)
from genrl.data.prompts import load_prompts
from genrl.data.shapes import ShapesWorldConfig, sample_seed
from genrl.models.causal import CausalConfig
from genrl.noise import sample_generator, stream_id

SIGMAS = [1.0, 0.5, 0.0]  # S = 2 student sigmas, then the clean state
TEACHER = [1.0, 0.75, 0.5, 0.25, 0.0]
PERM_SALT = 0x4F44455041495253  # "ODEPAIRS": the permutation seeds of every stored run depend on it


def _pairs(n: int = 4, sigmas=SIGMAS, latent=(2, 1), teacher=TEACHER, prompts=None, index=None,
           latents=None) -> ODEPairs:
    s1 = len(sigmas)
    if latents is None:
        latents = torch.arange(n * s1 * int(torch.tensor(latent).prod()), dtype=torch.float32).reshape(n, s1, *latent)
    return ODEPairs(latents=latents, sigmas=torch.tensor(sigmas, dtype=torch.float64),
                    teacher_sigmas=torch.tensor(teacher, dtype=torch.float64),
                    prompts=[f"p{i}" for i in range(n)] if prompts is None else prompts,
                    index=torch.arange(10, 10 + n) if index is None else index)


def _perm_reference(seed: int, epoch: int, n: int) -> torch.Tensor:
    g = torch.Generator("cpu").manual_seed(sample_seed(seed ^ PERM_SALT, epoch))
    return torch.randperm(n, generator=g)


@pytest.fixture
def pairs_file(tmp_path):
    return save_ode_pairs(tmp_path / "pairs.pt", _pairs(n=6))


# ---------------------------------------------------------------------------------------------- ODEPairs
def test_validate_accepts_the_smallest_layout_and_returns_self():
    """One trajectory, S = 1 (two sigmas) and a 1-axis latent ([N, S + 1, T], ndim 3) is a valid set."""
    p = _pairs(n=1, sigmas=[1.0, 0.0], latent=(3,), teacher=[1.0, 0.5, 0.0])
    assert p.latents.ndim == 3
    assert p.validate() is p
    assert (p.num_samples, p.num_steps, p.latent_shape) == (1, 1, (3,))


@pytest.mark.parametrize("case, match", [
    (dict(n=1, latents=torch.zeros(1, 3, 2, dtype=torch.int64)), "'latents' must be a float tensor"),
    (dict(n=1, latents=torch.zeros(1, 3)), "'latents' must be a float tensor"),
    (dict(n=1, sigmas=[0.0], teacher=[0.0]), "'sigmas' must be a 1-d tensor"),
    (dict(sigmas=[[1.0], [0.0]], latents=torch.zeros(4, 2, 2)), "'sigmas' must be a 1-d tensor"),
    (dict(sigmas=[1.0, 0.5], teacher=[1.0, 0.5]), r"descend strictly from <= 1 to exactly 0, got \[1.0, 0.5\]"),
    (dict(sigmas=[0.5, 0.75, 0.0]), "descend strictly"),
    (dict(sigmas=[1.5, 0.5, 0.0], teacher=[1.5, 1.0, 0.5, 0.0]), "descend strictly"),
    (dict(sigmas=[1.0, 0.5, 0.5, 0.0]), "descend strictly"),
    (dict(sigmas=[1.0, 0.25, 0.5, 0.0]), "descend strictly"),
    (dict(teacher=[1.0, 0.75, 0.25, 0.0]), r"lacks the student sigmas \[0.5\]"),
    (dict(prompts=["a", "b", "c"]), "4 trajectories but 3 prompts"),
    (dict(index=torch.arange(3)), r"4 trajectories but 4 prompts and index of shape \(3,\)"),
    (dict(n=0), "holds no trajectory"),
])
def test_validate_refuses_each_bad_layout_naming_ode_pairs_by_default(case, match):
    """Every layout rule is enforced on its own (float latents of ndim >= 3, 1-d sigmas of >= 2 values matching the
    states, strictly descending from <= 1 to exactly 0, all held by the teacher schedule, N prompts and ids, N >= 1);
    without ``where`` the message starts with "ODE pairs: "."""
    with pytest.raises(ValueError, match="^ODE pairs: .*" + match):
        _pairs(**case).validate()


def test_to_dict_writes_the_file_dtypes_whatever_the_inputs():
    """The payload holds float32 contiguous latents, float64 sigmas and teacher sigmas and int64 ids (the file format),
    with the same values, for bf16 / float32 / int32 inputs and non-contiguous latents."""
    lat = torch.tensor([0.5, -1.0, 2.0, 4.0, 0.25, 8.0], dtype=torch.bfloat16).reshape(1, 2, 3).transpose(1, 2)
    p = ODEPairs(latents=lat, sigmas=torch.tensor([1.0, 0.5, 0.0]), teacher_sigmas=torch.tensor([1.0, 0.75, 0.5, 0.0]),
                 prompts=("a",), index=torch.tensor([7], dtype=torch.int32), settings={"w": 3.0})
    d = p.to_dict()
    assert d["format"] == ODE_PAIRS_FORMAT == "genrl.ode_pairs" and d["version"] == ODE_PAIRS_VERSION == 1
    assert not lat.is_contiguous() and d["latents"].is_contiguous()
    assert d["latents"].dtype == torch.float32 and torch.equal(d["latents"], lat.float())
    assert d["sigmas"].dtype == torch.float64 and d["sigmas"].tolist() == [1.0, 0.5, 0.0]
    assert d["teacher_sigmas"].dtype == torch.float64 and d["teacher_sigmas"].tolist() == [1.0, 0.75, 0.5, 0.0]
    assert d["index"].dtype == torch.int64 and d["index"].tolist() == [7]
    assert d["prompts"] == ["a"] and d["settings"] == {"w": 3.0}


# ---------------------------------------------------------------------------------------------- save / load
def test_save_and_load_errors_name_the_path(tmp_path):
    """save_ode_pairs validates under the path's name; load_ode_pairs validates what it read under the path's name."""
    bad = _pairs(prompts=["a"])
    with pytest.raises(ValueError, match="^" + re.escape(str(tmp_path / "bad_save.pt")) + ": 4 trajectories but 1 "):
        save_ode_pairs(tmp_path / "bad_save.pt", bad)
    assert not (tmp_path / "bad_save.pt").exists()
    payload = _pairs().to_dict()
    payload["prompts"] = ["a"]
    torch.save(payload, tmp_path / "bad_load.pt")
    with pytest.raises(ValueError, match="^" + re.escape(str(tmp_path / "bad_load.pt")) + ": 4 trajectories but 1 "):
        load_ode_pairs(tmp_path / "bad_load.pt")
    good = load_ode_pairs(save_ode_pairs(tmp_path / "good.pt", _pairs()))
    assert good.prompts == ["p0", "p1", "p2", "p3"] and good.index.tolist() == [10, 11, 12, 13]


def test_load_refuses_other_files_naming_what_it_found(tmp_path):
    """A torch file that is not an ODE-pairs dict names the format it holds (a dict's "format" entry, or the type of
    a non-dict payload); another version names it; missing entries are listed."""
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match=r"list\.pt' is not an ODE-pairs file \(format 'list', expected "
                                         r"'genrl\.ode_pairs'\)"):
        load_ode_pairs(tmp_path / "list.pt")
    torch.save({"format": "genrl.other", "version": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"not an ODE-pairs file \(format 'genrl\.other'"):
        load_ode_pairs(tmp_path / "other.pt")
    torch.save({"format": ODE_PAIRS_FORMAT, "version": 2}, tmp_path / "v2.pt")
    with pytest.raises(ValueError, match="format version 2"):
        load_ode_pairs(tmp_path / "v2.pt")
    payload = _pairs().to_dict()
    del payload["teacher_sigmas"], payload["settings"]
    torch.save(payload, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"lacks the entries \['teacher_sigmas', 'settings'\]"):
        load_ode_pairs(tmp_path / "partial.pt")


def test_load_never_unpickles_even_when_the_environment_allows_it(tmp_path, monkeypatch):
    """The file is read with weights_only=True explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD (which turns torch's
    default into full unpickling) does not make it load a pickled object."""
    pairs = _pairs()
    pairs.settings = {"ratio": Fraction(1, 3)}
    path = save_ode_pairs(tmp_path / "pickled.pt", pairs)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ValueError, match="pickled.pt' is not a readable ODE-pairs file"):
        load_ode_pairs(path)


def test_load_maps_tensors_saved_on_a_gpu_to_the_cpu(tmp_path, monkeypatch):
    """A file whose tensors were saved from CUDA loads onto the CPU (map_location="cpu"), also without a GPU."""
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    path = save_ode_pairs(tmp_path / "gpu.pt", _pairs())
    monkeypatch.undo()
    for mmap in (True, False):
        p = load_ode_pairs(path, mmap=mmap)
        assert p.latents.device.type == "cpu" and p.sigmas.device.type == "cpu"
        assert torch.equal(p.latents, _pairs().latents)


def test_load_memory_maps_the_latents_by_default(tmp_path):
    """By default (and with mmap=True) the latents stay in the file until used: bytes rewritten in place after loading
    are what the tensor reads; with mmap=False they were copied at load time."""
    pairs = _pairs(latents=torch.full((2, 3, 2), 1234.5), n=2)
    old, new = struct.pack("<f", 1234.5) * 12, struct.pack("<f", -7.0) * 12
    for kw, want in (({}, -7.0), ({"mmap": True}, -7.0), ({"mmap": False}, 1234.5)):
        path = save_ode_pairs(tmp_path / "mm.pt", pairs)
        loaded = load_ode_pairs(path, **kw)
        raw = path.read_bytes()
        assert raw.count(old) == 1
        with open(path, "r+b") as f:
            f.seek(raw.index(old))
            f.write(new)
        assert loaded.latents.flatten().tolist() == [want] * 12, kw


# ---------------------------------------------------------------------------------------------- stream
def test_stream_defaults_are_seed_0_shuffled_rank_0_of_1_from_batch_0():
    """ODEPairsStream(pairs, B): seed 0, shuffled with the salted seed, rank 0 of 1 (global batch B), and iteration
    starts at batch 0 and steps by one batch."""
    pairs = _pairs(n=8)
    s = ODEPairsStream(pairs, 3)
    assert (s.seed, s.shuffle, s.rank, s.world_size, s.global_batch_size, s.start) == (0, True, 0, 1, 3, 0)
    perm0 = _perm_reference(0, 0, 8)
    assert not torch.equal(perm0, torch.arange(8))
    assert torch.equal(s.permutation(0), perm0)
    assert torch.equal(s.batch(1)["position"], torch.tensor([3, 4, 5]))
    it = iter(s)
    firsts = [int(next(it)["position"][0]) for _ in range(3)]
    assert firsts == [0, 3, 6]


def test_stream_permutations_are_the_salted_seed_draws_and_rows_follow_the_epochs():
    """Epoch e's order is randperm(N) of the generator seeded sample_seed(seed ^ salt, e); slot s is row
    perm_e[s mod N] of epoch e = s // N, so every epoch visits every trajectory once."""
    pairs = _pairs(n=5)
    s = ODEPairsStream(pairs, 3, seed=3)
    want = torch.cat([_perm_reference(3, e, 5) for e in range(3)])
    assert torch.equal(s.rows(torch.arange(15)), want)
    for e in range(3):
        assert sorted(want[5 * e: 5 * e + 5].tolist()) == list(range(5))
    b = s.batch(2)  # slots 6, 7, 8: epoch 1
    assert torch.equal(b["index"], pairs.index[want[6:9]])
    assert b["prompts"] == [pairs.prompts[int(r)] for r in want[6:9]]


def test_stream_without_shuffle_cycles_the_file_order_and_the_cache_evicts():
    """shuffle=False gives the identity every epoch; after more than four epochs the oldest cached order is dropped
    and recomputed identically (a pure function of (seed, epoch))."""
    s = ODEPairsStream(_pairs(n=4), 2, shuffle=False)
    for e in range(6):
        assert torch.equal(s.permutation(e), torch.arange(4))
    assert torch.equal(s.rows(torch.arange(10)), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1]))
    r = ODEPairsStream(_pairs(n=6), 2, seed=9)
    first = [r.permutation(e).clone() for e in range(6)]
    assert [r.permutation(e).tolist() for e in range(6)] == [p.tolist() for p in first]
    assert torch.equal(first[0], _perm_reference(9, 0, 6)) and torch.equal(first[5], _perm_reference(9, 5, 6))


def test_stream_checks_batch_size_and_rank():
    """batch_size >= 1 (1 is valid) and 0 <= rank < world_size."""
    pairs = _pairs()
    assert ODEPairsStream(pairs, 1).batch(2)["position"].tolist() == [2]
    assert ODEPairsStream(pairs, 1, rank=1, world_size=2).batch(1)["position"].tolist() == [3]
    for kw in (dict(batch_size=0), dict(batch_size=1, rank=2, world_size=2), dict(batch_size=1, rank=-1)):
        with pytest.raises(ValueError):
            ODEPairsStream(pairs, **kw)


def test_stream_batch_is_the_ranks_slice_in_the_file_dtypes():
    """Rank r of W takes slots [b*G + r*B, b*G + (r+1)*B) of global batch b; ode_latents are float32 copies of the
    rows' latents (also for float64 pairs), positions int64, sigmas the file's."""
    lat = torch.arange(4 * 3 * 2, dtype=torch.float64).reshape(4, 3, 2) / 3
    pairs = _pairs(latents=lat)
    s = ODEPairsStream(pairs, 2, seed=1, rank=1, world_size=2)
    b = s.batch(1)
    assert b["position"].dtype == torch.int64 and b["position"].tolist() == [6, 7]
    rows = s.rows(b["position"])
    assert b["ode_latents"].dtype == torch.float32 and torch.equal(b["ode_latents"], lat[rows].float())
    assert torch.equal(b["index"], pairs.index[rows]) and torch.equal(b["ode_sigmas"], pairs.sigmas)


def test_stream_iteration_takes_every_nth_batch_in_a_worker(monkeypatch):
    """In DataLoader worker w of n, iteration yields batches start + w, start + w + n, ... (no worker duplicates
    another's batches)."""
    s = ODEPairsStream(_pairs(), 1)
    s.start = 5
    monkeypatch.setattr(ode_pairs, "get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2))
    it = iter(s)
    assert [int(next(it)["position"][0]) for _ in range(3)] == [6, 8, 10]


def test_local_batch_is_the_integer_floor_of_the_global_batch():
    """The local batch number of a first slot p is p // (B * W), an int."""
    s = ODEPairsStream(_pairs(), 2, rank=1, world_size=2)
    got = [s.local_batch(p) for p in (0, 2, 5, 7, 8)]
    assert got == [0, 0, 1, 1, 2] and all(type(g) is int for g in got)


def test_mark_delivered_counts_the_batch_of_the_first_position():
    """The delivery count becomes (local batch of the first position) + 1, also with one sample per batch; batches
    that are not dicts with a non-empty "position" are ignored."""
    s = ODEPairsStream(_pairs(), 1)
    loader = ODEPairsTrainLoader(s, track_delivery=True)
    loader.mark_delivered(s.batch(4))
    assert loader.batches_consumed == 5
    for junk in (["not", "a", "dict"], {"prompts": ["a"]}, {"position": torch.zeros(0, dtype=torch.int64)}):
        loader.mark_delivered(junk)
        assert loader.batches_consumed == 5


# ---------------------------------------------------------------------------------------------- datamodule
def test_datamodule_defaults_are_the_shapes_recipe():
    """ODEPairsDataModule() reads the file pipelines/ode_pairs.py writes by default, with the shapes recipe's batch
    32, seed 0, shuffling, and 64 held-out shapes captions for validation (configs/ode_init/shapes.yaml)."""
    h = ODEPairsDataModule().hparams
    assert h.path == "runs/ode_pairs/shapes.pt"
    assert (h.batch_size, h.seed, h.shuffle, h.val, h.val_size, h.val_batch_size, h.prompt_key) == (
        32, 0, True, "shapes:heldout", 64, None, None)
    assert h.world == asdict(ShapesWorldConfig())


def test_datamodule_checks_its_sizes():
    """batch_size >= 1 and val_size >= 0 (1 and 0 are valid), val_batch_size >= 1 or None."""
    dm = ODEPairsDataModule("x.pt", batch_size=1, val_size=0)
    assert dm.val_batches() == []
    for kw in (dict(batch_size=0), dict(val_size=-1), dict(val_batch_size=0)):
        with pytest.raises(ValueError):
            ODEPairsDataModule("x.pt", **kw)


def test_datamodule_keeps_the_world_as_a_plain_dict():
    """The given world is used and stored in the hyperparameters as a dict of its fields; the hyperparameters as
    collected (hparams_initial, what loggers record) hold no ShapesWorldConfig object."""
    w = ShapesWorldConfig(colors=["red", "blue"])
    dm = ODEPairsDataModule("x.pt", world=w)
    assert dm.world == w and dm.hparams["world"] == asdict(w)
    assert not any(is_dataclass(v) for v in dm.hparams_initial.values())
    assert ODEPairsDataModule("x.pt", world=asdict(w)).world == w


def test_make_train_loader_defaults_start_and_delivery(pairs_file):
    """make_train_loader() runs in the main process from batch 0 and counts yielded batches; track_delivery=True
    counts only marked batches; start and the rank's share of the global batch are honoured."""
    dm = ODEPairsDataModule(str(pairs_file), batch_size=2, seed=4)
    loader = dm.make_train_loader()
    assert loader.num_workers == 0 and loader.track_delivery is False
    first = next(iter(loader))
    assert first["position"].tolist() == [0, 1] and loader.batches_consumed == 1
    tracked = dm.make_train_loader(track_delivery=True)
    assert tracked.track_delivery is True
    batch = next(iter(tracked))
    assert tracked.batches_consumed == 0
    tracked.mark_delivered(batch)
    assert tracked.batches_consumed == 1
    assert next(iter(dm.make_train_loader(start=3)))["position"].tolist() == [6, 7]
    assert next(iter(dm.make_train_loader(1, 2)))["position"].tolist() == [1]


def test_val_batches_take_the_first_prompts_of_the_source_in_order(tmp_path):
    """Validation is off for val=None (an empty list) and val_size=0; otherwise the first val_size prompts of the
    source (all of them when fewer: shapes captions of the given world, or a JSON file read with prompt_key) in
    batches of val_batch_size, which val_dataloader yields unchanged and in order."""
    assert ODEPairsDataModule("x.pt", val=None).val_batches() == []
    assert list(ODEPairsDataModule("x.pt", val=None).val_dataloader()) == []
    one = ODEPairsDataModule("x.pt", val_size=1).val_batches()
    assert len(one) == 1 and one[0]["index"].tolist() == [-1]
    w = ShapesWorldConfig(colors=["red", "blue"])
    dm = ODEPairsDataModule("x.pt", world=w, val_size=20, val_batch_size=1)
    want = [r.prompt for r in load_prompts("shapes:heldout", world=w)]
    assert len(want) == 7 and want != [r.prompt for r in load_prompts("shapes:heldout")[:7]]
    batches = dm.val_batches()
    assert [b["prompts"][0] for b in batches] == want
    got = list(dm.val_dataloader())
    assert len(got) == 7
    for g, b in zip(got, batches):
        assert g["prompts"] == b["prompts"] and torch.equal(g["index"], b["index"])
    assert [int(g["index"][0]) for g in got] == list(range(-1, -8, -1))
    f = tmp_path / "val.jsonl"
    f.write_text("\n".join(json.dumps({"caption": c}) for c in ("a cat", "a dog", "a cow")) + "\n")
    cap = ODEPairsDataModule("x.pt", val=str(f), prompt_key="caption", val_size=2, batch_size=4).val_batches()
    assert [b["prompts"] for b in cap] == [["a cat", "a dog"]]


# ---------------------------------------------------------------------------------------------- regression helpers
def test_draw_chunk_states_is_the_addressed_generators_draw():
    """Row b is randint(num_states, (K,)) from sample_generator(seed, sample_ids[b], step, the chunk-state stream),
    for a list or a tensor of ids."""
    stream = stream_id("data.ode_chunk_state")
    want = torch.stack([torch.randint(5, (3,), generator=sample_generator(7, i, 11, stream)) for i in (3, 5, 8)])
    assert torch.equal(draw_chunk_states(7, [3, 5, 8], 11, 3, 5), want)
    assert torch.equal(draw_chunk_states(7, torch.tensor([3, 5, 8]), 11, 3, 5), want)
    assert not torch.equal(draw_chunk_states(8, [3, 5, 8], 11, 3, 5), want)


def test_draw_chunk_states_bounds_and_empty_batch():
    """One chunk and one state are valid (the only state is 0); zero of either is refused; no ids give an int64
    [0, K]."""
    assert draw_chunk_states(0, [1, 2], 0, 1, 4).shape == (2, 1)
    assert draw_chunk_states(0, range(6), 0, 3, 1).tolist() == [[0, 0, 0]] * 6
    for k, s in ((0, 4), (3, 0)):
        with pytest.raises(ValueError, match="need num_chunks >= 1 and num_states >= 1"):
            draw_chunk_states(0, [1], 0, k, s)
    for ids in ([], torch.zeros(0, dtype=torch.int64)):
        e = draw_chunk_states(0, ids, 0, 3, 4)
        assert e.shape == (0, 3) and e.dtype == torch.int64


def test_chunk_states_to_frames_needs_b_by_k():
    """[B, K] chunk states spread to frames; any other rank is refused even when its second axis is K."""
    causal = CausalConfig(chunk_size=2)
    cs = torch.tensor([[2, 0], [1, 3]])
    assert chunk_states_to_frames(cs, causal, 4).tolist() == [[2, 2, 0, 0], [1, 1, 3, 3]]
    for bad in (cs[:, :, None], cs[:, :1]):
        with pytest.raises(ValueError, match="expected \\[B, 2\\]"):
            chunk_states_to_frames(bad, causal, 4)


def test_select_states_takes_each_frame_from_its_state_on_any_frame_axis():
    """x[b, .., t, ..] is the stored frame t of state frame_states[b, t] and sigma[b, t] its sigma, for 1-axis
    latents [B, S + 1, T] and for the frame axis last ([B, S + 1, C, T], frame_dim = 2)."""
    lat = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    sig = torch.tensor(SIGMAS, dtype=torch.float64)
    fs = torch.tensor([[0, 2, 1, 1], [2, 2, 0, 1]])
    x, s = select_states(lat, sig, fs)
    want = torch.stack([torch.stack([lat[b, fs[b, t], t] for t in range(4)]) for b in range(2)])
    assert torch.equal(x, want) and torch.equal(s, sig[fs]) and s.dtype == torch.float64
    ct = torch.stack([lat, -lat], dim=2)  # [B, S + 1, C = 2, T = 4]
    x2, s2 = select_states(ct, sig, fs, frame_dim=2)
    assert torch.equal(x2, torch.stack([want, -want], dim=1)) and torch.equal(s2, s)


def test_select_states_refuses_misfits_and_out_of_range_states():
    """Latents of ndim < 3 or a sigma count other than the stored states are refused ("do not fit"); a state index
    below 0 or at S + 1 or above is refused."""
    lat, sig = torch.zeros(2, 3, 4), torch.tensor(SIGMAS, dtype=torch.float64)
    fs = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not fit"):
        select_states(lat, torch.tensor([1.0, 0.75, 0.5, 0.0], dtype=torch.float64), fs)
    with pytest.raises(ValueError, match="do not fit"):
        select_states(torch.zeros(2, 3), sig, fs)
    for v in (-1, 3):
        bad = fs.clone()
        bad[1, 2] = v
        with pytest.raises(ValueError, match="must lie in 0..2"):
            select_states(lat, sig, bad)


def test_select_states_outputs_live_on_the_latents_device():
    """Frame states given on the CPU are moved to the latents' device, and the per-frame sigma is returned there
    too, whatever device the sigmas come on (meta tensors stand in for an accelerator)."""
    fs = torch.tensor([[0, 1], [2, 0]])
    lat = torch.empty(2, 3, 2, 5, device="meta")
    x, s = select_states(lat, torch.empty(3, dtype=torch.float64, device="meta"), fs)
    assert x.device.type == "meta" and x.shape == (2, 2, 5) and s.device.type == "meta"
    _, s_cpu_sigmas = select_states(lat, torch.tensor(SIGMAS, dtype=torch.float64), fs)
    assert s_cpu_sigmas.device.type == "meta" and s_cpu_sigmas.shape == (2, 2)


def _schedule(values):
    return SimpleNamespace(sigmas=lambda: torch.tensor(values, dtype=torch.float64), timesteps=[1000, 500],
                           shift=1.0, warp=None)


def test_check_pair_sigmas_tolerance_is_absolute_1e_6():
    """Stored sigmas within 1e-6 of the schedule's (absolute, no relative slack) pass, in float32 too; 5e-6 off at
    sigma 1 or another count is refused."""
    sched = _schedule([1.0, 0.5, 0.0])
    check_pair_sigmas(torch.tensor([1.0 + 5e-7, 0.5, 0.0], dtype=torch.float64), sched)
    check_pair_sigmas(torch.tensor([[1.0, 0.5, 0.0]], dtype=torch.float32), sched)
    for bad in ([1.0 + 5e-6, 0.5, 0.0], [1.0, 0.5], [0.0, 0.5, 0.0]):
        with pytest.raises(ValueError, match="regenerate the pairs"):
            check_pair_sigmas(torch.tensor(bad, dtype=torch.float64), sched)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_check_pair_sigmas_accepts_sigmas_on_the_gpu():
    """Sigmas of a batch already moved to the GPU are compared on the CPU with the schedule's."""
    check_pair_sigmas(torch.tensor([1.0, 0.5, 0.0], device="cuda"), _schedule([1.0, 0.5, 0.0]))


def test_regression_inputs_draw_noisy_states_on_frame_axis_1_by_default():
    """By default the per-chunk states are drawn among the S noisy states (not the clean one) and frames are on
    latent axis 1; x holds the stored frames of those states, sigma is float32 [B, T], the target is the clean x0."""
    b, s1, t, c = 12, 3, 4, 3
    lat = torch.arange(b * s1 * t * c, dtype=torch.float32).reshape(b, s1, t, c, 1, 1)
    sig = torch.tensor(SIGMAS, dtype=torch.float64)
    ids = torch.arange(100, 100 + b)
    causal = CausalConfig(chunk_size=2)
    x, sigma, target, cs = regression_inputs(lat, sig, 5, ids, 9, causal)
    assert torch.equal(cs, draw_chunk_states(5, ids, 9, 2, 2)) and int(cs.max()) == 1
    fs = chunk_states_to_frames(cs, causal, t)
    xr, sr = select_states(lat, sig, fs)
    assert torch.equal(x, xr) and torch.equal(target, lat[:, 2])
    assert sigma.dtype == torch.float32 and torch.equal(sigma, sr.float())
    _, _, _, cs_clean = regression_inputs(lat, sig, 5, ids, 9, causal, draw_clean_state=True)
    assert torch.equal(cs_clean, draw_chunk_states(5, ids, 9, 2, 3))
