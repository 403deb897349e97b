"""Reward-model zoo: the protocol, the registry and the rewards (docs/rewards.md; genrl/rewards/README.md).

Importing this package registers every reward (heavy libraries load only when a reward is built):
``"shapes"`` (:class:`ShapesVerifier`), ``"shapes_video"`` (:class:`ShapesVideoReward`, differentiable),
``"shapes_temporal"`` (:class:`ShapesTemporalReward`, step following / switch delay / order of step plans),
``"colorfulness"``, ``"brightness"`` (mean luma, or darkness: a planted hack), ``"clipscore"``, ``"pickscore"``,
``"aesthetic"``, ``"hpsv2"``, ``"imagereward"``, ``"videoalign"``, ``"ocr"``, ``"remote"`` (a loopback reward
server), ``"pairwise"`` (groupwise: win rates under a pairwise judge, Pref-GRPO) and ``"pair_judge"`` (a judge to
serve).
:class:`RewardManager` holds a method's rewards outside its module tree and combines them.
"""

from genrl.rewards.base import RANGE_TOLERANCE, RewardModel
from genrl.rewards.brightness import BrightnessReward
from genrl.rewards.clip_rewards import AestheticReward, CLIPScoreReward, HPSv2Reward, PickScoreReward
from genrl.rewards.colorfulness import ColorfulnessReward
from genrl.rewards.image import FramePolicy, ImageRewardModel
from genrl.rewards.image_reward import ImageRewardBLIP
from genrl.rewards.manager import (
    RewardManager,
    RewardResult,
    as_reward_spec,
    build_reward_with_context,
    per_reward_advantages,
)
from genrl.rewards.ocr import OCRReward
from genrl.rewards.pairwise import (
    PairJudgeReward,
    PairwiseJudge,
    PairwiseReward,
    RemoteJudge,
    ScoreJudge,
    ShapesJudge,
    UnknownJudgeError,
    available_judges,
    build_judge,
    check_complete_groups,
    parse_preference,
    register_judge,
    win_rates,
)
from genrl.rewards.registry import (
    RewardSpec,
    UnknownRewardError,
    available_rewards,
    build_reward,
    get_reward_class,
    register_reward,
)
from genrl.rewards.remote import RemoteReward
from genrl.rewards.shapes import ShapesVerifier, ShapesVideoReward
from genrl.rewards.shapes_temporal import ShapesTemporalReward, temporal_metrics
from genrl.rewards.videoalign import VideoAlignReward

__all__ = [
    "temporal_metrics",
    "RANGE_TOLERANCE",
    "AestheticReward",
    "BrightnessReward",
    "CLIPScoreReward",
    "ColorfulnessReward",
    "FramePolicy",
    "HPSv2Reward",
    "ImageRewardBLIP",
    "ImageRewardModel",
    "OCRReward",
    "PickScoreReward",
    "RemoteReward",
    "ShapesTemporalReward",
    "VideoAlignReward",
    "RewardModel",
    "RewardSpec",
    "ShapesVerifier",
    "ShapesVideoReward",
    "UnknownRewardError",
    "available_rewards",
    "build_reward",
    "get_reward_class",
    "register_reward",
    "RewardManager",
    "RewardResult",
    "as_reward_spec",
    "build_reward_with_context",
    "per_reward_advantages",
    "PairJudgeReward",
    "PairwiseJudge",
    "PairwiseReward",
    "RemoteJudge",
    "ScoreJudge",
    "ShapesJudge",
    "UnknownJudgeError",
    "available_judges",
    "build_judge",
    "check_complete_groups",
    "parse_preference",
    "register_judge",
    "win_rates",
]
