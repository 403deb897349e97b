"""genrl.flow: pure-function flow-matching library (schedules, parameterisations, losses, steps, guidance).

Conventions (DESIGN.md §2): sigma in [0, 1], 0 = data, 1 = noise; x_sigma = (1 - sigma) x0 + sigma eps;
velocity v = eps - x0; diffusers timestep = 1000 sigma; CFG pred = uncond + w (cond - uncond).
Step math in float32 (float64 kept). Latents [B, T, C, H, W] (frame_dim=1) or Wan's [B, C, T, H, W]
(frame_dim=2); sigma is a float, 0-d, [B] or per-frame [B, T].
"""

from genrl.flow.broadcast import SigmaLike, compute_dtype, expand_sigma
from genrl.flow.dmd import (
    critic_loss,
    dmd_cfg,
    dmd_gradient,
    dmd_loss,
    ode_regression_loss,
    reference_scale_to_w,
    sample_dmd_sigma,
    sid_loss,
    w_to_reference_scale,
    warped_sigmas,
    warped_timesteps,
)
from genrl.flow.guidance import cfg_combine
from genrl.flow.losses import SIGMA_SQRT_MIN_SIGMA, LossWeighting, flow_matching_loss, loss_weighting
from genrl.flow.parameterization import (
    MIN_DENOM,
    add_noise,
    eps_from_velocity,
    velocity_from_eps,
    velocity_from_x0,
    velocity_target,
    x0_from_velocity,
)
from genrl.flow.schedules import (
    NUM_TRAIN_TIMESTEPS,
    TimestepSampler,
    shift_sigmas,
    sigma_schedule,
    sigmas_to_timesteps,
    timesteps_to_sigmas,
)
from genrl.flow.steps import euler_step
from genrl.flow.sde import (
    STEP_KINDS,
    LogProbReduce,
    StepKind,
    StepOutput,
    diffusion_coefficient,
    gaussian_log_prob,
    sde_step,
    step_log_prob,
    step_mean_std,
)
from genrl.flow.policy import (
    ZERO_STD,
    AdvantageStd,
    KLKind,
    RunningMeanStd,
    clipped_policy_loss,
    gaussian_kl,
    group_advantages,
    group_stats,
    kl_penalty,
    normalize_rewards,
    velocity_kl,
)

__all__ = [
    "SigmaLike",
    "compute_dtype",
    "expand_sigma",
    "cfg_combine",
    "LossWeighting",
    "SIGMA_SQRT_MIN_SIGMA",
    "loss_weighting",
    "flow_matching_loss",
    "MIN_DENOM",
    "add_noise",
    "velocity_target",
    "x0_from_velocity",
    "eps_from_velocity",
    "velocity_from_x0",
    "velocity_from_eps",
    "NUM_TRAIN_TIMESTEPS",
    "TimestepSampler",
    "shift_sigmas",
    "sigma_schedule",
    "sigmas_to_timesteps",
    "timesteps_to_sigmas",
    "euler_step",
    "StepKind",
    "STEP_KINDS",
    "LogProbReduce",
    "StepOutput",
    "diffusion_coefficient",
    "step_mean_std",
    "gaussian_log_prob",
    "sde_step",
    "step_log_prob",
    "clipped_policy_loss",
    "KLKind",
    "gaussian_kl",
    "velocity_kl",
    "kl_penalty",
    "AdvantageStd",
    "ZERO_STD",
    "group_advantages",
    "group_stats",
    "normalize_rewards",
    "RunningMeanStd",
    "warped_timesteps",
    "warped_sigmas",
    "sample_dmd_sigma",
    "dmd_gradient",
    "dmd_loss",
    "critic_loss",
    "ode_regression_loss",
    "sid_loss",
    "reference_scale_to_w",
    "w_to_reference_scale",
    "dmd_cfg",
]
