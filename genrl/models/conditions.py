"""Prompts that carry more than text: the image of an image-to-video prompt (docs/models.md, Image-to-video).

Everything in genrl passes prompts as ``list[str]``: data modules repeat them into groups, rollouts record them,
rewards read them, methods re-encode them to replay a log-prob, ranks gather them. An image-conditioned prompt is a
:class:`Prompt`: a ``str`` (its text) that also holds its conditioning image, so it travels through all of these
unchanged, and the generator's ``encode_prompts`` builds the condition bundle (first-frame latents, frame mask,
image tokens) once per prompt and carries it in ``Conditioning.extras``.

Two prompts are equal (and hash alike) when their text *and* their image are, so the per-prompt encoding caches
never mix two images under one caption. String operations (``strip``, ``+``, f-strings) return plain text: keep the
:class:`Prompt` object itself where the image matters, and use :func:`null_prompts` / :meth:`Prompt.with_text` to
change only the text (CFG's unconditional branch drops the text and keeps the image).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

__all__ = ["Prompt", "prompt_image", "null_prompts", "image_key", "image_path", "load_image", "check_image_size",
           "check_prompt_images"]


def image_key(image: str | Path | torch.Tensor | None) -> str | None:
    """A stable identity of a conditioning image: the resolved path for a file, ``sha1:<digest>`` of the values
    (shape and dtype included) for a tensor, None for no image."""
    if image is None:
        return None
    if isinstance(image, torch.Tensor):
        t = image.detach().cpu().contiguous()
        digest = hashlib.sha1(f"{tuple(t.shape)}|{t.dtype}".encode() + t.numpy().tobytes()).hexdigest()
        return f"sha1:{digest}"
    return str(Path(image).expanduser().resolve())


class Prompt(str):
    """A text prompt with a conditioning image (image-to-video). It is a ``str`` (its text), so every API that takes
    prompts takes it.

    Args:
        text: the caption.
        image: a local image file (PNG / JPEG / ...; read with PIL when the prompt is encoded) or a float tensor
            [3, H, W] in [0, 1]; None makes a text-only prompt that still compares by text and image.
    Raises:
        TypeError: ``image`` is neither a path, a tensor nor None.
    """

    image: str | torch.Tensor | None
    image_key: str | None

    def __new__(cls, text: str, image: str | Path | torch.Tensor | None = None) -> Prompt:
        if image is not None and not isinstance(image, (str, Path, torch.Tensor)):
            raise TypeError(f"Prompt image must be a path or a [3, H, W] tensor in [0, 1], got {type(image).__name__}")
        obj = super().__new__(cls, text)
        obj.image = str(image) if isinstance(image, Path) else image
        obj.image_key = image_key(image)
        return obj

    @property
    def text(self) -> str:
        """The caption as a plain ``str``."""
        return str.__str__(self)

    def with_text(self, text: str) -> Prompt:
        """The same image with another caption (e.g. CFG's empty prompt)."""
        return Prompt(text, self.image)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, str):
            return NotImplemented
        return str.__eq__(self, other) and self.image_key == getattr(other, "image_key", None)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:  # a text-only Prompt hashes like its text (it equals it)
        return str.__hash__(self) if self.image_key is None else hash((str.__str__(self), self.image_key))

    def __reduce__(self):  # pickling (gathers across ranks, checkpoints, data-loader workers)
        return (Prompt, (str.__str__(self), self.image))

    def __repr__(self) -> str:
        image = f"<tensor {tuple(self.image.shape)}>" if isinstance(self.image, torch.Tensor) else repr(self.image)
        return f"Prompt({str.__repr__(self)}, image={image})"


def image_path(value, folder: Path, where: str) -> Path:
    """The file an ``image`` field names: ``value`` itself when absolute (``~`` expanded), else relative to
    ``folder`` (the prompt file's or the manifest's).

    Raises:
        ValueError: ``value`` is not a non-empty string (``where`` names the record and the folder it is relative to).
    """
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: image={value!r} is not a file path; give the image file (absolute, or relative to "
                         f"{folder})")
    path = Path(value).expanduser()
    return path if path.is_absolute() else folder / path


def prompt_image(prompt: str) -> str | torch.Tensor | None:
    """The conditioning image of ``prompt`` (None for a plain string or a text-only :class:`Prompt`)."""
    return getattr(prompt, "image", None)


def null_prompts(prompts: list[str], null: str) -> list[str]:
    """CFG's unconditional prompts: ``null`` text for each prompt, keeping each prompt's image (guidance drops only
    the text, as diffusers' image-to-video pipelines do)."""
    return [p.with_text(null) if isinstance(p, Prompt) and p.image is not None else null for p in prompts]


def check_image_size(size: tuple[int, int], height: int, width: int, what: str) -> None:
    """Refuse a conditioning image whose (height, width) is not the sample size.

    Raises:
        ValueError: naming the image, its size, the expected size and the fix.
    """
    if tuple(size) != (height, width):
        raise ValueError(f"conditioning image {what} is {size[0]}x{size[1]} (height x width) but the generator samples "
                         f"{height}x{width}: the first frame must have the video's size; resize the image or set the "
                         f"sample size to {size[0]} x {size[1]} (generator height / width, or generate.py --height "
                         f"{size[0]} --width {size[1]})")


def load_image(image: str | torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A conditioning image as float32 [3, height, width] in [0, 1].

    Args:
        image: a local file (read with PIL, converted to RGB) or a tensor [3, H, W] in [0, 1].
    Raises:
        FileNotFoundError: no such file (names it).
        ValueError: the image is not ``height`` x ``width`` (:func:`check_image_size`), or a tensor is not [3, H, W]
            with values in [0, 1].
    """
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"a conditioning image tensor must be [3, H, W] in [0, 1], got {tuple(image.shape)}")
        t = image.detach().float().cpu()
        if t.min() < 0 or t.max() > 1:
            raise ValueError(f"conditioning image values must lie in [0, 1], got [{t.min():.3g}, {t.max():.3g}]")
        check_image_size((t.shape[1], t.shape[2]), height, width, "tensor")
        return t
    path = Path(image).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"conditioning image {str(path)!r} does not exist")
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        check_image_size((img.height, img.width), height, width, repr(str(path)))
        array = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def check_prompt_images(prompts: list[str], height: int | None, width: int | None) -> int:
    """Check every image-conditioned prompt's image before a model is loaded: the file exists and its size (read from
    the header, not decoded) is ``height`` x ``width`` (sizes None: existence only, for a size not known yet).
    Returns the number of distinct images checked.

    Raises:
        FileNotFoundError: a missing image file (names it and the prompt).
        ValueError: an image of another size (:func:`check_image_size`).
    """
    seen: set[str] = set()
    for p in prompts:
        image = prompt_image(p)
        key = getattr(p, "image_key", None)
        if image is None or key in seen:
            continue
        seen.add(key)
        if isinstance(image, torch.Tensor):
            if height is not None:
                check_image_size((int(image.shape[-2]), int(image.shape[-1])), height, width, f"of {str(p)!r}")
            continue
        path = Path(image).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"conditioning image {str(path)!r} of the prompt {str(p)!r} does not exist")
        if height is None:
            continue
        from PIL import Image

        with Image.open(path) as img:
            check_image_size((img.height, img.width), height, width, repr(str(path)))
    return len(seen)
