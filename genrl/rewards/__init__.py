"""Reward-model zoo: the protocol, the registry and the built-in rewards (DESIGN.md section 3).

Importing this package registers the built-ins (``"shapes"``: :class:`ShapesVerifier`).
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
from genrl.rewards.shapes import ShapesVerifier

__all__ = [
    "RANGE_TOLERANCE",
    "RewardModel",
    "RewardSpec",
    "ShapesVerifier",
    "UnknownRewardError",
    "available_rewards",
    "build_reward",
    "get_reward_class",
    "register_reward",
]
