"""Causal Wan2.1: block-causal attention with a KV cache on diffusers' ``WanTransformer3DModel``.

The causal student of CausVid (Yin et al. 2025, sec. 3) and Self-Forcing (Huang et al. 2025, sec. 3) is the
Wan2.1 DiT with a different attention pattern: latent frames are grouped into chunks (3 latent frames for
Wan2.1-1.3B; optionally a different first chunk, e.g. [1, 3, 3, ...]); a token attends to every frame of its
own chunk and of earlier chunks, optionally only to a trailing local window plus the first ``sink_frames``
frames (LongLive, Yang et al. 2025). Generation runs chunk by chunk: each chunk is denoised while reading the
keys / values of the committed (clean) chunks from a KV cache, then one context pass commits its own keys /
values (docs/methods/distillation.md).

Nothing of the model is forked or re-implemented: the weights, the blocks and the forward are diffusers'.
The adapter swaps the attention *processors* (diffusers' processor interface) of every block:

- self-attention (``attn1``): :class:`CausalWanAttnProcessor` reads a per-forward :class:`_ForwardState`
  (mask, rotary tables, the cache prefix to read, whether to collect K/V for a commit). The state travels
  with the rotary tables the transformer passes to every block (a forward hook on ``transformer.rope``
  attaches it), so gradient-checkpoint recomputation in the backward pass replays the same state;
- cross-attention (``attn2``): the same class caches the text keys / values per layer under a conditioning
  key (only when gradients are disabled: with gradients the projections must see the text again);
- without a state (a plain transformer call, or ``attention="bidirectional"`` at frame 0) both fall back
  to diffusers' own ``WanAttnProcessor`` code path, bit for bit.

The state dict is exactly a ``WanTransformer3DModel``'s: real Wan2.1 checkpoints load unchanged (the student
starts from the bidirectional teacher's weights). Wan2.1's temporal patch is 1, so one frame group is one
latent frame; other temporal patches are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections

from genrl.models.causal import CausalConfig, KVCache, StaticKVCache, frame_visibility, make_kv_cache
from genrl.models.families.wan import WanGenerator

__all__ = ["CausalWanAttnProcessor", "CausalWanContext", "CausalWanGenerator", "install_causal_attention",
           "sdpa_backend", "wan_rope_tables", "WAN_ROPE_THETA"]

#: base of Wan2.1's rotary frequencies (``WanRotaryPosEmbed``'s theta; the model never changes it).
WAN_ROPE_THETA = 10000.0


# ---------------------------------------------------------------------------------------------- rotary tables
def _axis_table(dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin float64 ``[N, dim]`` of one rotary axis, each frequency repeated twice (interleaved pairs).

    Same arithmetic as diffusers' ``get_1d_rotary_pos_embed(..., use_real=True, repeat_interleave_real=True,
    freqs_dtype=float64)`` before its final cast, so casting to float32 reproduces Wan's own buffers bit for bit.
    """
    inv_freq = 1.0 / (WAN_ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(positions.to(torch.float64).cpu(), inv_freq)
    return angles.cos().repeat_interleave(2, dim=1), angles.sin().repeat_interleave(2, dim=1)


def wan_rope_tables(rope, frame_positions: torch.Tensor, height: int, width: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan2.1's 3-D rotary tables for frame groups at arbitrary temporal positions (RoFormer, Su et al. 2021).

    Wan splits a head of ``D`` channels into a temporal part (``rope.t_dim``) and two spatial parts
    (``rope.h_dim``, ``rope.w_dim``). The spatial parts are those of ``WanRotaryPosEmbed`` (rows 0..height-1 /
    0..width-1); the temporal part uses ``frame_positions`` instead of 0..F-1, which is how a chunk later in the
    video (absolute positions) or a cache-relative position is encoded. Positions beyond ``rope.max_seq_len`` are
    computed with the same formula (the module's buffers stop there). For positions 0..F-1 and float32 the
    result equals ``rope(hidden_states)`` exactly.

    Args:
        rope: the transformer's ``WanRotaryPosEmbed`` (``transformer.rope``): gives the axis split.
        frame_positions: int or float ``[N_groups]`` temporal position of each frame group, in token order.
        height, width: post-patch grid (tokens per frame = height * width).
        dtype: table dtype: float32 as Wan's own buffers, float64 for float64 reference computations.
        device: where the tables go (the per-axis parts are built on the CPU, the expansion on ``device``).
    Returns:
        (cos, sin), each ``[1, N_groups * height * width, 1, D]`` in frame-major token order (Wan's layout).
    """
    n = int(frame_positions.numel())
    parts = [_axis_table(rope.t_dim, frame_positions.reshape(-1)),
             _axis_table(rope.h_dim, torch.arange(height)),
             _axis_table(rope.w_dim, torch.arange(width))]
    out = []
    for i in range(2):  # cos, sin
        f, h, w = (p[i].to(device=device, dtype=dtype) for p in parts)
        grid = torch.cat([f.view(n, 1, 1, -1).expand(n, height, width, -1),
                          h.view(1, height, 1, -1).expand(n, height, width, -1),
                          w.view(1, 1, width, -1).expand(n, height, width, -1)], dim=-1)
        out.append(grid.reshape(1, n * height * width, 1, -1))
    return out[0], out[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2i, 2i+1) of ``x`` [B, N, heads, D] by the angles of ``cos`` / ``sin``
    [1, N, 1, D] (Wan's interleaved convention); the products run in the promoted dtype, the result is cast
    back to ``x.dtype`` (as diffusers' ``WanAttnProcessor`` does)."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------- per-forward state
@dataclass
class _ForwardState:
    """What every attention layer of one causal forward needs.

    Attributes:
        q_rope, k_rope: rotary (cos, sin) of the input's queries ``[1, Nq, 1, D]`` and of all keys read
            (visible cached groups, then the input) ``[1, Nk, 1, D]``.
        mask: bool ``[1, 1, Nq, Nk]`` (True = may attend), None when every query sees every key.
        keys, values: the cache's per-layer key / value lists at the time of the forward (None: no prefix). The
            lists, not the cache, are held: a later commit replaces the cache's lists (tensors are never written
            in place), so a gradient-checkpoint replay after that commit still reads what the forward read.
        rows: int64 token rows of the cached groups read (None: all).
        collect: store each layer's un-roped keys / values in ``produced`` (a commit).
        cross, cross_key: the cache's cross-attention dict and the conditioning key (None: no text cache).
        key_buffer, value_buffer: a :class:`~genrl.models.causal.StaticKVCache`'s stacked buffers
            ``[layers, B, heads, N, D]``, read whole (None: the per-layer ``keys`` / ``values`` lists). Each
            processor selects its layer with its ``layer_index`` tensor, so no per-layer Python value is read
            inside the blocks and ``torch.compile`` traces one graph for all of them.
        stage: with ``key_buffer`` and ``collect``: stacked ``(keys, values)`` ``[layers, B, heads, Nq, D]`` the
            processors write the input's un-roped keys / values into (instead of ``produced``).
    """

    q_rope: tuple[torch.Tensor, torch.Tensor]
    k_rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None = None
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    rows: torch.Tensor | None = None
    collect: bool = False
    produced: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cross: dict | None = None
    cross_key: Any = None
    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None
    stage: tuple[torch.Tensor, torch.Tensor] | None = None


class CausalWanContext:
    """Shared by the processors (and the rope hook) of one transformer; ``current`` is the state of the forward
    in progress (None outside a causal forward). A deep copy of the transformer gets its own context."""

    def __init__(self) -> None:
        self.current: _ForwardState | None = None


class _CausalRotary(tuple):
    """The transformer's ``(cos, sin)`` rotary tables plus the forward's state (``.state``): blocks hand this
    object to their self-attention unchanged, also when gradient checkpointing replays a block."""

    state: _ForwardState


class _RopeHook:
    """Forward hook on ``transformer.rope``: attaches the context's current state to the rotary tables."""

    def __init__(self, context: CausalWanContext) -> None:
        self.context = context

    def __call__(self, module, args, output):
        state = self.context.current
        if state is None:
            return None  # keep the module's output
        out = _CausalRotary(output)
        out.state = state
        return out


# ---------------------------------------------------------------------------------------------- the processor
class CausalWanAttnProcessor(WanAttnProcessor):
    """Wan attention processor with block-causal self-attention, a KV cache and a text K/V cache.

    One instance per attention layer; all instances of a transformer share one :class:`CausalWanContext`.
    Without a causal state it *is* ``WanAttnProcessor`` (the parent's ``__call__`` runs), so outputs are
    bit-identical to the stock model; ``set_attention_backend`` keeps working (the backend applies whenever no
    mask is needed; masked calls use PyTorch SDPA).

    Self-attention with a state (tensors ``[B, N, heads, D]``): q, k, v projections, ``norm_q`` / ``norm_k``;
    the un-roped k (after the norm) and v are kept for a commit; the visible cached keys / values are prepended;
    the 3-D rotary embedding is applied to the queries and to all keys at the state's positions; SDPA with the
    frame-visibility mask (none when everything is visible).

    Args:
        context: the transformer's shared context.
        layer: block index (which cache layer to read / write).
        cross: True for a block's cross-attention ``attn2``.
    """

    def __init__(self, context: CausalWanContext, layer: int, cross: bool = False) -> None:
        super().__init__()
        self.context, self.layer, self.cross = context, int(layer), bool(cross)
        #: int64 ``[1]`` = ``[layer]``, on the model's device: how a static-cache forward picks this layer's buffer
        #: (a tensor, not a Python int, so compiled blocks share one graph).
        self.layer_index = torch.tensor([self.layer])

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if self.cross:
            state = self.context.current
            if (state is None or state.cross is None or state.cross_key is None or torch.is_grad_enabled()
                    or attn.add_k_proj is not None or attention_mask is not None):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
            return self._cross_cached(attn, hidden_states, encoder_hidden_states, state)
        state = getattr(rotary_emb, "state", None)
        if state is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        return self._self_causal(attn, hidden_states, state)

    def _self_causal(self, attn, hidden_states: torch.Tensor, state: _ForwardState) -> torch.Tensor:
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if state.collect and state.stage is not None:  # static cache: stacked staging buffers, layer by tensor
            state.stage[0].index_copy_(0, self.layer_index, key.detach().transpose(1, 2)[None].to(state.stage[0].dtype))
            state.stage[1].index_copy_(0, self.layer_index,
                                       value.detach().transpose(1, 2)[None].to(state.stage[1].dtype))
        elif state.collect:  # the cache layout is [B, heads, N, D], keys before the rotary embedding
            state.produced[self.layer] = (key.detach().transpose(1, 2), value.detach().transpose(1, 2))
        if state.key_buffer is not None:  # static cache: the whole buffer (the mask hides empty / invisible slots)
            k_c = state.key_buffer.index_select(0, self.layer_index)[0]
            v_c = state.value_buffer.index_select(0, self.layer_index)[0]
            key = torch.cat([k_c.transpose(1, 2).to(key.dtype), key], dim=1)
            value = torch.cat([v_c.transpose(1, 2).to(value.dtype), value], dim=1)
        elif state.keys is not None:
            k_c, v_c = state.keys[self.layer], state.values[self.layer]
            if state.rows is not None:
                k_c, v_c = k_c.index_select(2, state.rows), v_c.index_select(2, state.rows)
            key = torch.cat([k_c.transpose(1, 2).to(key.dtype), key], dim=1)
            value = torch.cat([v_c.transpose(1, 2).to(value.dtype), value], dim=1)
        query = _rotate(query, *state.q_rope)
        key = _rotate(key, *state.k_rope)
        if state.mask is None:
            out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                        backend=self._attention_backend, parallel_config=None)
        else:
            out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                                 attn_mask=state.mask).transpose(1, 2)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _cross_cached(self, attn, hidden_states, encoder_hidden_states, state: _ForwardState) -> torch.Tensor:
        cached = state.cross.get(self.layer)
        if cached is not None and cached[0] == state.cross_key and cached[1].shape[0] == hidden_states.shape[0]:
            key, value = cached[1], cached[2]
            query = attn.norm_q(attn.to_q(hidden_states))
        else:
            query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
            query = attn.norm_q(query)
            key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
            value = value.unflatten(2, (attn.heads, -1))
            state.cross[self.layer] = (state.cross_key, key, value)
        query = query.unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=None)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


_SDPA_ORDER = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def sdpa_backend(batch: int, heads: int, q_tokens: int, k_tokens: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, masked: bool = True) -> dict:
    """Which PyTorch SDPA kernel serves the causal self-attention call of these shapes (for benchmarks' records).

    The call is the masked one of :class:`CausalWanAttnProcessor` (``F.scaled_dot_product_attention`` on
    ``[batch, heads, tokens, head_dim]`` with a boolean ``[1, 1, q_tokens, k_tokens]`` mask; ``masked=False``: no
    mask). PyTorch has no public "which kernel will run" query, so the kernels are probed: the call is run on
    zero tensors of these shapes under ``torch.nn.attention.sdpa_kernel([kernel])`` for flash, cuDNN, memory-
    efficient and math, in that order (fastest first), and every kernel that does not raise is listed. The
    dispatcher's own pick, from the private ``torch._fused_sdp_choice`` (same arguments), is added when this
    PyTorch has it; its priority order can differ from the probe's.

    Args:
        batch, heads, q_tokens, k_tokens, head_dim: the call's shapes (tokens: query tokens of a chunk; keys:
            cached + chunk tokens).
        dtype, device: of the query / key / value tensors.
        masked: whether the call carries a mask (a static cache always does).
    Returns:
        ``{"backend": first kernel that ran (lower case, e.g. "flash_attention", "math"), "available": [kernels
        that ran], "dispatcher": the dispatcher's pick or None, "errors": {kernel: first line of its error}}``.
    Raises:
        RuntimeError: no kernel accepts the call.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(batch, heads, q_tokens, head_dim, dtype=dtype, device=device)
    k = torch.zeros(batch, heads, k_tokens, head_dim, dtype=dtype, device=device)
    mask = torch.ones(1, 1, q_tokens, k_tokens, dtype=torch.bool, device=device) if masked else None
    available, errors = [], {}
    with torch.no_grad():
        for name in _SDPA_ORDER:
            kernel = getattr(SDPBackend, name, None)
            if kernel is None:
                continue
            try:
                with sdpa_kernel([kernel]):
                    F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
                available.append(name.lower())
            except RuntimeError as err:
                text = str(err).strip()
                errors[name.lower()] = text.splitlines()[0][:200] if text else type(err).__name__
        dispatcher = None
        choice = getattr(torch, "_fused_sdp_choice", None)
        if choice is not None:
            try:
                dispatcher = SDPBackend(choice(q, k, k, mask, 0.0, False)).name.lower()
            except Exception:  # noqa: BLE001 - a private API: its absence or a signature change is not an error
                dispatcher = None
    if not available:
        raise RuntimeError(f"no SDPA kernel accepts q [{batch}, {heads}, {q_tokens}, {head_dim}] {dtype} on {device}: "
                           f"{errors}")
    return {"backend": available[0], "available": available, "dispatcher": dispatcher, "errors": errors}


def install_causal_attention(transformer) -> CausalWanContext:
    """Give every block of a ``WanTransformer3DModel`` a :class:`CausalWanAttnProcessor` (self- and
    cross-attention, one shared context) and the rope hook; returns the context. Idempotent: an installed
    transformer returns its context unchanged. The attention backend of the replaced processors is kept.
    Weights are not touched."""
    blocks = transformer.blocks
    first = blocks[0].attn1.processor
    if isinstance(first, CausalWanAttnProcessor):
        ctx = first.context
        ok = all(isinstance(p, CausalWanAttnProcessor) and p.context is ctx
                 for b in blocks for p in (b.attn1.processor, b.attn2.processor))
        if ok and any(isinstance(h, _RopeHook) and h.context is ctx for h in transformer.rope._forward_hooks.values()):
            return ctx
    ctx = CausalWanContext()
    for i, block in enumerate(blocks):
        for attn, cross in ((block.attn1, False), (block.attn2, True)):
            new = CausalWanAttnProcessor(ctx, i, cross=cross)
            new._attention_backend = getattr(attn.processor, "_attention_backend", None)
            new._parallel_config = getattr(attn.processor, "_parallel_config", None)
            attn.set_processor(new)
    for handle_id, hook in list(transformer.rope._forward_hooks.items()):
        if isinstance(hook, _RopeHook):
            del transformer.rope._forward_hooks[handle_id]
    transformer.rope.register_forward_hook(_RopeHook(ctx))
    return ctx


# ---------------------------------------------------------------------------------------------- the generator
class CausalWanGenerator(WanGenerator):
    """Wan2.1 T2V as a causal, chunk-wise student (the ``CausalGenerator`` protocol of genrl.models.causal).

    Same pipeline, weights and prompt handling as :class:`~genrl.models.families.wan.WanGenerator`; latents
    ``[B, C, F, h, w]`` (frame axis 2, ``frame_dim = 2``); sigma in [0, 1] is ``[B]`` or per latent frame
    ``[B, F]`` (timestep = 1000 sigma, per token on the transformer's 2-D timestep path).

    - ``init_cache(batch_size, causal=None) -> KVCache``;
    - ``velocity_chunk(x [B, C, f, h, w], sigma [B] or [B, f], cond, cache)``: a chunk starting at
      ``cache.end_frame`` attending to the cached context (read only);
    - ``commit(x, sigma, cond, cache)``: the context pass (no gradient) appending the chunk's un-roped keys /
      values (Self-Forcing's cache update);
    - ``velocity(x, sigma, cond, attention=None, causal=None, start_frame=0)``: full sequence, block-causal by
      default (``self.causal``), ``"bidirectional"`` = the stock Wan forward (bit-identical at start_frame 0).

    Positions: ``causal.positions == "absolute"`` puts frame ``t`` at temporal RoPE position ``t``;
    ``"relative"`` at its rank among the frames the forward attends to (visible cached frames, then the input:
    LongLive's KV-relative RoPE), which keeps positions bounded while streaming.

    Args:
        pipeline, height, width, num_frames, ...: as :class:`WanGenerator` (``num_frames`` only sets
            :attr:`latent_shape`, the size a plain rollout draws; causal forwards take any frame count).
        causal: the default chunk layout (:class:`CausalConfig` or its dict; default chunks of 3 latent frames,
            Self-Forcing's Wan2.1 setting). ``None`` after construction makes ``velocity`` bidirectional by default.
    Raises:
        ValueError: the transformer's temporal patch is not 1 (Wan2.1 has (1, 2, 2)).
    """

    family: ClassVar[str] = "wan_causal"
    frame_dim = 2

    def __init__(self, pipeline, *args, causal: CausalConfig | dict | None = None, **kwargs) -> None:
        self._check_patch(pipeline.transformer)
        super().__init__(pipeline, *args, **kwargs)
        if isinstance(causal, dict):
            causal = CausalConfig(**causal)
        #: default chunk layout of ``velocity`` (None: bidirectional by default).
        self.causal: CausalConfig | None = causal if causal is not None else CausalConfig(chunk_size=3)
        install_causal_attention(self.transformer)

    @staticmethod
    def _check_patch(transformer) -> None:
        p = tuple(transformer.config.patch_size)
        if p[0] != 1:
            raise ValueError(f"wan_causal needs a temporal patch of 1 (Wan2.1's patch_size is (1, 2, 2)); this "
                             f"transformer has patch_size={p}: chunks, windows and the KV cache count latent frames")

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The text states, plus for prompts with an image (:class:`genrl.models.conditions.Prompt`) the given first
        latent frame (:func:`~genrl.models.families.wan_i2v.first_frame_extras`): the causal sampler then takes it as
        the first chunk, committed to the KV cache as context, and generates the rest (image-to-video)."""
        from genrl.models.conditions import prompt_image
        from genrl.models.families.wan_i2v import first_frame_extras

        out = super()._encode_uncached(prompts)
        if any(prompt_image(p) is not None for p in prompts):
            out |= first_frame_extras(self, prompts)
        return out

    # ------------------------------------------------------------------ causal API
    def init_cache(self, batch_size: int, causal: CausalConfig | None = None) -> KVCache | StaticKVCache:
        """An empty KV cache for ``batch_size`` videos with chunk layout / window ``causal`` (default
        :attr:`causal`): a :class:`~genrl.models.causal.StaticKVCache` (fixed-shape buffers, allocated on the first
        forward) when ``causal.static_cache``, else a :class:`~genrl.models.causal.KVCache`. Raises ValueError when
        neither is set, or for a static cache without ``local_window`` / ``max_frames``."""
        causal = causal or self.causal
        if causal is None:
            raise ValueError("init_cache needs a CausalConfig (or set generator.causal)")
        return make_kv_cache(causal, int(batch_size), patch_frames=1)

    def velocity_chunk(self, x: torch.Tensor, sigma: torch.Tensor, cond, cache: KVCache) -> torch.Tensor:
        """Velocity ``[B, C, f, h, w]`` of a chunk ``x`` (latent frames ``cache.end_frame ...``) at sigma ``[B]``
        or ``[B, f]``, attending to the visible cached frames; the cache is read, not written (except its
        text K/V cache, filled when gradients are disabled).

        Raises:
            ValueError: batch of ``cond`` / ``cache`` / sigma differs from ``x``; a token layout (h, w) other
                than the cache's; a bad latent shape.
        """
        return self._forward(x, sigma, cond, "block_causal", cache.config, cache.end_frame, cache, commit=False)

    def commit(self, x: torch.Tensor, sigma: torch.Tensor, cond, cache: KVCache) -> None:
        """Context pass over the chunk ``x`` (clean or lightly noised at ``sigma``): append its un-roped keys /
        values to ``cache`` (no gradient), evicting frames outside the sink and every later window."""
        with torch.no_grad():
            self._forward(x, sigma, cond, "block_causal", cache.config, cache.end_frame, cache, commit=True)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, attention: str | None = None,
                 causal: CausalConfig | None = None, start_frame: int = 0) -> torch.Tensor:
        """Full-sequence velocity ``[B, C, F, h, w]`` (transformer dtype) at latents ``x`` and sigma ``[B]`` or
        ``[B, F]`` in [0, 1]. With an image-conditioned ``cond`` and ``start_frame`` 0, latent frame 0 of the prompts
        that have an image is the given frame, clean (timestep 0), and its velocity is 0 (:meth:`fixed_latents`).

        Args:
            attention: ``"block_causal"`` (default when :attr:`causal` or ``causal`` is set) or
                ``"bidirectional"`` (the stock Wan attention).
            causal: chunk layout / window / positions of ``"block_causal"`` (default :attr:`causal`).
            start_frame: absolute latent frame index of ``x``'s first frame (chunk ids, window, positions).
        Raises:
            ValueError: unknown attention mode, ``"block_causal"`` without a layout, bad shapes.
        """
        causal = causal or self.causal
        if attention is None:
            attention = "block_causal" if causal is not None else "bidirectional"
        keep = None
        if start_frame == 0:  # image-to-video: the given first frame is clean (timestep 0), its velocity 0, so a DMD
            # teacher / critic scoring a video sees it as the condition it is (as Wan2.2-TI2V's pipeline gives it)
            x, sigma, keep = self._given_frame_inputs(x, sigma, cond)
        v = self._forward(x, sigma, cond, attention, causal, start_frame, None, commit=False)
        return v if keep is None else v * keep.to(v.dtype)

    # ------------------------------------------------------------------ internals
    def _timestep(self, sigma, b: int, f: int, tokens: int, device) -> torch.Tensor:
        sigma = torch.as_tensor(sigma).to(device, torch.float32)
        if sigma.ndim == 0:
            sigma = sigma.expand(b)
        if sigma.ndim == 1 and sigma.shape[0] == b:
            return sigma * 1000.0
        if sigma.ndim == 2 and sigma.shape == (b, f):
            return (sigma * 1000.0).repeat_interleave(tokens, dim=1)
        raise ValueError(f"wan_causal: sigma of shape {tuple(sigma.shape)}; expected [B]=[{b}] or per latent frame "
                         f"[B, F]=[{b}, {f}]")

    def _forward(self, x, sigma, cond, attention, causal, start_frame, cache, commit):
        transformer = self.transformer
        self._check_patch(transformer)
        if attention not in ("bidirectional", "block_causal"):
            raise ValueError(f"attention must be 'bidirectional' or 'block_causal', got {attention!r}")
        if x.ndim != 5:
            raise ValueError(f"wan_causal: latents must be [B, C, F, h, w], got shape {tuple(x.shape)}")
        b, c, f, h, w = x.shape
        _, ph, pw = transformer.config.patch_size
        if c != transformer.config.in_channels or h % ph or w % pw or f < 1:
            raise ValueError(f"wan_causal: latents of shape {tuple(x.shape)}; expected "
                             f"{transformer.config.in_channels} channels and h, w multiples of the patch ({ph}, {pw})")
        if len(cond) != b:
            raise ValueError(f"conditioning holds {len(cond)} prompts for a batch of {b} latents")
        gh, gw = h // ph, w // pw
        t = self._timestep(sigma, b, f, gh * gw, x.device)
        state = self._forward_state(attention, causal, int(start_frame), cache, commit, b, f, gh, gw, x.device,
                                    tuple(cond.prompts))
        ctx = install_causal_attention(transformer)
        ctx.current = state
        try:
            out = transformer(hidden_states=x.to(self.dtype), timestep=t,
                              encoder_hidden_states=cond.hidden_states.to(self.dtype), return_dict=False)[0]
        finally:
            ctx.current = None
        if commit:
            produced = ([(state.stage[0][i], state.stage[1][i]) for i in range(len(transformer.blocks))]
                        if state.stage is not None else [state.produced[i] for i in range(len(transformer.blocks))])
            cache.append(produced,
                         int(start_frame) + torch.arange(f), gh * gw)
        return out

    def _forward_state(self, attention, causal, start_frame, cache, commit, b, f, gh, gw, device, cross_key):
        """The :class:`_ForwardState` of one forward (None: the stock forward applies unchanged)."""
        s = gh * gw
        q_frames = start_frame + torch.arange(f)
        table_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        rope = self.transformer.rope
        if attention == "bidirectional":
            if cache is not None or commit:
                raise ValueError("a KV cache needs attention='block_causal'")
            if start_frame == 0:
                return None
            tables = wan_rope_tables(rope, q_frames, gh, gw, table_dtype, device)
            return _ForwardState(q_rope=tables, k_rope=tables)
        if causal is None:
            raise ValueError("attention='block_causal' needs a CausalConfig (pass causal=... or set generator.causal)")
        vis = frame_visibility(causal, q_frames, q_frames)
        if isinstance(cache, StaticKVCache):
            return self._static_state(causal, q_frames, vis, cache, commit, b, f, gh, gw, device, cross_key,
                                      table_dtype)
        k_frames = torch.zeros(0, dtype=torch.long)
        read, rows = None, None
        if cache is not None:
            self._check_cache(cache, b, start_frame)
            if cache.num_groups:
                if cache.tokens_per_group != s:
                    raise ValueError(f"KV cache holds {cache.tokens_per_group} tokens per latent frame, input has {s}; "
                                     f"the latent height / width changed mid-video")
                if len(cache.keys) != len(self.transformer.blocks):
                    raise ValueError(f"KV cache holds {len(cache.keys)} layers, the transformer has "
                                     f"{len(self.transformer.blocks)}")
                vis_c = cache.visible(q_frames)
                used = vis_c.any(0)
                if bool(used.any()):
                    read = cache
                    rows = None if bool(used.all()) else cache.token_rows(used).to(device)
                    k_frames = cache.frames[used]
                    vis = torch.cat([vis_c[:, used], vis], dim=1)
        if causal.positions == "absolute":
            q_pos, k_pos = q_frames, k_frames
        else:
            k_pos = torch.arange(len(k_frames))
            q_pos = len(k_frames) + torch.arange(f)
        mask = None
        if not bool(vis.all()):  # only multi-chunk inputs (or a window cutting a chunk's context) need a mask
            mask = vis.to(device).repeat_interleave(s, 0).repeat_interleave(s, 1)[None, None]
        k_rope = wan_rope_tables(rope, torch.cat([k_pos, q_pos]), gh, gw, table_dtype, device)
        q_rope = tuple(t[:, -f * s:] for t in k_rope)
        return _ForwardState(q_rope=q_rope, k_rope=k_rope, mask=mask, rows=rows, collect=commit,
                             keys=read.keys if read is not None else None,
                             values=read.values if read is not None else None,
                             cross=cache.cross if cache is not None else None,
                             cross_key=cross_key if cache is not None else None)

    def _check_cache(self, cache, b: int, start_frame: int) -> None:
        """ValueError unless ``cache`` (dynamic or static) holds a batch of ``b`` and ends at ``start_frame``."""
        if cache.batch_size != b:
            raise ValueError(f"KV cache holds a batch of {cache.batch_size}, input has {b}")
        if cache.end_frame != start_frame:
            raise ValueError(f"input starts at latent frame {start_frame} but the KV cache ends at "
                             f"{cache.end_frame}; pass start_frame=cache.end_frame")
        if cache.patch_frames != 1:
            raise ValueError(f"KV cache built for a temporal patch of {cache.patch_frames}; wan_causal uses 1")

    def _static_state(self, causal, q_frames, vis, cache: StaticKVCache, commit, b, f, gh, gw, device, cross_key,
                      table_dtype) -> _ForwardState:
        """The forward state with a :class:`StaticKVCache`: every slot is read (fixed shape), a mask of fixed shape
        ``[1, 1, f * s, (capacity + f) * s]`` hides empty and invisible slots, and there is no mask once every slot
        holds a visible frame (the window's steady state); positions as the dynamic cache's (absolute: the slot's
        frame; relative: its rank among the visible slots, then the input)."""
        s = gh * gw
        self._check_cache(cache, b, int(q_frames[0]))
        blocks = self.transformer.blocks
        attn = blocks[0].attn1
        head_dim = attn.inner_dim // attn.heads
        cache.allocate(len(blocks), attn.heads, head_dim, s, self.dtype, device)
        for block in blocks:  # each processor's layer index lives on the model's device
            proc = block.attn1.processor
            if proc.layer_index.device != torch.device(device):
                proc.layer_index = proc.layer_index.to(device)
        slot_frames = cache.slot_frames.clone()
        vis_c = cache.slot_visibility(q_frames)  # [f, capacity]
        used = vis_c.any(0)
        if causal.positions == "absolute":
            k_pos, q_pos = slot_frames.clamp(min=0), q_frames
        else:  # rank of each visible slot's frame among the visible frames (slots are not in frame order)
            used_frames = slot_frames[used]
            k_pos = (used_frames[None, :] < slot_frames[:, None]).sum(1) * used
            q_pos = int(used.sum()) + torch.arange(f)
        vis = torch.cat([vis_c, vis], dim=1)
        # once every slot holds a frame the chunk sees (a full window), no mask: the unmasked call can use flash
        # attention (one more compiled graph, traced when the cache first fills; none after)
        mask = None if bool(vis.all()) else vis.to(device).repeat_interleave(s, 0).repeat_interleave(s, 1)[None, None]
        k_rope = wan_rope_tables(self.transformer.rope, torch.cat([k_pos, q_pos]), gh, gw, table_dtype, device)
        q_rope = tuple(t[:, -f * s:] for t in k_rope)
        keys, values = cache.key_buffer, cache.value_buffer
        if torch.is_grad_enabled():  # a later commit writes the buffers in place: a gradient-checkpoint replay
            keys, values = keys.clone(), values.clone()  # must read what this forward read
        stage = None
        if commit:
            shape = (len(blocks), b, attn.heads, f * s, head_dim)
            stage = (torch.empty(shape, dtype=keys.dtype, device=device),
                     torch.empty(shape, dtype=values.dtype, device=device))
        # no text K/V cache (cross=None): its per-layer dict would make every block a different graph; the text
        # projections are recomputed (a few per cent of a block's work at Wan's sizes)
        return _ForwardState(q_rope=q_rope, k_rope=k_rope, mask=mask, collect=commit, key_buffer=keys,
                             value_buffer=values, stage=stage)
