"""The 2-D toy of TMD: an 8-mode Gaussian mixture, its analytic flow-matching teacher, a small TMD student, stage-1
(TM-MeanFlow) training and a mode-coverage evaluation. Used by ``benchmarks/tmd_toy.py`` and ``tests/test_tmd_toy.py``.

With one outer transition from t = t_max (M = 1) the transition must sample the whole data distribution given
nearly pure noise x_t: the teacher's velocity ``E[x1 - x0 | x_t]`` gives ``x0 = x_t - t v`` = the posterior mean,
the blurry centre of the mixture. The inner flow head, trained with TM-MeanFlow, turns that one transition into a
sampler of the conditional distribution of ``y = x1 - x0`` given x_t, which is multi-modal.

The student (:class:`ToyTMDStudent`, a :class:`genrl.rollout.transition.TransitionModelLike`):

- backbone ``features(x, t)``: an MLP of (x_t, a Fourier embedding of t) giving a feature vector h, plus the
  teacher's analytic velocity ``v_T(x_t, t)`` (no parameters), carried in :class:`ToyFeatures`;
- head ``head(y_s, s, r, m, t)``: ``v_T(x_t, t) + MLP(h + gate * W_y (y_s - (1 - s) v_T) + E_s(s) + E_d(s - r))``
  (the y-path sees y_s minus its mean given x_t, ``(1 - s) E[y | x_t]``, which spares the small head from
  undoing the x_t offset; this learned faster than feeding y_s). The gate is a learnable scalar that starts
  closed (0: the head ignores y_s), the delta embedding ``E_d`` of s - r and the MLP's output layer start at
  zero, so a fresh student's head returns exactly the teacher's velocity, whatever y_s, s and r: "gate closed" is
  the teacher, and M = 1 then gives the blurry mean.

Everything is float32 except the teacher's velocity, computed in float64 and cast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from genrl.flow import (
    adaptive_loss,
    add_noise,
    average_velocity,
    finite_difference_derivative,
    meanflow_target,
    sample_inner_times,
    transition_grid,
)
from genrl.rollout.transition import TransitionConfig, transition_rollout

__all__ = ["GaussianMixture2D", "ToyFeatures", "ToyTMDStudent", "mode_metrics", "sample_student", "train_stage1"]


@dataclass
class GaussianMixture2D:
    """An equal-weight mixture of K isotropic 2-D Gaussians with means on a circle.

    Attributes:
        num_modes: K (8); radius: of the circle (4.0); std: of every component (0.3).
    """

    num_modes: int = 8
    radius: float = 4.0
    std: float = 0.3

    def means(self, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> torch.Tensor:
        """The K means [K, 2]: ``radius (cos 2 pi k / K, sin 2 pi k / K)``."""
        angle = 2 * math.pi * torch.arange(self.num_modes, dtype=torch.float64) / self.num_modes
        return (self.radius * torch.stack([angle.cos(), angle.sin()], dim=1)).to(dtype=dtype, device=device)

    def sample(self, n: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """n samples [n, 2] drawn with ``generator`` (CPU)."""
        k = torch.randint(0, self.num_modes, (n,), generator=generator)
        z = torch.randn(n, 2, generator=generator, dtype=torch.float64)
        return (self.means()[k] + self.std * z).to(dtype)

    def velocity(self, x: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """The exact flow-matching velocity ``E[eps - x0 | x_t = x]`` of this mixture, in float64.

        For component k, ``x_t | k ~ N((1 - t) mu_k, var_t I)`` with ``var_t = (1 - t)^2 std^2 + t^2``;
        ``E[x0 | x_t, k] = mu_k + (1 - t) std^2 (x_t - (1 - t) mu_k) / var_t`` and
        ``E[eps | x_t, k] = t (x_t - (1 - t) mu_k) / var_t``; the posterior weights are the softmax over k of
        ``-|x_t - (1 - t) mu_k|^2 / (2 var_t)`` (equal priors).

        Args:
            x: [B, 2] points; t: a float, 0-d or [B] tensor in [0, 1].

        Returns:
            float64 [B, 2].
        """
        x = x.to(torch.float64)
        mu = self.means(device=x.device)  # [K, 2]
        t = torch.as_tensor(t, dtype=torch.float64, device=x.device).reshape(-1, 1, 1)  # [B or 1, 1, 1]
        var = (1 - t) ** 2 * self.std**2 + t**2
        diff = x.unsqueeze(1) - (1 - t) * mu.unsqueeze(0)  # [B, K, 2]
        w = torch.softmax(-(diff**2).sum(-1, keepdim=True) / (2 * var), dim=1)  # [B, K, 1]
        e_x0 = mu.unsqueeze(0) + (1 - t) * self.std**2 * diff / var
        e_eps = t * diff / var
        return (w * (e_eps - e_x0)).sum(dim=1)


def _fourier(tau: torch.Tensor, num: int) -> torch.Tensor:
    """[B] -> [B, 2 num + 1]: tau, sin(pi k tau), cos(pi k tau) for k = 1 .. num."""
    k = torch.arange(1, num + 1, dtype=tau.dtype, device=tau.device)
    ang = math.pi * tau.unsqueeze(1) * k
    return torch.cat([tau.unsqueeze(1), ang.sin(), ang.cos()], dim=1)


@dataclass
class ToyFeatures:
    """The toy backbone's output: h [B, hidden] (learned) and the teacher's velocity [B, 2] at (x_t, t)."""

    h: torch.Tensor
    teacher: torch.Tensor


class ToyTMDStudent(nn.Module):
    """A TMD student for the 2-D toy (see the module docstring); float32.

    Args:
        mixture: the data distribution whose analytic velocity is the teacher.
        hidden: width of every layer (128).
        backbone_depth: linear layers of the backbone (3); head_depth: linear layers of the head after the fusion
            (4, the last one the zero-initialised output). ``num_layers = backbone_depth + head_depth`` and
            ``head_layers = head_depth`` feed the effective NFE.
        fourier: frequencies of the scalar embeddings (8).
    """

    def __init__(self, mixture: GaussianMixture2D, hidden: int = 128, backbone_depth: int = 3, head_depth: int = 4,
                 fourier: int = 8) -> None:
        super().__init__()
        self.mixture = mixture
        self.fourier = fourier
        self.num_layers = backbone_depth + head_depth
        self.head_layers = head_depth
        emb = 2 * fourier + 1
        layers: list[nn.Module] = [nn.Linear(2 + emb, hidden)]
        for _ in range(backbone_depth - 1):
            layers += [nn.SiLU(), nn.Linear(hidden, hidden)]
        self.backbone = nn.Sequential(*layers)
        self.embed_y = nn.Linear(2, hidden)
        self.embed_s = nn.Linear(emb, hidden)
        self.embed_delta = nn.Linear(emb, hidden)
        nn.init.zeros_(self.embed_delta.weight)
        nn.init.zeros_(self.embed_delta.bias)
        head: list[nn.Module] = []
        for _ in range(head_depth - 1):
            head += [nn.SiLU(), nn.Linear(hidden, hidden)]
        self.out = nn.Linear(hidden, 2)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        self.head_mlp = nn.Sequential(*head, nn.SiLU(), self.out)
        self.gate = nn.Parameter(torch.zeros(()))

    def features(self, x: torch.Tensor, t: torch.Tensor, cond=None) -> ToyFeatures:
        """Backbone: ``ToyFeatures(h = MLP(x, emb(t)), teacher = v_T(x, t))``; x [B, 2], t [B]; cond unused."""
        t = t.to(x.dtype).expand(x.shape[0])
        h = self.backbone(torch.cat([x, _fourier(t, self.fourier)], dim=1))
        return ToyFeatures(h=h, teacher=self.mixture.velocity(x, t).to(x.dtype))

    def head(self, y: torch.Tensor, s: torch.Tensor, r: torch.Tensor, features: ToyFeatures,
             t: torch.Tensor) -> torch.Tensor:
        """Head: ``teacher + MLP(h + gate W_y (y - (1 - s) teacher) + E_s(s) + E_d(s - r))`` [B, 2] (t enters
        through h); y [B, 2], s, r [B]."""
        s, r = s.to(y.dtype).expand(y.shape[0]), r.to(y.dtype).expand(y.shape[0])
        centred = y - (1 - s).unsqueeze(1) * features.teacher  # y_s minus its mean given x_t, (1 - s) E[y | x_t]
        z = (features.h + self.gate * self.embed_y(centred) + self.embed_s(_fourier(s, self.fourier))
             + self.embed_delta(_fourier(s - r, self.fourier)))
        return features.teacher + self.head_mlp(z)


def train_stage1(
    student: ToyTMDStudent,
    steps: int = 4000,
    batch: int = 512,
    lr: float = 2e-3,
    seed: int = 0,
    inner_choices: tuple[int, ...] = (1, 2, 4),
    inner_shift: float = 1.0,
    outer_steps: int = 1,
    outer_shift: float = 1.0,
    t_max: float = 0.999,
    time_shift: float = 1.0,
    p_equal: float = 0.75,
    delta: float = 5e-3,
    parameterization: str = "denoiser",
    loss_c: float = 2.0,
    loss_power: float = 1.0,
    log_every: int = 0,
) -> list[float]:
    """TM-MeanFlow (stage 1) on the toy with Adam (cosine learning-rate decay to 0); returns every step's loss.

    One step: x0 from the mixture, x1 ~ N(0, I), t uniform over the outer grid's starting points (t_max for
    M = 1), ``x_t = (1 - t) x0 + t x1``, ``y = x1 - x0``, y1 ~ N(0, I), the inner grid of N =
    ``inner_choices[step % len]`` points (so one student serves every N), (s, r) from
    :func:`genrl.flow.sample_inner_times`, ``y_s = (1 - s) y + s y1``, ``v = y1 - y``, u from the head,
    du/ds along (v, 1) by :func:`genrl.flow.finite_difference_derivative` (no grad), the target
    :func:`genrl.flow.meanflow_target` and :func:`genrl.flow.adaptive_loss` with c = ``loss_c`` (TMD's c = d =
    2) and ``loss_power`` (1). The data draws use one CPU generator seeded with ``seed``; the inner times are
    addressed (philox backend) by (seed, sample id, step). Backbone and head both train.

    Measured choices (benchmarks/tmd_toy.py): in 2-D the adaptive weight ``1 / (e + 2)`` varies a lot between
    samples, which biases the fit towards the nearest mode of a multi-modal target, but the plain squared error
    (power 0) is unstable with the MeanFlow target's variance (and, under ``"denoiser"``, with u's 1 / s), and a
    large c learns more slowly; c = 2, power 1 worked best of those tried.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1 + math.cos(math.pi * k / steps)))
    outer = transition_grid(outer_steps, outer_shift, t_max, dtype=torch.float32)
    grids = {n: transition_grid(n, inner_shift, t_max) for n in inner_choices}
    mixture = student.mixture
    losses = []
    student.train()
    for step in range(steps):
        x0 = mixture.sample(batch, gen)
        x1 = torch.randn(batch, 2, generator=gen)
        y1 = torch.randn(batch, 2, generator=gen)
        t = outer[torch.randint(0, outer_steps, (batch,), generator=gen)]
        x_t = add_noise(x0, x1, t)
        y = x1 - x0
        grid = grids[inner_choices[step % len(inner_choices)]]
        ids = range(step * batch, (step + 1) * batch)
        s, r = sample_inner_times(seed, ids, step, grid, shift=time_shift, p_equal=p_equal, backend="philox")
        y_s = add_noise(y, y1, s)
        v = y1 - y
        feats = student.features(x_t, t)

        def u_of(yy: torch.Tensor, ss: torch.Tensor, feats=feats, r=r, y1=y1, t=t) -> torch.Tensor:
            return average_velocity(yy, ss, y1, student.head(yy, ss, r, feats, t), parameterization)

        u = u_of(y_s, s)
        with torch.no_grad():
            dudt = finite_difference_derivative(u_of, y_s, s, v, delta=delta)
        loss = adaptive_loss(u, meanflow_target(v, dudt, s, r), c=loss_c, power=loss_power)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            recent = losses[-log_every:]
            print(f"step {step + 1}: loss {sum(recent) / len(recent):.4f} gate {float(student.gate):+.3f}")
    student.eval()
    return losses


def sample_student(
    student: ToyTMDStudent,
    n: int,
    inner_steps: int,
    outer_steps: int = 1,
    seed: int = 1234,
    inner_shift: float = 1.0,
    outer_shift: float = 1.0,
    t_max: float = 0.999,
    parameterization: str = "denoiser",
) -> tuple[torch.Tensor, float]:
    """n samples [n, 2] of the student with :func:`genrl.rollout.transition_rollout` (sample ids 0 .. n - 1, one
    network call per step for the whole batch) and the effective NFE."""
    config = TransitionConfig(outer_steps=outer_steps, inner_steps=inner_steps, outer_shift=outer_shift,
                              inner_shift=inner_shift, t_max=t_max, parameterization=parameterization,
                              micro_batch_size=n, batching="fast")
    out = transition_rollout(student, None, (2,), seed, range(n), config)
    return out.latents, out.effective_nfe


def mode_metrics(samples: torch.Tensor, mixture: GaussianMixture2D, within_std: float = 4.0,
                 rel_tolerance: float = 0.05, abs_tolerance: float = 0.05) -> dict:
    """Mode coverage of 2-D samples.

    Each sample is assigned to its nearest mean. ``weights[k]`` is the fraction of *all* samples that are nearest
    to mode k and within ``within_std`` standard deviations of it (4 std: a perfect sampler puts 99.97% of its mass
    there; blurry samples between the modes count for no mode, so they lower every weight). Two counts of
    recovered modes (K = number of modes):

    - ``recovered_rel``: ``|w_k - 1/K| < rel_tolerance / K`` (the weight's relative error under 5%; with 20k
      samples the sampling error alone is about 1.9% relative, so a perfect sampler passes almost surely);
    - ``recovered_abs``: ``|w_k - 1/K| < abs_tolerance`` (absolute, 0.05 = 40% of 1/8: the looser criterion the
      toy's goal uses, see benchmarks/tmd_toy.py).

    Returns:
        dict with ``weights`` (K floats), ``nearest_weights`` (the weights without the distance cut),
        ``recovered_rel``, ``recovered_abs`` (counts), ``max_rel_error`` (max_k |w_k K - 1|), ``max_abs_error``
        (max_k |w_k - 1/K|), ``in_mode`` (fraction of samples within the cut), ``mean_dist`` (mean distance to the
        nearest mean; about 0.376 for exact samples of std 0.3) and ``mean_norm`` (mean |x|; about 4.01 for exact
        samples, about 0 for the blurry mean).
    """
    x = samples.detach().to(torch.float64).cpu()
    mu = mixture.means()
    k_count = mixture.num_modes
    dmin, nearest = torch.cdist(x, mu).min(dim=1)
    inside = dmin < within_std * mixture.std
    n = x.shape[0]
    weights = torch.bincount(nearest[inside], minlength=k_count).to(torch.float64) / n
    nearest_w = torch.bincount(nearest, minlength=k_count).to(torch.float64) / n
    err = (weights - 1.0 / k_count).abs()
    return {
        "weights": [round(float(w), 5) for w in weights],
        "nearest_weights": [round(float(w), 5) for w in nearest_w],
        "recovered_rel": int((err * k_count < rel_tolerance).sum()),
        "recovered_abs": int((err < abs_tolerance).sum()),
        "max_rel_error": round(float(err.max() * k_count), 5),
        "max_abs_error": round(float(err.max()), 5),
        "in_mode": round(float(inside.to(torch.float64).mean()), 5),
        "mean_dist": round(float(dmin.mean()), 5),
        "mean_norm": round(float(x.norm(dim=1).mean()), 5),
    }
