"""One LightningModule per method; methods compose the shared sampler, losses and rewards."""

from genrl.methods.afd import AFD
from genrl.methods.branch_grpo import BranchGRPO
from genrl.methods.crd import CRD
from genrl.methods.dgpo import DGPO
from genrl.methods.dmd import DMD
from genrl.methods.dpo import DPO
from genrl.methods.grpo import GRPO
from genrl.methods.ode_init import ODEInit
from genrl.methods.pretrain import FlowMatchingPretrain
from genrl.methods.preview import PreviewConfig
from genrl.methods.ram import RAM
from genrl.methods.rwr import RewardWeightedRegression
from genrl.methods.stream_r1 import StreamR1Weighting
from genrl.methods.tempact import TempAct
from genrl.methods.tmd import TMD
from genrl.models.lora import LoraSpec  # re-exported: configs and user code name genrl.methods.LoraSpec
from genrl.models.quantized import RolloutPrecision  # re-exported with PreviewConfig (Sol-RL)

__all__ = ["AFD", "BranchGRPO", "CRD", "DGPO", "DMD", "DPO", "FlowMatchingPretrain", "GRPO", "LoraSpec", "ODEInit",
           "PreviewConfig", "RAM", "RewardWeightedRegression", "RolloutPrecision", "StreamR1Weighting", "TMD",
           "TempAct"]
