"""The rollout sampler: addressable noise, step kernels, trajectories (shared by every method and evaluation)."""

from genrl.rollout.noise import mix_seed, rand_per_sample, randn_per_sample, sample_generator
from genrl.rollout.ode import sample_ode

__all__ = ["mix_seed", "rand_per_sample", "randn_per_sample", "sample_generator", "sample_ode"]
