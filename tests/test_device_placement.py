"""Device placement of the flow math: a per-sample tensor argument on the CPU (advantages, old log-probs, noise
levels, stds) with the velocities / latents on an accelerator gives a result on the accelerator equal to the
all-CPU result. These need a second device: they run where CUDA is present and are skipped on a CPU-only machine.

They kill the mutants that drop a ``.to(device=...)`` (listed in tests/mutation_accepted.txt as "device
placement"): on one device such a mutant computes the same thing, so no CPU test can tell it apart.
"""

from __future__ import annotations

import pytest
import torch

from genrl.flow.forward_rl import awm_loss, awm_weight
from genrl.flow.sde import gaussian_log_prob

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device next to the CPU")

F64 = torch.float64


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_awm_weight_cpu_t_with_cuda_error():
    """awm_weight(ell on CUDA, t [B] or a python float) is on CUDA and equals the CPU result."""
    ell = torch.tensor([0.1, 0.7, 1.3], dtype=F64)
    t = torch.tensor([0.2, 0.5, 0.9], dtype=F64)
    for weighting in ("t", "t2", "huber", "ghuber"):
        for tt in (t, 0.5):
            out = awm_weight(ell.cuda(), tt, weighting)
            assert out.device.type == "cuda"
            torch.testing.assert_close(out.cpu(), awm_weight(ell, tt, weighting), rtol=1e-12, atol=0)


def test_awm_loss_cpu_per_sample_arguments_with_cuda_velocities():
    """awm_loss with v, u, v_ref, v_ema on CUDA and t, advantages, log_p_old on the CPU: loss and every stat on
    CUDA, equal to the all-CPU values (clipped and unclipped; with and without anchors)."""
    v, u, v_ref, v_ema = (_randn(3, 4, seed=s) for s in range(4))
    t = torch.tensor([0.2, 0.5, 0.9], dtype=F64)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    log_p_old = torch.tensor([-1.0, -2.5, -0.5], dtype=F64)
    for kw in ({"clip_range": 0.2, "v_ref": v_ref, "beta": 0.1, "v_ema": v_ema, "beta_ema": 0.5},
               {"clip_range": None}):
        cpu_loss, cpu_stats = awm_loss(v, u, t, adv, log_p_old=log_p_old, **kw)
        gpu_kw = {k: (x.cuda() if isinstance(x, torch.Tensor) else x) for k, x in kw.items()}
        loss, stats = awm_loss(v.cuda(), u.cuda(), t, adv, log_p_old=log_p_old, **gpu_kw)
        assert loss.device.type == "cuda"
        torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-12, atol=1e-14)
        for key, value in stats.items():
            assert value.device.type == "cuda", key
            torch.testing.assert_close(value.cpu(), cpu_stats[key], rtol=1e-12, atol=1e-14, msg=key)


def test_gaussian_log_prob_cpu_std_with_cuda_sample():
    """gaussian_log_prob(sample, mean on CUDA, std a CPU [B, 1] tensor or a float) is on CUDA, equal to the CPU."""
    x, m = _randn(2, 5, seed=10), _randn(2, 5, seed=11)
    for std in (torch.tensor([[0.5], [0.25]], dtype=F64), 0.3):
        out = gaussian_log_prob(x.cuda(), m.cuda(), std)
        assert out.device.type == "cuda"
        torch.testing.assert_close(out.cpu(), gaussian_log_prob(x, m, std), rtol=1e-12, atol=0)
