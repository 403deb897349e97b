"""A small prompt-conditioned spatio-temporal video discriminator (AFD), and GAN heads on a frozen network's
features (DMD2 / TMD).

`VideoDiscriminator` scores a clean (or noised) video and its prompt with one real number. It is a
plain transformer over space-time patch tokens: patchify, fixed 3-D sin-cos positions computed for
each input (so any T, H, W divisible by the patch works), pre-norm blocks of self-attention over all
tokens, cross-attention to the text encoder's per-token states, and an MLP; a learned readout token
(or a mean pool) goes through a linear head. Like every genrl model, it is a diffusers model whose
constructor is its config: the default is tiny (width 64, 2 blocks) and saves / loads with
``save_pretrained`` / ``from_pretrained``.

AFD (docs/methods/distillation.md, AFD) trains it with `genrl.flow.bt_loss` on (teacher clip, student
rollout) pairs of the same prompt, optionally with `genrl.flow.r1_penalty` / `r2_penalty`; its score
gap becomes the student's advantage.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from einops import rearrange
from torch import nn

from genrl.models.dit import sincos_position_embedding_3d, timestep_embedding

__all__ = ["FeatureGANHeads", "TrunkDiscriminator", "VideoDiscriminator"]

_READOUTS = ("token", "mean")


class _Attention(nn.Module):
    """Multi-head (self- or cross-) attention with optional RMS query / key normalisation."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        head_dim = dim // num_heads
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, double_backward: bool = False) -> torch.Tensor:
        context = x if context is None else context
        split = "b n (h d) -> b h n d"
        q = self.norm_q(rearrange(self.to_q(x), split, h=self.num_heads))
        k = self.norm_k(rearrange(self.to_k(context), split, h=self.num_heads))
        v = rearrange(self.to_v(context), split, h=self.num_heads)
        if double_backward:
            # explicit softmax(q k^T / sqrt(d)) v: the fused SDPA kernels (flash / memory-efficient, CPU and
            # CUDA) have no derivative of their backward, which R1 / R2 (create_graph=True) need
            logits = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            out = logits.softmax(dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class _Block(nn.Module):
    """Pre-norm transformer block: space-time self-attention, text cross-attention, MLP."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qk_norm: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _Attention(dim, num_heads, qk_norm)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.cross_attn = _Attention(dim, num_heads, qk_norm)
        self.norm3 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor,
                double_backward: bool = False) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), double_backward=double_backward)
        x = x + self.cross_attn(self.norm2(x), context=text, mask=text_mask, double_backward=double_backward)
        return x + self.mlp(self.norm3(x))


class VideoDiscriminator(ModelMixin, ConfigMixin):
    """Prompt-conditioned spatio-temporal discriminator: (video, prompt states[, sigma]) -> score [B].

    Input: clean latents or pixels ``[B, T, C, H, W]`` (``frame_dim=1``, genrl's layout; pixels are
    float in [0, 1] with C = 3) or Wan's ``[B, C, T, H, W]`` (``frame_dim=2``); T, H, W must be
    multiples of ``patch_size`` = (frames, height, width). Text: the per-token states
    ``[B, L, text_dim]`` and bool mask ``[B, L]`` of a `~genrl.models.Conditioning`. An optional noise
    level sigma in [0, 1] ([B] or per frame [B, T]; default 0 = clean) enters as a sinusoidal
    embedding of ``1000 * sigma`` added to every token of its frame group, so the same network can
    score noised inputs. Output: one unbounded real score per video, float32 [B], higher = judged
    more real (AFD: more teacher-like).

    Architecture: linear patch embedding + fixed 3-D sin-cos positions (computed per input, no
    learned position table, hence input-size agnostic); a learned readout token prepended to the
    tokens, initialised with the mask-mean-pooled text projection (``readout="token"``), or a mean
    pool over video tokens (``readout="mean"``); ``num_layers`` pre-norm blocks (self-attention over
    all space-time tokens, cross-attention to the projected text states, GELU MLP); final LayerNorm
    and a linear head. No batch-norm, so each sample's score depends only on its own inputs (needed
    for per-sample R1 / R2). Inputs that require grad switch attention to an explicit implementation
    with a double backward (see ``double_backward`` in `forward`), so R1 / R2 work, also through
    ``enable_gradient_checkpointing()`` (non-reentrant checkpointing re-runs the same path).

    Args:
        in_channels: channels per frame (3 for pixels, 16 for Wan latents).
        patch_size: (frames, height, width) of one token.
        hidden_size: transformer width; a multiple of 8 and of ``num_attention_heads``.
        num_layers: number of blocks (>= 1).
        num_attention_heads: heads of self- and cross-attention.
        mlp_ratio: MLP width / hidden_size.
        text_dim: width of the text states (384 for MiniLM-L6, 4096 for Wan's UMT5).
        frame_dim: default frame dim of the input (1: [B, T, C, H, W]; 2: [B, C, T, H, W]).
        readout: "token" (learned readout token) or "mean" (mean pool of the video tokens).
        qk_norm: RMS-normalise attention queries and keys.
        timestep_embed_dim: width of the sinusoidal sigma features (even).

    Raises:
        ValueError: a bad config value (the message names it).

    Source: the discriminator role of AFD (arXiv 2605.26105; docs/methods/distillation.md, AFD step 2);
    transformer blocks after ViT / DiT (Dosovitskiy et al. 2021; Peebles & Xie 2023) with text
    cross-attention as in PixArt-alpha (Chen et al. 2023); sin-cos positions (Vaswani et al. 2017).
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["_Block"]
    #: R1 / R2 differentiate through the input gradient (a double backward): a sharding strategy must keep the
    #: gathered weights for the whole step (genrl.models.sharding.shard_module reads this)
    needs_double_backward = True

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        patch_size: tuple[int, int, int] = (1, 2, 2),
        hidden_size: int = 64,
        num_layers: int = 2,
        num_attention_heads: int = 4,
        mlp_ratio: float = 4.0,
        text_dim: int = 384,
        frame_dim: int = 1,
        readout: str = "token",
        qk_norm: bool = True,
        timestep_embed_dim: int = 64,
    ) -> None:
        super().__init__()
        patch = tuple(int(p) for p in patch_size)
        if len(patch) != 3 or min(patch) < 1:
            raise ValueError(f"patch_size must be three positive ints (frames, height, width), got {patch_size}")
        for name, v in (("in_channels", in_channels), ("num_layers", num_layers),
                        ("num_attention_heads", num_attention_heads), ("text_dim", text_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if hidden_size % 8 or hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size must be a multiple of 8 and of num_attention_heads={num_attention_heads}, "
                f"got {hidden_size}"
            )
        if frame_dim not in (1, 2):
            raise ValueError(f"frame_dim must be 1 ([B, T, C, H, W]) or 2 ([B, C, T, H, W]), got {frame_dim!r}")
        if readout not in _READOUTS:
            raise ValueError(f"readout must be one of {_READOUTS}, got {readout!r}")
        if timestep_embed_dim < 2 or timestep_embed_dim % 2:
            raise ValueError(f"timestep_embed_dim must be even and >= 2, got {timestep_embed_dim}")
        if not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0, got {mlp_ratio}")
        pt, ph, pw = patch
        self.patch_embed = nn.Linear(in_channels * pt * ph * pw, hidden_size)
        self.sigma_embed = nn.Sequential(
            nn.Linear(timestep_embed_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.text_proj = nn.Sequential(nn.LayerNorm(text_dim), nn.Linear(text_dim, hidden_size))
        self.readout_token = nn.Parameter(torch.randn(hidden_size) * 0.02)
        self.blocks = nn.ModuleList(
            [_Block(hidden_size, num_attention_heads, mlp_ratio, qk_norm) for _ in range(num_layers)]
        )
        self.norm_out = nn.LayerNorm(hidden_size, eps=1e-6)
        self.head = nn.Linear(hidden_size, 1)
        self.gradient_checkpointing = False

    # ------------------------------------------------------------------ helpers
    def _to_btchw(self, x: torch.Tensor, frame_dim: int) -> torch.Tensor:
        if frame_dim not in (1, 2):
            raise ValueError(f"frame_dim must be 1 ([B, T, C, H, W]) or 2 ([B, C, T, H, W]), got {frame_dim!r}")
        layout = "[B, T, C, H, W]" if frame_dim == 1 else "[B, C, T, H, W]"
        if not isinstance(x, torch.Tensor) or x.ndim != 5:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"VideoDiscriminator expects a video {layout} (frame_dim={frame_dim}), got shape {shape}; "
                "give an image as a 1-frame video"
            )
        if frame_dim == 2:
            x = x.transpose(1, 2)
        b, t, c, h, w = x.shape
        if c != self.config.in_channels:
            raise ValueError(
                f"input of shape {tuple(x.shape) if frame_dim == 1 else (b, c, t, h, w)} has {c} channels on "
                f"the channel dim of {layout}, the discriminator was built for in_channels="
                f"{self.config.in_channels} (check frame_dim)"
            )
        pt, ph, pw = self.config.patch_size
        if b < 1 or t % pt or h % ph or w % pw or min(t, h, w) < 1:
            raise ValueError(
                f"input of {t} frames x {h} x {w} (shape {layout} = "
                f"{tuple(x.shape) if frame_dim == 1 else (b, c, t, h, w)}) is not divisible by patch_size "
                f"{tuple(self.config.patch_size)}; crop / pad to multiples of it or build a smaller patch"
            )
        return x

    def _group_sigma(self, sigma: torch.Tensor | float | None, b: int, t: int, f: int,
                     device: torch.device) -> torch.Tensor:
        """sigma (None, float, 0-d, [B] or [B, T]) -> [B, F] float32, one value per temporal patch."""
        if sigma is None:
            return torch.zeros(b, f, device=device)
        s = torch.as_tensor(sigma, dtype=torch.float32, device=device)
        if s.ndim == 0:
            s = s.expand(b)
        if s.ndim == 1 and s.shape[0] == b:
            s = s[:, None].expand(b, f)
        elif s.shape == (b, t):
            pt = self.config.patch_size[0]
            grouped = s.reshape(b, f, pt)
            if pt > 1 and not torch.equal(grouped, grouped[..., :1].expand_as(grouped)):
                raise ValueError(f"per-frame sigma differs inside a temporal patch of {pt} frames; "
                                 f"give the frames of one patch the same sigma")
            s = grouped[..., 0]
        else:
            raise ValueError(f"sigma has shape {tuple(s.shape)}, expected a float, [B] = [{b}] or [B, T] = [{b}, {t}]")
        if bool(((s < 0) | (s > 1) | torch.isnan(s)).any()):
            raise ValueError(f"sigma must lie in [0, 1] (0 = clean), got values in "
                             f"[{float(s.min())}, {float(s.max())}]")
        return s

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        sigma: torch.Tensor | float | None = None,
        frame_dim: int | None = None,
        double_backward: bool | None = None,
    ) -> torch.Tensor:
        """Score videos against their prompts.

        Args:
            hidden_states: videos [B, T, C, H, W] (``frame_dim=1``) or [B, C, T, H, W]
                (``frame_dim=2``), any float dtype (latents, or pixels in [0, 1]).
            encoder_hidden_states: per-token text states [B, L, text_dim] (``Conditioning.hidden_states``).
            encoder_attention_mask: [B, L] bool (or 0/1), True for real tokens (default all real);
                every row needs at least one real token.
            sigma: noise level of the input in [0, 1]: None / 0 (clean, default), a float, [B], or
                per frame [B, T] (equal within a temporal patch).
            frame_dim: layout of ``hidden_states`` (default: the config's ``frame_dim``).
            double_backward: compute attention explicitly (softmax(q k^T / sqrt(d)) v) so that a
                gradient of an input gradient can be taken (R1 / R2 with ``create_graph=True``): the
                fused SDPA kernels have no double backward. Default (None): on exactly when grad is
                enabled and ``hidden_states.requires_grad``. Costs O(tokens^2) attention memory;
                pass False to keep the fused kernels for first-order input gradients (e.g. a GAN
                generator loss through D) on long videos.

        Returns:
            scores [B], float32, unbounded.

        Raises:
            ValueError: the video is not 5-D, has the wrong channel count or sizes not divisible by
                ``patch_size`` (the message names the shape), the text states / mask do not fit,
                a mask row has no real token, or sigma has a bad shape / leaves [0, 1].
        """
        x = self._to_btchw(hidden_states, self.config.frame_dim if frame_dim is None else frame_dim)
        b, t, _, h, w = x.shape
        pt, ph, pw = self.config.patch_size
        f, gh, gw = t // pt, h // ph, w // pw
        dim = self.config.hidden_size
        dtype = self.patch_embed.weight.dtype
        device = x.device

        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[0] != b \
                or encoder_hidden_states.shape[2] != self.config.text_dim:
            raise ValueError(
                f"encoder_hidden_states of shape {tuple(encoder_hidden_states.shape)} must be [B, L, text_dim] = "
                f"[{b}, L, {self.config.text_dim}]"
            )
        length = encoder_hidden_states.shape[1]
        if encoder_attention_mask is None:
            text_keep = torch.ones(b, length, dtype=torch.bool, device=device)
        else:
            if encoder_attention_mask.shape != (b, length):
                raise ValueError(
                    f"encoder_attention_mask of shape {tuple(encoder_attention_mask.shape)} must be [B, L] = "
                    f"[{b}, {length}]"
                )
            text_keep = encoder_attention_mask.to(device=device, dtype=torch.bool)
        empty = (~text_keep.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"encoder_attention_mask has no real token in row(s) {empty}; encode an (empty) prompt "
                             "with the text encoder, which always keeps its special tokens")

        tokens = rearrange(x.to(dtype), "b (f pt) c (gh ph) (gw pw) -> b f (gh gw) (c pt ph pw)",
                           pt=pt, ph=ph, pw=pw)
        pos = sincos_position_embedding_3d(f, gh, gw, dim).to(dtype=dtype, device=device).reshape(f, gh * gw, dim)
        s = self._group_sigma(sigma, b, t, f, device)
        semb = self.sigma_embed(timestep_embedding(1000.0 * s, self.config.timestep_embed_dim).to(dtype))  # [B, F, D]
        tokens = (self.patch_embed(tokens) + pos + semb[:, :, None]).reshape(b, f * gh * gw, dim)

        text = self.text_proj(encoder_hidden_states.to(dtype))  # [B, L, D]
        keep = text_keep[..., None].to(dtype)
        pooled = (text * keep).sum(1) / keep.sum(1)  # [B, D]
        use_token = self.config.readout == "token"
        if use_token:
            readout = self.readout_token.to(dtype)[None] + pooled + semb.mean(dim=1)
            tokens = torch.cat([readout[:, None], tokens], dim=1)
        text_mask = text_keep[:, None, None, :]  # [B, 1, 1, L], True = attend

        if double_backward is None:
            double_backward = torch.is_grad_enabled() and hidden_states.requires_grad
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                tokens = self._gradient_checkpointing_func(block, tokens, text, text_mask, double_backward)
            else:
                tokens = block(tokens, text, text_mask, double_backward)

        feat = tokens[:, 0] if use_token else tokens.mean(dim=1)
        return self.head(self.norm_out(feat)).squeeze(-1).float()

    def score(self, videos: torch.Tensor, cond, sigma: torch.Tensor | float | None = None,
              frame_dim: int | None = None, double_backward: bool | None = None) -> torch.Tensor:
        """Score videos against a `~genrl.models.Conditioning` (its per-token states and mask).

        Args:
            videos: [B, T, C, H, W] or [B, C, T, H, W] (see `forward`).
            cond: a Conditioning with ``hidden_states`` [B, L, text_dim] and ``attention_mask`` [B, L].
            sigma: optional noise level, as in `forward`.
            frame_dim: layout override, as in `forward`.
            double_backward: as in `forward`.

        Returns:
            scores [B], float32.

        Raises:
            ValueError: as `forward`.
        """
        return self(videos, cond.hidden_states, cond.attention_mask, sigma=sigma, frame_dim=frame_dim,
                    double_backward=double_backward)


class FeatureGANHeads(nn.Module):
    """DMD2-style GAN heads: one small 3-D convolutional classifier per tapped layer of a frozen network's features,
    their logits summed (Yin et al. 2024, DMD2, section 4.3: a classification branch on the fake score's bottleneck;
    TMD's DMD2-v puts Conv3D heads on the *teacher*'s unpatchified features at three depths).

    Each head: Conv3d(D -> c, 3) -> GroupNorm -> SiLU -> Conv3d(c -> c, 3, stride (1, 2, 2)) -> GroupNorm -> SiLU ->
    mean over (F, h, w) -> Linear(c -> 1). Any grid size works (padding 1; a 1-frame image grid too).

    Args:
        feature_dim: D, the channel count of every tapped feature grid.
        num_taps: how many feature grids ``forward`` receives (one head each), >= 1.
        channels: c, the heads' width (default 64).
    Raises:
        ValueError: ``num_taps`` < 1 or ``channels`` < 1.
    """

    def __init__(self, feature_dim: int, num_taps: int, channels: int = 64) -> None:
        super().__init__()
        if num_taps < 1 or channels < 1:
            raise ValueError(f"FeatureGANHeads needs num_taps >= 1 and channels >= 1, got {num_taps}, {channels}")
        groups = math.gcd(channels, 8)
        self.heads = nn.ModuleList(nn.Sequential(
            nn.Conv3d(feature_dim, channels, 3, padding=1), nn.GroupNorm(groups, channels), nn.SiLU(),
            nn.Conv3d(channels, channels, 3, stride=(1, 2, 2), padding=1), nn.GroupNorm(groups, channels), nn.SiLU(),
            nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(channels, 1),
        ) for _ in range(num_taps))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        """Summed logits, float32 [B], of feature grids ``[B, D, F, h, w]`` (one per head, cast to the heads' dtype).

        Raises:
            ValueError: a number of grids other than ``num_taps``.
        """
        if len(features) != len(self.heads):
            raise ValueError(f"{len(features)} feature grids for {len(self.heads)} GAN heads")
        dtype = self.heads[0][0].weight.dtype
        return sum(head(f.to(dtype)).squeeze(-1).float() for head, f in zip(self.heads, features, strict=True))


class TrunkDiscriminator(nn.Module):
    """A prompt-conditioned video discriminator on a frozen copy of the student's own network (AFD).

    The copy (taken when the discriminator is built, i.e. the initial student) runs bidirectionally on the noised
    latents ``x_sigma`` at ``sigma`` with the prompt through its own cross-attention, and
    :class:`FeatureGANHeads` score its token grids after ``layers`` blocks; only the heads train. This is the
    discriminator the AFD spec recommends for real-size students (a head on the student architecture's trunk, as in
    Self-Forcing's GAN and DMD2, Yin et al. 2024, section 4.3): its features already encode the text and the data, so
    the heads need not learn them from a few pairs.

    ``score(videos, cond, sigma=None, frame_dim=None, double_backward=None) -> float32 [B]`` as
    :meth:`VideoDiscriminator.score` (``sigma``: None / float / [B] in [0, 1]). R1 / R2 penalties are not supported
    (the trunk's fused attention has no double backward): ``double_backward=True`` raises.

    Args:
        generator: the student generator (genrl's DiT or a diffusers family with a trunk adapter); it is held by
            reference (not a submodule) to run the copy with its input handling and text conditioning.
        layers: block counts to tap (each in 1 .. L); default ``[round(0.53 L), round(0.77 L), L]``.
        channels: width of each head.

    Raises:
        ValueError: a layer outside 1 .. L, a family without a trunk adapter.
    """

    needs_double_backward = False

    def __init__(self, generator: nn.Module, layers: list[int] | None = None, channels: int = 64) -> None:
        import copy

        from genrl.models.trunk import trunk_adapter

        super().__init__()
        self.trunk = copy.deepcopy(generator.transformer).requires_grad_(False).eval()
        with self._bidirectional(generator) as gen:
            adapter = trunk_adapter(gen)
            n = adapter.num_layers
            self.layers = list(layers) if layers else sorted({max(1, round(0.53 * n)), max(1, round(0.77 * n)), n})
            if any(not 1 <= k <= n for k in self.layers):
                raise ValueError(f"discriminator trunk layers {self.layers}: block counts must be in 1 .. L = {n}")
            width = adapter.hidden_size
        self.heads = FeatureGANHeads(width, len(self.layers), channels)
        self._generator = [generator]  # a plain list: the student is not a submodule of its discriminator

    def train(self, mode: bool = True) -> TrunkDiscriminator:
        super().train(mode)
        self.trunk.eval()  # frozen: no dropout / norm updates
        return self

    @contextmanager
    def _bidirectional(self, generator: nn.Module) -> Iterator[nn.Module]:
        """``generator`` running the frozen copy with full (bidirectional) attention; restored on exit."""
        from genrl.models.roles import swapped_transformer

        with swapped_transformer(generator, self.trunk) as gen:
            gen.causal = None  # the discriminator sees the whole clip (swapped_transformer restores the layout)
            yield gen

    def score(self, videos: torch.Tensor, cond, sigma: torch.Tensor | float | None = None,
              frame_dim: int | None = None, double_backward: bool | None = None) -> torch.Tensor:
        """Scores float32 [B] of latents ``videos`` (the generator's layout) against ``cond``; higher = more real."""
        from genrl.models.trunk import trunk_adapter

        if double_backward:
            raise ValueError("TrunkDiscriminator does not support R1 / R2 (no double backward through the trunk); "
                             "set r1_weight = r2_weight = 0 and use instance noise (disc_noise_max) instead")
        b = videos.shape[0]
        s = torch.as_tensor(0.0 if sigma is None else sigma, dtype=torch.float32, device=videos.device)
        s = s.expand(b) if s.ndim == 0 else s
        with self._bidirectional(self._generator[0]) as gen:
            feats = trunk_adapter(gen).features_at(videos.to(next(self.trunk.parameters()).dtype), s, cond, self.layers)
        return self.heads(feats)
