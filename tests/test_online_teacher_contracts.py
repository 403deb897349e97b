"""Contracts of genrl/data/online_teacher.py pinned for issue 51 (stage 4: mutation survivors).

The renderer teacher's clips (its world, its addressed start position, its defaults, its name and modes), the
teacher cache's on-disk format (file name and stored key of a clip and of a latent, so a ``cache_dir`` written by one
run is read by the next), what a cache file must hold to be used (a dict of this format with this key; only tensors
are unpickled), the latent cache's separation by teacher, format, seed and index, and ``OnlineTeacherSpec``'s
generator teacher (every sampler and size field reaches ``load_generator`` and :class:`GeneratorTeacher`).
All inputs are tiny and hand-made: no model, no Trainer.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from genrl.data.online_teacher import OnlineTeacherSpec, ShapesRendererTeacher, TeacherCache
from genrl.data.shapes import ShapesWorldConfig, parse_caption, render
from genrl.data.teacher_videos import CallableTeacher, VideoSpec, normalise_video
from genrl.noise import sample_generator, stream_id

SPEC = VideoSpec(2, 4, 4, 8.0)
FORMAT = "genrl.online_teacher"


def _api(calls: list, offset: float = 0.0):
    """A cheap teacher fn: sample (prompt, seed, index) is a constant clip whose value encodes all three."""
    def fn(prompts, seed, indices):
        calls.append((list(prompts), seed, list(indices)))
        vals = [(offset + 0.01 * len(p) + 0.05 * (seed % 5) + 0.1 * (i % 4)) % 1.0 for p, i in zip(prompts, indices)]
        return torch.stack([torch.full((SPEC.num_frames, 3, SPEC.height, SPEC.width), v) for v in vals])
    return fn


def _source(name: str = "ramp", offset: float = 0.0, spec: VideoSpec = SPEC, calls: list | None = None):
    return CallableTeacher(_api([] if calls is None else calls, offset), spec, spec.fps, name=name)


def _file(cache_dir, key: str):
    return cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.pt"


def _no_encode(px):
    raise AssertionError("encode called although the latent is cached")


# ---------------------------------------------------------------------------------------------- renderer teacher
def test_renderer_renders_each_caption_in_its_own_world_from_the_addressed_start():
    """Sample (seed, i) is render(parse_caption(p, world), world, sample_generator(seed, i, 0, REND)): the caption
    is parsed with the teacher's world (a word only that world knows renders), and the start is the sample's own."""
    world = ShapesWorldConfig(colors=["red", "orange"], shapes=["circle", "diamond"])
    prompts = ["an orange diamond moving right slowly", "a red diamond moving down quickly"]
    teacher = ShapesRendererTeacher(world=world)
    stream = stream_id("data.online_render")
    for seed, indices in ((5, [3, 4]), (11, [3, 0])):
        got = teacher.videos_for(prompts, seed=seed, indices=indices)
        ref = torch.stack([render(parse_caption(p, world), world, sample_generator(seed, i, 0, stream))
                           for p, i in zip(prompts, indices)])
        assert got.shape == (2, 8, 3, 16, 16)
        assert torch.equal(got, ref)
    # the seed moves the clip (same prompt, same index)
    assert not torch.equal(teacher.videos_for(prompts[:1], seed=5, indices=[3]),
                           teacher.videos_for(prompts[:1], seed=11, indices=[3]))


def test_renderer_defaults_name_and_modes():
    """Default fps 8 (spec and source rate); the teacher is named "ShapesRendererTeacher" (the default cache-key
    name of a TeacherCache in front of it); resize / crop reach the normalisation of its clips."""
    teacher = ShapesRendererTeacher(world={"num_frames": 4})
    assert teacher.fps == 8.0 and teacher.spec == VideoSpec(4, 16, 16, 8.0)
    assert teacher.name == "ShapesRendererTeacher"
    assert TeacherCache(teacher).name == "ShapesRendererTeacher"
    world = ShapesWorldConfig()
    spec = VideoSpec(8, 6, 10, 8.0)
    prompt = "a blue square moving up quickly"
    raw = render(parse_caption(prompt, world), world, sample_generator(2, 1, 0, stream_id("data.online_render")))
    for resize, crop in (("bilinear", "center"), ("area", "none")):
        t = ShapesRendererTeacher(spec, world, resize=resize, crop=crop)
        assert (t.resize, t.crop) == (resize, crop)
        got = t.videos_for([prompt], seed=2, indices=[1])[0]
        assert torch.equal(got, normalise_video(raw, 8.0, spec, resize=resize, crop=crop))
        other = normalise_video(raw, 8.0, spec)  # the default modes give another clip
        assert not torch.equal(got, other)


# ---------------------------------------------------------------------------------------------- on-disk format
def test_cache_files_are_named_and_keyed_stably(tmp_path):
    """On-disk format: a clip is stored at sha256("name|spec|seed|index|prompt")[:40].pt and a latent at
    sha256("latent|codec|name|spec|seed|index|prompt")[:40].pt, each as {"format", "key", "tensor"}: entries
    written in that format are read without asking the source or the encoder (a cache_dir outlives a run)."""
    calls: list = []
    cache = TeacherCache(_source("ramp", calls=calls), cache_dir=tmp_path)
    clip, lat = torch.full((2, 3, 4, 4), 0.25), torch.full((2, 5, 2, 2), -3.0)
    ckey = "|".join(["ramp", str(SPEC), "3", "5", "a cat"])
    lkey = "|".join(["latent", "codec-x", "ramp", str(SPEC), "3", "5", "a cat"])
    torch.save({"format": FORMAT, "key": ckey, "tensor": clip}, _file(tmp_path, ckey))
    torch.save({"format": FORMAT, "key": lkey, "tensor": lat}, _file(tmp_path, lkey))
    assert torch.equal(cache.videos_for(["a cat"], 3, [5])[0], clip)
    assert torch.equal(cache.latents_for(["a cat"], 3, [5], _no_encode, "codec-x")[0], lat)
    assert cache.queries == 0 and calls == []
    # and what the cache writes is found under exactly those names
    cache.videos_for(["a dog"], 4, [1])
    k2 = "|".join(["ramp", str(SPEC), "4", "1", "a dog"])
    entry = torch.load(_file(tmp_path, k2), weights_only=True)
    assert entry["format"] == FORMAT and entry["key"] == k2 and entry["tensor"].shape == (2, 3, 4, 4)


def test_cache_file_is_used_only_with_its_format_and_key(tmp_path):
    """A file at an entry's path is used only if it is a dict with format "genrl.online_teacher" AND the entry's
    own key; a foreign key, a foreign format or a non-dict is a miss (the source is asked, its clip returned)."""
    key = "|".join(["ramp", str(SPEC), "3", "5", "a cat"])
    wrong = torch.zeros(2, 3, 4, 4)
    truth = _source("ramp").videos_for(["a cat"], 3, [5])
    for bad in ({"format": FORMAT, "key": "another|key", "tensor": wrong},
                {"format": "something.else", "key": key, "tensor": wrong},
                wrong):
        torch.save(bad, _file(tmp_path, key))
        cache = TeacherCache(_source("ramp"), cache_dir=tmp_path)
        got = cache.videos_for(["a cat"], 3, [5])
        assert torch.equal(got, truth) and cache.queries == 1
        _file(tmp_path, key).unlink()


def test_cache_file_read_once_is_kept_in_memory(tmp_path):
    """With memory=True a clip read from a file is kept in memory: a second request is a hit (no query) and
    returns the same tensor."""
    TeacherCache(_source("ramp"), cache_dir=tmp_path).videos_for(["a", "bb"], 1, [0, 2])
    fresh = TeacherCache(_source("ramp"), cache_dir=tmp_path)
    first = fresh.videos_for(["a", "bb"], 1, [0, 2])
    second = fresh.videos_for(["a", "bb"], 1, [0, 2])
    assert fresh.queries == 0 and torch.equal(first, second)
    assert len(fresh._mem) == 2 and all(isinstance(t, torch.Tensor) for t in fresh._mem.values())


def test_cache_file_never_unpickles_objects(tmp_path, monkeypatch):
    """Cache files are loaded weights-only, explicitly: a file holding a non-tensor object is refused by
    torch's safe unpickler, even when TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD asks torch to loosen its default."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    key = "|".join(["ramp", str(SPEC), "3", "5", "a cat"])
    torch.save({"format": FORMAT, "key": key, "tensor": Fraction(1, 3)}, _file(tmp_path, key))
    cache = TeacherCache(_source("ramp"), cache_dir=tmp_path)
    with pytest.raises(pickle.UnpicklingError):
        cache.videos_for(["a cat"], 3, [5])


# ---------------------------------------------------------------------------------------------- latent keys
def test_latents_are_separated_by_seed_and_index():
    """A latent is cached per (seed, index): another seed or index of the same prompt encodes its own clip."""
    cache = TeacherCache(_source("ramp"))
    src = _source("ramp")

    def enc(px):
        return px[:, :, :1] * 2 - 1

    for seed, i in ((1, 0), (1, 1), (2, 1), (2, 0)):
        got = cache.latents_for(["a"], seed, [i], enc, "c")
        assert torch.equal(got, enc(src.videos_for(["a"], seed, [i]))), (seed, i)


def test_latents_are_separated_by_teacher_and_format(tmp_path):
    """Latents in a shared cache_dir are keyed by the teacher's name and its spec: another teacher, or the same
    teacher in another pixel format, encodes its own clips instead of reading the first one's latents."""
    def enc(px):
        return px.mean(dim=(2, 3, 4), keepdim=True)

    spec2 = VideoSpec(2, 4, 4, 16.0)
    caches = [TeacherCache(_source("t1", 0.0), cache_dir=tmp_path),
              TeacherCache(_source("t2", 0.5), cache_dir=tmp_path),
              TeacherCache(_source("t2", 0.3, spec2), cache_dir=tmp_path)]
    sources = [_source("t1", 0.0), _source("t2", 0.5), _source("t2", 0.3, spec2)]
    for cache, src in zip(caches, sources):
        got = cache.latents_for(["a"], 1, [2], enc, "c")
        assert torch.equal(got, enc(src.videos_for(["a"], 1, [2])))


# ---------------------------------------------------------------------------------------------- generator spec
def test_generator_teacher_gets_every_field(tmp_path, monkeypatch):
    """kind="generator": load_generator gets text_encoder and the teacher's frames / height / width, the model is
    moved to ``device``; GeneratorTeacher gets steps / cfg_scale / shift / batch_size (its rollout config), the
    teacher's sample size (latent shape), teacher_fps and the resize / crop modes."""
    import genrl.models.loading as loading

    seen: dict = {}

    class FakeGen:
        codec = SimpleNamespace(latent_channels=4)

        def to(self, device):
            seen["device"] = device
            return self

    def fake_load(path, **kwargs):
        seen["path"], seen["kwargs"] = path, kwargs
        return FakeGen()

    monkeypatch.setattr(loading, "load_generator", fake_load)
    spec = OnlineTeacherSpec(kind="generator", path=str(tmp_path), text_encoder="te", steps=7, cfg_scale=1.5,
                             shift=2.5, batch_size=3, teacher_frames=5, teacher_height=12, teacher_width=20,
                             teacher_fps=12.0, resize="bilinear", crop="none", device="cuda:1")
    teacher = spec.build().source
    assert seen["path"] == str(tmp_path) and seen["device"] == "cuda:1"
    assert seen["kwargs"] == {"text_encoder": "te", "num_frames": 5, "height": 12, "width": 20}
    cfg = teacher.config
    assert (cfg.num_steps, cfg.cfg_scale, cfg.shift, cfg.micro_batch_size) == (7, 1.5, 2.5, 3)
    assert teacher.latent_shape == (5, 4, 12, 20)
    assert teacher.fps == 12.0 and teacher.spec == VideoSpec(8, 16, 16, 8.0)
    assert (teacher.resize, teacher.crop) == ("bilinear", "none")


# ---------------------------------------------------------------------------------------------- spec.build
def test_shapes_spec_builds_the_renderer_with_every_field(tmp_path):
    """kind="shapes": the renderer gets the student's format (frames, height, width, fps), the spec's world and
    resize / crop modes; the cache is named "shapes-renderer" and gets cache_dir and variants_per_prompt (None
    stays None: every sample index renders its own clip)."""
    world = {"colors": ["red", "orange"], "shapes": ["circle", "diamond"], "num_frames": 6}
    spec = OnlineTeacherSpec(kind="shapes", num_frames=4, height=6, width=10, fps=4.0, world=world,
                             resize="bilinear", crop="none", variants_per_prompt=3, cache_dir=str(tmp_path))
    cache = spec.build()
    src = cache.source
    assert isinstance(src, ShapesRendererTeacher)
    assert src.spec == VideoSpec(4, 6, 10, 4.0) and cache.spec == VideoSpec(4, 6, 10, 4.0)
    assert src.world == ShapesWorldConfig(**world) and src.fps == 4.0
    assert (src.resize, src.crop) == ("bilinear", "none")
    assert cache.name == "shapes-renderer" and cache.variants == 3 and cache.cache_dir == tmp_path
    # an empty world is the default world; no variants cap and no cache_dir by default
    default = OnlineTeacherSpec(kind="shapes").build()
    assert default.source.world == ShapesWorldConfig() and default.variants is None and default.cache_dir is None
    assert (default.source.resize, default.source.crop) == ("area", "center")


def _fake_loader(monkeypatch, seen: list):
    import genrl.models.loading as loading

    class FakeGen:
        codec = SimpleNamespace(latent_channels=4)

        def to(self, device):
            return self

    def fake_load(path, **kwargs):
        seen.append(path)
        return FakeGen()

    monkeypatch.setattr(loading, "load_generator", fake_load)


def test_generator_spec_names_its_cache_by_path_and_sampler(tmp_path, monkeypatch):
    """kind="generator": the cache key name is "generator:<resolved path>:steps=..,cfg=..,shift=.." (another sampler
    is another teacher); variants_per_prompt defaults to 4 for a generator and a given value is kept."""
    seen: list = []
    _fake_loader(monkeypatch, seen)
    cache = OnlineTeacherSpec(kind="generator", path=str(tmp_path), steps=7, cfg_scale=1.5, shift=2.5,
                              cache_dir=str(tmp_path / "c")).build()
    assert cache.name == f"generator:{tmp_path.resolve()}:steps=7,cfg=1.5,shift=2.5"
    assert cache.variants == 4 and cache.cache_dir == tmp_path / "c" and cache.fallback is None
    given = OnlineTeacherSpec(kind="generator", path=str(tmp_path), variants_per_prompt=2).build()
    assert given.variants == 2 and given.cache_dir is None


def _mp4_folder(root, captions: dict[str, str]):
    from genrl.data.video_io import write_video

    root.mkdir()
    for i, file in enumerate(captions):
        write_video(root / file, torch.full((8, 3, 16, 16), 0.2 + 0.3 * i), fps=8.0)
    (root / "captions.jsonl").write_text("".join(json.dumps({"file": f, "caption": c}) + "\n"
                                                 for f, c in captions.items()))
    return root


def test_folder_spec_builds_the_store_with_its_format_and_fallback(tmp_path, monkeypatch):
    """kind="folder": the store reads ``path`` in the student's format with the resize / crop modes; ``fallback``
    loads a generator teacher for the prompts the folder lacks; the cache gets cache_dir and variants (default 4)
    and is named "folder:<resolved path>|<fallback>:<sampler>"."""
    from genrl.data.teacher_videos import GeneratorTeacher, TeacherVideoStore

    root = _mp4_folder(tmp_path / "vids", {"a.mp4": "a red circle", "b.mp4": "a blue square"})
    seen: list = []
    _fake_loader(monkeypatch, seen)
    spec = OnlineTeacherSpec(kind="folder", path=str(root), num_frames=4, height=8, width=12, fps=8.0,
                             resize="bilinear", crop="none", fallback=str(tmp_path / "gen"), steps=3,
                             cfg_scale=2.0, shift=1.5, cache_dir=str(tmp_path / "c"))
    cache = spec.build()
    store = cache.source
    assert isinstance(store, TeacherVideoStore) and store.folder == root
    assert store.spec == VideoSpec(4, 8, 12, 8.0) and (store.resize, store.crop) == ("bilinear", "none")
    assert sorted(store.prompts) == ["a blue square", "a red circle"]
    assert seen == [str(tmp_path / "gen")]
    assert isinstance(cache.fallback, GeneratorTeacher) and cache.fallback.spec == VideoSpec(4, 8, 12, 8.0)
    assert cache.name == f"folder:{root.resolve()}|{tmp_path / 'gen'}:steps=3,cfg=2.0,shift=1.5"
    assert cache.variants == 4 and cache.cache_dir == tmp_path / "c"
    # the store's clip is what the cache returns for a caption it has
    clip = cache.videos_for(["a red circle"], 0, [0])[0]
    assert clip.shape == (4, 3, 8, 12) and abs(clip.mean().item() - 0.2) < 0.02
    plain = OnlineTeacherSpec(kind="folder", path=str(root), variants_per_prompt=1).build()
    assert plain.fallback is None and plain.variants == 1 and seen == [str(tmp_path / "gen")]
    assert plain.name == f"folder:{root.resolve()}|None:steps=20,cfg=3.0,shift=1.0"


def test_spec_refuses_unknown_kind_and_missing_path():
    with pytest.raises(ValueError, match="'video'"):
        OnlineTeacherSpec(kind="video").build()
    for kind in ("generator", "folder"):
        with pytest.raises(ValueError, match=f"'{kind}' needs path"):
            OnlineTeacherSpec(kind=kind).build()


def test_cache_over_a_bare_source_uses_its_class_name_and_fallback():
    """A source with neither ``name`` nor ``prompts`` (an API client): the cache is named after its class, and
    when it raises UnknownPromptError every prompt of the batch goes to the fallback."""
    from genrl.data.teacher_videos import UnknownPromptError

    class ApiClient:
        spec = SPEC

        def videos_for(self, prompts, seed, indices):
            raise UnknownPromptError("not in the store")

    fallback = _source("fb", 0.5)
    cache = TeacherCache(ApiClient(), fallback=fallback)
    assert cache.name == "ApiClient"
    got = cache.videos_for(["a", "bb"], 2, [0, 1])
    assert torch.equal(got, fallback.videos_for(["a", "bb"], 2, [0, 1]))
