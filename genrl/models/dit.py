"""The built-in small video DiT: a diffusers model class for the shapes world and for tests.

It follows DiT (Peebles & Xie 2023, "Scalable Diffusion Models with Transformers"): patchified input,
adaLN-Zero blocks, zero-initialised output layer; plus text cross-attention (as in PixArt-alpha) over
per-token text-encoder states, fixed 3-D sin-cos positions, per-frame noise levels (Diffusion Forcing,
Chen et al. 2024; DFoT, Song et al. 2025) and optional block-causal attention by chunk (CausVid /
Self-Forcing). Like every diffusers model, the constructor is the config: the same class serves the
shipped 1.6M-parameter base model and a 20k-parameter test model, it saves / loads with
``save_pretrained`` / ``from_pretrained`` from a local folder, and takes LoRA adapters through peft
(``add_adapter``, ``disable_adapters``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from einops import rearrange
from torch import nn

from genrl.models.causal import CausalConfig, frame_visibility

__all__ = ["VideoDiT", "sincos_embedding_1d", "sincos_position_embedding_3d", "timestep_embedding"]


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of diffusers-style timesteps (Vaswani et al. 2017; DDPM / DiT convention).

    Args:
        timesteps: any shape ``S``, float, in [0, 1000] (``1000 * sigma``).
        dim: even embedding width.
    Returns:
        Tensor ``S + (dim,)`` in the dtype of ``timesteps`` (float32 at least).
    """
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, dtype=torch.float64, device=timesteps.device) / half
    ).to(torch.promote_types(timesteps.dtype, torch.float32))
    args = timesteps[..., None].to(freqs.dtype) * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_embedding_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed 1-D sin-cos position embedding (Vaswani et al. 2017). positions [N] -> [N, dim] (dim even)."""
    if dim % 2:
        raise ValueError(f"sin-cos embedding width must be even, got {dim}")
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    out = positions.to(torch.float64)[:, None] * omega[None]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_position_embedding_3d(
    frames: int, height: int, width: int, dim: int, frame_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Fixed 3-D sin-cos positions for a (frames x height x width) token grid, frame-major order.

    The width is split into a temporal part (dim // 4, rounded to even) and two equal spatial parts.
    ``frame_positions`` [frames] gives the temporal position of each frame group (default 0..frames-1; a
    causal chunk later in the video passes its absolute or cache-relative positions).
    Returns float64 [frames * height * width, dim].
    """
    d_t = (dim // 4) // 2 * 2
    d_s = (dim - d_t) // 2
    if d_s % 2 or d_t + 2 * d_s != dim:
        raise ValueError(f"hidden_size {dim} cannot be split into even (t, h, w) parts; use a multiple of 8")
    t = sincos_embedding_1d(torch.arange(frames) if frame_positions is None else frame_positions.cpu(), d_t)
    h = sincos_embedding_1d(torch.arange(height), d_s)
    w = sincos_embedding_1d(torch.arange(width), d_s)
    grid = torch.cat(
        [
            t[:, None, None].expand(frames, height, width, d_t),
            h[None, :, None].expand(frames, height, width, d_s),
            w[None, None, :].expand(frames, height, width, d_s),
        ],
        dim=-1,
    )
    return grid.reshape(frames * height * width, dim)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D rotary embedding tables (Su et al. 2021, RoFormer, eq. 34) for the first ``dim`` channels of a head.

    Args:
        positions: [N] token positions (any real values).
        dim: rotated channels (even).
    Returns:
        (cos, sin), each float64 [N, dim // 2].
    """
    if dim % 2:
        raise ValueError(f"rope_temporal_dim must be even, got {dim}")
    inv = 1.0 / theta ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    ang = positions.to(torch.float64).cpu()[:, None] * inv[None]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x`` [B, heads, N, head_dim] (half-split pairs)."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([a * c - b * s, a * s + b * c, rest], dim=-1)


class _SelfAttentionContext:
    """Per-forward state of causal self-attention: the mask, rotary tables, the cached K/V prefix each layer
    reads, and the un-roped K/V each layer produced (collected for a cache commit)."""

    def __init__(self, mask, q_rope=None, k_rope=None, prefix=None, collect=False, cross=None, cross_key=None):
        self.mask, self.q_rope, self.k_rope = mask, q_rope, k_rope
        self.prefix = prefix  # list over layers of (k, v) or None
        self.collect = collect
        self.produced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cross, self.cross_key = cross, cross_key  # KVCache.cross dict and the conditioning's key


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x [B, F, S, D]; shift/scale [B, F, 1, D] (one modulation per latent frame group)
    return x * (1 + scale) + shift


class _Attention(nn.Module):
    """Multi-head attention with RMS query/key normalisation; self- or cross-attention."""

    def __init__(self, dim: int, num_heads: int, kv_dim: int | None = None, qk_norm: bool = True) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden_size {dim} is not divisible by num_attention_heads {num_heads}")
        self.num_heads = num_heads
        head_dim = dim // num_heads
        kv_dim = kv_dim or dim
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(kv_dim, dim)
        self.to_v = nn.Linear(kv_dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                ctx: _SelfAttentionContext | None = None, layer: int = 0, cross: bool = False):
        q = self.norm_q(rearrange(self.to_q(x), "b n (h d) -> b h n d", h=self.num_heads))
        use_cross_cache = cross and ctx is not None and ctx.cross is not None and ctx.cross_key is not None
        # with grad enabled the text keys / values are recomputed so the cross-attention projections get gradients
        cached = ctx.cross.get(layer) if use_cross_cache and not torch.is_grad_enabled() else None
        if cached is not None and cached[0] == ctx.cross_key:
            k, v = cached[1], cached[2]
        else:
            context = x if context is None else context
            k = self.norm_k(rearrange(self.to_k(context), "b n (h d) -> b h n d", h=self.num_heads))
            v = rearrange(self.to_v(context), "b n (h d) -> b h n d", h=self.num_heads)
            if use_cross_cache:
                ctx.cross[layer] = (ctx.cross_key, k.detach(), v.detach())
        if ctx is not None and not cross:
            if ctx.collect:
                ctx.produced[layer] = (k.detach(), v.detach())
            if ctx.prefix is not None:
                k = torch.cat([ctx.prefix[layer][0].to(k.dtype), k], dim=2)
                v = torch.cat([ctx.prefix[layer][1].to(v.dtype), v], dim=2)
            if ctx.q_rope is not None:
                q = apply_rope(q, *ctx.q_rope)
                k = apply_rope(k, *ctx.k_rope)
            mask = ctx.mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class _DiTBlock(nn.Module):
    """adaLN-Zero block (DiT, Peebles & Xie 2023, sec. 3.2) with a text cross-attention layer."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qk_norm: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = _Attention(dim, num_heads, qk_norm=qk_norm)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.cross_attn = _Attention(dim, num_heads, qk_norm=qk_norm)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.ada_ln = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        nn.init.zeros_(self.ada_ln[1].weight)
        nn.init.zeros_(self.ada_ln[1].bias)

    def forward(self, x, c, text, text_mask, ctx: _SelfAttentionContext, layer: int):
        # x [B, F, S, D] tokens grouped by latent frame group; c [B, F, 1, D]; text [B, L, D]
        b, f, s, d = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada_ln(c).chunk(6, dim=-1)
        h = _modulate(self.norm1(x), shift1, scale1).reshape(b, f * s, d)
        x = x + gate1 * self.attn(h, ctx=ctx, layer=layer).reshape(b, f, s, d)
        h = self.norm2(x).reshape(b, f * s, d)
        x = x + self.cross_attn(h, context=text, mask=text_mask, ctx=ctx, layer=layer, cross=True).reshape(b, f, s, d)
        h = _modulate(self.norm3(x), shift2, scale2)
        return x + gate2 * self.mlp(h)


class VideoDiT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Small text-conditioned video DiT predicting the flow-matching velocity ``v = eps - x0``.

    Input layout is genrl's native one, ``[B, T, C, H, W]`` (an image is ``T = 1``). The noise level is
    a sigma in [0, 1] per sample ``[B]`` or per frame ``[B, T]`` (diffusion forcing); frames that share a
    temporal patch must share their sigma. The network embeds ``timestep = 1000 * sigma``.

    Attention over video tokens is ``"bidirectional"`` or ``"block_causal"``: with ``causal_chunk_size``
    latent frames per chunk, a token attends to every token of its own chunk and of earlier chunks, so
    outputs for chunks ``<= k`` do not depend on chunk ``k + 1`` (CausVid, Yin et al. 2025, sec. 3;
    Self-Forcing, Huang et al. 2025).

    Args:
        in_channels: channels per frame of the input (3 for the pixel codec).
        out_channels: channels of the prediction; defaults to ``in_channels``.
        patch_size: ``(frames, height, width)`` of one token; ``T, H, W`` must be divisible by it.
        hidden_size: transformer width (multiple of 8 and of ``num_attention_heads``).
        num_layers: number of adaLN-Zero blocks.
        num_attention_heads: heads of self- and cross-attention.
        mlp_ratio: MLP width / hidden_size.
        text_dim: width of the text encoder's hidden states (384 for MiniLM-L6).
        causal_chunk_size: latent frames per causal chunk (a multiple of ``patch_size[0]``), or None for a
            bidirectional-only model. ``attention="block_causal"`` in ``forward`` needs it.
        qk_norm: RMS-normalise queries and keys (stabilises small-batch training).
        timestep_embed_dim: width of the sinusoidal timestep features.
        rope_temporal_dim: head channels that also get a temporal rotary embedding in self-attention (0 = none,
            the shipped base model). Rotary positions are applied when keys are read, so a KV cache stores
            un-roped keys and can re-position them (cache-relative positions for unbounded streaming).

    Causal use (``attention="block_causal"``): the forward takes a :class:`~genrl.models.causal.CausalConfig`
    (chunk sizes, local window, sink frames, position policy), the absolute ``start_frame`` of its input, and
    optionally a :class:`~genrl.models.causal.KVCache` of committed context frames to attend to; with
    ``commit=True`` the input's keys / values are appended to the cache (Self-Forcing's context pass).
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["_DiTBlock"]
    _repeated_blocks = ["_DiTBlock"]

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int | None = None,
        patch_size: tuple[int, int, int] = (2, 2, 2),
        hidden_size: int = 128,
        num_layers: int = 4,
        num_attention_heads: int = 4,
        mlp_ratio: float = 4.0,
        text_dim: int = 384,
        causal_chunk_size: int | None = None,
        qk_norm: bool = True,
        timestep_embed_dim: int = 256,
        rope_temporal_dim: int = 0,
    ) -> None:
        super().__init__()
        patch_size = tuple(int(p) for p in patch_size)
        if len(patch_size) != 3 or min(patch_size) < 1:
            raise ValueError(f"patch_size must be three positive ints (frames, height, width), got {patch_size}")
        if causal_chunk_size is not None and causal_chunk_size % patch_size[0]:
            raise ValueError(
                f"causal_chunk_size {causal_chunk_size} must be a multiple of the temporal patch {patch_size[0]}"
            )
        if rope_temporal_dim < 0 or rope_temporal_dim % 2 or rope_temporal_dim > hidden_size // num_attention_heads:
            raise ValueError(f"rope_temporal_dim must be even and at most the head width "
                             f"{hidden_size // num_attention_heads}, got {rope_temporal_dim}")
        self.out_channels = out_channels or in_channels
        pt, ph, pw = patch_size
        self.patch_embed = nn.Linear(in_channels * pt * ph * pw, hidden_size)
        self.time_embed = nn.Sequential(
            nn.Linear(timestep_embed_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.text_proj = nn.Sequential(nn.LayerNorm(text_dim), nn.Linear(text_dim, hidden_size))
        self.pooled_proj = nn.Sequential(nn.LayerNorm(text_dim), nn.Linear(text_dim, hidden_size))
        self.blocks = nn.ModuleList(
            [_DiTBlock(hidden_size, num_attention_heads, mlp_ratio, qk_norm) for _ in range(num_layers)]
        )
        self.norm_out = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.ada_ln_out = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.proj_out = nn.Linear(hidden_size, self.out_channels * pt * ph * pw)
        for m in (self.ada_ln_out[1], self.proj_out):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)
        self.gradient_checkpointing = False

    # ------------------------------------------------------------------ helpers
    def _grid(self, t: int, h: int, w: int) -> tuple[int, int, int]:
        pt, ph, pw = self.config.patch_size
        if t % pt or h % ph or w % pw:
            raise ValueError(
                f"input of {t} frames x {h} x {w} is not divisible by patch_size {tuple(self.config.patch_size)}; "
                f"use frames / height / width that are multiples of it (or a model with a smaller patch)"
            )
        return t // pt, h // ph, w // pw

    def _frame_sigma(self, sigma: torch.Tensor, b: int, t: int, f: int) -> torch.Tensor:
        """sigma [B] or [B, T] -> [B, F] (one noise level per temporal patch)."""
        if sigma.ndim == 0:
            sigma = sigma.expand(b)
        if sigma.ndim == 1:
            if sigma.shape[0] != b:
                raise ValueError(f"sigma has shape {tuple(sigma.shape)}, expected [B]={b} or [B, T]=[{b}, {t}]")
            return sigma[:, None].expand(b, f)
        if sigma.shape != (b, t):
            raise ValueError(f"sigma has shape {tuple(sigma.shape)}, expected [B]={b} or [B, T]=[{b}, {t}]")
        pt = self.config.patch_size[0]
        grouped = sigma.reshape(b, f, pt)
        if pt > 1 and not torch.equal(grouped, grouped[..., :1].expand_as(grouped)):
            raise ValueError(
                f"per-frame sigma differs inside a temporal patch of {pt} frames; give frames "
                f"{pt}k..{pt}k+{pt - 1} the same sigma (e.g. sample [B, T/{pt}] and repeat_interleave({pt}))"
            )
        return grouped[..., 0]

    def causal_config(self, causal: CausalConfig | None = None) -> CausalConfig:
        """``causal`` checked against the temporal patch, or the model's default (chunks of
        ``causal_chunk_size``, no window).

        Raises:
            ValueError: no layout given and the model has no ``causal_chunk_size``; sizes not multiples of the patch.
        """
        if causal is None:
            if self.config.causal_chunk_size is None:
                raise ValueError("attention='block_causal' needs a CausalConfig or a model built with "
                                 "causal_chunk_size")
            causal = CausalConfig(chunk_size=self.config.causal_chunk_size)
        causal.check_patch(self.config.patch_size[0])
        return causal

    def block_causal_mask(self, f: int, s: int, device: torch.device, causal=None,
                          start_frame: int = 0) -> torch.Tensor:
        """Boolean self-attention mask [F*S, F*S] (True = may attend) for chunked causal attention over F frame
        groups of S tokens starting at latent frame ``start_frame`` (window and sink from ``causal``)."""
        causal = self.causal_config(causal)
        frames = start_frame + torch.arange(f) * self.config.patch_size[0]
        vis = frame_visibility(causal, frames, frames)
        return vis.repeat_interleave(s, 0).repeat_interleave(s, 1).to(device)

    def _attention_context(self, attention, causal, start_frame, kv_cache, commit, f, s, device, cross_key):
        """Mask, rotary tables and cache prefix of one forward; returns (context, group positions [F])."""
        pt = self.config.patch_size[0]
        q_frames = start_frame + torch.arange(f) * pt
        rope_dim = self.config.rope_temporal_dim
        if attention == "bidirectional":
            if kv_cache is not None or commit:
                raise ValueError("a KV cache needs attention='block_causal'")
            positions = q_frames // pt
            rope = rope_cos_sin(positions.repeat_interleave(s), rope_dim) if rope_dim else None
            if rope is not None:  # the tables are built on the CPU: move them to the tokens' device (as below)
                rope = tuple(t.to(device) for t in rope)
            return _SelfAttentionContext(None, rope, rope), positions
        causal = self.causal_config(causal)
        vis = frame_visibility(causal, q_frames, q_frames)
        prefix, k_groups = None, torch.zeros(0, dtype=torch.long)
        if kv_cache is not None:
            if kv_cache.end_frame != start_frame:
                raise ValueError(f"input starts at latent frame {start_frame} but the KV cache ends at "
                                 f"{kv_cache.end_frame}; pass start_frame=kv_cache.end_frame")
            if kv_cache.patch_frames != pt:
                raise ValueError(f"KV cache built for a temporal patch of {kv_cache.patch_frames}, model has {pt}")
            if kv_cache.num_groups:
                if kv_cache.tokens_per_group != s:
                    raise ValueError(f"KV cache holds {kv_cache.tokens_per_group} tokens per frame group, input has "
                                     f"{s}; the latent height / width changed mid-video")
                vis_c = kv_cache.visible(q_frames)
                used = vis_c.any(0)
                rows = kv_cache.token_rows(used).to(device)
                prefix = [(k.index_select(2, rows), v.index_select(2, rows))
                          for k, v in zip(kv_cache.keys, kv_cache.values)]
                k_groups = kv_cache.frames[used]
                vis = torch.cat([vis_c[:, used], vis], dim=1)
        if causal.positions == "absolute":
            q_pos, k_pos = q_frames // pt, k_groups // pt
        else:
            k_pos = torch.arange(len(k_groups))
            q_pos = len(k_groups) + torch.arange(f)
        mask = None if bool(vis.all()) else vis.repeat_interleave(s, 0).repeat_interleave(s, 1).to(device)
        q_rope = k_rope = None
        if rope_dim:
            q_rope = rope_cos_sin(q_pos.repeat_interleave(s), rope_dim)
            k_rope = rope_cos_sin(torch.cat([k_pos, q_pos]).repeat_interleave(s), rope_dim)
            q_rope = tuple(t.to(device) for t in q_rope)
            k_rope = tuple(t.to(device) for t in k_rope)
        cross = kv_cache.cross if kv_cache is not None else None
        return _SelfAttentionContext(mask, q_rope, k_rope, prefix, collect=commit, cross=cross,
                                     cross_key=cross_key), q_pos

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        sigma: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        attention: str = "bidirectional",
        causal=None,
        start_frame: int = 0,
        kv_cache=None,
        commit: bool = False,
        cross_key=None,
    ) -> torch.Tensor:
        """Predict the velocity.

        Args:
            hidden_states: noisy latents ``x_sigma`` [B, T, C, H, W].
            sigma: noise level in [0, 1], [B] or per frame [B, T] (float).
            encoder_hidden_states: text encoder states [B, L, text_dim].
            encoder_attention_mask: [B, L] bool, True for real tokens (None = all real).
            attention: ``"bidirectional"`` or ``"block_causal"``.
            causal: the :class:`~genrl.models.causal.CausalConfig` of ``"block_causal"`` (default: chunks of
                ``causal_chunk_size``, no window, absolute positions).
            start_frame: absolute latent frame index of the input's first frame (positions, chunk ids, window).
            kv_cache: committed context to attend to (``"block_causal"`` only); must end at ``start_frame``.
            commit: append the input's un-roped keys / values to ``kv_cache`` after the forward.
            cross_key: hashable id of the conditioning; with a cache, text keys / values are cached under it.
        Returns:
            velocity [B, T, C_out, H, W] in the dtype of ``hidden_states``.
        Raises:
            ValueError: wrong ranks, sizes not divisible by the patch, sigma of the wrong shape or
                differing inside a temporal patch, unknown attention mode, a cache that does not end at
                ``start_frame`` or whose batch / token layout differs.
        """
        if hidden_states.ndim != 5:
            raise ValueError(f"VideoDiT expects latents [B, T, C, H, W], got shape {tuple(hidden_states.shape)}")
        b, t, c, h, w = hidden_states.shape
        if c != self.config.in_channels:
            raise ValueError(f"latents have {c} channels, the model was built for {self.config.in_channels}")
        if attention not in ("bidirectional", "block_causal"):
            raise ValueError(f"attention must be 'bidirectional' or 'block_causal', got {attention!r}")
        if commit and kv_cache is None:
            raise ValueError("commit=True needs a kv_cache")
        if kv_cache is not None and kv_cache.batch_size != b:
            raise ValueError(f"KV cache holds a batch of {kv_cache.batch_size}, input has {b}")
        f, gh, gw = self._grid(t, h, w)
        pt, ph, pw = self.config.patch_size
        if start_frame % pt:
            raise ValueError(f"start_frame {start_frame} is not a multiple of the temporal patch {pt}")
        dtype = self.patch_embed.weight.dtype
        ctx, q_pos = self._attention_context(attention, causal, start_frame, kv_cache, commit, f, gh * gw,
                                             hidden_states.device, cross_key)

        x = rearrange(
            hidden_states.to(dtype),
            "b (f pt) c (gh ph) (gw pw) -> b f (gh gw) (c pt ph pw)",
            pt=pt, ph=ph, pw=pw,
        )
        # with a temporal rotary embedding, time enters only through it (the additive table keeps h, w)
        frame_pos = torch.zeros_like(q_pos) if self.config.rope_temporal_dim else q_pos
        pos = sincos_position_embedding_3d(f, gh, gw, self.config.hidden_size, frame_positions=frame_pos)
        x = self.patch_embed(x) + pos.to(dtype=dtype, device=x.device).reshape(f, gh * gw, -1)

        sigma_f = self._frame_sigma(torch.as_tensor(sigma, device=x.device), b, t, f)
        temb = timestep_embedding(1000.0 * sigma_f.float(), self.config.timestep_embed_dim).to(dtype)
        c_emb = self.time_embed(temb)  # [B, F, D]

        text_states = encoder_hidden_states.to(dtype)
        if encoder_attention_mask is None:
            encoder_attention_mask = torch.ones(text_states.shape[:2], dtype=torch.bool, device=x.device)
        encoder_attention_mask = encoder_attention_mask.to(device=x.device, dtype=torch.bool)
        denom = encoder_attention_mask.sum(1, keepdim=True).clamp_min(1).to(dtype)
        pooled = (text_states * encoder_attention_mask[..., None].to(dtype)).sum(1) / denom
        c_emb = (c_emb + self.pooled_proj(pooled)[:, None])[:, :, None]  # [B, F, 1, D]
        text = self.text_proj(text_states)
        text_mask = encoder_attention_mask[:, None, None, :]  # [B, 1, 1, L]

        for layer, block in enumerate(self.blocks):
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x = self._gradient_checkpointing_func(block, x, c_emb, text, text_mask, ctx, layer)
            else:
                x = block(x, c_emb, text, text_mask, ctx, layer)

        if commit:
            kv_cache.append([ctx.produced[i] for i in range(len(self.blocks))],
                            start_frame + torch.arange(f) * pt, gh * gw)

        shift, scale = self.ada_ln_out(c_emb).chunk(2, dim=-1)
        x = self.proj_out(_modulate(self.norm_out(x), shift, scale))
        out = rearrange(
            x, "b f (gh gw) (c pt ph pw) -> b (f pt) c (gh ph) (gw pw)",
            gh=gh, gw=gw, pt=pt, ph=ph, pw=pw,
        )
        return out.to(hidden_states.dtype)
