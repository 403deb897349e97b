"""Shared by the in-process strategy tests (tests/test_strategy_choices.py, test_sharding_fsdp2_contracts.py): a
tiny network with two repeated blocks, its context-parallel variant and a generator holding it. Their process-group
fixtures (``one_process_mesh``, ``fake_group``) are in tests/conftest.py."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Two repeated blocks (the FSDP2 units) and a head (in the root unit): 2 x (16 + 4) + (8 + 2) = 50 parameter
    elements."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class DoubleBackward(Net):
    needs_double_backward = True


class ContextParallelNet(Net):
    """A network with a diffusers context-parallel plan (what supports_context_parallel looks for)."""

    _cp_plan: dict = {}

    def enable_parallelism(self, config=None) -> None:  # pragma: no cover - the strategy's call is recorded instead
        raise AssertionError("enable_context_parallel is recorded in these tests")


class Gen(nn.Module):
    """A generator holding ``transformer`` (what the strategy looks for on a method)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
