"""The backbone / flow-head split of a generator's transformer, for TMD students.

Transition Matching Distillation (TMD; Nie, Berner, Ma, Liu, Xie, Vahdat 2026, "Transition Matching Distillation for
Fast Video Generation", arXiv 2601.09881) turns a teacher DiT with L blocks into a two-part student:

- the *main backbone*: the patch / time / text embeddings and blocks ``0 .. L-H-1``; it runs once per outer
  transition step on x_t and yields the feature stream m (the tokens after block L-H-1);
- the *flow head*: blocks ``L-H .. L-1`` and the output layers of the same transformer, plus a few new parts (a
  fusion block with a learnable gate and an embedding of the inner step length s - r, Appendix A.1 of the paper);
  it runs N times per outer step on an inner variable y.

This module exposes a transformer as a sequence of stages that can be stopped and resumed at any block:

- :class:`TrunkState`: the activations between two blocks (token stream, time embedding, everything else the
  blocks and the output layers read);
- :class:`TrunkAdapter` with one subclass per family (:class:`DiTTrunk` for genrl's :class:`~genrl.models.dit.VideoDiT`,
  :class:`WanTrunk` for diffusers' ``WanTransformer3DModel``, :class:`SD3Trunk` for ``SD3Transformer2DModel``) and
  the dispatcher :func:`trunk_adapter`. An adapter calls the model's *own* submodules in the order of the model's
  own forward (no hooks, no copied weights, no forked class), so ``finalize(run_blocks(embed(x, s, c), 0, L))`` is
  ``generator.velocity(x, s, c)`` bit for bit, and LoRA adapters, gradient checkpointing and FSDP units of the
  transformer keep working;
- :class:`FlowHead`: the head's *new* parameters only (fusion block, gate, delta-time embedder); it reaches the
  transformer's last H blocks through an adapter passed at call time;
- :class:`TransitionModel`: the student, generator + head.

Conventions (docs/architecture.md): sigma in [0, 1] with sigma = 1 noise, ``x_sigma = (1 - sigma) x0 + sigma eps``,
velocity ``v = eps - x0``; latents in each family's native layout (DiT ``[B, T, C, H, W]``, Wan ``[B, C, F, h, w]``,
SD3 ``[B, C, h, w]``); timesteps ``1000 sigma``.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from torch import nn

from genrl.models.dit import VideoDiT, sincos_position_embedding_3d, timestep_embedding
from genrl.models.families.sd3 import SD3Generator
from genrl.models.families.wan import WanGenerator
from genrl.models.generator import DiTGenerator
from genrl.models.text_encoder import Conditioning

__all__ = ["TrunkState", "TrunkAdapter", "DiTTrunk", "WanTrunk", "SD3Trunk", "trunk_adapter", "FlowHead",
           "TransitionModel", "SUPPORTED_FAMILIES", "HEAD_CONFIG_FILE", "HEAD_WEIGHTS_FILE", "load_head",
           "save_head"]

#: generator classes :func:`trunk_adapter` can split, by family name.
SUPPORTED_FAMILIES = ("dit (genrl.models.DiTGenerator, bidirectional)", "wan (WanGenerator)", "sd3 (SD3Generator)")


@dataclass
class TrunkState:
    """The activations of a transformer between two of its blocks (a plain container).

    Attributes:
        h: the token stream in the family's own layout and the model's compute dtype: genrl's DiT
            ``[B, F, S, D]`` (F temporal patch groups of S tokens), Wan ``[B, N, D]``, SD3 ``[B, N, D]`` (image
            tokens only; SD3's text stream is in ``extra["text"]``).
        temb: the time (and pooled-text) embedding that the blocks' modulation consumes: DiT ``c_emb``
            ``[B, F, 1, D]`` (one per frame group; pooled text included); Wan the embedding ``temb`` ``[B, D]`` (or
            ``[B, N, D]`` with a per-frame sigma) *before* ``time_proj`` (the projected ``timestep_proj`` the
            blocks read is in ``extra``); SD3 the output of ``time_text_embed`` ``[B, D]``.
        extra: everything else the blocks and ``finalize`` need (text states, masks, attention context, rotary
            tables, patch grid, output dtype, SD3's text stream, ...); keys are family-specific and documented on
            each adapter. Adapters never mutate a state's dict in place: they return a new state with a shallow copy.
    """

    h: torch.Tensor
    temb: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)

    def replace(self, **changes) -> TrunkState:
        """A new state with ``changes`` (``h``, ``temb``, or ``extra`` keys given as ``extra={...}`` merged into a
        shallow copy of this state's dict); this state is untouched."""
        extra = dict(self.extra)
        extra.update(changes.pop("extra", {}))
        return TrunkState(changes.pop("h", self.h), changes.pop("temb", self.temb), extra)


class TrunkAdapter(abc.ABC):
    """A generator's transformer as stoppable stages: ``embed`` -> ``run_blocks`` -> ``finalize``.

    An adapter is a plain object (not an ``nn.Module``) that holds the generator and looks its transformer up at each
    call, so it registers nothing and a LoRA-wrapped, checkpointed or FSDP-sharded transformer is used as it is.

    Golden property (tested for every split point k in 0..L): for the inputs ``generator.velocity`` accepts,
    ``finalize(run_blocks(run_blocks(embed(x, sigma, cond), 0, k), k, L)) == generator.velocity(x, sigma, cond)``,
    and ``time_cond(state, sigma)`` at the state's own sigma without ``delta`` leaves the result unchanged.

    Args:
        generator: the family's generator (see the subclasses).
    """

    def __init__(self, generator: nn.Module) -> None:
        self.generator = generator

    @property
    def transformer(self) -> nn.Module:
        """The generator's transformer (looked up at each call)."""
        return self.generator.transformer

    # ------------------------------------------------------------------ sizes
    @property
    @abc.abstractmethod
    def num_layers(self) -> int:
        """L, the number of transformer blocks."""

    @property
    @abc.abstractmethod
    def hidden_size(self) -> int:
        """D, the width of the token stream ``state.h``."""

    @property
    @abc.abstractmethod
    def time_dim(self) -> int:
        """Width of the vector ``delta`` that :meth:`time_cond` adds to the time embedding."""

    # ------------------------------------------------------------------ stages
    def embed(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> TrunkState:
        """Patch, time and text embeddings of ``x`` at ``sigma`` (the state before block 0).

        Args:
            x: latents in the generator's native layout, as ``generator.velocity`` takes them.
            sigma: noise level in [0, 1], [B] (per-frame shapes where the family supports them).
            cond: the generator's :class:`~genrl.models.text_encoder.Conditioning` for the batch.
        Raises:
            ValueError: the same input checks as ``generator.velocity`` (shapes, batch sizes, missing pooled text).
        """
        return self._in_root(self._embed, x, sigma, cond)

    @abc.abstractmethod
    def _embed(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> TrunkState: ...

    def run_blocks(self, state: TrunkState, i: int, j: int) -> TrunkState:
        """Blocks ``i .. j-1`` (``blocks[i:j]``) applied to ``state`` (gradient-checkpointed when the transformer's
        ``gradient_checkpointing`` flag is on and gradients are enabled, as its own forward does). ``i == j`` returns
        the state unchanged.

        Raises:
            ValueError: not ``0 <= i <= j <= L``.
        """
        if not 0 <= i <= j <= self.num_layers:
            raise ValueError(f"run_blocks({i}, {j}): need 0 <= i <= j <= L = {self.num_layers}")
        if i == j:
            return state
        return self._run_blocks(state, i, j)

    @abc.abstractmethod
    def _run_blocks(self, state: TrunkState, i: int, j: int) -> TrunkState: ...

    def finalize(self, state: TrunkState) -> torch.Tensor:
        """Output layers of the state after block L-1: the velocity in the native layout and dtype that
        ``generator.velocity`` returns."""
        return self._in_root(self._finalize, state)

    @abc.abstractmethod
    def _finalize(self, state: TrunkState) -> torch.Tensor: ...

    def time_cond(self, state: TrunkState, sigma: torch.Tensor, delta: torch.Tensor | None = None) -> TrunkState:
        """A new state with only the time branch recomputed at ``sigma`` (token stream and text untouched).

        Args:
            state: any state of this adapter.
            sigma: noise level in [0, 1], [B] (float; per-frame shapes where the family supports them).
            delta: optional [B, time_dim] added to the time embedding *before* the per-block modulation projections
                (so every block's modulation and the output layer's see it); None adds nothing (not even a zero).
        Raises:
            ValueError: sigma or delta of the wrong shape.
        """
        return self._in_root(self._time_cond, state, sigma, delta)

    @abc.abstractmethod
    def _time_cond(self, state: TrunkState, sigma: torch.Tensor, delta: torch.Tensor | None = None) -> TrunkState: ...

    def patch_embed(self, y: torch.Tensor) -> torch.Tensor:
        """The model's own patch embedding of a latent-shaped tensor ``y`` (native layout, the shape of the ``x``
        given to :meth:`embed`): tokens with the shape of ``state.h`` in the model's compute dtype. Whether
        positional terms are included is family-specific (see the subclass)."""
        return self._in_root(self._patch_embed, y)

    @abc.abstractmethod
    def _patch_embed(self, y: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def feature_grid(self, state: TrunkState) -> torch.Tensor:
        """The token stream ``state.h`` unpatchified to a 3-D grid ``[B, D, F, h, w]`` (F latent-frame patches, h x w
        spatial patches; F = 1 for an image family), the layout DMD2-style GAN heads convolve over."""

    def features_at(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, layers: list[int]
                    ) -> list[torch.Tensor]:
        """Intermediate features of the transformer at ``x``, ``sigma``: for each k in ``layers`` the
        :meth:`feature_grid` of the state after blocks ``0 .. k-1`` (k blocks run), embedding once and running each
        block once (up to ``max(layers)``). Differentiable w.r.t. ``x`` when gradients are enabled.

        Raises:
            ValueError: ``layers`` empty, or an entry outside ``1 .. L``.
        """
        if not layers or any(not 1 <= k <= self.num_layers for k in layers):
            raise ValueError(f"feature layers must be block counts in 1 .. L = {self.num_layers}, got {layers}")
        state, done, out = self.embed(x, sigma, cond), 0, {}
        for k in sorted(set(layers)):
            state, done = self.run_blocks(state, done, k), k
            out[k] = self.feature_grid(state)
        return [out[k] for k in layers]

    # ------------------------------------------------------------------ shared helpers
    def _in_root(self, fn, *args):
        """``fn(*args)`` run as the transformer's forward when the transformer is an FSDP2 unit: the stages outside
        the blocks use the root unit's parameters (embeddings, output layers), which FSDP2 gathers only in the hooks
        around the root's own call (and reduce-scatters their gradients from there). Calling the module with its
        forward temporarily replaced runs those hooks around ``fn``; a plain module just calls ``fn``."""
        from torch.distributed.fsdp import FSDPModule

        tr = self.transformer
        if not isinstance(tr, FSDPModule) or "forward" in vars(tr):  # plain, or already inside the root's call
            return fn(*args)
        tr.forward = fn  # an instance attribute shadows the class's forward for this one call
        try:
            return tr(*args)
        finally:
            del tr.forward

    def _checkpointed(self, block: nn.Module, *args):
        tr = self.transformer
        if torch.is_grad_enabled() and getattr(tr, "gradient_checkpointing", False):
            return tr._gradient_checkpointing_func(block, *args)
        return block(*args)

    @staticmethod
    def _delta(delta: torch.Tensor | None, batch: int, width: int) -> torch.Tensor | None:
        if delta is None:
            return None
        if delta.shape != (batch, width):
            raise ValueError(f"delta has shape {tuple(delta.shape)}, expected [B, time_dim] = [{batch}, {width}]")
        return delta


# ---------------------------------------------------------------------------------------------- genrl's DiT
class DiTTrunk(TrunkAdapter):
    """The split of genrl's :class:`~genrl.models.dit.VideoDiT` inside a :class:`~genrl.models.generator.DiTGenerator`.

    Bidirectional attention only (the generator's default mode when ``generator.causal`` is None). Sigma may be
    per sample [B] or per frame [B, T] (equal within a temporal patch), as in ``VideoDiT.forward``: the time
    embedding is per frame group, ``temb = c_emb`` [B, F, 1, D] (time embedding + pooled-text projection).

    ``extra`` keys: ``text`` [B, L, D] projected text, ``text_mask`` [B, 1, 1, L] bool, ``ctx`` the model's
    self-attention context (rotary tables), ``pooled`` [B, D] the pooled-text projection (re-added by
    :meth:`time_cond`), ``grid`` (T, F, gh, gw), ``out_dtype`` the dtype of ``x``.

    ``patch_embed(y)`` includes the additive 3-D sin-cos position table that :meth:`embed` adds, so the head's
    tokens carry the same positions as the backbone's (a temporal rotary embedding, when the model has one, is in
    ``ctx`` and applied inside attention).

    Raises:
        ValueError: the generator has a causal layout (``generator.causal`` set), or its transformer is not a VideoDiT.
    """

    def __init__(self, generator: DiTGenerator) -> None:
        if getattr(generator, "causal", None) is not None:
            raise ValueError("the TMD backbone / head split supports bidirectional attention only; this DiT generator "
                             "has a causal layout (generator.causal is set): set generator.causal = None or use a "
                             "bidirectional generator")
        if not isinstance(generator.transformer, VideoDiT):
            raise ValueError(f"DiTTrunk needs a VideoDiT transformer, got {type(generator.transformer).__name__}")
        super().__init__(generator)

    @property
    def num_layers(self) -> int:
        return len(self.transformer.blocks)

    @property
    def hidden_size(self) -> int:
        return int(self.transformer.config.hidden_size)

    @property
    def time_dim(self) -> int:
        return int(self.transformer.config.hidden_size)

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
        """Patchified + embedded tokens [B, F, S, D] with the position table, and the grid (T, F, gh, gw)."""
        tr = self.transformer
        if x.ndim != 5:
            raise ValueError(f"VideoDiT expects latents [B, T, C, H, W], got shape {tuple(x.shape)}")
        _, t, c, h, w = x.shape
        if c != tr.config.in_channels:
            raise ValueError(f"latents have {c} channels, the model was built for {tr.config.in_channels}")
        f, gh, gw = tr._grid(t, h, w)
        pt, ph, pw = tr.config.patch_size
        dtype = tr.patch_embed.weight.dtype
        tokens = rearrange(x.to(dtype), "b (f pt) c (gh ph) (gw pw) -> b f (gh gw) (c pt ph pw)", pt=pt, ph=ph, pw=pw)
        # bidirectional at start_frame 0: group positions 0..F-1 (zero when time enters through a rotary embedding)
        q_pos = torch.arange(f)
        frame_pos = torch.zeros_like(q_pos) if tr.config.rope_temporal_dim else q_pos
        pos = sincos_position_embedding_3d(f, gh, gw, tr.config.hidden_size, frame_positions=frame_pos)
        tokens = tr.patch_embed(tokens) + pos.to(dtype=dtype, device=tokens.device).reshape(f, gh * gw, -1)
        return tokens, (t, f, gh, gw)

    def _c_emb(self, sigma, b: int, t: int, f: int, pooled: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        tr = self.transformer
        dtype = tr.patch_embed.weight.dtype
        sigma_f = tr._frame_sigma(torch.as_tensor(sigma, device=pooled.device), b, t, f)
        temb = timestep_embedding(1000.0 * sigma_f.float(), tr.config.timestep_embed_dim).to(dtype)
        c_emb = tr.time_embed(temb) + pooled[:, None]  # [B, F, D]
        if delta is not None:
            c_emb = c_emb + delta.to(c_emb.dtype)[:, None]
        return c_emb[:, :, None]  # [B, F, 1, D]

    def _embed(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> TrunkState:
        if len(cond) != x.shape[0]:
            raise ValueError(f"conditioning holds {len(cond)} prompts for a batch of {x.shape[0]} latents")
        tr = self.transformer
        tokens, (t, f, gh, gw) = self._tokens(x)
        dtype = tokens.dtype
        b = x.shape[0]
        ctx, _ = tr._attention_context("bidirectional", None, 0, None, False, f, gh * gw, x.device, None)
        text_states = cond.hidden_states.to(dtype)
        mask = cond.attention_mask
        if mask is None:
            mask = torch.ones(text_states.shape[:2], dtype=torch.bool, device=x.device)
        mask = mask.to(device=x.device, dtype=torch.bool)
        denom = mask.sum(1, keepdim=True).clamp_min(1).to(dtype)
        pooled = tr.pooled_proj((text_states * mask[..., None].to(dtype)).sum(1) / denom)  # [B, D]
        c_emb = self._c_emb(sigma, b, t, f, pooled, None)
        extra = {"text": tr.text_proj(text_states), "text_mask": mask[:, None, None, :], "ctx": ctx,
                 "pooled": pooled, "grid": (t, f, gh, gw), "out_dtype": x.dtype}
        return TrunkState(tokens, c_emb, extra)

    def _run_blocks(self, state: TrunkState, i: int, j: int) -> TrunkState:
        blocks = self.transformer.blocks
        e = state.extra
        h = state.h
        for layer in range(i, j):
            h = self._checkpointed(blocks[layer], h, state.temb, e["text"], e["text_mask"], e["ctx"], layer)
        return state.replace(h=h)

    def _finalize(self, state: TrunkState) -> torch.Tensor:
        tr = self.transformer
        _, _, gh, gw = state.extra["grid"]
        pt, ph, pw = tr.config.patch_size
        shift, scale = tr.ada_ln_out(state.temb).chunk(2, dim=-1)
        x = tr.proj_out(tr.norm_out(state.h) * (1 + scale) + shift)
        out = rearrange(x, "b f (gh gw) (c pt ph pw) -> b (f pt) c (gh ph) (gw pw)", gh=gh, gw=gw, pt=pt, ph=ph, pw=pw)
        return out.to(state.extra["out_dtype"])

    def _time_cond(self, state: TrunkState, sigma: torch.Tensor, delta: torch.Tensor | None = None) -> TrunkState:
        """Recompute ``c_emb`` at ``sigma`` ([B] or per frame [B, T]): time embedding + pooled text (+ ``delta``
        [B, D], broadcast over frame groups), before every block's ``ada_ln`` and the output ``ada_ln_out``."""
        t, f, _, _ = state.extra["grid"]
        pooled = state.extra["pooled"]
        delta = self._delta(delta, pooled.shape[0], self.time_dim)
        return state.replace(temb=self._c_emb(sigma, pooled.shape[0], t, f, pooled, delta))

    def _patch_embed(self, y: torch.Tensor) -> torch.Tensor:
        """``patch_embed`` of ``y`` [B, T, C, H, W] plus the additive 3-D position table: [B, F, S, D]."""
        return self._tokens(y)[0]

    def feature_grid(self, state: TrunkState) -> torch.Tensor:
        _, _, gh, gw = state.extra["grid"]
        return rearrange(state.h, "b f (gh gw) d -> b d f gh gw", gh=gh, gw=gw)


# ---------------------------------------------------------------------------------------------- Wan2.1
class WanTrunk(TrunkAdapter):
    """The split of diffusers' ``WanTransformer3DModel`` inside a :class:`~genrl.models.families.wan.WanGenerator`.

    Follows ``WanTransformer3DModel.forward`` (diffusers 0.42): rotary tables from ``rope``, ``patch_embedding``,
    the condition embedder's parts (``timesteps_proj`` -> ``time_embedder`` -> ``temb``; ``time_proj(act_fn(temb))``
    -> the blocks' ``timestep_proj`` [B, 6, D]; ``text_embedder``), the blocks, then ``norm_out`` modulated by
    ``scale_shift_table + temb`` and ``proj_out``. ``state.temb`` is ``temb`` before ``time_proj``; :meth:`time_cond`
    adds ``delta`` there and re-derives ``timestep_proj``, so both the blocks and ``norm_out`` see it.

    Sigma is [B] or per latent frame [B, F] (the transformer's per-token timestep path), as in
    ``WanGenerator.velocity``. Image conditioning (I2V's ``encoder_hidden_states_image``) is not used by the
    generator and not supported.

    ``extra`` keys: ``text`` [B, L, D] embedded text, ``rotary`` (cos, sin) tables of the token grid,
    ``timestep_proj`` [B, 6, D] (or [B, N, 6, D]), ``grid`` (F', h', w') after patching, ``text_dtype``.

    ``patch_embed(y)`` is ``patch_embedding`` alone: Wan has no additive positions; positions enter through the
    rotary tables in ``extra["rotary"]``, which the head's blocks reuse (same token grid as the backbone's x).

    Raises:
        ValueError: the generator has a causal layout (``generator.causal`` set, a ``wan_causal`` student).
    """

    def __init__(self, generator: WanGenerator) -> None:
        if getattr(generator, "causal", None) is not None:
            raise ValueError("the TMD backbone / head split supports bidirectional attention only; this Wan generator "
                             "has a causal layout (generator.causal is set): use family 'wan'")
        super().__init__(generator)

    @property
    def num_layers(self) -> int:
        return len(self.transformer.blocks)

    @property
    def hidden_size(self) -> int:
        cfg = self.transformer.config
        return int(cfg.num_attention_heads * cfg.attention_head_dim)

    @property
    def time_dim(self) -> int:
        return self.hidden_size

    def _timestep(self, sigma: torch.Tensor, device) -> torch.Tensor:
        """1000 sigma exactly as WanGenerator.velocity builds it: [B] or, for sigma [B, F], per token [B, N]."""
        return self.generator.timesteps(sigma, device)

    def _time(self, timestep: torch.Tensor, text_dtype: torch.dtype, delta: torch.Tensor | None):
        """(temb, timestep_proj) from the condition embedder's own parts, ``delta`` added to temb before time_proj."""
        ce = self.transformer.condition_embedder
        ts_seq_len = None
        if timestep.ndim == 2:
            ts_seq_len = timestep.shape[1]
            timestep = timestep.flatten()
        ts = ce.timesteps_proj(timestep)
        if ts_seq_len is not None:
            ts = ts.unflatten(0, (-1, ts_seq_len))
        emb_dtype = next(iter(ce.time_embedder.parameters())).dtype
        if ts.dtype != emb_dtype and emb_dtype != torch.int8:
            ts = ts.to(emb_dtype)
        temb = ce.time_embedder(ts).to(text_dtype)
        if delta is not None:
            d = delta.to(temb.dtype)
            temb = temb + (d[:, None] if temb.ndim == 3 else d)
        proj = ce.time_proj(ce.act_fn(temb))
        proj = proj.unflatten(2, (6, -1)) if ts_seq_len is not None else proj.unflatten(1, (6, -1))
        return temb, proj

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()

    def _embed(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> TrunkState:
        gen, tr = self.generator, self.transformer
        gen._check_x(x, sigma, cond)
        timestep = self._timestep(sigma, x.device)
        hidden = x.to(gen.dtype)
        text_in = cond.hidden_states.to(gen.dtype)
        p_t, p_h, p_w = tr.config.patch_size
        grid = (hidden.shape[2] // p_t, hidden.shape[3] // p_h, hidden.shape[4] // p_w)
        rotary = tr.rope(hidden)
        tokens = self._tokens(hidden)
        temb, proj = self._time(timestep, text_in.dtype, None)
        text = tr.condition_embedder.text_embedder(text_in)
        extra = {"text": text, "rotary": rotary, "timestep_proj": proj, "grid": grid, "text_dtype": text_in.dtype}
        return TrunkState(tokens, temb, extra)

    def _run_blocks(self, state: TrunkState, i: int, j: int) -> TrunkState:
        blocks = self.transformer.blocks
        e = state.extra
        h = state.h
        for layer in range(i, j):
            h = self._checkpointed(blocks[layer], h, e["text"], e["timestep_proj"], e["rotary"])
        return state.replace(h=h)

    def _finalize(self, state: TrunkState) -> torch.Tensor:
        tr = self.transformer
        temb, h = state.temb, state.h
        if temb.ndim == 3:
            shift, scale = (tr.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (tr.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        shift, scale = shift.to(h.device), scale.to(h.device)
        h = (tr.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
        h = tr.proj_out(h)
        f, gh, gw = state.extra["grid"]
        p_t, p_h, p_w = tr.config.patch_size
        h = h.reshape(h.shape[0], f, gh, gw, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return h.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def _time_cond(self, state: TrunkState, sigma: torch.Tensor, delta: torch.Tensor | None = None) -> TrunkState:
        """Recompute ``temb`` and ``timestep_proj`` at ``sigma`` ([B] or [B, F]); ``delta`` [B, D] is added to
        ``temb`` before ``time_proj`` (seen by every block's modulation and by ``norm_out``)."""
        b = state.h.shape[0]
        delta = self._delta(delta, b, self.time_dim)
        sigma = torch.as_tensor(sigma, device=state.h.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(b)
        if sigma.shape[0] != b:
            raise ValueError(f"sigma of shape {tuple(sigma.shape)} for a batch of {b}")
        temb, proj = self._time(self._timestep(sigma, state.h.device), state.extra["text_dtype"], delta)
        return state.replace(temb=temb, extra={"timestep_proj": proj})

    def _patch_embed(self, y: torch.Tensor) -> torch.Tensor:
        """``patch_embedding`` of ``y`` [B, C, F, h, w] flattened to tokens [B, N, D] (no positional term: Wan's
        positions are rotary, in ``extra["rotary"]``)."""
        return self._tokens(y.to(self.generator.dtype))

    def feature_grid(self, state: TrunkState) -> torch.Tensor:
        f, gh, gw = state.extra["grid"]
        return state.h.transpose(1, 2).reshape(state.h.shape[0], -1, f, gh, gw)


# ---------------------------------------------------------------------------------------------- SD3 / SD3.5
class SD3Trunk(TrunkAdapter):
    """The split of diffusers' ``SD3Transformer2DModel`` (MMDiT) inside an
    :class:`~genrl.models.families.sd3.SD3Generator`.

    Follows ``SD3Transformer2DModel.forward`` (diffusers 0.42) without ControlNet residuals, skipped layers or
    IP-adapter (the generator uses none): ``pos_embed`` (patch embedding + cropped sin-cos positions),
    ``time_text_embed(1000 sigma, pooled)`` -> ``temb``, ``context_embedder`` -> the text stream, the joint blocks,
    then ``norm_out(h, temb)`` and ``proj_out``.

    The text stream is a second residual stream that every joint block updates, so it travels in the state:
    ``extra["text"]`` [B, L, D] is the text stream *entering* the next block. The last block is ``context_pre_only``
    (it reads the text but returns none): after it ``extra["text"]`` is None. A flow head that re-runs blocks
    ``L-H .. L-1`` starts each pass from the backbone's text stream at L-H (which depends on x_t and the outer
    time, never on the inner variable) and evolves its own copy.

    ``temb`` [B, D] is the output of ``time_text_embed`` (timestep embedding + pooled-text projection);
    :meth:`time_cond` recomputes it at a new sigma (from ``extra["pooled"]``, the pooled vector in the model dtype)
    and adds ``delta`` to it, before every block's ``norm1`` / ``norm1_context`` modulation and ``norm_out``.

    ``patch_embed(y)`` is ``pos_embed(y)``, which includes SD3's additive position table (the module always adds it).
    """

    @property
    def num_layers(self) -> int:
        return len(self.transformer.transformer_blocks)

    @property
    def hidden_size(self) -> int:
        return int(self.transformer.inner_dim)

    @property
    def time_dim(self) -> int:
        return int(self.transformer.inner_dim)

    @staticmethod
    def _sigma(sigma, b: int) -> torch.Tensor:
        sigma = torch.as_tensor(sigma)
        if sigma.ndim == 0:
            sigma = sigma.expand(b)
        if sigma.ndim == 2 and sigma.shape[1] == 1:
            sigma = sigma[:, 0]
        if sigma.shape != (b,):
            raise ValueError(f"sd3: sigma of shape {tuple(sigma.shape)}; expected [B] = [{b}] or [B, 1]")
        return sigma

    def _embed(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> TrunkState:
        gen, tr = self.generator, self.transformer
        sigma = gen._image_inputs(x, sigma, cond, pooled=True)
        timestep = sigma.to(x.device, torch.float32) * 1000.0
        hidden = x.to(gen.dtype)
        pooled = cond.pooled.to(gen.dtype)
        tokens = tr.pos_embed(hidden).contiguous()
        temb = tr.time_text_embed(timestep, pooled)
        text = tr.context_embedder(cond.hidden_states.to(gen.dtype))
        extra = {"text": text, "pooled": pooled, "size": tuple(hidden.shape[-2:])}
        return TrunkState(tokens, temb, extra)

    def _run_blocks(self, state: TrunkState, i: int, j: int) -> TrunkState:
        blocks = self.transformer.transformer_blocks
        h, text = state.h, state.extra["text"]
        for layer in range(i, j):
            text, h = self._checkpointed(blocks[layer], h, text, state.temb, None)
        return state.replace(h=h, extra={"text": text})

    def _finalize(self, state: TrunkState) -> torch.Tensor:
        tr = self.transformer
        h = tr.proj_out(tr.norm_out(state.h, state.temb))
        p = tr.config.patch_size
        height, width = state.extra["size"][0] // p, state.extra["size"][1] // p
        h = h.reshape(h.shape[0], height, width, p, p, tr.out_channels)
        h = torch.einsum("nhwpqc->nchpwq", h)
        return h.reshape(h.shape[0], tr.out_channels, height * p, width * p)

    def _time_cond(self, state: TrunkState, sigma: torch.Tensor, delta: torch.Tensor | None = None) -> TrunkState:
        """Recompute ``temb = time_text_embed(1000 sigma, pooled)`` at ``sigma`` [B] (or [B, 1]), plus ``delta``
        [B, D]."""
        pooled = state.extra["pooled"]
        b = pooled.shape[0]
        delta = self._delta(delta, b, self.time_dim)
        timestep = self._sigma(sigma, b).to(pooled.device, torch.float32) * 1000.0
        temb = self.transformer.time_text_embed(timestep, pooled)
        if delta is not None:
            temb = temb + delta.to(temb.dtype)
        return state.replace(temb=temb)

    def _patch_embed(self, y: torch.Tensor) -> torch.Tensor:
        """``pos_embed(y)`` of ``y`` [B, C, h, w]: tokens [B, N, D] *with* SD3's additive position table."""
        return self.transformer.pos_embed(y.to(self.generator.dtype)).contiguous()

    def feature_grid(self, state: TrunkState) -> torch.Tensor:
        p = self.transformer.config.patch_size
        gh, gw = state.extra["size"][0] // p, state.extra["size"][1] // p
        return state.h.transpose(1, 2).reshape(state.h.shape[0], -1, 1, gh, gw)


def trunk_adapter(generator: nn.Module) -> TrunkAdapter:
    """The :class:`TrunkAdapter` of ``generator``'s family.

    Args:
        generator: a :class:`~genrl.models.generator.DiTGenerator` (bidirectional), a
            :class:`~genrl.models.families.wan.WanGenerator` or a :class:`~genrl.models.families.sd3.SD3Generator`.
    Raises:
        ValueError: another generator class (the message names the supported families), or a causal layout.
    """
    if isinstance(generator, DiTGenerator):
        return DiTTrunk(generator)
    if isinstance(generator, WanGenerator):
        return WanTrunk(generator)
    if isinstance(generator, SD3Generator):
        return SD3Trunk(generator)
    raise ValueError(f"no backbone / head split for {type(generator).__name__}; supported families: "
                     f"{', '.join(SUPPORTED_FAMILIES)}")


# ---------------------------------------------------------------------------------------------- the flow head
def _per_sample(v, b: int, device, name: str) -> torch.Tensor:
    """A time given as a float, a 0-d or a [B] tensor -> float32 [B] on ``device``."""
    v = torch.as_tensor(v, device=device)
    if v.ndim == 0:
        v = v.expand(b)
    if v.shape != (b,):
        raise ValueError(f"{name} has shape {tuple(v.shape)}, expected [B] = [{b}] (one inner time per sample)")
    return v.float()


class FlowHead(nn.Module):
    """The new parameters of TMD's flow head (Nie et al. 2026, Appendix A.1); the transformer blocks it re-runs are
    *not* its children: it reaches them through the adapter passed to :meth:`forward`, so LoRA on the transformer,
    its gradient checkpointing and its FSDP units apply to the head's passes unchanged, and ``parameters()`` holds
    only the parts below.

    Parts:

    - fusion block on the patch-embedded inner variable e = ``adapter.patch_embed(y_s)``: an adaLN-Zero residual MLP
      ``z = e + g * MLP(LN(e) (1 + scale) + shift)``, with (shift, scale, g) a zero-initialised linear map of the
      head's own time embedding of (s, s - r) (sinusoidal features of 1000 s and 1000 (s - r) -> Linear -> SiLU ->
      Linear); at initialisation z = e;
    - one learnable gate logit ``alpha`` (shape [1], init ``gate_init``): fused tokens
      ``h = m + sigmoid(alpha) (z - m)`` with m the backbone's token stream; sigmoid(-inf) = 0 gives exactly m;
    - a delta-time embedder of s - r (sinusoidal features of 1000 (s - r) -> Linear -> SiLU -> Linear, the last layer
      zero-initialised) whose output [B, time_dim] is added to the transformer's time embedding
      (``adapter.time_cond(..., delta=...)``);
    - ``head_time``: the head's blocks are conditioned on the inner time s (``"inner"``, the paper) or on the outer
      time t (``"outer"``: with the gate closed and the delta embedder at zero, the head then reproduces the
      teacher's velocity at t exactly, whatever y).

    The head computes in its own parameters' dtype (float32 by default) and casts the fused tokens back to the
    transformer's dtype.

    Args:
        adapter: the :class:`TrunkAdapter` of the generator the head will run with (only its sizes are read; it is
            not stored).
        num_layers: H, the number of the transformer's last blocks the head re-runs; 1 <= H < L.
        gate_init: initial gate logit (-4: sigmoid = 0.018, the student starts close to the teacher).
        head_time: ``"inner"`` or ``"outer"`` (see above).
        mlp_ratio: hidden width of the fusion MLP / D.
        freq_dim: number of sinusoidal features per time input (even).
    Raises:
        ValueError: H out of range, an unknown ``head_time``, an odd ``freq_dim``.
    """

    def __init__(self, adapter: TrunkAdapter, num_layers: int, *, gate_init: float = -4.0,
                 head_time: str = "inner", mlp_ratio: float = 4.0, freq_dim: int = 256) -> None:
        super().__init__()
        total = int(adapter.num_layers)
        num_layers = int(num_layers)
        if not 1 <= num_layers < total:
            raise ValueError(f"flow head num_layers H = {num_layers} (TMD's head_layers) is out of range for a "
                             f"transformer of L = {total} blocks: use 1 <= head_layers <= {total - 1} (the backbone "
                             f"keeps at least one block)")
        if head_time not in ("inner", "outer"):
            raise ValueError(f"head_time must be 'inner' or 'outer', got {head_time!r}")
        if freq_dim % 2:
            raise ValueError(f"freq_dim must be even, got {freq_dim}")
        d, td = int(adapter.hidden_size), int(adapter.time_dim)
        self.num_layers, self.total_layers, self.hidden_size, self.time_dim = num_layers, total, d, td
        self.head_time, self.freq_dim = head_time, int(freq_dim)
        hidden = int(d * mlp_ratio)
        # fusion block (adaLN-Zero residual MLP on the embedded inner variable)
        self.fusion_time = nn.Sequential(nn.Linear(2 * freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.fusion_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.fusion_mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d))
        self.fusion_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 3 * d))
        nn.init.zeros_(self.fusion_mod[1].weight)
        nn.init.zeros_(self.fusion_mod[1].bias)
        # global gate logit
        self.alpha = nn.Parameter(torch.full((1,), float(gate_init)))
        # embedding of the inner step length s - r, added to the transformer's time embedding
        self.delta_embed = nn.Sequential(nn.Linear(freq_dim, d), nn.SiLU(), nn.Linear(d, td))
        nn.init.zeros_(self.delta_embed[2].weight)
        nn.init.zeros_(self.delta_embed[2].bias)

    @property
    def gate(self) -> torch.Tensor:
        """sigmoid(alpha), shape [1], in [0, 1]."""
        return torch.sigmoid(self.alpha)

    def _features(self, v: torch.Tensor) -> torch.Tensor:
        return timestep_embedding(1000.0 * v, self.freq_dim).to(self.alpha.dtype)

    def delta(self, s: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The delta-time embedding of s - r: float [B, time_dim] (zero at initialisation). s, r: [B] in [0, 1]."""
        return self.delta_embed(self._features(s - r))

    def fuse(self, e: torch.Tensor, m: torch.Tensor, s: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """Fused tokens ``m + sigmoid(alpha) (z - m)`` with z the fusion block's output on ``e``.

        Args:
            e: patch-embedded inner variable, the shape of ``m`` ([B, ..., D], any token layout).
            m: the backbone's token stream (``TrunkState.h``).
            s, r: float [B] inner times.
        Returns:
            tokens of ``m``'s shape and dtype.
        """
        cond = self.fusion_time(torch.cat([self._features(s), self._features(s - r)], dim=-1))  # [B, D]
        shift, scale, g = self.fusion_mod(cond).view(cond.shape[0], *([1] * (e.ndim - 2)), -1).chunk(3, dim=-1)
        e = e.to(self.alpha.dtype)
        z = e + g * self.fusion_mlp(self.fusion_norm(e) * (1 + scale) + shift)
        m32 = m.to(torch.promote_types(m.dtype, torch.float32))
        fused = m32 + self.gate.to(m32.dtype) * (z.to(m32.dtype) - m32)
        return fused.to(m.dtype)

    def forward(self, adapter: TrunkAdapter, features: TrunkState, y: torch.Tensor, s, r,
                t: torch.Tensor | None = None) -> torch.Tensor:
        """One flow-head pass: the prediction y_hat of the inner target from the noisy inner variable y_s.

        Patch-embeds ``y``, fuses it with ``features.h`` through the gate, recomputes the time conditioning at s
        (``head_time="inner"``) or t (``"outer"``) plus the delta embedding of s - r, runs blocks ``L-H .. L-1`` and
        the output layers.

        Args:
            adapter: the generator's :class:`TrunkAdapter` (L and D must match the head's).
            features: the backbone's state after block L-H-1 (``TransitionModel.features``).
            y: the noisy inner variable y_s in the native latent layout (the shape of the backbone's x).
            s, r: inner times in [0, 1], float or [B] (r <= s expected, not enforced).
            t: the outer time the features were computed at ([B], or what the adapter's ``time_cond`` accepts);
                needed only with ``head_time="outer"``.
        Returns:
            y_hat in the native latent layout and the generator's output dtype (like a velocity).
        Raises:
            ValueError: adapter sizes differing from the head's, s / r not [B], ``t`` missing with ``"outer"``.
        """
        if adapter.num_layers != self.total_layers or adapter.hidden_size != self.hidden_size:
            raise ValueError(f"this flow head was built for L = {self.total_layers}, D = {self.hidden_size}; the "
                             f"adapter has L = {adapter.num_layers}, D = {adapter.hidden_size}")
        b = features.h.shape[0]
        s = _per_sample(s, b, features.h.device, "s")
        r = _per_sample(r, b, features.h.device, "r")
        if self.head_time == "outer":
            if t is None:
                raise ValueError("head_time='outer' needs the outer time t")
            tau = t
        else:
            tau = s
        h = self.fuse(adapter.patch_embed(y), features.h, s, r)
        state = adapter.time_cond(features.replace(h=h), tau, self.delta(s, r))
        state = adapter.run_blocks(state, self.total_layers - self.num_layers, self.total_layers)
        return adapter.finalize(state)


# ---------------------------------------------------------------------------------------------- the student
class TransitionModel(nn.Module):
    """The TMD student: a generator split into a backbone and a :class:`FlowHead` over its last H blocks.

    Only the head is a child module: the generator is held as a plain attribute (not registered), so
    ``parameters()`` / ``state_dict()`` hold the head's parameters only, never the generator's (a Lightning method
    registers the generator and the head as separate roles and steps both). Consequently ``.to()``, ``.train()`` and
    ``.eval()`` on this module move / switch the head only.

    Inner-flow convention (shared with the sampler, :mod:`genrl.rollout.transition`, and :mod:`genrl.flow.tmd`):

    - outer time t in [0, 1] (t = 1 noise), x_t = (1 - t) x0 + t x1; inner variable y = x1 - x0 (outer noise minus
      data: the outer velocity);
    - inner path y_s = (1 - s) y + s y1, y1 ~ N(0, I), s in [0, 1];
    - the head predicts y_hat(y_s, s, r; m_t) ~ y, and the inner flow map from s down to r is
      f(y_s, s, r) = y_s - (s - r) (y1 - y_hat)  (so u = y1 - y_hat is the average inner velocity over [r, s]);
    - an outer step with the final y: x <- x - (t_i - t_{i-1}) y.

    Args:
        generator: a generator :func:`trunk_adapter` supports.
        head: the :class:`FlowHead` (built for this generator's adapter), or an int H to build a default one.
    Raises:
        ValueError: an unsupported generator, or a head built for another L / D.
    """

    def __init__(self, generator: nn.Module, head: FlowHead | int) -> None:
        super().__init__()
        adapter = trunk_adapter(generator)
        object.__setattr__(self, "generator", generator)  # not a child: the method registers it as its own role
        self.adapter = adapter  # a plain object
        if isinstance(head, int):
            head = FlowHead(adapter, head)
        if head.total_layers != adapter.num_layers or head.hidden_size != adapter.hidden_size:
            raise ValueError(f"the flow head was built for L = {head.total_layers}, D = {head.hidden_size}; the "
                             f"generator has L = {adapter.num_layers}, D = {adapter.hidden_size}")
        self.flow_head = head

    @property
    def device(self) -> torch.device:
        """The generator's device (where the sampler draws noise; move the head there too)."""
        return self.generator.device

    @property
    def num_layers(self) -> int:
        """L, the transformer's block count."""
        return self.adapter.num_layers

    @property
    def head_layers(self) -> int:
        """H, the blocks the head re-runs."""
        return self.flow_head.num_layers

    def features(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> TrunkState:
        """The backbone: embeddings of ``x`` (native layout) at outer time ``t`` [B] and blocks ``0 .. L-H-1``.

        Returns:
            the :class:`TrunkState` after block L-H-1 (m_t in ``.h``).
        """
        return self.adapter.run_blocks(self.adapter.embed(x, t, cond), 0, self.num_layers - self.head_layers)

    def head(self, y: torch.Tensor, s, r, features: TrunkState, t: torch.Tensor | None = None) -> torch.Tensor:
        """One flow-head pass: y_hat from the noisy inner variable ``y`` (= y_s, native layout) at inner times
        ``s``, ``r`` ([B] or float) given the backbone's ``features`` at outer time ``t``; see
        :meth:`FlowHead.forward`."""
        return self.flow_head(self.adapter, features, y, s, r, t)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, **kwargs) -> torch.Tensor:
        """The full transformer's velocity (the generator's own ``velocity``): the teacher before any training."""
        return self.generator.velocity(x, t, cond, **kwargs)

    def forward(self, y: torch.Tensor, s, r, features: TrunkState, t: torch.Tensor | None = None) -> torch.Tensor:
        """Same as :meth:`head`."""
        return self.head(y, s, r, features, t)


#: files an export (and TMD's ``head_init``) holds for the flow head, beside the transformer's
HEAD_WEIGHTS_FILE = "flow_head.safetensors"
HEAD_CONFIG_FILE = "flow_head.json"

def save_head(head: torch.nn.Module | Mapping[str, torch.Tensor], dirpath: str | Path, config: dict) -> Path:
    """Save a flow head's weights (safetensors) and ``config`` (JSON) into ``dirpath``; returns the weights' path.
    ``head``: the module, or its full state dict (e.g. gathered from FSDP2 shards with
    :func:`genrl.models.sharding.full_state_dict`)."""
    from safetensors.torch import save_file

    folder = Path(dirpath)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / HEAD_WEIGHTS_FILE
    state = head.state_dict() if isinstance(head, torch.nn.Module) else head
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path))
    (folder / HEAD_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path


def load_head(head: torch.nn.Module, dirpath: str | Path) -> dict:
    """Load ``flow_head.safetensors`` from ``dirpath`` into ``head`` (strict); returns the folder's head config.

    Raises:
        FileNotFoundError: no flow head in the folder (names the stage-1 export it should come from).
    """
    from safetensors.torch import load_file

    folder = Path(dirpath)
    path = folder / HEAD_WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"head_init {str(folder)!r} holds no {HEAD_WEIGHTS_FILE}; point it at the export "
                                f"folder of a TMD stage-1 run (stage: meanflow), e.g. runs/tmd_shapes_meanflow/export")
    head.load_state_dict(load_file(str(path)))
    cfg = folder / HEAD_CONFIG_FILE
    return json.loads(cfg.read_text()) if cfg.is_file() else {}
