"""Contracts of the autoregressive chunk loop (genrl/rollout/autoregressive.py) on an analytic stub generator:
ar_rollout equals a step-by-step float64 reference whose noise is drawn at the documented (seed, index, step, stream)
addresses, keeps the step dtype and the generator's device (meta), honours the gradient policies, the recorded
trajectory and its defaults; new_state, step_dtype and sample_exit_step defaults and draws."""

from __future__ import annotations

import pytest
import torch

from genrl.models.causal import CausalConfig, KVCache
from genrl.models.text_encoder import Conditioning
from genrl.noise import mix_seed, randn_per_sample
from genrl.rollout.autoregressive import ChunkSchedule, ar_rollout, new_state, sample_exit_step, step_dtype

FRAME = (3, 4, 5)
W = 0.75  # the stub's velocity weight


def _cond(prompts, device="cpu") -> Conditioning:
    """One text state per prompt: hidden_states[i, 0, 0] = len(prompt) / 10 + i / 3 (not float32-representable)."""
    h = torch.tensor([len(p) / 10 + i / 3 for i, p in enumerate(prompts)], dtype=torch.float64)[:, None, None]
    h = h.expand(len(prompts), 2, 4).clone()
    return Conditioning(h.to(device), torch.ones(len(prompts), 2, dtype=torch.bool, device=device), list(prompts))


class _Stub:
    """A causal generator without a network: v = w x - 0.3 sigma + h + 0.1 end_frame, with w the single weight of
    ``transformer`` (its dtype is the model's dtype), h the prompt's text state, end_frame the cache's end. The
    velocity is returned in ``out_dtype`` when given (a low-precision model). Calls and commits are logged."""

    frame_dim = 1

    def __init__(self, dtype=torch.float64, device="cpu", trainable=False, out_dtype=None) -> None:
        self.device = torch.device(device)
        self.transformer = torch.nn.Linear(1, 1, bias=False).to(dtype)
        with torch.no_grad():
            self.transformer.weight.fill_(W)
        self.transformer.weight.requires_grad_(trainable)
        self.out_dtype = out_dtype
        self.calls: list[dict] = []
        self.commits: list[dict] = []

    def init_cache(self, batch_size, causal):
        return KVCache(causal, batch_size)

    def velocity_chunk(self, x, sigma, cond, cache):
        self.calls.append({"x": x, "sigma": sigma, "grad": torch.is_grad_enabled(), "start": cache.end_frame})
        w = self.transformer.weight.reshape(())
        h = cond.hidden_states[:, 0, 0].to(device=x.device, dtype=x.dtype).reshape(-1, 1, 1, 1, 1)
        v = w * x - 0.3 * sigma.reshape(-1, 1, 1, 1, 1) + h + 0.1 * cache.end_frame
        return v if self.out_dtype is None else v.to(self.out_dtype)

    def commit(self, x, sigma, cond, cache):
        self.commits.append({"x": x, "sigma": sigma, "start": cache.end_frame, "prompts": list(cond.prompts)})
        cache.end_frame += x.shape[1]


def _schedule(kernel="consistency", context_noise=0.0, causal=None) -> ChunkSchedule:
    return ChunkSchedule(causal=causal or CausalConfig(2, first_chunk_size=1), timesteps=[1000, 750, 500, 250],
                         shift=3.0, kernel=kernel, context_noise=context_noise)


def _reference(cond, sch, num_chunks, seed, idx, w=W, last=None):
    """The documented chunk loop written out in float64: per chunk k, step inputs x_j, predictions x0_j = x_j -
    sigma_j v_j, injected noises (step 0 and, for the consistency kernel, steps 1..), the output x0_last, and the
    committed context (x0_last, or (1 - c) x0_last + c eps at step S + 1 for context noise c)."""
    sig = sch.sigmas().tolist()
    steps = sch.num_steps
    last = steps - 1 if last is None else last
    h = cond.hidden_states[:, 0, 0].double().reshape(-1, 1, 1, 1, 1)
    chunks, end = [], 0
    for k in range(num_chunks):
        length = sch.causal.chunk_len(k)

        def eps(step, k=k, length=length):
            return randn_per_sample((length, *FRAME), seed, idx, step=step, stream=1 + k).double()

        x = eps(0)
        rec = {"x": [], "x0": [], "noise": [x], "start_frame": end}
        for j in range(last + 1):
            v = w * x - 0.3 * sig[j] + h + 0.1 * end
            x0 = x - sig[j] * v
            rec["x"].append(x)
            rec["x0"].append(x0)
            if j == last:
                break
            if sch.kernel == "consistency":
                e = eps(j + 1)
                rec["noise"].append(e)
                x = (1 - sig[j + 1]) * x0 + sig[j + 1] * e
            else:
                x = x + (sig[j + 1] - sig[j]) * v
        c = sch.context_noise
        rec["out"] = x0
        rec["ctx"] = x0 if c == 0 else (1 - c) * x0.detach() + c * eps(steps + 1)
        chunks.append(rec)
        end += length
    return chunks


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel,context_noise", [("consistency", 1 / 3), ("ode", 0.0), ("ode", 0.2)])
def test_ar_rollout_equals_the_step_by_step_reference(kernel, context_noise):
    """Each chunk's output, every step input / sigma the generator sees and every committed context (frames and
    float64 sigma) equal the float64 reference with noise from (seed, index, step, stream 1 + chunk)."""
    gen = _Stub()
    sch = _schedule(kernel, context_noise)
    cond = _cond(["a red circle", "a blue square"])
    out = ar_rollout(gen, cond, 3, FRAME, sch, seed=3, indices=[5, 9])
    ref = _reference(cond, sch, 3, 3, [5, 9])
    _close(out.latents, torch.cat([r["out"] for r in ref], 1))
    assert out.latents.dtype == torch.float64 and out.latents.shape == (2, 5, *FRAME)
    sig = sch.sigmas()
    calls = iter(gen.calls)
    for r in ref:
        for j, x in enumerate(r["x"]):
            call = next(calls)
            _close(call["x"], x)
            assert call["x"].dtype == torch.float64 and call["start"] == r["start_frame"]
            assert call["sigma"].dtype == torch.float64 and torch.equal(call["sigma"], sig[j].repeat(2))
    assert next(calls, None) is None
    assert [c["start"] for c in gen.commits] == [r["start_frame"] for r in ref]
    for c, r in zip(gen.commits, ref, strict=True):
        _close(c["x"], r["ctx"])
        assert c["sigma"].dtype == torch.float64
        assert torch.equal(c["sigma"], torch.full((2,), context_noise, dtype=torch.float64))
    assert out.grad_mask.tolist() == [[False] * 5] * 2 and out.exit_step is None and out.trajectory is None
    assert out.sigma_from is None and out.sigma_to is None and out.state.chunk_index == 3


def test_ar_rollout_default_seed_and_indices_address_seed_0_samples_0_to_b():
    """Without seed / indices the noise comes from seed 0 and sample ids 0..B-1; no trajectory is recorded by
    default."""
    gen = _Stub()
    sch = _schedule()
    cond = _cond(["a", "bb"])
    out = ar_rollout(gen, cond, 2, FRAME, sch)
    _close(out.latents, torch.cat([r["out"] for r in _reference(cond, sch, 2, 0, [0, 1])], 1))
    assert out.trajectory is None and out.state.seed == 0 and out.state.indices.tolist() == [0, 1]


def test_ar_rollout_records_the_trajectory_per_chunk():
    """record=True: per chunk exactly the documented keys, the step inputs / velocities / predictions / injected
    noises stacked [S, B, ...], the sigmas [S + 1] ending in 0, the chunk index and start frame."""
    gen = _Stub()
    sch = _schedule("consistency", 0.25)
    cond = _cond(["a red circle", "a blue square"])
    out = ar_rollout(gen, cond, 3, FRAME, sch, seed=1, indices=[2, 4], record=True)
    ref = _reference(cond, sch, 3, 1, [2, 4])
    assert len(out.trajectory) == 3
    for k, (t, r) in enumerate(zip(out.trajectory, ref, strict=True)):
        assert set(t) == {"x", "v", "x0", "noise", "sigmas", "chunk", "start_frame"}
        assert t["chunk"] == k and t["start_frame"] == r["start_frame"]
        for key in ("x", "x0", "noise"):
            assert t[key].shape[0] == 4
            _close(t[key], torch.stack(r[key]))
        torch.testing.assert_close(t["sigmas"].double(), sch.sigmas(), rtol=0, atol=1e-7)
        assert t["sigmas"][-1] == 0.0 and t["sigmas"].shape == (5,)
        # the recorded velocities are the ones each step used: x0_j = x_j - sigma_j v_j
        sig = t["sigmas"][:4].to(t["v"].dtype).reshape(4, *([1] * (t["v"].dim() - 1)))
        torch.testing.assert_close(t["x"] - sig * t["v"], t["x0"], rtol=0, atol=1e-6)


def test_ar_rollout_keeps_the_generators_device_and_the_step_dtype_on_meta():
    """On a generator whose device is meta, every chunk input, step sigma, committed context and sigma, and the
    output are on meta, in float64 for a float64 model (with context noise and the consistency kernel)."""
    gen = _Stub(device="meta")
    sch = _schedule("consistency", 0.5)
    out = ar_rollout(gen, _cond(["a", "b"], "meta"), 2, FRAME, sch, seed=2)
    assert out.latents.device.type == "meta" and out.latents.dtype == torch.float64
    assert len(gen.calls) == 8 and len(gen.commits) == 2
    for log in gen.calls + gen.commits:
        assert (log["x"].device.type, log["x"].dtype) == ("meta", torch.float64)
        assert (log["sigma"].device.type, log["sigma"].dtype, tuple(log["sigma"].shape)) == \
            ("meta", torch.float64, (2,))


def test_ar_rollout_casts_a_low_precision_velocity_to_float32_step_math():
    """A bfloat16 model's velocity is cast to float32 before the step: the output is float32 and equals the float32
    step x - sigma v with v rounded to bfloat16 (ODE kernel, one step input from the float32 noise)."""
    gen = _Stub(dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    sch = _schedule("ode", causal=CausalConfig(2))
    cond = _cond(["a", "b"])
    out = ar_rollout(gen, cond, 1, FRAME, sch, seed=5)
    assert out.latents.dtype == torch.float32
    sig = sch.sigmas().tolist()
    h = cond.hidden_states[:, 0, 0].float().reshape(-1, 1, 1, 1, 1)
    x = randn_per_sample((2, *FRAME), 5, [0, 1], step=0, stream=1)
    w = torch.tensor(W, dtype=torch.bfloat16)
    for j in range(4):
        s = torch.full((2,), sig[j], dtype=torch.float32).reshape(-1, 1, 1, 1, 1)
        v = (w * x - 0.3 * s + h).to(torch.bfloat16).float()
        x0 = x - sig[j] * v
        if j < 3:
            x = x + (sig[j + 1] - sig[j]) * v
    assert torch.equal(out.latents, x0)


@pytest.mark.parametrize("kernel", ["consistency", "ode"])
def test_ar_rollout_full_gradient_flows_through_every_step(kernel):
    """grad="full": every forward carries a graph and d(sum of latents)/dw equals the float64 reference's gradient
    through all steps (no detach between steps)."""
    gen = _Stub(trainable=True)
    sch = _schedule(kernel)
    cond = _cond(["a", "bb"])
    out = ar_rollout(gen, cond, 2, FRAME, sch, seed=4, grad="full")
    assert all(c["grad"] for c in gen.calls) and len(gen.calls) == 8
    assert out.grad_mask.all() and out.latents.requires_grad and out.exit_step is None
    out.latents.sum().backward()
    w = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    ref = torch.cat([r["out"] for r in _reference(cond, sch, 2, 4, [0, 1], w=w)], 1)
    _close(out.latents.detach(), ref.detach())
    ref.sum().backward()
    torch.testing.assert_close(gen.transformer.weight.grad.reshape(()), w.grad, rtol=1e-12, atol=1e-10)


def test_ar_rollout_no_grad_policy_and_a_frozen_model_carry_no_graph():
    """grad="none" never enables grad (trainable model): no graph, grad_mask all False; "self_forcing" on a frozen
    model enables grad at the exit step but nothing carries a graph, so grad_mask is all False too."""
    gen = _Stub(trainable=True)
    out = ar_rollout(gen, _cond(["a", "b"]), 2, FRAME, _schedule(), grad="none")
    assert [c["grad"] for c in gen.calls] == [False] * 8
    assert not out.latents.requires_grad and not out.grad_mask.any()
    frozen = _Stub()
    out = ar_rollout(frozen, _cond(["a", "b"]), 2, FRAME, _schedule(), grad="self_forcing")
    assert [c["grad"] for c in frozen.calls] == [False, False, False, True] * 2
    assert not out.latents.requires_grad and out.grad_mask.shape == (2, 3) and not out.grad_mask.any()


def test_ar_rollout_self_forcing_exit_step_default_and_first_step():
    """self_forcing defaults to the exit step S - 1 (sigma interval [sigma_{S-1}, 0]); exit step 0 is allowed and
    returns the step-0 prediction after one forward per chunk, sigma interval [sigma_0, sigma_1]."""
    sch = _schedule()
    sig = sch.sigmas().tolist()
    cond = _cond(["a", "b"])
    out = ar_rollout(_Stub(), cond, 2, FRAME, sch, seed=6, grad="self_forcing")
    assert (out.exit_step, out.sigma_from, out.sigma_to) == (3, sig[3], 0.0)
    gen = _Stub(trainable=True)
    out = ar_rollout(gen, cond, 2, FRAME, sch, seed=6, grad="self_forcing", exit_step=0)
    assert (out.exit_step, out.sigma_from, out.sigma_to) == (0, sig[0], sig[1])
    assert [c["grad"] for c in gen.calls] == [True, True] and out.grad_mask.all()
    _close(out.latents.detach(), torch.cat([r["out"] for r in _reference(cond, sch, 2, 6, [0, 1], last=0)], 1))


def test_ar_rollout_state_and_cond_must_not_disagree():
    """Continuing a state with another conditioning is refused (naming cond / state); passing the state's own
    conditioning is allowed."""
    gen = _Stub()
    sch = _schedule()
    first = ar_rollout(gen, _cond(["a", "b"]), 1, FRAME, sch)
    with pytest.raises(ValueError, match="either cond .* or state"):
        ar_rollout(gen, _cond(["a", "b"]), 1, FRAME, sch, state=first.state)
    more = ar_rollout(gen, first.state.cond, 1, FRAME, sch, state=first.state)
    assert more.state.chunk_index == 2 and more.latents.shape == (2, 2, *FRAME)


def test_ar_rollout_prompt_switch_uses_the_given_mode():
    """A prompt switch in "swap" mode re-commits nothing: one commit per generated chunk, and later chunks see the
    new prompt."""
    gen = _Stub()
    new = _cond(["new one", "new two"])
    out = ar_rollout(gen, _cond(["a", "b"]), 3, FRAME, _schedule(), prompt_switches={2: (new, "swap")})
    assert [c["start"] for c in gen.commits] == [0, 1, 3]
    assert [c["prompts"] for c in gen.commits] == [["a", "b"]] * 2 + [new.prompts]
    assert out.state.segment == 1 and out.state.cond is new


def test_ar_rollout_progress_bar_only_when_asked(monkeypatch):
    """The progress bar (rich's track over the chunks) is off by default; progress=True wraps the chunk range and
    gives the same latents."""
    import rich.progress

    seen = []
    real = rich.progress.track

    def spy(sequence, *args, **kw):
        seen.append(list(sequence))
        return real(sequence, *args, **kw)

    monkeypatch.setattr(rich.progress, "track", spy)
    cond = _cond(["a", "b"])
    plain = ar_rollout(_Stub(), cond, 2, FRAME, _schedule(), seed=1)
    assert seen == []
    shown = ar_rollout(_Stub(), cond, 2, FRAME, _schedule(), seed=1, progress=True)
    assert seen == [[0, 1]]
    assert torch.equal(shown.latents, plain.latents)


def test_new_state_default_frame_axis_and_int64_indices():
    """A generator without frame_dim gets frame axis 1; given indices are int64 even for an empty batch."""

    class _NoFrameDim:
        def init_cache(self, batch_size, causal):
            return KVCache(causal, batch_size)

    state = new_state(_NoFrameDim(), _cond(["a", "b"]), CausalConfig(2), seed=1, indices=[4, 2])
    assert state.frame_dim == 1 and state.indices.dtype == torch.long and state.indices.tolist() == [4, 2]
    empty = new_state(_NoFrameDim(), _cond([]), CausalConfig(2), seed=1, indices=[])
    assert empty.indices.dtype == torch.long and empty.batch_size == 0


def test_step_dtype_is_float64_only_for_a_float64_model():
    """float64 parameters give float64; float32 parameters, a transformer without parameters, or no transformer
    give float32."""

    class _G:
        def __init__(self, transformer):
            self.transformer = transformer

    assert step_dtype(_G(torch.nn.Linear(1, 1).double())) == torch.float64
    assert step_dtype(_G(torch.nn.Linear(1, 1))) == torch.float32
    assert step_dtype(_G(torch.nn.Identity())) == torch.float32
    assert step_dtype(object()) == torch.float32


def test_sample_exit_step_draws_from_the_rank_stream_and_last_mode():
    """uniform: rank r's draw is randint(S) seeded by mix_seed(seed, iteration, r, 0xE817), rank 0 by default;
    "last" gives S - 1 (S = 1 allowed, giving 0)."""
    for it in range(8):
        for rank in (0, 1):
            g = torch.Generator().manual_seed(mix_seed(5, it, rank, 0xE817))
            want = int(torch.randint(1000, (1,), generator=g))
            assert sample_exit_step(1000, 5, it, rank=rank) == want
        assert sample_exit_step(1000, 5, it) == sample_exit_step(1000, 5, it, rank=0)
    assert [sample_exit_step(s, 5, 3, mode="last") for s in (1, 2, 1000)] == [0, 1, 999]
    assert sample_exit_step(1, 5, 3) == 0


def test_sample_exit_step_returns_the_broadcast_value():
    """With broadcast, the rank's own draw is passed to it and its (rank 0's) value is returned, as an int."""
    seen = []

    def broadcast(value):
        seen.append(value)
        return torch.tensor(7)

    assert sample_exit_step(1000, 2, 1, rank=1, broadcast=broadcast) == 7
    assert seen == [sample_exit_step(1000, 2, 1, rank=1)]
    assert isinstance(sample_exit_step(1000, 2, 1, rank=1, broadcast=broadcast), int)
