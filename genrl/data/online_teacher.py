"""Online black-box teachers for AFD: queried per batch on the student's own prompts, with a clip / latent cache.

AFD's loop (docs/methods/distillation.md, "AFD") asks a teacher for finished videos of the prompts the student is
rolling out *in that batch*. Any :class:`~genrl.data.teacher_videos.TeacherSource` answers that call
(``videos_for(prompts, seed, indices) -> float32 [B, T, 3, H, W] in [0, 1]`` in the student's format); this module
adds what the method needs around it:

* :class:`ShapesRendererTeacher`: the shapes world's own renderer as a teacher. It parses each caption and draws
  the ground-truth video (every attribute right), so it knows more than any student yet has no network, no score
  and no latent: exactly the interface AFD claims to need and DMD cannot use.
* :class:`TeacherCache`: in front of any source (and an optional fallback for prompts the source cannot answer,
  e.g. a folder of mp4s backed by a generator), it caches clips (memory, and files under ``cache_dir``) and the
  student codec's latents of them, keyed by (teacher, prompt, seed, variant) and the codec's fingerprint. With
  ``variants_per_prompt = n`` an expensive teacher makes at most n clips per prompt: sample ``index`` asks for
  variant ``j = hash(seed, index) mod n``, addressed as index ``j`` of the prompt. Cached and uncached calls return
  the same tensors bit for bit (tested).
* :class:`OnlineTeacherSpec`: the typed config block (``model.init_args.teacher``) that builds one of the three
  kinds: ``shapes`` (the renderer), ``generator`` (any local genrl DiT folder, diffusers pipeline folder or ``genrl
  fit`` checkpoint, sampled with its own steps and CFG) and ``folder`` (a folder of mp4s with captions, optionally
  backed by a generator for prompts the folder lacks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from genrl.data.shapes import ShapesWorldConfig, as_world, parse_caption, render
from genrl.data.teacher_videos import (
    CallableTeacher,
    CropMode,
    GeneratorTeacher,
    ResizeMode,
    TeacherVideoStore,
    UnknownPromptError,
    VideoSpec,
    _indices,
)
from genrl.data.video_io import atomic_write
from genrl.noise import mix_seed, sample_generator, stream_id

__all__ = ["OnlineTeacherSpec", "ShapesRendererTeacher", "TeacherCache"]

_STREAM_RENDER = stream_id("data.online_render")  # "REND": the renderer teacher's start positions
_STREAM_VARIANT = stream_id("data.online_variant")  # "VARI": which cached variant a sample asks for
_CACHE_FORMAT = "genrl.online_teacher"


class ShapesRendererTeacher(CallableTeacher):
    """The shapes world's renderer as a black-box teacher: the ground-truth video of each caption.

    Sample ``(seed, index)`` draws its start position from its own generator (``sample_generator(seed, index, 0,
    stream)``), so a clip does not depend on its batch. The videos are the world's frames ([world.num_frames, 3,
    world.height, world.width] in [0, 1], black background) at ``fps`` frames / s, normalised to ``spec`` like any
    teacher's (frame selection, area resize, center crop; :func:`~genrl.data.teacher_videos.normalise_video`).

    Args:
        spec: the student's format (default: the world's frames and size at ``fps``).
        world: the shapes world (a :class:`~genrl.data.shapes.ShapesWorldConfig` or a dict of its fields).
        fps: the rendered videos' frame rate (frames / s, > 0).

    Raises:
        ValueError (from ``videos_for``): a caption the world cannot parse or render, naming it and the teacher.
    """

    def __init__(self, spec: VideoSpec | None = None, world: ShapesWorldConfig | dict | None = None,
                 fps: float = 8.0, *, resize: ResizeMode = "area", crop: CropMode = "center") -> None:
        self.world = as_world(world)
        spec = spec or VideoSpec(self.world.num_frames, self.world.height, self.world.width, float(fps))
        super().__init__(self._render, spec, fps, resize=resize, crop=crop, name="ShapesRendererTeacher")

    def _render(self, prompts: list[str], seed: int, indices: list[int]) -> torch.Tensor:
        out = []
        for prompt, i in zip(prompts, indices):
            try:
                shape_spec = parse_caption(prompt, self.world)
            except ValueError as err:
                raise ValueError(f"ShapesRendererTeacher cannot render prompt {prompt!r}: {err}; the renderer "
                                 f"teacher only answers shapes-world captions (use shapes:train prompts)") from None
            out.append(render(shape_spec, self.world, sample_generator(seed, i, 0, _STREAM_RENDER)))
        return torch.stack(out)


def _key(*parts: Any) -> str:
    return "|".join(str(p) for p in parts)


class TeacherCache:
    """A teacher source with a clip cache and a latent cache (AFD's online loop).

    Args:
        source: any object with ``videos_for(prompts, seed, indices)`` and ``spec`` (a
            :class:`~genrl.data.teacher_videos.TeacherSource`).
        fallback: answers the prompts ``source`` raises :class:`~genrl.data.teacher_videos.UnknownPromptError`
            for (a folder of mp4s backed by a generator); None re-raises.
        cache_dir: where clips and latents are also stored as files (atomic writes, so an interrupted run never
            leaves a partial entry); None keeps them in memory only.
        variants_per_prompt: n >= 1 caps the distinct clips per prompt (sample ``index`` asks for variant
            ``mix_seed(seed, index, stream) mod n``, passed to the source as the index); None asks the source
            for every sample index (no reuse within a run; the right choice for a cheap teacher).
        memory: keep entries in memory (``False``: files only, for large clips).
        name: the teacher's id in cache keys (default the source's ``name`` or class): change it when the
            teacher changes, or the cache answers with the old teacher's clips.

    Raises:
        ValueError: ``variants_per_prompt < 1``.
    """

    def __init__(self, source: Any, *, fallback: Any | None = None, cache_dir: str | Path | None = None,
                 variants_per_prompt: int | None = None, memory: bool = True, name: str | None = None) -> None:
        if variants_per_prompt is not None and variants_per_prompt < 1:
            raise ValueError(f"variants_per_prompt must be >= 1 or None, got {variants_per_prompt}")
        self.source, self.fallback = source, fallback
        self.spec: VideoSpec = source.spec
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.variants, self.memory = variants_per_prompt, memory
        self.name = name or getattr(source, "name", None) or type(source).__name__
        self._mem: dict[str, torch.Tensor] = {}
        self.queries = 0  # clips the source (or fallback) was asked for: cache misses

    # -------------------------------------------------------------- addressing
    def addresses(self, seed: int, indices: Sequence[int]) -> list[int]:
        """The index each sample asks the source for: itself, or its variant in [0, n)."""
        if self.variants is None:
            return list(indices)
        return [mix_seed(seed, int(i), _STREAM_VARIANT) % self.variants for i in indices]

    def _file(self, key: str) -> Path:
        return self.cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.pt"

    def _get(self, key: str) -> torch.Tensor | None:
        if key in self._mem:
            return self._mem[key]
        if self.cache_dir is None:
            return None
        path = self._file(key)
        if not path.is_file():
            return None
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT or data.get("key") != key:
            return None
        if self.memory:
            self._mem[key] = data["tensor"]
        return data["tensor"]

    def _put(self, key: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        if self.memory:
            self._mem[key] = tensor
        if self.cache_dir is not None:
            entry = {"format": _CACHE_FORMAT, "key": key, "tensor": tensor}
            atomic_write(self._file(key), lambda tmp: torch.save(entry, tmp))

    def _query(self, prompts: list[str], seed: int, idx: list[int]) -> torch.Tensor:
        self.queries += len(prompts)
        try:
            return self.source.videos_for(prompts, seed, idx).float().cpu()
        except UnknownPromptError:
            if self.fallback is None:
                raise
        known = set(getattr(self.source, "prompts", None) or [])  # a store: split known / unknown prompts
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for src, rows in ((self.source, [r for r, p in enumerate(prompts) if p in known]),
                          (self.fallback, [r for r, p in enumerate(prompts) if p not in known])):
            if rows:
                clips = src.videos_for([prompts[r] for r in rows], seed, [idx[r] for r in rows]).float().cpu()
                for r, clip in zip(rows, clips):
                    out[r] = clip
        return torch.stack(out)

    # -------------------------------------------------------------- public
    def videos_for(self, prompts: Sequence[str], seed: int,
                   indices: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Teacher clips for ``prompts``: float32 [B, T, 3, H, W] in [0, 1] (CPU), from the cache or the source.

        Raises:
            whatever the source raises for a prompt it cannot answer (with no fallback), naming the prompt.
        """
        idx = self.addresses(seed, _indices(prompts, indices))
        keys = [_key(self.name, self.spec, seed, i, p) for p, i in zip(prompts, idx)]
        out = [self._get(k) for k in keys]
        miss = [r for r, clip in enumerate(out) if clip is None]
        if miss:
            uniq = list(dict.fromkeys(keys[r] for r in miss))  # a key asked twice in one batch is made once
            first = {k: next(r for r in miss if keys[r] == k) for k in uniq}
            clips = self._query([prompts[first[k]] for k in uniq], seed, [idx[first[k]] for k in uniq])
            for k, clip in zip(uniq, clips):
                self._put(k, clip)
            made = dict(zip(uniq, clips))
            for r in miss:
                out[r] = made[keys[r]]
        return torch.stack(out)

    def latents_for(self, prompts: Sequence[str], seed: int, indices: Sequence[int] | torch.Tensor | None,
                    encode: Callable[[torch.Tensor], torch.Tensor], codec_id: str) -> torch.Tensor:
        """The student codec's latents of the teacher clips (``encode(pixels [N, T, 3, H, W]) -> latents``),
        cached under ``codec_id`` (e.g. :func:`~genrl.data.teacher_videos.codec_fingerprint`): float32, CPU."""
        raw = _indices(prompts, indices)
        idx = self.addresses(seed, raw)
        keys = [_key("latent", codec_id, self.name, self.spec, seed, i, p) for p, i in zip(prompts, idx)]
        out = [self._get(k) for k in keys]
        miss = [r for r, lat in enumerate(out) if lat is None]
        if miss:
            pixels = self.videos_for([prompts[r] for r in miss], seed, [raw[r] for r in miss])
            with torch.no_grad():
                lat = encode(pixels).float().cpu()
            for r, z in zip(miss, lat):
                self._put(keys[r], z)
                out[r] = z
        return torch.stack(out)


@dataclass
class OnlineTeacherSpec:
    """The online teacher of an AFD config (``model.init_args.teacher``), built into a :class:`TeacherCache`.

    Attributes:
        kind: ``"shapes"`` (the world's renderer, :class:`ShapesRendererTeacher`), ``"generator"`` (``path``: a
            genrl DiT folder, diffusers pipeline folder or ``genrl fit`` checkpoint, sampled by
            :class:`~genrl.data.teacher_videos.GeneratorTeacher` with ``steps`` / ``cfg_scale`` / ``shift``) or
            ``"folder"`` (``path``: mp4s with captions, :class:`~genrl.data.teacher_videos.TeacherVideoStore`;
            ``fallback`` names a generator for the prompts the folder lacks).
        num_frames, height, width, fps: the student's pixel format the clips are normalised to.
        path / fallback / text_encoder: model or folder paths (local only); text_encoder for a DiT teacher.
        steps, cfg_scale, shift, batch_size: the generator teacher's sampler.
        teacher_frames, teacher_height, teacher_width: a generator teacher's own sample size (default the
            student's); its clips are resampled to the student's format like a folder's.
        teacher_fps: the generator teacher's frame rate (default ``fps``).
        world: the shapes world of the renderer (dict of :class:`~genrl.data.shapes.ShapesWorldConfig` fields).
        variants_per_prompt, cache_dir: see :class:`TeacherCache` (a generator teacher defaults to 4 variants).
        resize, crop: as in :func:`~genrl.data.teacher_videos.normalise_video`.
        device: where a generator teacher runs (default CPU; "cuda" on a GPU machine).

    Raises:
        ValueError (``build``): an unknown kind, or ``path`` missing for ``generator`` / ``folder``.
    """

    kind: Literal["shapes", "generator", "folder"] = "shapes"
    num_frames: int = 8
    height: int = 16
    width: int = 16
    fps: float = 8.0
    path: str | None = None
    fallback: str | None = None
    text_encoder: str | None = None
    steps: int = 20
    cfg_scale: float = 3.0
    shift: float = 1.0
    batch_size: int = 8
    teacher_frames: int | None = None
    teacher_height: int | None = None
    teacher_width: int | None = None
    teacher_fps: float | None = None
    world: dict[str, Any] = field(default_factory=dict)
    variants_per_prompt: int | None = None
    cache_dir: str | None = None
    resize: ResizeMode = "area"
    crop: CropMode = "center"
    device: str = "cpu"

    def _generator(self, path: str, spec: VideoSpec) -> GeneratorTeacher:
        from genrl.models.loading import load_generator

        gen = load_generator(path, text_encoder=self.text_encoder, num_frames=self.teacher_frames,
                             height=self.teacher_height, width=self.teacher_width).to(self.device)
        return GeneratorTeacher(gen, spec, steps=self.steps, cfg_scale=self.cfg_scale, shift=self.shift,
                                num_frames=self.teacher_frames, height=self.teacher_height, width=self.teacher_width,
                                fps=self.teacher_fps, batch_size=self.batch_size, resize=self.resize, crop=self.crop)

    def build(self) -> TeacherCache:
        """The teacher with its cache (loads a generator teacher's weights)."""
        spec = VideoSpec(self.num_frames, self.height, self.width, self.fps)
        if self.kind == "shapes":
            source, name, variants = ShapesRendererTeacher(spec, self.world or None, fps=self.fps, resize=self.resize,
                                                           crop=self.crop), "shapes-renderer", self.variants_per_prompt
            return TeacherCache(source, cache_dir=self.cache_dir, variants_per_prompt=variants, name=name)
        if self.kind not in ("generator", "folder"):
            raise ValueError(f"unknown teacher kind {self.kind!r}; use 'shapes', 'generator' or 'folder'")
        if not self.path:
            raise ValueError(f"teacher kind {self.kind!r} needs path: a local "
                             f"{'model folder or checkpoint' if self.kind == 'generator' else 'folder of mp4s'}")
        sampler = f"steps={self.steps},cfg={self.cfg_scale},shift={self.shift}"
        variants = self.variants_per_prompt if self.variants_per_prompt is not None else 4
        if self.kind == "generator":
            return TeacherCache(self._generator(self.path, spec), cache_dir=self.cache_dir,
                                variants_per_prompt=variants, name=f"generator:{Path(self.path).resolve()}:{sampler}")
        store = TeacherVideoStore(self.path, spec=spec, resize=self.resize, crop=self.crop)
        fallback = self._generator(self.fallback, spec) if self.fallback else None
        return TeacherCache(store, fallback=fallback, cache_dir=self.cache_dir, variants_per_prompt=variants,
                            name=f"folder:{Path(self.path).resolve()}|{self.fallback}:{sampler}")
