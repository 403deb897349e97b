"""EMA callback, called directly (no trainer run): its checkpoint state and the validation swap.

The end-to-end EMA tests (resume, export) go through a Lightning trainer; these pin the two hooks' contracts in
closed form so a wrong key, a lost loaded state or an inverted swap condition fails in milliseconds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from genrl.callbacks.ema import EMA


class _Tiny(torch.nn.Module):
    """One trainable 2-vector ``w``."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((2,), value, dtype=torch.float64))


def _trainer(fn: TrainerFn) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(fn=fn))


def test_state_dict_has_exactly_the_documented_keys_and_values():
    """state_dict() is {"shadow": {name: tensor}, "num_updates": int}, with the shadow's exact values."""
    ema = EMA()
    ema.shadow = {"w": torch.tensor([1.5, -2.0])}
    ema.num_updates = 7
    state = ema.state_dict()
    assert set(state) == {"shadow", "num_updates"}
    assert state["num_updates"] == 7
    assert set(state["shadow"]) == {"w"}
    assert torch.equal(state["shadow"]["w"], torch.tensor([1.5, -2.0]))


def test_load_state_dict_is_applied_at_the_next_ensure_and_clears_the_old_shadow():
    """After load_state_dict the shadow is emptied and the next use restores the loaded shadow and update count."""
    src = EMA()
    src.shadow = {"w": torch.tensor([3.0, 4.0])}
    src.num_updates = 5
    state = src.state_dict()

    dst = EMA()
    module = _Tiny(1.0)
    dst._ensure(module)  # a shadow from the raw weights, to be replaced by the loaded one
    assert torch.equal(dst.shadow["w"], torch.tensor([1.0, 1.0]))
    dst.load_state_dict(state)
    assert dst.shadow == {}
    dst._ensure(module)
    assert torch.equal(dst.shadow["w"], torch.tensor([3.0, 4.0]))
    assert dst.shadow["w"].dtype == torch.float32
    assert dst.num_updates == 5


@pytest.mark.parametrize(
    ("validate_with_ema", "fn", "already_swapped", "swaps"),
    [
        (True, TrainerFn.FITTING, False, True),
        (True, TrainerFn.VALIDATING, False, False),  # `genrl validate`: the raw weights are what is validated
        (False, TrainerFn.FITTING, False, False),
        (True, TrainerFn.FITTING, True, False),  # never swap twice (that would put the raw weights back)
    ],
)
def test_validation_swaps_in_the_ema_weights_only_when_asked_during_fit(validate_with_ema, fn, already_swapped, swaps):
    """on_validation_epoch_start puts the EMA weights in exactly when validate_with_ema, fitting and not swapped."""
    ema = EMA(validate_with_ema=validate_with_ema)
    module = _Tiny(1.0)
    ema.shadow = {"w": torch.tensor([3.0, 5.0])}
    ema._swapped = already_swapped
    ema.on_validation_epoch_start(_trainer(fn), module)
    expected = [3.0, 5.0] if swaps else [1.0, 1.0]
    assert torch.equal(module.w.detach(), torch.tensor(expected, dtype=torch.float64))
    assert ema._swapped == (swaps or already_swapped)


def test_validation_end_puts_the_raw_weights_back_and_keeps_the_shadow():
    """A swap at validation start and the swap back at its end leave the raw weights and the shadow as they were."""
    ema = EMA()
    module = _Tiny(1.0)
    ema.shadow = {"w": torch.tensor([3.0, 5.0])}
    trainer = _trainer(TrainerFn.FITTING)
    ema.on_validation_epoch_start(trainer, module)
    assert torch.equal(module.w.detach(), torch.tensor([3.0, 5.0], dtype=torch.float64))
    ema.on_validation_epoch_end(trainer, module)
    assert torch.equal(module.w.detach(), torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert torch.equal(ema.shadow["w"], torch.tensor([3.0, 5.0]))
    assert ema._swapped is False
