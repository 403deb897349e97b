"""LoRA adapters on a generator's transformer (peft; Hu et al. 2022, "LoRA: Low-Rank Adaptation")."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DIT_LORA_TARGETS", "LoraSpec"]

#: LoRA targets of genrl's own DiT.
DIT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out"]


@dataclass
class LoraSpec:
    """LoRA adapter on the policy (peft; Hu et al. 2022). Flow-GRPO SD3.5: r 32, alpha 64, gaussian init.

    Attributes:
        rank, alpha: LoRA rank r and scale alpha (update = alpha / r * B A).
        target_modules: module names to adapt (None: the attention projections of the generator's family,
            e.g. ``to_q, to_k, to_v, to_out.0`` for Wan; genrl's DiT: ``to_q, to_k, to_v, to_out``).
        init_lora_weights: peft init (``"gaussian"`` or True for Kaiming-A / zero-B).
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] | None = None
    init_lora_weights: str | bool = "gaussian"

    def __post_init__(self) -> None:
        if self.target_modules is not None and len(self.target_modules) == 0:
            raise ValueError("lora.target_modules is an empty list, which would adapt nothing; leave it unset (null) "
                             "for the family's attention projections, or name the modules")

    def add_to(self, generator) -> None:
        """Add this adapter to ``generator.transformer`` (peft); the adapter weights are kept in float32
        whatever the base weights' dtype (diffusers' cast_training_params practice)."""
        from peft import LoraConfig

        targets = self.target_modules
        if targets is None:
            targets = list(getattr(generator, "lora_target_modules", DIT_LORA_TARGETS))
        generator.transformer.add_adapter(
            LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(targets),
                       init_lora_weights=self.init_lora_weights)
        )
        for p in generator.transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()
