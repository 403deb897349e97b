"""The rollout sampler: addressable noise, step kernels, trajectories (shared by every method and evaluation)."""

from genrl.noise import mix_seed, rand_per_sample, randn_per_sample, sample_generator
from genrl.rollout.history import HistorySample, history_rollout, sample_window
from genrl.rollout.ode import sample_ode
from genrl.rollout.sampler import RolloutConfig, Trajectory, guided_velocity, rollout, sde_mask, transition_log_prob
from genrl.rollout.transition import (
    TransitionConfig,
    TransitionModelLike,
    TransitionResult,
    inner_flow,
    transition_rollout,
)

__all__ = [
    "HistorySample", "RolloutConfig", "Trajectory", "history_rollout", "sample_window",
    "guided_velocity", "mix_seed", "rand_per_sample", "randn_per_sample", "rollout",
    "sample_generator", "sample_ode", "sde_mask", "transition_log_prob",
    "TransitionConfig", "TransitionModelLike", "TransitionResult", "inner_flow", "transition_rollout",
]
