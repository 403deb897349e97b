"""The procedural shapes world: short videos of one colored shape that moves, with exact captions.

This is genrl's embedded default world (docs/architecture.md, The shapes world). Everything here is a pure
function of its arguments: no Lightning, no global RNG. A sample is addressed by ``(seed, index)``:

    pixels, caption, spec = sample(config, seed=0, index=17)

draws from a ``torch.Generator`` seeded with ``sample_seed(seed, index)`` (SplitMix64 of the two ints, the
same hash as ``genrl.noise.mix_seed(seed, index)``), so sample 17 is bit-identical whatever batch it
lands in.

Geometry and units:

* Pixels are float32 ``[T, 3, H, W]`` in [0, 1], black background, RGB colors from :data:`PALETTE`.
* Pixel ``(row i, column j)`` covers ``[j, j + 1) x [i, i + 1)`` in continuous pixel coordinates; ``y`` grows
  downwards, so "up" is ``-y``.
* Every shape fits an axis-aligned ``object_size x object_size`` box: circle (diameter), square (side),
  triangle (pointing up: apex at the top-center of the box, base along its bottom edge), diamond
  (diagonals). Rendering is anti-aliased by 4x4 supersampling and box averaging; positions are subpixel.
* Speeds are in pixels per frame **at the configured resolution**; they are not rescaled with
  ``height`` / ``width``. The defaults (slow 0.6, fast 1.2 px/frame) move a 6 px object 4.2 / 8.4 px over
  8 frames, which fits a 16 x 16 frame (fast needs ``7 * 1.2 + 6 = 14.4 <= 16`` px) and keeps the two
  speeds 0.6 px/frame apart for the verifier. At a larger resolution raise them yourself if you want the
  same relative motion; :class:`ShapesWorldConfig` refuses values whose path leaves the frame.
* Boundary (``ShapesWorldConfig.boundary``): ``"inside"`` (the default) keeps the whole path inside the frame, so
  a video is at most about 8 frames long at the default speeds; ``"wrap"`` makes the frame a torus (x modulo
  ``width``, y modulo ``height``): the start is uniform over the frame, an object crossing the right edge reappears
  on the left, and any ``num_frames`` / speed is allowed (long rollouts of history-guided sampling are scored on
  it). :func:`start_position` is the start :func:`render` draws, :func:`render_at` renders from a given start,
  :func:`centroid_path` gives the analytic (wrapped) position of the object over any number of frames and
  :func:`position_error` the shortest (wrapped) distance between two positions.

Captions (``caption`` / ``parse_caption`` are exact inverses):

* single step:  ``"a red circle moving left slowly"``, ``"a red circle moving up quickly"``,
  ``"a red circle staying still"`` (and ``"a red circle moving left"`` when no speed is stated: it is
  rendered at the mean of the configured speeds);
* two steps:    ``"a red circle moves right, then moves up"`` / ``"..., then stays still"``: the first half of
  the frames follows direction 1, the second half direction 2, at the mean speed;
* three steps:  ``"a red circle moves right, then moves up, then moves left"`` (opt-in,
  ``ShapesWorldConfig.max_segments = 3``): the frames split into three as-even-as-possible contiguous segments
  (:func:`segment_spans`), each following its direction at the mean speed;
* image mode (``num_frames = 1``): ``"a red circle"``.

:func:`step_captions` splits a multi-step caption into the single-step caption of each segment ("a red circle moving
right", "a red circle moving up"): the world's ground-truth plan; :func:`segment_spans` gives the frames of each.

Held-out split: a fixed (seed-independent) set of (color, shape, direction) combinations, about
``heldout_fraction`` of all of them, chosen by a stable hash of their names such that every single
attribute value and every pair of values still appears in training. A caption is held out iff its
(color, shape, first direction) is.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from genrl.models.plans import uniform_spans
from genrl.noise import mix_seed, sample_generator, stream_id

#: the stream of a real video's render (genrl.noise.STREAMS).
_RENDER_STREAM = stream_id("data.shapes_render")

__all__ = [
    "PALETTE",
    "KNOWN_SHAPES",
    "KNOWN_DIRECTIONS",
    "SPEED_ADVERBS",
    "DIRECTION_VECTORS",
    "ShapesWorldConfig",
    "ShapeSpec",
    "Split",
    "caption",
    "parse_caption",
    "step_captions",
    "segment_spans",
    "turn_points",
    "MAX_SEGMENTS",
    "render",
    "trajectory",
    "BOUNDARIES",
    "start_position",
    "render_at",
    "centroid_path",
    "wrapped_delta",
    "position_error",
    "combos",
    "heldout_combos",
    "is_heldout",
    "sample_spec",
    "sample_seed",
    "sample",
    "heldout_prompts",
    "real_videos",
]

Split = Literal["train", "heldout", "all"]

#: Known colors (RGB in [0, 1]; every entry has max channel 1, which the verifier relies on). The first six
#: are the default world; white / orange / pink are opt-in extras; crimson (near red) and teal (near cyan)
#: are opt-in "close hues" that make color a harder attribute.
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "magenta": (1.0, 0.0, 1.0),
    "cyan": (0.0, 1.0, 1.0),
    "white": (1.0, 1.0, 1.0),
    "orange": (1.0, 0.5, 0.0),
    "pink": (1.0, 0.45, 0.7),
    "crimson": (1.0, 0.0, 0.35),
    "teal": (0.0, 1.0, 0.7),
}

#: Known shapes; "diamond" is an opt-in extra (the default world uses circle, square, triangle).
KNOWN_SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")

#: Known motion directions and their unit vectors in pixel coordinates (x right, y down).
KNOWN_DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down", "still")
DIRECTION_VECTORS: dict[str, tuple[float, float]] = {
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
    "still": (0.0, 0.0),
}

#: Known speed names and the adverb captions use for them.
SPEED_ADVERBS: dict[str, str] = {"slow": "slowly", "medium": "steadily", "fast": "quickly"}

#: The most motion segments a caption may have ("..., then moves up, then moves left").
MAX_SEGMENTS = 3

#: Known frame boundaries: "inside" (the path stays inside the frame) and "wrap" (the frame is a torus).
BOUNDARIES: tuple[str, ...] = ("inside", "wrap")

_SUPERSAMPLE = 4


def _known(kind: str, words: list[str], known) -> None:
    for w in words:
        if w not in known:
            raise ValueError(f"unknown {kind} {w!r} in ShapesWorldConfig; known {kind}s: {', '.join(known)}")
    if len(set(words)) != len(words):
        raise ValueError(f"ShapesWorldConfig {kind}s contain duplicates: {words}")
    if not words:
        raise ValueError(f"ShapesWorldConfig needs at least one {kind}; known {kind}s: {', '.join(known)}")


@dataclass
class ShapesWorldConfig:
    """Configuration of the shapes world (plain typed values: usable directly as a LightningCLI config).

    Attributes:
        height, width: frame size in pixels (>= 4 each).
        num_frames: frames per video T (>= 1). ``1`` is image mode: no motion, captions "a red circle".
        colors: color words, each a key of :data:`PALETTE`.
        shapes: shape words, each in :data:`KNOWN_SHAPES`.
        directions: motion words, each in :data:`KNOWN_DIRECTIONS` (ignored in image mode).
        speeds: speed name (a key of :data:`SPEED_ADVERBS`) -> pixels per frame at this resolution, > 0 and
            distinct. Captions say "slowly" / "steadily" / "quickly". Not rescaled with resolution.
        object_size: side of the shape's bounding box in pixels (2 <= size <= min(height, width)).
        multi_step_prob: fraction of video captions with several motion segments (needs num_frames >= 4 and two
            directions when > 0; ignored in image mode).
        max_segments: the most motion segments of a multi-step caption, 2 or 3 (:data:`MAX_SEGMENTS`). ``2`` (the
            default) samples two-segment captions exactly as before this field existed (same draws, same captions,
            same videos); ``3`` draws the number of segments of each multi-step caption uniformly in {2, 3} (one
            extra ``torch.randint`` draw) and needs ``num_frames >= 6`` (two frames per segment) when
            ``multi_step_prob > 0``.
        heldout_fraction: fraction of (color, shape, direction) combinations held out of training, in [0, 0.5].
        boundary: one of :data:`BOUNDARIES`. ``"inside"``: every frame's bounding box stays inside the frame (the
            start is drawn among the positions that keep it there). ``"wrap"``: the frame is a torus (x modulo
            ``width``, y modulo ``height``); the start is uniform over the whole frame, the part of the object
            past an edge is drawn at the opposite edge, and the travel check below is skipped (any
            ``num_frames`` and speed).

    Raises:
        ValueError: an unknown or duplicated word (the message names it and lists the known ones), a
            non-positive or duplicated speed, an object larger than the frame, a motion path that leaves the
            frame on an ``"inside"`` world (``(num_frames - 1) * max(speeds) + object_size > min(height,
            width)``), a probability / fraction out of range, an unknown ``boundary`` (named with the known
            ones), ``max_segments`` not an int in [2, 3], or ``max_segments=3`` with ``multi_step_prob > 0`` and
            fewer than 6 frames.
    """

    height: int = 16
    width: int = 16
    num_frames: int = 8
    colors: list[str] = field(default_factory=lambda: ["red", "green", "blue", "yellow", "magenta", "cyan"])
    shapes: list[str] = field(default_factory=lambda: ["circle", "square", "triangle"])
    directions: list[str] = field(default_factory=lambda: ["left", "right", "up", "down", "still"])
    speeds: dict[str, float] = field(default_factory=lambda: {"slow": 0.6, "fast": 1.2})
    object_size: float = 6.0
    multi_step_prob: float = 0.2
    heldout_fraction: float = 0.15
    boundary: str = "inside"
    max_segments: int = 2

    def __post_init__(self) -> None:
        self.colors = [str(c).lower() for c in self.colors]
        self.shapes = [str(s).lower() for s in self.shapes]
        self.directions = [str(d).lower() for d in self.directions]
        self.speeds = {str(k).lower(): float(v) for k, v in dict(self.speeds).items()}
        for name in ("height", "width", "num_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ShapesWorldConfig.{name} must be an int, got {value!r}")
        if self.height < 4 or self.width < 4:
            raise ValueError(f"frames must be at least 4x4 pixels, got {self.height}x{self.width}")
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1 (1 = image mode), got {self.num_frames}")
        _known("color", self.colors, tuple(PALETTE))
        _known("shape", self.shapes, KNOWN_SHAPES)
        _known("direction", self.directions, KNOWN_DIRECTIONS)
        side = min(self.height, self.width)
        if not (2.0 <= self.object_size <= side):
            raise ValueError(
                f"object_size={self.object_size} px does not fit a {self.height}x{self.width} frame; "
                f"use 2 <= object_size <= {side}"
            )
        if not 0.0 <= self.multi_step_prob <= 1.0:
            raise ValueError(f"multi_step_prob must be in [0, 1], got {self.multi_step_prob}")
        if not 0.0 <= self.heldout_fraction <= 0.5:
            raise ValueError(f"heldout_fraction must be in [0, 0.5], got {self.heldout_fraction}")
        if not isinstance(self.boundary, str) or self.boundary not in BOUNDARIES:
            raise ValueError(
                f"unknown boundary {self.boundary!r} in ShapesWorldConfig; known boundaries: {', '.join(BOUNDARIES)} "
                f"('inside': the path stays inside the frame, 'wrap': the frame is a torus)"
            )
        if (isinstance(self.max_segments, bool) or not isinstance(self.max_segments, int)
                or not 2 <= self.max_segments <= MAX_SEGMENTS):
            raise ValueError(
                f"ShapesWorldConfig.max_segments must be an int in [2, {MAX_SEGMENTS}] (the most motion segments of a "
                f"multi-step caption), got {self.max_segments!r}"
            )
        if self.image_mode:
            return
        for name in self.speeds:
            if name not in SPEED_ADVERBS:
                raise ValueError(
                    f"unknown speed {name!r} in ShapesWorldConfig; known speeds: {', '.join(SPEED_ADVERBS)}"
                )
        if not self.speeds:
            raise ValueError("a video world (num_frames > 1) needs at least one speed, e.g. {'slow': 0.6}")
        values = sorted(self.speeds.values())
        if values[0] <= 0 or any(not math.isfinite(v) for v in values):
            raise ValueError(f"speeds must be finite and > 0 px/frame, got {self.speeds}")
        if any(b - a < 1e-6 for a, b in zip(values, values[1:])):
            raise ValueError(f"speeds must be distinct, got {self.speeds}")
        travel = (self.num_frames - 1) * values[-1]
        if self.boundary == "inside" and travel + self.object_size > side:
            raise ValueError(
                f"a {self.object_size:g} px object moving {values[-1]:g} px/frame for {self.num_frames} frames "
                f"travels {travel:g} px and leaves a {self.height}x{self.width} frame; lower the speeds, "
                f"object_size or num_frames, raise the resolution, or use boundary='wrap' (a torus frame)"
            )
        if self.multi_step_prob > 0:
            if self.num_frames < 4:
                raise ValueError(
                    f"multi-step captions need num_frames >= 4 (two frames per segment), got {self.num_frames}; "
                    f"set multi_step_prob=0"
                )
            if len(self.directions) < 2:
                raise ValueError("multi-step captions need at least two directions; set multi_step_prob=0")
            if self.max_segments * 2 > self.num_frames:
                raise ValueError(
                    f"max_segments={self.max_segments} needs num_frames >= {2 * self.max_segments} (two frames per "
                    f"segment), got num_frames={self.num_frames}; raise num_frames, lower max_segments or set "
                    f"multi_step_prob=0"
                )

    @property
    def image_mode(self) -> bool:
        """True when ``num_frames == 1``: no motion, captions "a red circle"."""
        return self.num_frames == 1

    @property
    def mean_speed(self) -> float:
        """Mean of the configured speeds (px/frame): the speed of multi-step and speed-less captions."""
        return sum(self.speeds.values()) / len(self.speeds) if self.speeds else 0.0


def as_world(world: ShapesWorldConfig | dict | None) -> ShapesWorldConfig:
    """A :class:`ShapesWorldConfig` from a config, a dict of its fields (as stored in checkpoint
    hyperparameters) or None (the default world). Raises ValueError / TypeError like the constructor."""
    if isinstance(world, dict):
        return ShapesWorldConfig(**world)
    return world if world is not None else ShapesWorldConfig()


@dataclass(frozen=True)
class ShapeSpec:
    """The hidden state of one sample.

    Attributes:
        color: a color word.
        shape: a shape word.
        directions: ``()`` in image mode (or for a caption that states no motion), one direction for a
            single-step caption, two or three (:data:`MAX_SEGMENTS`) for a multi-step caption.
        speed: a speed name for a moving single-step caption that states one; ``None`` when still,
            multi-step, image mode, or unstated (rendered at the mean speed).

    Raises:
        ValueError: more than three directions, or a speed with a still / multi-step / motionless spec.
    """

    color: str
    shape: str
    directions: tuple[str, ...] = ()
    speed: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "directions", tuple(self.directions))
        if len(self.directions) > MAX_SEGMENTS:
            raise ValueError(f"a ShapeSpec has at most {MAX_SEGMENTS} motion segments, got {self.directions}")
        if self.speed is not None and (len(self.directions) != 1 or self.directions[0] == "still"):
            raise ValueError(
                f"speed {self.speed!r} only applies to a single moving segment, got directions {self.directions}"
            )

    @property
    def multi_step(self) -> bool:
        """True for two or more motion segments."""
        return len(self.directions) >= 2


# Plain-value dataclasses: allow them in checkpoints loaded with torch.load(weights_only=True).
torch.serialization.add_safe_globals([ShapesWorldConfig, ShapeSpec])


# ---------------------------------------------------------------------------------------------- captions
def caption(spec: ShapeSpec) -> str:
    """The caption of a spec, e.g. ``"a red circle moving left slowly"`` (see the module docstring).

    Raises:
        ValueError: an unknown speed name.
    """
    article = "an" if spec.color[:1] in "aeiou" else "a"
    base = f"{article} {spec.color} {spec.shape}"
    if not spec.directions:
        return base
    if len(spec.directions) == 1:
        d = spec.directions[0]
        if d == "still":
            return f"{base} staying still"
        if spec.speed is None:
            return f"{base} moving {d}"
        if spec.speed not in SPEED_ADVERBS:
            raise ValueError(f"unknown speed {spec.speed!r}; known speeds: {', '.join(SPEED_ADVERBS)}")
        return f"{base} moving {d} {SPEED_ADVERBS[spec.speed]}"
    segs = ["stays still" if d == "still" else f"moves {d}" for d in spec.directions]
    return f"{base} " + ", then ".join(segs)


_FORMS = ("'a red circle moving left slowly', 'a red circle staying still', 'a red circle moves right, then moves up'"
          " (up to three segments: '..., then moves up, then moves left')")


def parse_caption(text: str, config: ShapesWorldConfig | None = None) -> ShapeSpec:
    """Invert :func:`caption`: case- and whitespace-tolerant, accepts "a" or "an" and a final period.

    Args:
        text: a caption.
        config: the world whose vocabulary is allowed (default: ``ShapesWorldConfig()``).

    Returns:
        The :class:`ShapeSpec` (``speed=None`` when the caption states none).

    Raises:
        ValueError: an unknown color / shape / direction / speed word (the message names the word, quotes the
            caption and lists the known words), or a caption that does not have one of the forms above.
    """
    config = config or ShapesWorldConfig()
    if not isinstance(text, str):
        raise ValueError(f"a caption must be a string, got {type(text).__name__}: {text!r}")
    norm = " ".join(text.strip().lower().replace(",", " , ").split())
    if norm.endswith("."):
        norm = norm[:-1].rstrip()
    tok = norm.split()

    def malformed(why: str) -> ValueError:
        return ValueError(f"malformed caption {text!r} ({why}); expected forms: {_FORMS}")

    if len(tok) < 3 or tok[0] not in ("a", "an"):
        raise malformed("it must start with 'a <color> <shape>'")
    color, shape, rest = tok[1], tok[2], tok[3:]
    if color not in config.colors:
        if color in config.shapes:
            raise malformed(f"no color word before the shape {color!r}")
        raise ValueError(f"unknown color {color!r} in caption {text!r}; known colors: {', '.join(config.colors)}")
    if shape not in config.shapes:
        raise ValueError(f"unknown shape {shape!r} in caption {text!r}; known shapes: {', '.join(config.shapes)}")

    def direction(word: str) -> str:
        if word not in config.directions:
            raise ValueError(
                f"unknown direction {word!r} in caption {text!r}; known directions: {', '.join(config.directions)}"
            )
        return word

    def segment(words: list[str]) -> str:
        if words == ["stays", "still"]:
            return direction("still")
        if len(words) == 2 and words[0] == "moves" and words[1] != "still":
            return direction(words[1])
        raise malformed(f"cannot read the segment {' '.join(words)!r}")

    if not rest:
        return ShapeSpec(color, shape)
    if rest == ["staying", "still"]:
        return ShapeSpec(color, shape, (direction("still"),))
    if rest[0] == "moving" and len(rest) in (2, 3) and rest[1] != "still":
        d = direction(rest[1])
        if len(rest) == 2:
            return ShapeSpec(color, shape, (d,))
        by_adverb = {SPEED_ADVERBS[s]: s for s in config.speeds if s in SPEED_ADVERBS}
        if rest[2] not in by_adverb:
            raise ValueError(
                f"unknown speed word {rest[2]!r} in caption {text!r}; known speed words: {', '.join(by_adverb)}"
            )
        return ShapeSpec(color, shape, (d,), by_adverb[rest[2]])
    if "," in rest:
        parts: list[list[str]] = [[]]
        for word in rest:
            if word == ",":
                parts.append([])
            else:
                parts[-1].append(word)
        if any(p[:1] != ["then"] for p in parts[1:]):
            raise malformed("segments are joined by ', then'")
        if len(parts) > MAX_SEGMENTS:
            raise malformed(f"{len(parts)} segments; a caption has at most {MAX_SEGMENTS}")
        return ShapeSpec(color, shape, tuple(segment(p if i == 0 else p[1:]) for i, p in enumerate(parts)))
    raise malformed(f"cannot read the motion {' '.join(rest)!r}")


def step_captions(text: str, config: ShapesWorldConfig | None = None) -> list[str]:
    """The shapes world's ground-truth plan of a caption: the single-step caption of each motion segment.

    ``"a red circle moves right, then moves up"`` -> ``["a red circle moving right", "a red circle moving up"]``;
    a ``"stays still"`` segment gives ``"a red circle staying still"``. Each step caption is the world's single-step
    form with no speed stated (rendered at the mean speed, the speed of every multi-step segment). A single-step,
    still or image-mode caption is its own one-step plan: ``[text]``, unchanged.

    Args:
        text: a caption of the world (any form :func:`parse_caption` reads).
        config: the world whose vocabulary is allowed (default: ``ShapesWorldConfig()``).

    Returns:
        One caption per segment, in order (1 to :data:`MAX_SEGMENTS` strings).

    Raises:
        ValueError: as :func:`parse_caption` (unknown word, malformed caption).
    """
    spec = parse_caption(text, config)
    if len(spec.directions) < 2:
        return [text]
    return [caption(ShapeSpec(spec.color, spec.shape, (d,))) for d in spec.directions]


# ---------------------------------------------------------------------------------------------- rendering
def trajectory(spec: ShapeSpec, config: ShapesWorldConfig) -> Tensor:
    """Offsets of the shape's box center from frame 0, float32 ``[T, 2]`` as (x, y) in pixels.

    Single segment: ``p(t) = v t``. Several segments: ``p(t) = v sum_k u_k clamp(t - m_{k-1}, 0, m_k - m_{k-1})``
    with turn points ``m_0 = 0 < m_1 < ... `` (:func:`turn_points`; the last segment is unbounded), so frames
    ``m_{k-1} <= t <= m_k`` follow direction k. Two segments: ``m_1 = (T - 1) / 2`` (frames ``t <= m_1`` follow
    direction 1, frames ``t >= m_1`` direction 2; for even T the turn falls between frames ``T/2 - 1`` and ``T/2``,
    and that one displacement is half of each direction). Three segments: the turn after segment k is the last frame
    of its span in :func:`segment_spans` (``end_k - 1``), so every displacement follows a single direction. Speeds:
    the named speed, else the mean of the configured speeds. The offsets are not wrapped (on a ``"wrap"`` world they
    may exceed the frame; :func:`centroid_path` gives the wrapped positions).
    """
    return _offsets(spec, config, config.num_frames)


def segment_spans(num_frames: int, num_segments: int) -> list[tuple[int, int]]:
    """The world's split of ``num_frames`` frames into ``num_segments`` as-even-as-possible contiguous spans.

    Spans are ``(start, end)`` frame indices, end exclusive, covering ``[0, num_frames)`` in order; the first
    ``num_frames % num_segments`` spans have one frame more than the others (8 frames, 2 segments: ``[(0, 4),
    (4, 8)]``; 8 frames, 3 segments: ``[(0, 3), (3, 6), (6, 8)]``; 7 frames, 2 segments: ``[(0, 4), (4, 7)]``).
    Segment k's motion is the displacement from the frame before its start (when there is one) to its last frame;
    :func:`trajectory` turns at these boundaries (the two-segment turn of an even T lies half a frame later, see
    there).

    Raises:
        ValueError: a non-int argument, ``num_segments < 1``, or fewer frames than segments.
    """
    for name, value in (("num_frames", num_frames), ("num_segments", num_segments)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"segment_spans: {name} must be an int, got {value!r}")
    if num_segments < 1 or num_frames < num_segments:
        raise ValueError(
            f"segment_spans: cannot split num_frames={num_frames} into num_segments={num_segments} non-empty spans; "
            f"use 1 <= num_segments <= num_frames"
        )
    return [(int(a), int(b)) for a, b in uniform_spans(num_segments, num_frames)]  # the plans' even split, in frames


def turn_points(num_frames: int, num_segments: int) -> list[float]:
    """The times (in frames) where :func:`trajectory` turns from segment k to k + 1, ``num_segments - 1`` of them.

    One segment: ``[]``. Two: ``[(T - 1) / 2]`` (the historical midpoint; on a frame for odd T). Three or more: the
    last frame of each span of :func:`segment_spans` but the final one (``end_k - 1``). With fewer frames than
    segments (only reachable through :func:`centroid_path` with a short ``num_frames``) the spans of ``num_segments``
    frames are used and the turns clamped to ``[0, T - 1]``.
    """
    if num_segments <= 1:
        return []
    if num_segments == 2:
        return [(num_frames - 1) / 2]
    spans = segment_spans(max(num_frames, num_segments), num_segments)
    return [float(min(end - 1, max(num_frames - 1, 0))) for _, end in spans[:-1]]


def _offsets(spec: ShapeSpec, config: ShapesWorldConfig, num_frames: int) -> Tensor:
    """:func:`trajectory` for ``num_frames`` frames (turns at :func:`turn_points` of ``num_frames``)."""
    t = torch.arange(num_frames, dtype=torch.float64)
    out = torch.zeros(num_frames, 2, dtype=torch.float64)
    if not spec.directions or config.image_mode:
        return out.float()
    v = config.speeds[spec.speed] if spec.speed is not None else config.mean_speed
    u1 = torch.tensor(DIRECTION_VECTORS[spec.directions[0]], dtype=torch.float64)
    if len(spec.directions) == 1:
        return (v * t[:, None] * u1).float()
    turns = turn_points(num_frames, len(spec.directions))
    # segment k covers [m_{k-1}, m_k]: the first starts at 0 (t >= 0 needs no lower clamp), the last is unbounded;
    # for two segments this is exactly v * (min(t, m) u1 + max(t - m, 0) u2), the historical formula
    acc = t.clamp(max=turns[0])[:, None] * u1
    for k in range(1, len(spec.directions)):
        u = torch.tensor(DIRECTION_VECTORS[spec.directions[k]], dtype=torch.float64)
        lo = turns[k - 1]
        span = (t - lo).clamp(min=0) if k == len(turns) else (t - lo).clamp(min=0, max=turns[k] - lo)
        acc = acc + span[:, None] * u
    return (v * acc).float()


def wrapped_delta(delta: Tensor, period: float | Tensor) -> Tensor:
    """``delta`` brought to the nearest periodic image: ``delta - period * floor(delta / period + 1/2)``, in
    ``[-period / 2, period / 2)``; entries already in that range come back bit for bit.

    Args:
        delta: float differences of positions (pixels), any shape.
        period: the period in pixels (> 0), a float or a tensor broadcastable to ``delta`` (e.g. ``[W, H]`` for
            (x, y) pairs in the last axis).
    """
    return delta - period * torch.floor(delta / period + 0.5)


def _frame_size(config: ShapesWorldConfig, like: Tensor | None = None) -> Tensor:
    """``[width, height]`` float32 (x, y order), on ``like``'s device / dtype when given."""
    size = torch.tensor([config.width, config.height], dtype=torch.float32)
    return size if like is None else size.to(device=like.device, dtype=like.dtype)


def position_error(a: Tensor, b: Tensor, config: ShapesWorldConfig) -> Tensor:
    """Euclidean distance in pixels between positions ``a`` and ``b`` (float ``[..., 2]`` as (x, y), broadcastable).

    On a ``"wrap"`` world the shortest distance on the torus (each axis difference taken to the nearest periodic
    image, :func:`wrapped_delta`, so it is at most ``hypot(W, H) / 2``); on an ``"inside"`` world the plain
    distance. Returns float ``[...]`` in ``a``'s dtype.

    Raises:
        ValueError: a last axis that is not 2.
    """
    if a.shape[-1] != 2 or b.shape[-1] != 2:
        raise ValueError(f"positions must be [..., 2] (x, y), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    d = a - b
    if config.boundary == "wrap":
        d = wrapped_delta(d, _frame_size(config, d))
    return d.norm(dim=-1)


def _coverage(shape: str, centers: Tensor, config: ShapesWorldConfig) -> Tensor:
    """Anti-aliased coverage ``[T, H, W]`` in [0, 1] of a shape whose box centers are ``centers`` [T, 2].

    On a ``"wrap"`` world the offsets of the supersample points from the center are taken to their nearest
    periodic image, so the part of the shape past an edge is drawn at the opposite edge.
    """
    s, k = float(config.object_size), _SUPERSAMPLE
    xs = (torch.arange(config.width * k, dtype=torch.float32) + 0.5) / k
    ys = (torch.arange(config.height * k, dtype=torch.float32) + 0.5) / k
    dx = xs[None, None, :] - centers[:, 0, None, None]  # [T, 1, Wk]
    dy = ys[None, :, None] - centers[:, 1, None, None]  # [T, Hk, 1]
    if config.boundary == "wrap":
        dx, dy = wrapped_delta(dx, float(config.width)), wrapped_delta(dy, float(config.height))
    h = s / 2
    if shape == "circle":
        inside = dx * dx + dy * dy <= h * h
    elif shape == "square":
        inside = (dx.abs() <= h) & (dy.abs() <= h)
    elif shape == "triangle":  # apex at (0, -h), base y = +h from x = -h to +h
        inside = (dy <= h) & (dx.abs() <= (dy + h) / 2)
    elif shape == "diamond":
        inside = dx.abs() + dy.abs() <= h
    else:
        raise ValueError(f"unknown shape {shape!r}; known shapes: {', '.join(KNOWN_SHAPES)}")
    inside = inside.float()
    return torch.nn.functional.avg_pool2d(inside[:, None], k)[:, 0]


def _check_spec(spec: ShapeSpec, config: ShapesWorldConfig) -> None:
    if spec.color not in config.colors:
        raise ValueError(f"unknown color {spec.color!r}; known colors: {', '.join(config.colors)}")
    if spec.shape not in config.shapes:
        raise ValueError(f"unknown shape {spec.shape!r}; known shapes: {', '.join(config.shapes)}")
    for d in spec.directions:
        if d not in config.directions:
            raise ValueError(f"unknown direction {d!r}; known directions: {', '.join(config.directions)}")
    if spec.speed is not None and spec.speed not in config.speeds:
        raise ValueError(f"unknown speed {spec.speed!r}; known speeds: {', '.join(config.speeds)}")
    if config.image_mode and spec.directions:
        raise ValueError(f"image mode (num_frames=1) cannot render motion {spec.directions}")
    if len(spec.directions) > 2 and config.num_frames < 2 * len(spec.directions):
        raise ValueError(
            f"a {len(spec.directions)}-segment spec {spec.directions} needs num_frames >= {2 * len(spec.directions)} "
            f"(two frames per segment), got num_frames={config.num_frames}; raise num_frames"
        )


def _draw_start(spec: ShapeSpec, config: ShapesWorldConfig, offsets: Tensor, generator: torch.Generator) -> Tensor:
    """The frame-0 box center [2] of :func:`render` (two ``torch.rand`` draws from ``generator``)."""
    size = _frame_size(config)
    if config.boundary == "wrap":
        return size * torch.rand(2, generator=generator)
    h = config.object_size / 2
    lo, hi = offsets.min(0).values, offsets.max(0).values
    low = h - lo
    room = (size - h - hi) - low
    if (room < -1e-5).any():
        raise ValueError(f"the trajectory of {spec} does not fit a {config.height}x{config.width} frame")
    return low + room.clamp(min=0) * torch.rand(2, generator=generator)


def _draw(spec: ShapeSpec, config: ShapesWorldConfig, start: Tensor, offsets: Tensor) -> Tensor:
    centers = start[None] + offsets  # [T, 2]
    if config.boundary == "wrap":  # positions in [0, W) x [0, H): unchanged when already there
        centers = torch.remainder(centers, _frame_size(config))
    cov = _coverage(spec.shape, centers, config)  # [T, H, W]
    color = torch.tensor(PALETTE[spec.color], dtype=torch.float32)
    return (cov[:, None] * color[None, :, None, None]).clamp_(0.0, 1.0).contiguous()


def start_position(spec: ShapeSpec, config: ShapesWorldConfig, generator: torch.Generator) -> Tensor:
    """The frame-0 box center that :func:`render` draws from ``generator`` in this state, float32 ``[2]`` (x, y)
    in pixels; it makes the same two ``torch.rand`` draws, so ``render(spec, config, g)`` equals
    ``render_at(spec, config, start_position(spec, config, g2))`` for two generators in the same state.

    ``"inside"``: uniform among the starts that keep the whole path inside the frame. ``"wrap"``: uniform over
    ``[0, W) x [0, H)``.

    Raises:
        ValueError: as :func:`render`.
    """
    _check_spec(spec, config)
    return _draw_start(spec, config, trajectory(spec, config), generator)


def render(spec: ShapeSpec, config: ShapesWorldConfig, generator: torch.Generator) -> Tensor:
    """Render one video of ``spec``.

    The start position is drawn uniformly (two ``torch.rand`` draws from ``generator``, :func:`start_position`):
    on an ``"inside"`` world among the positions that keep the whole trajectory's bounding boxes inside the frame,
    on a ``"wrap"`` world over the whole frame (the object wraps around the edges, see
    :class:`ShapesWorldConfig`).

    Args:
        spec: what to draw; its words must be in ``config``.
        config: the world.
        generator: a CPU ``torch.Generator``; the only source of randomness.

    Returns:
        float32 ``[T, 3, H, W]`` in [0, 1] (black background).

    Raises:
        ValueError: a word of ``spec`` that ``config`` does not allow, or motion in image mode.
    """
    _check_spec(spec, config)
    offsets = trajectory(spec, config)  # [T, 2]
    start = _draw_start(spec, config, offsets, generator)
    return _draw(spec, config, start, offsets)


def render_at(spec: ShapeSpec, config: ShapesWorldConfig, start: Tensor | tuple[float, float]) -> Tensor:
    """Render ``spec`` with its frame-0 box center at ``start`` (no randomness): :func:`render` with a given start.

    Args:
        spec: what to draw; its words must be in ``config``.
        config: the world (``num_frames`` frames; on a ``"wrap"`` world any number, e.g.
            ``dataclasses.replace(world, num_frames=64)`` for a long real continuation).
        start: (x, y) in pixels, a float tensor [2] or a pair. ``"wrap"``: any value (taken modulo the frame).

    Returns:
        float32 ``[T, 3, H, W]`` in [0, 1] (black background).

    Raises:
        ValueError: as :func:`render`; a ``start`` that is not two finite numbers; on an ``"inside"`` world a
            start whose path leaves the frame (the message gives the allowed range).
    """
    _check_spec(spec, config)
    start = torch.as_tensor(start, dtype=torch.float32).flatten()
    if start.numel() != 2 or not torch.isfinite(start).all():
        raise ValueError(f"start must be two finite numbers (x, y) in pixels, got {start.tolist()}")
    offsets = trajectory(spec, config)
    if config.boundary == "inside":
        h = config.object_size / 2
        low = h - offsets.min(0).values
        high = _frame_size(config) - h - offsets.max(0).values
        if ((start < low - 1e-5) | (start > high + 1e-5)).any():
            raise ValueError(
                f"start {start.tolist()} puts the path of {spec} outside the {config.height}x{config.width} frame of "
                f"an 'inside' world; use x in [{float(low[0]):g}, {float(high[0]):g}] and y in "
                f"[{float(low[1]):g}, {float(high[1]):g}], or boundary='wrap'"
            )
    return _draw(spec, config, start, offsets)


def centroid_path(
    spec: ShapeSpec, config: ShapesWorldConfig, start: Tensor | tuple[float, float], num_frames: int | None = None
) -> Tensor:
    """The analytic position of the object's area centroid over ``num_frames`` frames, float32 ``[T, 2]`` (x, y) in
    pixels: ``start`` (the frame-0 box center, as :func:`start_position` / :func:`render_at`) plus the trajectory
    offsets (:func:`trajectory` for T frames; a multi-segment spec turns at :func:`turn_points` of T), plus the shape's
    centroid offset within its box (``(0, object_size / 6)`` below the center for the upward triangle, zero for the
    symmetric shapes).

    On a ``"wrap"`` world the positions are taken modulo the frame, in ``[0, W) x [0, H)`` (compare with
    :func:`position_error`); on an ``"inside"`` world they are not reduced (and describe a rendered video only while
    the path fits the frame). The verifier's measured centroid (:meth:`genrl.rewards.ShapesVerifier.measure`) follows
    it within about 0.2 px on clean renders (its foreground threshold on anti-aliased edges; largest for squares).

    Args:
        spec: the sample's spec (its words in ``config``).
        config: the world.
        start: (x, y) of the box center at frame 0, a float tensor [2] or a pair.
        num_frames: T (>= 1); default ``config.num_frames``. A real continuation of a video's first k frames over
            T frames is frames ``k..T-1`` of the path of T frames.

    Raises:
        ValueError: ``num_frames < 1``, a ``start`` that is not two finite numbers, or a word of ``spec`` that
            ``config`` does not allow.
    """
    _check_spec(spec, config)
    n = config.num_frames if num_frames is None else num_frames
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_frames must be an int >= 1, got {num_frames!r}")
    start = torch.as_tensor(start, dtype=torch.float32).flatten()
    if start.numel() != 2 or not torch.isfinite(start).all():
        raise ValueError(f"start must be two finite numbers (x, y) in pixels, got {start.tolist()}")
    shift = torch.tensor([0.0, config.object_size / 6 if spec.shape == "triangle" else 0.0])
    path = start[None] + _offsets(spec, config, n) + shift
    if config.boundary == "wrap":
        path = torch.remainder(path, _frame_size(config))
    return path


# ---------------------------------------------------------------------------------------------- splits
Combo = tuple[str, str, "str | None"]


def combos(config: ShapesWorldConfig) -> list[Combo]:
    """All (color, shape, direction) combinations in config order; direction is None in image mode."""
    dirs: list[str | None] = [None] if config.image_mode else list(config.directions)
    return [(c, s, d) for c in config.colors for s in config.shapes for d in dirs]


@functools.lru_cache(maxsize=64)
def _heldout(colors: tuple, shapes: tuple, dirs: tuple, fraction: float) -> frozenset:
    all_combos = [(c, s, d) for c in colors for s in shapes for d in dirs]
    target = int(round(fraction * len(all_combos)))
    if target == 0:
        return frozenset()

    def key(combo) -> str:
        return hashlib.sha256("|".join(str(x) for x in combo).encode()).hexdigest()

    # coverage counts of training combos per attribute value and per pair of values
    def features(combo):
        c, s, d = combo
        if d is None:  # image mode: the (color, shape) pair *is* the combo; protect single values only
            return [("c", c), ("s", s)]
        return [("c", c), ("s", s), ("d", d), ("cs", c, s), ("cd", c, d), ("sd", s, d)]

    counts: dict = {}
    for combo in all_combos:
        for f in features(combo):
            counts[f] = counts.get(f, 0) + 1
    chosen = set()
    for combo in sorted(all_combos, key=key):
        if len(chosen) == target:
            break
        if all(counts[f] > 1 for f in features(combo)):
            chosen.add(combo)
            for f in features(combo):
                counts[f] -= 1
    return frozenset(chosen)


def heldout_combos(config: ShapesWorldConfig) -> list[Combo]:
    """The held-out (color, shape, direction) combinations, in config order.

    Fixed for a given vocabulary and ``heldout_fraction`` (independent of any seed and of list order):
    combinations are ranked by the SHA-256 of ``"color|shape|direction"`` and taken greedily, skipping any
    whose removal would leave a color, shape, direction, or (in video mode) a pair of them without a
    training combination. About ``round(heldout_fraction * len(combos(config)))`` of them.
    """
    dirs = (None,) if config.image_mode else tuple(config.directions)
    held = _heldout(tuple(config.colors), tuple(config.shapes), dirs, float(config.heldout_fraction))
    return [c for c in combos(config) if c in held]


def is_heldout(spec: ShapeSpec, config: ShapesWorldConfig) -> bool:
    """Whether ``spec``'s (color, shape, first direction) combination is held out."""
    d = None if config.image_mode else (spec.directions[0] if spec.directions else None)
    return (spec.color, spec.shape, d) in set(heldout_combos(config))


def _split_combos(config: ShapesWorldConfig, split: str) -> list[Combo]:
    if split == "all":
        return combos(config)
    held = set(heldout_combos(config))
    if split == "heldout":
        out = [c for c in combos(config) if c in held]
        if not out:
            raise ValueError(
                f"the held-out split is empty (heldout_fraction={config.heldout_fraction}); raise heldout_fraction"
            )
        return out
    if split == "train":
        return [c for c in combos(config) if c not in held]
    raise ValueError(f"unknown split {split!r}; use 'train', 'heldout' or 'all'")


def _choice(n: int, generator: torch.Generator) -> int:
    return int(torch.randint(n, (1,), generator=generator).item())


def sample_spec(
    config: ShapesWorldConfig, generator: torch.Generator, split: Split = "train", multi_step: bool | None = None
) -> ShapeSpec:
    """Draw a spec: a uniform combination of ``split``, then (video mode) multi-step with probability
    ``multi_step_prob`` (second direction uniform among the others), else a uniform speed when moving.

    With ``config.max_segments = 3`` a multi-step spec then draws its number of segments uniformly in {2, 3} and a
    third direction uniform among those other than the second (consecutive segments always differ; the first and
    third may be equal). With the default ``max_segments = 2`` no further draw is made, so every spec is the one
    drawn before ``max_segments`` existed.

    Args:
        config: the world.
        generator: a CPU ``torch.Generator``.
        split: ``"train"``, ``"heldout"`` or ``"all"``.
        multi_step: force (True) or forbid (False) several segments; None draws it.

    Raises:
        ValueError: an unknown split, or an empty held-out split.
    """
    c, s, d = (pool := _split_combos(config, split))[_choice(len(pool), generator)]
    if config.image_mode:
        return ShapeSpec(c, s)
    draw = float(torch.rand(1, generator=generator))
    multi = (draw < config.multi_step_prob) if multi_step is None else multi_step
    if multi:
        others = [x for x in config.directions if x != d]
        if not others:
            raise ValueError("multi-step captions need at least two directions")
        dirs = [d, others[_choice(len(others), generator)]]
        extra = _choice(config.max_segments - 1, generator) if config.max_segments > 2 else 0
        for _ in range(extra):
            others = [x for x in config.directions if x != dirs[-1]]
            dirs.append(others[_choice(len(others), generator)])
        return ShapeSpec(c, s, tuple(dirs))
    names = list(config.speeds)
    speed = names[_choice(len(names), generator)]
    return ShapeSpec(c, s, (d,), None if d == "still" else speed)


def sample_seed(seed: int, index: int) -> int:
    """The 63-bit generator seed of sample ``index`` of stream ``seed``.

    ``h = splitmix64(splitmix64(seed mod 2^64) ^ (index mod 2^64)) mod 2^63`` (computed by
    :func:`genrl.noise.mix_seed`). Negative indices are allowed (validation uses them).
    """
    return mix_seed(int(seed), int(index))


def sample(
    config: ShapesWorldConfig, seed: int, index: int, split: Split = "train"
) -> tuple[Tensor, str, ShapeSpec]:
    """Sample ``index`` of stream ``seed``: a pure function of ``(config, seed, index, split)``.

    Returns:
        ``(pixels float32 [T, 3, H, W] in [0, 1], caption, spec)``.

    Raises:
        ValueError: an unknown split or an empty held-out split.
    """
    g = torch.Generator("cpu").manual_seed(sample_seed(seed, index))
    spec = sample_spec(config, g, split)
    return render(spec, config, g), caption(spec), spec


def heldout_prompts(config: ShapesWorldConfig, n: int, seed: int = 0) -> list[str]:
    """``n`` single-step captions of held-out combinations, deterministic in ``(config, n, seed)``.

    The held-out combinations are visited in a seed-dependent order and cycled, so every one appears
    ``n // len(heldout_combos(config))`` or one more times; moving captions get a uniform speed.

    Raises:
        ValueError: ``n < 0`` or an empty held-out split.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = _split_combos(config, "heldout")
    g = torch.Generator("cpu").manual_seed(sample_seed(seed, -1))
    order = torch.randperm(len(pool), generator=g).tolist()
    names = list(config.speeds)
    out = []
    for i in range(n):
        c, s, d = pool[order[i % len(pool)]]
        if d is None:
            out.append(caption(ShapeSpec(c, s)))
        else:
            speed = names[_choice(len(names), g)] if d != "still" else None
            out.append(caption(ShapeSpec(c, s, (d,), speed)))
    return out


def real_videos(config: ShapesWorldConfig, prompts: list[str], seed: int) -> Tensor:
    """True videos of ``prompts``: video i is :func:`render` of ``parse_caption(prompts[i], config)`` with the
    generator ``genrl.noise.sample_generator(seed, i, 0, 99)`` (stream 99, apart from every sampler's draws), so a
    (prompts, seed) pair always gives the same set and different seeds give independent start positions.

    The real reference of the shapes world's distribution metrics (``genrl.eval.gold``: Frechet distance, flicker gap)
    and of the benchmarks that compare generated videos with real ones.

    Args:
        config: the world.
        prompts: captions of ``config`` (a repeated caption gets a fresh start position at each index).
        seed: the set's seed.

    Returns:
        float32 ``[N, T, 3, H, W]`` in [0, 1], N = len(prompts) (``[0, T, 3, H, W]`` for no prompt).

    Raises:
        ValueError: a caption that does not parse for ``config`` (:func:`parse_caption`) or does not render in it.
    """
    if not prompts:
        return torch.zeros(0, config.num_frames, 3, config.height, config.width)
    return torch.stack([render(parse_caption(p, config), config, sample_generator(seed, i, 0, _RENDER_STREAM))
                        for i, p in enumerate(prompts)])
