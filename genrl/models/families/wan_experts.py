"""Wan2.2's two experts as one denoiser (Wan Team 2025, Wan2.2 A14B: a mixture of two experts split by noise level).

Wan2.2-T2V-A14B and -I2V-A14B hold two transformers of the same architecture: ``transformer`` denoises the
high-noise steps (timestep t >= ``boundary_ratio`` x 1000) and ``transformer_2`` the low-noise ones. genrl's methods
train, copy, checkpoint and shard ``generator.transformer``; :class:`WanExperts` is that module for Wan2.2: both experts
are its children, so LoRA, the reference / old-policy roles, EMA, FSDP2 (it exposes both experts' blocks) and
checkpoints cover both, and ``experts`` freezes one of them (users often train only the high-noise expert).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

__all__ = ["WanExperts", "EXPERT_NAMES", "EXPERTS_FILE"]

#: user-facing expert names -> child module names (diffusers' pipeline attribute names).
EXPERT_NAMES = {"high": "transformer", "low": "transformer_2"}
#: file beside the two expert folders of a saved :class:`WanExperts` (its boundary and which experts trained).
EXPERTS_FILE = "wan_experts.json"


class WanExperts(nn.Module):
    """Route each sample to the high- or low-noise expert of Wan2.2 by its timestep, as ``WanPipeline`` does per step.

    Args:
        transformer: the high-noise expert (``WanTransformer3DModel``).
        transformer_2: the low-noise expert (same architecture).
        boundary_ratio: the switch, in (0, 1): a sample whose timestep is >= ``boundary_ratio * num_train_timesteps``
            runs the high-noise expert (Wan2.2 T2V-A14B 0.875, I2V-A14B 0.9).
        experts: which experts train, a subset of ``("high", "low")``; the other's weights are frozen (no LoRA, no
            gradient, bitwise unchanged by training).
        num_train_timesteps: the scheduler's training timesteps (1000).
    Raises:
        ValueError: a boundary outside (0, 1), an unknown or empty expert list.
    """

    _supports_gradient_checkpointing = True

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_ratio: float,
                 experts: tuple[str, ...] | list[str] = ("high", "low"), num_train_timesteps: int = 1000) -> None:
        super().__init__()
        if not 0.0 < float(boundary_ratio) < 1.0:
            raise ValueError(f"Wan2.2 experts: boundary_ratio={boundary_ratio} must lie in (0, 1) (T2V-A14B 0.875, "
                             f"I2V-A14B 0.9)")
        experts = tuple(experts)
        if not experts or any(e not in EXPERT_NAMES for e in experts):
            raise ValueError(f"Wan2.2 experts: experts={list(experts)}; name one or both of {sorted(EXPERT_NAMES)}")
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = float(boundary_ratio)
        self.boundary_timestep = self.boundary_ratio * num_train_timesteps
        self.experts = tuple(e for e in EXPERT_NAMES if e in experts)
        for name, child in EXPERT_NAMES.items():
            if name not in self.experts:
                getattr(self, child).requires_grad_(False)
        names = set(getattr(transformer, "_no_split_modules", None) or ())
        self._no_split_modules = sorted(names | set(getattr(transformer_2, "_no_split_modules", None) or ()))

    # ------------------------------------------------------------------ routing
    @property
    def config(self):
        """The high-noise expert's config (both experts share the architecture)."""
        return self.transformer.config

    def high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """bool [B]: which samples the high-noise expert denoises; ``timestep`` [B] or per token [B, L] (a sample is
        routed by its largest timestep, so a per-token timestep with a clean first frame routes by the noisy ones)."""
        t = timestep if timestep.ndim == 1 else timestep.reshape(timestep.shape[0], -1).amax(dim=1)
        return t >= self.boundary_timestep

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None, return_dict: bool = False,
                **kwargs) -> tuple[torch.Tensor]:
        """``WanTransformer3DModel``'s forward, each sample through its expert; returns ``(sample,)``.

        A batch on one side of the boundary is one call of one expert; a mixed batch is split, run in two calls and
        put back in order (differentiable).
        """
        high = self.high_noise(timestep)
        inputs = dict(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                      encoder_hidden_states_image=encoder_hidden_states_image)
        if bool(high.all()) or not bool(high.any()):
            expert = self.transformer if bool(high.all()) else self.transformer_2
            return (expert(**inputs, return_dict=False, **kwargs)[0],)
        rows_h, rows_l = high.nonzero().flatten(), (~high).nonzero().flatten()
        outs = []
        for expert, rows in ((self.transformer, rows_h), (self.transformer_2, rows_l)):
            sub = {k: (None if v is None else v[rows.to(v.device)]) for k, v in inputs.items()}
            outs.append(expert(**sub, return_dict=False, **kwargs)[0])
        order = torch.argsort(torch.cat([rows_h, rows_l])).to(outs[0].device)
        return (torch.cat(outs)[order],)

    # ------------------------------------------------------------------ the model surface genrl uses
    def _trained(self) -> Iterator[nn.Module]:
        for name in self.experts:
            yield getattr(self, EXPERT_NAMES[name])

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """A LoRA adapter on each trained expert (peft; the frozen expert gets none)."""
        for expert in self._trained():
            expert.add_adapter(adapter_config, adapter_name=adapter_name)

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return any(getattr(e, "_hf_peft_config_loaded", False) for e in (self.transformer, self.transformer_2))

    @property
    def peft_config(self) -> dict:
        return next(e.peft_config for e in self._trained() if getattr(e, "_hf_peft_config_loaded", False))

    def disable_adapters(self) -> None:
        for expert in self._trained():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self._trained():
            expert.enable_adapters()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.transformer.is_gradient_checkpointing and self.transformer_2.is_gradient_checkpointing

    def fuse_lora(self, lora_scale: float = 1.0, **kwargs) -> None:
        """Merge each adapted expert's LoRA into its base weights (an export's full mode)."""
        for expert in self._adapted():
            expert.fuse_lora(lora_scale=lora_scale, **kwargs)

    def unload_lora(self) -> None:
        """Remove the LoRA layers of each adapted expert."""
        for expert in self._adapted():
            expert.unload_lora()

    def _adapted(self) -> Iterator[nn.Module]:
        for expert in (self.transformer, self.transformer_2):
            if getattr(expert, "_hf_peft_config_loaded", False):
                yield expert

    def enable_gradient_checkpointing(self, *args, **kwargs) -> None:
        for expert in (self.transformer, self.transformer_2):
            expert.enable_gradient_checkpointing(*args, **kwargs)

    def set_attention_backend(self, backend: str) -> None:
        for expert in (self.transformer, self.transformer_2):
            expert.set_attention_backend(backend)

    def save_pretrained(self, folder: str | Path, safe_serialization: bool = True, **kwargs) -> Path:
        """Write ``folder/transformer`` and ``folder/transformer_2`` (diffusers model folders, the pipeline's own
        layout) and ``folder/wan_experts.json``; uses ``self.state_dict()``, so an exporter that swaps in gathered or
        EMA weights through it exports those."""
        folder = Path(folder)
        state = self.state_dict()
        for child in EXPERT_NAMES.values():
            prefix = f"{child}."
            sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            expert = getattr(self, child)
            with _state_dict_as(expert, sub):
                expert.save_pretrained(str(folder / child), safe_serialization=safe_serialization, **kwargs)
        (folder / EXPERTS_FILE).write_text(json.dumps({"boundary_ratio": self.boundary_ratio,
                                                       "experts": list(self.experts)}))
        return folder


@contextlib.contextmanager
def _state_dict_as(module: nn.Module, state: dict):
    module.state_dict = lambda *args, **kwargs: state
    try:
        yield module
    finally:
        del module.state_dict
