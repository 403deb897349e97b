"""The Generator protocol (docs/architecture.md, The Generator protocol) and its implementation over genrl's own DiT.

Every backbone (the built-in DiT, and the diffusers families that plug in later) exposes the same small
surface, so the rollout sampler, the losses and every method are written once:

- ``encode_prompts(list[str]) -> Conditioning`` (cached),
- ``velocity(x, sigma, cond) -> v`` with sigma [B] or per frame [B, T],
- ``decode(latents) -> pixels`` and ``encode(pixels) -> latents``;
- causal students (:class:`~genrl.models.causal.CausalGenerator`) add ``init_cache``, ``velocity_chunk`` and
  ``commit`` (chunk-wise generation with a KV cache, driven by :mod:`genrl.rollout.autoregressive`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from genrl.models.causal import CausalConfig, KVCache
from genrl.models.codec import PixelCodec
from genrl.models.dit import VideoDiT
from genrl.models.spec import ModelSpec
from genrl.models.text_encoder import Conditioning, TextEncoder

__all__ = ["Generator", "DiTGenerator"]


@runtime_checkable
class Generator(Protocol):
    """What the sampler and the methods need from a generator, whatever the backbone."""

    def encode_prompts(self, prompts: list[str]) -> Conditioning: ...

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, **kwargs) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def encode(self, pixels: torch.Tensor) -> torch.Tensor: ...


class DiTGenerator(nn.Module):
    """genrl's small video DiT + a text encoder + the pixel codec, behind the Generator protocol.

    The text encoder is frozen and deliberately kept *outside* this module's children: it is not
    trained, not checkpointed with the method and not wrapped by distributed strategies; it follows
    the transformer's device lazily.

    Args:
        transformer: the :class:`VideoDiT` (trainable role).
        text_encoder: a :class:`TextEncoder` whose hidden size equals ``transformer.config.text_dim``.
        codec: maps pixels to latents (defaults to :class:`PixelCodec`).
    Raises:
        ValueError: the text encoder width does not match the transformer's ``text_dim``.
    """

    def __init__(self, transformer: VideoDiT, text_encoder: TextEncoder, codec: nn.Module | None = None) -> None:
        super().__init__()
        if text_encoder.hidden_size != transformer.config.text_dim:
            raise ValueError(
                f"text encoder width {text_encoder.hidden_size} != transformer text_dim "
                f"{transformer.config.text_dim}; build the transformer with text_dim={text_encoder.hidden_size}"
            )
        self.transformer = transformer
        #: chunk layout when this generator is a causal student (None: bidirectional by default).
        self.causal: CausalConfig | None = None
        self.codec = codec if codec is not None else PixelCodec(transformer.config.in_channels)
        object.__setattr__(self, "text_encoder", text_encoder)  # not a child: frozen, never checkpointed

    @classmethod
    def from_pretrained(
        cls, path: str, text_encoder: str = "minilm", max_text_length: int = 32, subfolder: str | None = None
    ) -> DiTGenerator:
        """Load a transformer saved with ``save_pretrained`` (e.g. ``assets/shapes-dit``) plus a text encoder.

        Raises:
            FileNotFoundError: no weights at ``path`` or no text-encoder folder (each names the path).
        """
        transformer = ModelSpec(pretrained=path, subfolder=subfolder).build().eval()
        return cls(transformer, TextEncoder.from_pretrained(text_encoder, max_length=max_text_length))

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """B prompts -> :class:`Conditioning` on the transformer's device (float32 states, bool mask)."""
        if next(self.text_encoder.parameters()).device != self.device:
            self.text_encoder.to(self.device)
        return self.text_encoder(prompts)

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, attention: str | None = None,
        causal: CausalConfig | None = None, start_frame: int = 0,
    ) -> torch.Tensor:
        """Velocity ``v = eps - x0`` at ``x`` [B, T, C, H, W] and sigma [B] or [B, T] in [0, 1].

        ``attention`` defaults to ``"block_causal"`` when the generator has a causal layout (``self.causal``, set
        for a causal student) and to ``"bidirectional"`` otherwise; ``causal`` / ``start_frame`` override the
        layout and the absolute position of the first frame.

        Raises:
            ValueError: batch of ``cond`` differs from ``x`` (and the transformer's own shape checks).
        """
        if len(cond) != x.shape[0]:
            raise ValueError(f"conditioning holds {len(cond)} prompts for a batch of {x.shape[0]} latents")
        causal = causal or self.causal
        if attention is None:
            attention = "block_causal" if causal is not None else "bidirectional"
        return self.transformer(x, sigma, cond.hidden_states, cond.attention_mask, attention=attention,
                                causal=causal if attention == "block_causal" else None, start_frame=start_frame)

    # ------------------------------------------------------------------ causal (chunk-wise) use
    #: frame axis of this generator's latents ([B, T, C, H, W]).
    frame_dim = 1

    def init_cache(self, batch_size: int, causal: CausalConfig) -> KVCache:
        """An empty KV cache for ``batch_size`` videos with chunk layout / window ``causal``.

        Raises:
            ValueError: chunk, window or sink sizes not multiples of the DiT's temporal patch; ``static_cache``
                (not implemented for the DiT).
        """
        if getattr(causal, "static_cache", False):
            raise ValueError("static_cache=True is implemented for the causal Wan2.1 adapter (wan_causal), not for "
                             "genrl's DiT; use static_cache=False here")
        causal.check_patch(self.transformer.config.patch_size[0])
        return KVCache(causal, batch_size, patch_frames=self.transformer.config.patch_size[0])

    def velocity_chunk(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, cache: KVCache) -> torch.Tensor:
        """Velocity of a chunk ``x`` [B, f, C, H, W] (frames ``cache.end_frame ...``) attending to the cached
        context; sigma [B] or [B, f]. The cache is read, not written.

        Raises:
            ValueError: batch of ``cond`` / cache differs from ``x`` (and the transformer's checks).
        """
        if len(cond) != x.shape[0]:
            raise ValueError(f"conditioning holds {len(cond)} prompts for a batch of {x.shape[0]} latents")
        return self.transformer(x, sigma, cond.hidden_states, cond.attention_mask, attention="block_causal",
                                causal=cache.config, start_frame=cache.end_frame, kv_cache=cache,
                                cross_key=tuple(cond.prompts))

    def commit(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, cache: KVCache) -> None:
        """Context pass: run the chunk ``x`` (clean or lightly noised, at ``sigma``) and append its keys /
        values to ``cache`` (Self-Forcing's cache update; no gradient)."""
        with torch.no_grad():
            self.transformer(x, sigma, cond.hidden_states, cond.attention_mask, attention="block_causal",
                             causal=cache.config, start_frame=cache.end_frame, kv_cache=cache, commit=True,
                             cross_key=tuple(cond.prompts))

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, T, C, H, W] in [0, 1] -> latents (native layout of the codec)."""
        return self.codec.encode(pixels)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents -> pixels float32 [B, T, C, H, W] in [0, 1]."""
        return self.codec.decode(latents)
