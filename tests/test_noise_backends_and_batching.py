"""Noise drawn where the model runs (the Philox counter backend, the per-sample device generators) and the sampler's
batching modes (fixed, fast, bucketed): closed-form references, addresses, batch composition, call sizes."""

from __future__ import annotations

import math

import pytest
import torch

import genrl.noise as noise_mod
from genrl.models import DiTGenerator
from genrl.noise import mix_seed, philox4x32, rand_per_sample, randn_per_sample
from genrl.rollout import RolloutConfig, rollout, transition_log_prob
from genrl.rollout.sampler import call_plan, guided_velocity
from genrl.rollout.tree import TreeConfig, regenerate_leaf, tree_rollout

M32 = 0xFFFFFFFF


def _philox_reference(ctr: list[int], key: list[int], rounds: int = 10) -> list[int]:
    """Philox4x32 with Python integers (Salmon et al. 2011, section 5): mulhi / mullo of the 64-bit product."""
    c, k = list(ctr), list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return c


# ------------------------------------------------------------------------------------------------ Philox itself


@pytest.mark.parametrize("ctr,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox4x32_10_matches_the_random123_known_answers(ctr, key, expected):
    """Random123's known-answer vectors for Philox4x32-10 (zero, all-ones and the pi-digit counter / key)."""
    assert tuple(int(w) for w in philox4x32(ctr, key)) == expected
    assert tuple(_philox_reference(list(ctr), list(key))) == expected


def test_philox4x32_tensor_ops_equal_the_integer_reference_on_random_words():
    """1,000 random (counter, key) pairs, words over the whole 32-bit range (the top bit set half the time: an int64
    overflow in the 32 x 32-bit products would show), and 7 rounds: the tensor version equals exact integers."""
    g = torch.Generator().manual_seed(0)
    ctr = torch.randint(0, 2**32, (4, 1000), generator=g, dtype=torch.int64)
    key = torch.randint(0, 2**32, (2, 1000), generator=g, dtype=torch.int64)
    for rounds in (10, 7):
        out = torch.stack(philox4x32(list(ctr), list(key), rounds=rounds))
        for j in range(0, 1000, 37):
            ref = _philox_reference([int(c) for c in ctr[:, j]], [int(k) for k in key[:, j]], rounds)
            assert out[:, j].tolist() == ref
        assert int(out.min()) >= 0 and int(out.max()) <= M32


def test_philox_normals_are_box_muller_of_the_address_words():
    """Element 2j / 2j + 1 of a sample's normals is Box-Muller of words 2j, 2j + 1 of Philox(counter j // 2, key =
    the address hash): uniforms (k + 1) / 2^24 and k / 2^24 from the top 24 bits, checked in float64 (float32 tol)."""
    z = randn_per_sample((3, 5), 3, [17], step=2, stream=1, backend="philox")[0].flatten().double()
    h = mix_seed(3, 17, 2, 1)
    words = [w for c in range(4) for w in _philox_reference([c, 0, 0, 0], [h & M32, h >> 32])]
    for e in range(15):
        a, b = words[2 * (e // 2)], words[2 * (e // 2) + 1]
        u1, u2 = ((a >> 8) + 1) / 2**24, (b >> 8) / 2**24
        r, t = math.sqrt(-2 * math.log(u1)), 2 * math.pi * u2
        assert z[e].item() == pytest.approx(r * (math.cos(t) if e % 2 == 0 else math.sin(t)), abs=2e-6)
    u = rand_per_sample((6,), 3, [17], step=2, stream=1, backend="philox")[0].double()
    assert u.tolist() == [(w >> 8) / 2**24 for w in words[:6]]  # exact: multiples of 2^-24


@pytest.mark.parametrize("draw", [randn_per_sample, rand_per_sample])
def test_philox_row_is_a_pure_function_of_its_address(draw):
    """Philox rows are bitwise equal whatever the other rows (subset, order, duplicates), and a longer draw starts
    with the shorter one (element e depends on (address, e) only)."""
    full = draw((4, 6), 5, [3, 9, 40, 7], step=2, stream=1, backend="philox")
    sub = draw((4, 6), 5, [7, 3, 3], step=2, stream=1, backend="philox")
    assert torch.equal(sub[0], full[3]) and torch.equal(sub[1], full[0]) and torch.equal(sub[2], full[0])
    longer = draw((50,), 5, [9], step=2, stream=1, backend="philox")
    assert torch.equal(longer[0, :24], full[1].flatten())
    assert draw((4, 6), 5, [9], step=2, stream=1, dtype=torch.float64, backend="philox").dtype == torch.float64


def test_philox_addresses_give_independent_standard_normals():
    """65,536 normals: mean, variance, tail mass and the fourth moment within 5 standard errors of N(0, 1); rows of
    neighbouring addresses (seed, index, step, stream each changed alone) uncorrelated; the two backends differ."""
    z = randn_per_sample((4096,), 0, range(16), backend="philox").double()
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2 / n)
    assert abs(float((z.abs() > 1.959964).double().mean()) - 0.05) < 5 * math.sqrt(0.05 * 0.95 / n)
    assert abs(float((z**4).mean()) - 3) < 5 * math.sqrt(96 / n)
    base = randn_per_sample((2048,), 1, [4], step=2, stream=3, backend="philox")[0].double()
    for other in ([2, [4], 2, 3], [1, [5], 2, 3], [1, [4], 3, 3], [1, [4], 2, 4]):
        seed, idx, step, stream = other
        o = randn_per_sample((2048,), seed, idx, step=step, stream=stream, backend="philox")[0].double()
        r = float(torch.corrcoef(torch.stack([base, o]))[0, 1])
        assert abs(r) < 5 / math.sqrt(2048), (other, r)
    assert not torch.equal(randn_per_sample((64,), 1, [4]), randn_per_sample((64,), 1, [4], backend="philox"))
    u = rand_per_sample((4096,), 0, range(4), backend="philox").double()
    assert float(u.min()) >= 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / u.numel())


def test_generator_backend_draws_on_the_requested_device_and_backends_are_checked(monkeypatch):
    """The default backend draws from a generator on the draw's device (no host copy), reseeded per sample with the
    address hash, and keeps the CPU values it always had (those of ``sample_generator``); an unknown backend is
    refused, naming it (in the draw and in RolloutConfig)."""
    seen = []
    real = torch.Generator

    def spy(device="cpu"):
        seen.append(torch.device(device).type)
        return real(device)

    monkeypatch.setattr(noise_mod.torch, "Generator", spy)
    out = randn_per_sample((3,), 2, [0, 1], device="cpu")
    monkeypatch.undo()
    assert seen == ["cpu"]  # one generator on the draw's device, reseeded per row
    for row in (0, 1):
        assert torch.equal(out[row], torch.randn((3,), generator=noise_mod.sample_generator(2, row, 0, 0)))
    with pytest.raises(ValueError, match="unknown noise backend 'cuda_philox'"):
        randn_per_sample((3,), 2, [0], backend="cuda_philox")
    with pytest.raises(ValueError, match="unknown noise backend 'fast'"):
        RolloutConfig(noise_backend="fast")
    with pytest.raises(ValueError, match="unknown batching 'dynamic'"):
        RolloutConfig(batching="dynamic")


# ------------------------------------------------------------------------------------------------ batching modes


def test_call_plan_sizes_in_closed_form():
    """fixed: calls of exactly ``size`` (last padded by its last row); fast: ceil(n / size) near-equal calls, no
    padding; bucketed: the fast split padded to powers of two capped at ``size``. Every row once, in order."""
    assert call_plan(10, 4, "fixed") == [([0, 1, 2, 3], [0, 1, 2, 3]), ([4, 5, 6, 7], [4, 5, 6, 7]),
                                         ([8, 9], [8, 9, 9, 9])]
    assert call_plan(10, 4, "fast") == [([0, 1, 2, 3], [0, 1, 2, 3]), ([4, 5, 6], [4, 5, 6]), ([7, 8, 9], [7, 8, 9])]
    assert call_plan(10, 4, "bucketed") == [([0, 1, 2, 3], [0, 1, 2, 3]), ([4, 5, 6], [4, 5, 6, 6]),
                                            ([7, 8, 9], [7, 8, 9, 9])]
    assert call_plan(5, 32, "fast") == [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])]
    assert call_plan(5, 32, "bucketed") == [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 4, 4, 4])]
    assert call_plan(5, 6, "bucketed") == [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 4])]  # capped at size, not 8
    assert call_plan(33, 32, "fast") == [(list(range(17)), list(range(17))), (list(range(17, 33)), list(range(17, 33)))]
    for n in (1, 7, 64, 65):
        for mode in ("fixed", "fast", "bucketed"):
            plan = call_plan(n, 16, mode)
            assert [r for rows, _ in plan for r in rows] == list(range(n))
            assert all(p[: len(r)] == r and set(p[len(r):]) <= {r[-1]} for r, p in plan)
            assert all(len(p) <= 16 for _, p in plan) and len(plan) == -(-n // 16)
    with pytest.raises(ValueError, match="unknown batching 'auto'"):
        call_plan(4, 2, "auto")


class _SizeSpy:
    """v = -x + sigma per row, recording the batch size of every network call."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.calls: list[int] = []

    def encode_prompts(self, prompts):
        from genrl.models.text_encoder import Conditioning

        return Conditioning(torch.zeros(len(prompts), 2, 4), torch.ones(len(prompts), 2, dtype=torch.bool),
                            list(prompts))

    def velocity(self, x, sigma, cond, **kwargs):
        self.calls.append(x.shape[0])
        return -x + sigma.reshape(-1, *([1] * (x.ndim - 1)))


@pytest.mark.parametrize("batching,cfg", [("fixed", 1.0), ("fast", 1.0), ("bucketed", 1.0), ("fast", 2.0)])
def test_tree_rollout_network_calls_are_sized_to_the_frontier(batching, cfg):
    """Two trees, factor 2, splits {0, 1, 3} of 5 steps: frontiers 2, 4, 8, 8, 16 nodes. Micro-batch 8: fixed pays
    8 rows per call (2 + 1 + 1 + 1 + 2 calls = 56 rows); fast calls exactly the frontier (in 2 calls of 8 at the
    last step); bucketed pads to powers of two (same here); CFG doubles each call's rows."""
    spy = _SizeSpy()
    config = RolloutConfig(num_steps=5, kernel="dance_grpo", noise_level=0.3, micro_batch_size=8, batching=batching,
                           cfg_scale=cfg)
    ro = tree_rollout(spy, ["a", "b"], (2, 3), seed=1, config=config, tree=TreeConfig(split_steps=[0, 1, 3]))
    assert [x.shape[0] for x in ro.latents[:-1]] == [2, 4, 8, 8, 16]
    expected = {"fixed": [8, 8, 8, 8, 8, 8], "fast": [2, 4, 8, 8, 8, 8], "bucketed": [2, 4, 8, 8, 8, 8]}[batching]
    assert spy.calls == [c * (2 if cfg != 1.0 else 1) for c in expected]


def test_bucketed_pads_an_odd_frontier_to_a_power_of_two():
    """Three trees: frontiers 3, 6, 12 with micro-batch 16: fast calls 3, 6, 12 rows, bucketed 4, 8, 16."""
    for batching, expected in (("fast", [3, 6, 12]), ("bucketed", [4, 8, 16])):
        spy = _SizeSpy()
        config = RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.3, micro_batch_size=16,
                               batching=batching)
        tree_rollout(spy, ["a", "b", "c"], (2,), seed=0, config=config, tree=TreeConfig(split_steps=[0, 1]))
        assert spy.calls == expected


@pytest.fixture(scope="module")
def dit(tiny_dit_generator) -> DiTGenerator:
    return tiny_dit_generator


PROMPTS = ["a red circle moving left slowly", "a blue square", "a green triangle moving up quickly",
           "a red circle", "a cyan square staying still"]


def test_fast_batching_equals_fixed_up_to_rounding_and_scores_its_own_batch_exactly(dit):
    """A real tiny DiT: fast and bucketed rollouts equal the fixed one to float32 rounding (same noise, different
    call sizes), and the recomputed log-prob of the whole fast batch equals its recorded one bitwise (same calls)."""
    shape = (4, 3, 8, 8)
    base = dict(num_steps=4, kernel="flow_grpo", noise_level=0.7, cfg_scale=2.0, micro_batch_size=4)
    fixed = rollout(dit, PROMPTS, shape, seed=3, config=RolloutConfig(**base))
    for batching in ("fast", "bucketed"):
        fast = rollout(dit, PROMPTS, shape, seed=3, config=RolloutConfig(**base, batching=batching))
        torch.testing.assert_close(fast.final, fixed.final, rtol=0, atol=1e-5)
        torch.testing.assert_close(fast.log_probs, fixed.log_probs, rtol=0, atol=1e-4)
        for k in fast.sde_steps:
            lp, _, _ = transition_log_prob(dit, fast, k)
            assert torch.equal(lp, fast.log_probs[:, k])


@pytest.mark.parametrize("backend", ["generator", "philox"])
def test_each_backend_regenerates_a_sample_and_a_leaf_alone_bitwise(dit, backend):
    """Under fixed batching, either noise backend regenerates a flat sample alone and a tree leaf as a chain bitwise;
    the backend changes the samples."""
    shape = (4, 3, 8, 8)
    config = RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.3, micro_batch_size=4,
                           noise_backend=backend)
    full = rollout(dit, PROMPTS, shape, seed=5, indices=[20, 21, 22, 23, 24], config=config)
    alone = rollout(dit, PROMPTS[3:4], shape, seed=5, indices=[23], config=config)
    assert torch.equal(full.final[3], alone.final[0]) and torch.equal(full.noises[3], alone.noises[0])
    tree = TreeConfig(split_steps=[0, 1])
    ro = tree_rollout(dit, PROMPTS[:2], shape, seed=5, tree_indices=[7, 8], config=config, tree=tree)
    leaf = 5  # tree 1, code 1
    x = regenerate_leaf(dit, PROMPTS[1], shape, 5, 8, int(ro.codes[-1][leaf]), config, tree)
    assert torch.equal(x.cpu(), ro.leaves[leaf])
    other = "philox" if backend == "generator" else "generator"
    swapped = rollout(dit, PROMPTS[3:4], shape, seed=5, indices=[23], config=RolloutConfig(
        **{**vars(config), "noise_backend": other}))
    assert not torch.allclose(swapped.final, alone.final)


def test_guided_velocity_single_full_call_does_not_copy_and_matches_indexing(dit):
    """When one call covers every row in order (n == micro-batch, or fast with n <= micro-batch) the inputs go to the
    network as they are; the result equals the fixed padded path bitwise when the shapes agree."""
    cond = dit.encode_prompts(PROMPTS[:4])
    x = torch.randn(4, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    s = torch.full((4,), 0.5)
    a = guided_velocity(dit, x, s, cond, None, 1.0, 4, "fixed")
    b = guided_velocity(dit, x, s, cond, None, 1.0, 8, "fast")
    assert torch.equal(a, b)


def test_validation_sampler_keeps_the_rollouts_batching_and_noise_backend():
    """The default validation sampler (ODE) of a flat method inherits batching and noise backend from the rollout."""
    from genrl.methods.common import ode_validation_config

    val = ode_validation_config(RolloutConfig(batching="bucketed", noise_backend="philox", micro_batch_size=16))
    assert (val.kernel, val.batching, val.noise_backend, val.micro_batch_size) == ("ode", "bucketed", "philox", 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device next to the CPU")
def test_cuda_draws_are_made_on_the_device_and_reproducible_by_address():
    """On CUDA both backends return device tensors, rows bitwise equal across batch compositions; Philox uniforms
    equal the CPU's exactly, its normals to an ulp or so; CUDA generators differ from CPU ones."""
    for backend in ("generator", "philox"):
        full = randn_per_sample((4, 8), 2, [3, 9, 40], step=1, device="cuda", backend=backend)
        part = randn_per_sample((4, 8), 2, [40, 3], step=1, device="cuda", backend=backend)
        assert full.device.type == "cuda" and torch.equal(part[0], full[2]) and torch.equal(part[1], full[0])
    u = rand_per_sample((64,), 2, [3], device="cuda", backend="philox").cpu()
    assert torch.equal(u, rand_per_sample((64,), 2, [3], backend="philox"))
    z = randn_per_sample((64,), 2, [3], device="cuda", backend="philox").cpu()
    torch.testing.assert_close(z, randn_per_sample((64,), 2, [3], backend="philox"), rtol=0, atol=1e-5)


def test_sampler_overhead_benchmark_measures_a_tiny_family():
    """benchmarks/sampler_overhead.py's measurement on the tiny Wan2.1 (2 steps, one repeat) returns positive rollout
    and raw times, the call count of its plan and the noise / kernel shares."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sampler_overhead

    gen, shape, prompts = sampler_overhead.build("wan")
    config = RolloutConfig(num_steps=2, kernel="flow_grpo", sde_steps="all", skip_last_step=False,
                           micro_batch_size=12, batching="fast")
    row = sampler_overhead.measure(gen, shape, prompts[:20], config, repeats=1)
    assert row["calls_per_step"] == 2 and row["rollout_s"] > 0 and row["raw_forwards_s"] > 0
    assert row["noise_s"] > 0 and row["kernel_s"] > 0
    assert row["overhead"] == row["rollout_s"] / row["raw_forwards_s"] - 1


@pytest.mark.parametrize("kind", ["randn", "rand"])
def test_philox_chunking_does_not_change_the_values(monkeypatch, kind):
    """The Philox draw is computed in counter chunks (small on the CPU for the cache): chunks of 1, 2 and 3 counters
    per row (13 elements: the last counter half used) give bitwise the values of one pass."""
    draw = randn_per_sample if kind == "randn" else rand_per_sample
    monkeypatch.setitem(noise_mod._PHILOX_CHUNK, "cpu", 1 << 30)
    whole = draw((13,), 4, [2, 5, 9], step=1, backend="philox")
    for per_row in (1, 2, 3):
        monkeypatch.setitem(noise_mod._PHILOX_CHUNK, "cpu", 4 * 3 * per_row)
        assert torch.equal(draw((13,), 4, [2, 5, 9], step=1, backend="philox"), whole)
