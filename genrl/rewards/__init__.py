"""Reward-model zoo: the protocol, the registry and the built-in rewards (DESIGN.md section 3).

Importing this package registers the built-ins (``"shapes"``: :class:`ShapesVerifier`;
``"colorfulness"``: :class:`ColorfulnessReward`).
:class:`RewardManager` holds a method's rewards outside its module tree and combines them.
"""

from genrl.rewards.base import RANGE_TOLERANCE, RewardModel
from genrl.rewards.registry import (
    RewardSpec,
    UnknownRewardError,
    available_rewards,
    build_reward,
    get_reward_class,
    register_reward,
)
from genrl.rewards.colorfulness import ColorfulnessReward
from genrl.rewards.shapes import ShapesVerifier
from genrl.rewards.manager import (
    RewardManager,
    RewardResult,
    as_reward_spec,
    build_reward_with_context,
    per_reward_advantages,
)

__all__ = [
    "RANGE_TOLERANCE",
    "ColorfulnessReward",
    "RewardModel",
    "RewardSpec",
    "ShapesVerifier",
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
]
