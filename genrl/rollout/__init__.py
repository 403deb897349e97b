"""The rollout sampler: addressable noise, step kernels, trajectories (shared by every method and evaluation)."""

from genrl.noise import mix_seed, rand_per_sample, randn_per_sample, sample_generator
from genrl.rollout.ode import sample_ode
from genrl.rollout.sampler import RolloutConfig, Trajectory, guided_velocity, rollout, sde_mask, transition_log_prob

__all__ = [
    "RolloutConfig", "Trajectory", "guided_velocity", "mix_seed", "rand_per_sample", "randn_per_sample", "rollout",
    "sample_generator", "sample_ode", "sde_mask", "transition_log_prob",
]
