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

__all__ = ["REWARDS", "Registry", "register_reward", "build_reward", "available_rewards", "get_reward_class",
           "RewardSpec", "UnknownRewardError"]

class Registry:
    """Names -> classes of one kind (rewards, pairwise judges), filled by a class decorator.

    Args:
        kind: what is registered, as messages name it (``"reward"``, ``"judge"``).
        base: the class every registered class must subclass.
        error: the exception type of an unknown name (a KeyError and ValueError subclass).
    """

    def __init__(self, kind: str, base: type, error: type[KeyError]) -> None:
        self.kind, self.base, self.error = kind, base, error
        self.classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator registering a ``base`` subclass under ``name`` (and setting ``cls.name``).

        Raises:
            TypeError: the decorated object is not a ``base`` subclass.
            ValueError: an empty name, or ``name`` already taken by another class.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")

        def deco(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"@register_{self.kind}({name!r}) needs a {self.base.__name__} subclass, got {cls!r}")
            old = self.classes.get(name)
            if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"{self.kind} name {name!r} is already registered by {old.__module__}."
                                 f"{old.__qualname__}")
            cls.name = name
            self.classes[name] = cls
            return cls

        return deco

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self.classes)

    def get(self, name: str) -> type:
        """The class registered as ``name``.

        Raises:
            ``error`` (a KeyError and ValueError): unknown name; the message lists the registered names.
        """
        try:
            return self.classes[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; registered {self.kind}s: "
                             f"{', '.join(self.names()) or '(none)'}") from None


T = TypeVar("T", bound=type)


class UnknownRewardError(KeyError, ValueError):
    """An unregistered reward name (both a KeyError and a ValueError); the message lists the registered names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


REWARDS = Registry("reward", RewardModel, UnknownRewardError)
#: ``@register_reward(name)``: register a :class:`RewardModel` subclass (:meth:`Registry.register`).
register_reward = REWARDS.register
#: sorted registered reward names.
available_rewards = REWARDS.names
#: the class registered as a name; UnknownRewardError listing the registered ones for an unknown name.
get_reward_class = REWARDS.get


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
