"""Reward registry: names -> :class:`~genrl.rewards.base.RewardModel` classes, built from config values.

    @register_reward("my_reward")
    class MyReward(RewardModel): ...

    build_reward("my_reward", path="/weights/my_reward", scale=0.5)
    RewardSpec(name="shapes", weight=1.0).build()
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from genrl.rewards.base import RewardModel

__all__ = ["register_reward", "build_reward", "available_rewards", "get_reward_class", "RewardSpec",
           "UnknownRewardError"]

_REGISTRY: dict[str, type[RewardModel]] = {}
R = TypeVar("R", bound=type[RewardModel])


class UnknownRewardError(KeyError, ValueError):
    """An unregistered reward name (both a KeyError and a ValueError); the message lists the registered names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def register_reward(name: str) -> Callable[[R], R]:
    """Class decorator registering a :class:`RewardModel` subclass under ``name`` (and setting ``cls.name``).

    Raises:
        TypeError: the decorated object is not a RewardModel subclass.
        ValueError: an empty name, or ``name`` already taken by another class.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward name must be a non-empty string, got {name!r}")

    def deco(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, RewardModel)):
            raise TypeError(f"@register_reward({name!r}) needs a RewardModel subclass, got {cls!r}")
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"reward name {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_rewards() -> list[str]:
    """Sorted registered reward names."""
    return sorted(_REGISTRY)


def get_reward_class(name: str) -> type[RewardModel]:
    """The class registered as ``name``.

    Raises:
        UnknownRewardError (a KeyError and ValueError): unknown name; the message lists the registered names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownRewardError(
            f"unknown reward {name!r}; registered rewards: {', '.join(available_rewards()) or '(none)'}"
        ) from None


def build_reward(name: str, path: str | None = None, **kwargs: Any) -> RewardModel:
    """Instantiate the reward registered as ``name``.

    Args:
        name: registry name.
        path: local weights path, passed as ``path=`` to rewards whose constructor takes one.
        **kwargs: constructor arguments (``scale``, ``shift`` and reward-specific options).

    Raises:
        UnknownRewardError (KeyError, ValueError): unknown name, listing the registered ones.
        ValueError: ``path`` given to a reward that loads no weights.
        TypeError: an argument the reward's constructor does not take.
    """
    cls = get_reward_class(name)
    if path is not None:
        if "path" not in inspect.signature(cls.__init__).parameters:
            raise ValueError(f"reward {name!r} loads no weights; drop path={path!r}")
        kwargs["path"] = path
    return cls(**kwargs)


@dataclass
class RewardSpec:
    """One reward entry of a config.

    Attributes:
        name: registry name.
        path: local weights path (None for rewards without weights).
        weight: weight in a combined reward (used by the combiner, not by the reward itself).
        scale, shift: affine on the reward's main key.
        kwargs: further constructor arguments.
        standardize: standardise this reward's main key with its running mean / std (over every valid sample
            seen so far) before weighting it into the combined total, whatever the manager's ``combine``
            (``zscore_sum`` does it for every reward); see :class:`~genrl.rewards.RewardManager`.
    """

    name: str
    path: str | None = None
    weight: float = 1.0
    scale: float = 1.0
    shift: float = 0.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    standardize: bool = False

    def build(self) -> RewardModel:
        """``build_reward(name, path, scale=..., shift=..., **kwargs)``; raises like :func:`build_reward`."""
        return build_reward(self.name, self.path, scale=self.scale, shift=self.shift, **self.kwargs)
