"""A closed-form generator stub shared by the tests of the rollout knobs and of GRPO's step loss: the velocity
v(x, sigma, prompt) = a x + len(prompt) (the empty prompt gives 0), with ``a`` one trainable scalar, so a rollout,
a log-prob or a KL has a hand-computable value and a frozen copy of the stub is a reference policy."""

from __future__ import annotations

import torch
from torch import nn

from genrl.models.text_encoder import Conditioning


class StubNet(nn.Module):
    """The stub's "transformer": one scalar weight ``a`` (a frozen copy of it is a reference policy)."""

    def __init__(self, a: float) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))


class StubGen(nn.Module):
    """A Generator with a closed-form velocity: v(x, sigma, prompt) = a x + len(prompt) (the empty prompt gives 0).

    Records every velocity call (rows, sigma, prompts) in ``calls`` and every encoded prompt list in ``encoded``."""

    def __init__(self, a: float = 1.0) -> None:
        super().__init__()
        self.transformer = StubNet(a)
        self.calls: list[tuple[int, torch.Tensor, list[str]]] = []
        self.encoded: list[list[str]] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        self.encoded.append(list(prompts))
        h = torch.tensor([float(len(p)) for p in prompts]).reshape(-1, 1, 1)
        return Conditioning(h, torch.ones(len(prompts), 1, dtype=torch.bool), list(prompts))

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        self.calls.append((x.shape[0], sigma.detach().clone(), list(cond.prompts)))
        c = cond.hidden_states[:, 0, 0].to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return self.transformer.a * x + c
