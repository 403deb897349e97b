"""One LightningModule per method; methods compose the shared sampler, losses and rewards."""

from genrl.methods.branch_grpo import BranchGRPO
from genrl.methods.grpo import GRPO, LoraSpec
from genrl.methods.pretrain import FlowMatchingPretrain

__all__ = ["BranchGRPO", "FlowMatchingPretrain", "GRPO", "LoraSpec"]
