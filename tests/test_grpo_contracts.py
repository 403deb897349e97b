"""GRPO's per-step loss contracts (genrl/methods/grpo.py; issue 51, mutation survivors of ``step_loss`` and the
reference velocity): GRPO-Guard's ``scale: step`` divides the step's loss by exactly |delta sigma| = sigma_k -
sigma_{k+1} of the trained step, the stored rollout tensors are moved to the policy's device, and the reference
policy of the KL term runs in the same network calls (the rollout's ``micro_batch_size`` and ``batching``) as the
policy.

The closed-form stub generator of tests/stub_generator_util.py (v = a x + len(prompt)) keeps each test well under
a second.
"""

from __future__ import annotations

import pytest
import torch
from stub_generator_util import StubGen

from genrl.methods.grpo import GRPO
from genrl.rollout import RolloutConfig, rollout
from genrl.rollout.sampler import call_plan, encode_cfg

SHAPE = (1, 2, 2, 2)  # per-sample latent [T, C, H, W]
PROMPTS = ["ab", "abcd", "abcdefg", "abc", "abcdef"]


def _trajectory(config: RolloutConfig, record_moments: bool = False):
    gen = StubGen(a=1.0)
    traj = rollout(gen, PROMPTS, SHAPE, seed=3, config=config, record_moments=record_moments)
    with torch.no_grad():
        gen.transformer.a.fill_(0.9)  # the policy has moved away from the rollout's
    cond, uncond = encode_cfg(gen, traj.prompts, config)
    return gen, traj, cond, uncond


def test_guard_scale_step_divides_the_loss_by_the_trained_steps_sigma_decrement():
    """Catches a wrong step length in GRPO's StepMoments (sigma_k + sigma_{k+1}, sigma_k - sigma_{k-1},
    sigma_k - sigma_{k+2}, or none): with ``policy_loss_args: {scale: step}`` the loss of step k is the unscaled
    GRPO-Guard loss divided by sigma_k - sigma_{k+1} of the trajectory's grid (shifted, so the decrements differ)."""
    config = RolloutConfig(num_steps=4, kernel="dance_grpo", noise_level=0.5, cfg_scale=1.0, shift=3.0,
                           micro_batch_size=5)
    gen, traj, cond, uncond = _trajectory(config, record_moments=True)
    adv = torch.tensor([1.5, -0.5, 0.75, -2.0, 0.25])
    sig = traj.sigmas.double()
    assert len({round(float(sig[i] - sig[i + 1]), 6) for i in range(4)}) == 4  # the decrements all differ
    for k in (1, 2):
        losses = {}
        for scale in ("none", "step"):
            m = GRPO(rollout=config, policy_loss="guard", policy_loss_args={"scale": scale}, clip_range=0.05)
            m.roles.trainable("generator", gen)
            losses[scale] = float(m.step_loss(traj, k, cond, uncond, adv)[0].detach())
        assert losses["none"] != 0.0
        step = float(traj.sigmas[k] - traj.sigmas[k + 1])  # the decrement in the grid's own dtype
        assert losses["step"] == pytest.approx(losses["none"] / step, rel=1e-4), k  # float32 losses


class _DeviceRecorder:
    """Stands for a stored rollout tensor (the trajectory keeps them on the CPU): records every device ``.to`` is
    asked for, by this tensor or by a row / column of it (``[...]`` returns a recorder sharing the log)."""

    def __init__(self, tensor: torch.Tensor, log: list | None = None) -> None:
        self.tensor, self.moved_to = tensor, ([] if log is None else log)

    def __getitem__(self, index):
        return _DeviceRecorder(self.tensor[index], self.moved_to)

    def numel(self) -> int:
        return self.tensor.numel()

    def __float__(self) -> float:
        return float(self.tensor)

    def to(self, device=None, *args, **kwargs):
        self.moved_to.append(device)
        return self.tensor.to(device, *args, **kwargs)


def test_step_loss_moves_every_stored_rollout_tensor_to_the_policys_device():
    """Catches ``.to(None)`` on the tensors step_loss reads from the trajectory or the caller: the trajectory stores
    its latents, log-probs and step means on the CPU, and the advantages come from the CPU, so on a GPU run each must
    be moved to the device of the policy's log-prob / velocity before the loss combines them (else a device-mismatch
    error, which no CPU run shows). Checked in process by recording where step_loss moves each: the step means with
    GRPO-Guard, the rest with the clipped loss and the Gaussian KL term (which reads the latents and the grid)."""
    config = RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.5, cfg_scale=1.0, micro_batch_size=5)
    gen, traj, cond, uncond = _trajectory(config, record_moments=True)
    stored = traj.step_moments(1)
    mean = _DeviceRecorder(stored[0])
    traj.step_moments = lambda k: (mean, stored[1])
    log_probs, latents = _DeviceRecorder(traj.log_probs), _DeviceRecorder(traj.latents)
    sigmas = _DeviceRecorder(traj.sigmas)
    traj.log_probs, traj.latents, traj.sigmas = log_probs, latents, sigmas
    adv = _DeviceRecorder(torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0]))
    m = GRPO(rollout=config, policy_loss="clipped", kl_beta=0.1, kl_kind="gaussian")
    m.roles.trainable("generator", gen)
    m.roles.reference_copy(gen)  # the reference keeps a = 0.9
    with torch.no_grad():
        gen.transformer.a.fill_(0.8)
    loss, stats = m.step_loss(traj, 1, cond, uncond, adv)
    cpu = torch.device("cpu")
    assert log_probs.moved_to == [cpu] and adv.moved_to == [cpu] and mean.moved_to == []
    # transition_log_prob reads x_k and x_{k+1}, the KL term x_k again
    assert latents.moved_to == [cpu, cpu, cpu]
    assert sigmas.moved_to == [cpu, cpu]  # transition_log_prob's grid, the KL term's grid
    traj.sigmas = sigmas.tensor  # GRPO-Guard subtracts two grid entries
    guard = GRPO(rollout=config, policy_loss="guard")
    guard.roles.trainable("generator", gen)
    guard.step_loss(traj, 1, cond, uncond, torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0]))
    assert mean.moved_to == [cpu]
    assert torch.isfinite(loss) and float(stats["kl"]) > 0


def test_the_gaussian_kl_is_exactly_zero_when_the_policy_is_the_reference():
    """Catches the KL's reference mean computed on another grid than the rollout's transition: with the Flow-GRPO
    kernel (whose sigma = 1 step uses sigma_at_one = sigma_1 of the trajectory) and the grid in float32 as the
    rollout's, a policy equal to its reference has a Gaussian KL of exactly 0 at every step, the first included
    (sigma_at_one = sigma_2 there, or the grid left in float64, gives a KL > 0). The returned stats' ``loss`` is the
    returned loss."""
    config = RolloutConfig(num_steps=4, kernel="flow_grpo", noise_level=0.7, cfg_scale=1.0, shift=3.0,
                           micro_batch_size=5)
    gen, traj, cond, uncond = _trajectory(config)
    m = GRPO(rollout=config, kl_beta=0.1, kl_kind="gaussian")
    m.roles.trainable("generator", gen)
    m.roles.reference_copy(gen)  # the same weights as the policy
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0])
    for k in traj.sde_steps:
        loss, stats = m.step_loss(traj, k, cond, uncond, adv)
        assert float(stats["kl"]) == 0.0, k
        assert float(stats["loss"]) == float(loss.detach()), k
    assert 0 in traj.sde_steps


@pytest.mark.parametrize("batching", ["fast", "bucketed"])
def test_the_kl_reference_runs_in_the_rollouts_network_calls(batching):
    """Catches the reference velocity of the KL term evaluated with the default ``fixed`` batching instead of the
    rollout's: its network calls must follow call_plan(n, micro_batch_size, batching), as the policy's do, so the two
    velocities of a row come from calls of the same shape (bitwise comparable)."""
    config = RolloutConfig(num_steps=3, kernel="dance_grpo", noise_level=0.4, cfg_scale=1.0, micro_batch_size=4,
                           batching=batching)
    gen, traj, cond, uncond = _trajectory(config)
    m = GRPO(rollout=config, kl_beta=0.1)
    m.roles.trainable("generator", gen)
    m.roles.reference_copy(gen)
    sig = traj.sigmas.float()
    with torch.no_grad(), m.roles.reference(gen) as ref:
        ref.calls.clear()
        m._reference_velocity(traj.latents[:, 1], sig[1].expand(len(PROMPTS)), cond, uncond, 1.0)
        rows = [n for n, _, _ in ref.calls]
    want = [len(padded) for _, padded in call_plan(len(PROMPTS), 4, batching)]
    assert rows == want and want != [len(p) for _, p in call_plan(len(PROMPTS), 4, "fixed")]
