"""Diffusion-forcing frame schedules (genrl.flow.frame_schedules): scheduling-matrix invariants in float64 (closed
forms, pyramid(lag=0) == full sequence, autoregressive == pyramid(lag=S), row count) and the training-time per-frame
sigma sampler (marginal, independence, history structure, frame groups, determinism, errors)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from genrl.flow import (
    TimestepSampler,
    diffusion_forcing_sigmas,
    frame_schedule,
    schedule_transitions,
    shift_sigmas,
    sigma_schedule,
)

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------ frame_schedule
def test_pyramid_closed_form_small():
    """S = 2, T = 3, first frame history, lag 1: grid [1, 1/2, 0]; frame 2 starts one step after frame 1."""
    got = frame_schedule(2, 3, 1, kind="pyramid", lag=1)
    want = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.5, 1.0], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]], dtype=F64)
    assert got.dtype == F64
    assert torch.equal(got, want)
    # shift 3 maps 1/2 to 3/4 exactly; a bool-mask history at the end with stabilization
    got = frame_schedule(2, 3, [False, False, True], kind="autoregressive", shift=3.0, stabilization=0.25)
    want = torch.tensor(
        [[1.0, 1.0, 0.25], [0.75, 1.0, 0.25], [0.0, 1.0, 0.25], [0.0, 0.75, 0.25], [0.0, 0.0, 0.25]], dtype=F64
    )
    assert torch.equal(got, want)


def test_full_sequence_columns_are_the_sampling_grid():
    m = frame_schedule(7, 5, 2, shift=3.0, sigma_max=0.9, stabilization=0.02)
    grid = sigma_schedule(7, 3.0, 0.9)
    assert m.shape == (8, 5)
    for f in (2, 3, 4):
        assert torch.equal(m[:, f], grid)
    assert torch.equal(m[:, :2], torch.full((8, 2), 0.02, dtype=F64))
    assert m[0, 2].item() == shift_sigmas(0.9, 3.0)


CASES = list(
    itertools.product(
        (1, 2, 5),  # num_steps
        (1, 3, 6),  # num_frames
        (0, 1, 2),  # history k (skipped when >= num_frames)
        (1.0, 3.0),  # shift
    )
)


@pytest.mark.parametrize("steps,frames,k,shift", CASES)
def test_matrix_invariants(steps, frames, k, shift):
    if k >= frames:
        return
    sigma_max, stab = 0.8, 0.05
    top = shift_sigmas(sigma_max, shift)
    gen_cols = list(range(k, frames))
    n_gen = len(gen_cols)
    full = frame_schedule(steps, frames, k, shift=shift, sigma_max=sigma_max, stabilization=stab)
    for lag in range(0, steps + 1):
        m = frame_schedule(
            steps, frames, k, kind="pyramid", lag=lag, shift=shift, sigma_max=sigma_max, stabilization=stab
        )
        assert m.dtype == F64
        assert m.shape == (steps + lag * (n_gen - 1) + 1, frames)  # row count formula
        assert bool((m[1:] <= m[:-1]).all())  # every column non-increasing
        assert bool((m[0, gen_cols] == top).all())
        assert bool((m[-1, gen_cols] == 0.0).all())
        assert bool((m[:, :k] == stab).all())  # history constant
        assert bool((m[1:] != m[:-1]).any(dim=1).all())  # no two consecutive rows equal
        # earlier generated frames are never noisier than later ones
        assert bool((m[:, gen_cols][:, 1:] >= m[:, gen_cols][:, :-1]).all())
        # every generated frame visits exactly the S + 1 grid values
        grid = sigma_schedule(steps, shift, sigma_max)
        for f in gen_cols:
            assert torch.equal(torch.unique_consecutive(m[:, f]), grid)
        if lag == 0:
            assert torch.equal(m, full)  # bitwise
        if lag == steps:
            auto = frame_schedule(
                steps, frames, k, kind="autoregressive", shift=shift, sigma_max=sigma_max, stabilization=stab
            )
            assert torch.equal(auto, m)


def test_bool_mask_history_orders_generated_frames_by_position():
    mask = torch.tensor([True, False, True, False, False])
    m = frame_schedule(3, 5, mask, kind="pyramid", lag=2)
    assert m.shape == (3 + 2 * 2 + 1, 5)
    grid = sigma_schedule(3)
    for j, f in enumerate((1, 3, 4)):
        idx = (torch.arange(m.shape[0]) - 2 * j).clamp(0, 3)
        assert torch.equal(m[:, f], grid[idx])
    assert bool((m[:, [0, 2]] == 0.0).all())
    # the same mask as a list of python bools
    assert torch.equal(frame_schedule(3, 5, mask.tolist(), kind="pyramid", lag=2), m)


def test_schedule_transitions():
    m = frame_schedule(2, 3, 1, kind="pyramid", lag=1)
    s_from, s_to, active = schedule_transitions(m)
    assert torch.equal(s_from, m[:-1]) and torch.equal(s_to, m[1:])
    assert active.dtype == torch.bool
    assert active.tolist() == [[False, True, False], [False, True, True], [False, False, True]]
    # autoregressive: exactly one frame moves per step; full sequence: every generated frame moves every step
    _, _, a = schedule_transitions(frame_schedule(4, 5, 2, kind="autoregressive"))
    assert a.sum(dim=1).tolist() == [1] * 12
    _, _, a = schedule_transitions(frame_schedule(4, 5, 2))
    assert torch.equal(a, torch.tensor([[False, False, True, True, True]] * 4))


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((0, 4, 1), {}, "num_steps"),
        ((3, 0, 0), {}, "num_frames"),
        ((3, 4, 4), {}, "history"),
        ((3, 4, -1), {}, "history"),
        ((3, 4, [True] * 4), {}, "all 4 frames"),
        ((3, 4, [True, False]), {}, "num_frames = 4"),
        ((3, 4, [1, 0, 0, 0]), {}, "python bools"),
        ((3, 4, torch.tensor([1, 0, 0, 0])), {}, "bool mask"),
        ((3, 4, 1), {"kind": "pyramid", "lag": -1}, "lag"),
        ((3, 4, 1), {"kind": "pyramid", "lag": 4}, "lag"),
        ((3, 4, 1), {"kind": "pyramid"}, "lag=None"),
        ((3, 4, 1), {"kind": "full_sequence", "lag": 1}, "lag applies to"),
        ((3, 4, 1), {"kind": "autoregressive", "lag": 3}, "lag applies to"),
        ((3, 4, 1), {"stabilization": 1.0}, "stabilization"),
        ((3, 4, 1), {"stabilization": -0.1}, "stabilization"),
        ((3, 4, 1), {"kind": "causal"}, "kind"),
        ((3, 4, 1), {"sigma_max": 0.0}, "sigma_max"),
        ((3, 4, 1), {"shift": 0.0}, "shift"),
    ],
)
def test_frame_schedule_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        frame_schedule(*args, **kwargs)


def test_schedule_transitions_errors():
    with pytest.raises(ValueError, match="at least 2 rows"):
        schedule_transitions(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="2-d floating"):
        schedule_transitions(torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="2-d floating"):
        schedule_transitions(torch.zeros(3, 3, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ training sigmas
def test_independent_marginal_is_uniform_and_frames_uncorrelated():
    s = diffusion_forcing_sigmas(4000, 4, generator=_gen(0))
    assert s.shape == (4000, 4) and s.dtype == torch.float32
    assert bool(((s >= 0) & (s < 1)).all())
    x = s.flatten().double().sort().values
    n = x.numel()
    ecdf = torch.arange(1, n + 1, dtype=F64) / n
    ks = torch.maximum((ecdf - x).abs(), (ecdf - 1.0 / n - x).abs()).max().item()
    assert ks < 1.63 / math.sqrt(n)  # Kolmogorov-Smirnov, 1 % level
    assert abs(x.mean().item() - 0.5) < 0.01
    corr = torch.corrcoef(s.T.double())
    off = corr[~torch.eye(4, dtype=torch.bool)]
    assert off.abs().max().item() < 0.05
    # the default sampler is U[0, 1) drawn as TimestepSampler("uniform") from the same generator state
    assert torch.equal(s, TimestepSampler("uniform")((4000, 4), _gen(0)))


def test_sampler_is_the_marginal_and_frame_groups_repeat():
    sampler = TimestepSampler("logit_normal", logit_mean=0.3, logit_std=1.2)
    s = diffusion_forcing_sigmas(5, 6, generator=_gen(3), frame_group=2, sampler=sampler, dtype=F64)
    direct = sampler((5, 3), _gen(3)).repeat_interleave(2, dim=1)
    assert s.dtype == F64
    assert torch.equal(s, direct.double())
    assert torch.equal(s[:, 0::2], s[:, 1::2])
    assert not torch.equal(s[:, 0], s[:, 2])


def test_same_generator_state_same_output():
    for mode, hist in (("independent", None), ("history", [0, 2, 4])):
        a = diffusion_forcing_sigmas(8, 6, generator=_gen(11), mode=mode, history=hist, frame_group=2)
        b = diffusion_forcing_sigmas(8, 6, generator=_gen(11), mode=mode, history=hist, frame_group=2)
        c = diffusion_forcing_sigmas(8, 6, generator=_gen(12), mode=mode, history=hist, frame_group=2)
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
    g = _gen(5)
    first = diffusion_forcing_sigmas(2, 4, generator=g)
    assert not torch.equal(first, diffusion_forcing_sigmas(2, 4, generator=g))  # the generator advances


def _inferred_history(s: torch.Tensor, g: int) -> torch.Tensor:
    """The first group k from which every group equals the last one, times g (a.s. the drawn h)."""
    groups = s[:, ::g]
    same = groups == groups[:, -1:]
    # trailing run of True: count from the end
    tail = torch.flip(same, dims=[1]).int().cumprod(dim=1).sum(dim=1)
    return (groups.shape[1] - tail) * g


def test_history_mode_structure_and_allowed_lengths():
    allowed = [0, 2, 6]
    b, t, g = 3000, 8, 2
    s = diffusion_forcing_sigmas(b, t, generator=_gen(1), mode="history", history=allowed, frame_group=g)
    assert torch.equal(s[:, 0::2], s[:, 1::2])  # frame groups
    h = _inferred_history(s, g)
    for i in range(b):
        hi = int(h[i])
        assert hi in allowed
        assert bool((s[i, hi:] == s[i, hi]).all())  # all frames after h share one sigma
    counts = torch.bincount(h, minlength=t)[allowed].double() / b
    assert (counts - 1 / 3).abs().max().item() < 0.04  # uniform over the allowed set, each value appears
    # every frame's marginal is still U[0, 1)
    assert abs(s.double().mean().item() - 0.5) < 0.01


def test_history_mode_reproduces_the_documented_draws():
    sampler = TimestepSampler("logit_normal")
    s = diffusion_forcing_sigmas(6, 8, generator=_gen(4), mode="history", history=4, frame_group=2, sampler=sampler)
    g = _gen(4)
    pick = torch.randint(3, (6,), generator=g)  # allowed = [0, 2, 4]
    raw = sampler((6, 4), g)
    start = pick  # h / g = index in [0, 2, 4] / 2
    want = torch.stack([raw[i, torch.arange(4).clamp(max=int(start[i]))] for i in range(6)]).repeat_interleave(2, 1)
    assert torch.equal(s, want)


def test_history_defaults_to_every_multiple_of_the_group_below_T():
    s = diffusion_forcing_sigmas(600, 6, generator=_gen(2), mode="history", frame_group=2)
    h = _inferred_history(s, 2)
    assert sorted(set(h.tolist())) == [0, 2, 4]
    s = diffusion_forcing_sigmas(400, 3, generator=_gen(2), mode="history", history=1)
    assert sorted(set(_inferred_history(s, 1).tolist())) == [0, 1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_frames": 5, "frame_group": 2}, "divisible"),
        ({"batch": 0}, "batch"),
        ({"num_frames": 0}, "num_frames"),
        ({"frame_group": 0}, "frame_group"),
        ({"mode": "uniform_future"}, "mode"),
        ({"history": 2}, "mode='history' only"),
        ({"mode": "history", "history": [1], "frame_group": 2}, "multiples of frame_group"),
        ({"mode": "history", "history": [6]}, r"\[0, 5\]"),
        ({"mode": "history", "history": [-1]}, "got \\[-1\\]"),
        ({"mode": "history", "history": []}, "non-empty"),
        ({"mode": "history", "history": [0, 0]}, "distinct"),
        ({"mode": "history", "history": 6}, "largest history length"),
        ({"dtype": torch.int64}, "dtype"),
        ({"sampler": 0.5}, "sampler"),
        ({"sampler": lambda shape, gen: torch.rand(3)}, "requested shape"),
    ],
)
def test_diffusion_forcing_sigmas_errors(kwargs, match):
    args = {"batch": 2, "num_frames": 6, "generator": _gen(0)} | kwargs
    with pytest.raises(ValueError, match=match):
        diffusion_forcing_sigmas(args.pop("batch"), args.pop("num_frames"), **args)


def test_generator_is_required():
    with pytest.raises(TypeError, match="torch.Generator"):
        diffusion_forcing_sigmas(2, 4, generator=None)
