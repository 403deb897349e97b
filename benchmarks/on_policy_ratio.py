"""The first GRPO update's importance ratio, measured: train / rollout log-prob parity, and each way's cost (issue 50).

    python benchmarks/on_policy_ratio.py --family wan                       # Wan2.1-1.3B, 480x832x81, LoRA r32, bf16
    python benchmarks/on_policy_ratio.py --family sd3 --batch 8 --cfg-scale 4.5 --deterministic   # SD3.5-M, 512 px
    python benchmarks/on_policy_ratio.py --family wan --tiny                # CPU smoke run, tiny Wan, float32

Random weights, real architectures (``family_grpo_step.build_family``: LoRA r32 on the transformer, gradient
checkpointing), bf16 on CUDA (float32 on the CPU). One rollout with the Flow-GRPO kernel (``genrl.rollout.sampler.
rollout``, called as GRPO's ``collect_flat`` calls it, without the decode: no reward is needed here), ``--batch``
prompts in one network call (``micro_batch_size = --batch``, CFG doubling the rows), the first ``--trained-steps``
steps stochastic; then GRPO's first update (the clipped loss, ``genrl.flow.policy.policy_loss``, on every trained
step of every sample, backward, AdamW step) with the log-probs of the trained steps obtained each way GRPO can:

- ``plain``: recomputed by ``transition_log_prob`` with the rollout's own config (the same micro-batches), GRPO's
  default;
- ``micro_batch``: recomputed with ``micro_batch_size = --recompute-micro-batch`` (default 1): the same rows in
  other network calls, so other GEMM shapes; in bf16 the usual cause of a ratio that is not 1 (batch variance);
- ``reuse``: GRPO's ``reuse_rollout_forward``: a second rollout with ``grad="sde"`` keeps each trained step's
  log-prob with its graph (``Trajectory.live``) and the update back-propagates it (ratio 1 by construction; the
  cost moves into the rollout: its forwards keep activations);
- ``deterministic`` and ``deterministic_micro_batch`` (``--deterministic``): ``torch.use_deterministic_algorithms
  (True, warn_only=True)`` with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set for the variant if unset, then removed;
  cuBLAS sizes its workspace once per process, so set it before the process starts for the full effect), a fresh
  rollout, then the plain and the micro-batch recompute; the operations that warned are listed.

For each: ``log_ratio_max_abs`` and ``log_ratio_mean_abs`` over samples x trained steps (log ratio = recomputed
log-prob - the rollout's, float32 per-sample log-probs, mean over latent elements), ``bitwise_equal``,
``velocity_calls`` (the update's network calls: trained steps x micro-batches, 0 for ``reuse``), ``update_s`` (the
update step: recompute or reuse, loss, backward, AdamW step; synchronised, one timed update per variant, no separate
warm-up) and CUDA peaks in GiB (None on the CPU): ``update_peak_gib`` (the update alone, counters reset after the
rollout; for ``reuse`` it includes the graphs the rollout kept) and ``rollout_peak_gib`` of the rollout that variant
needs. Between variants the LoRA weights are restored, so every recompute sees the rollout's weights.
``rollout_plus_update_s`` compares the paths: reuse pays in the rollout what it saves in the update.

``measure(parse_args([...]))`` runs the same measurement from Python (``benchmarks/gpu_suite.py``'s section 2c).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import warnings
from pathlib import Path

import torch

_BENCH = Path(__file__).resolve().parent
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))

import family_grpo_step  # noqa: E402

#: CUBLAS_WORKSPACE_CONFIG as this module found it at import (the deterministic variant sets it when unset, but
#: cuBLAS reads its workspace size once per process: a value set later only satisfies torch's determinism check)
CUBLAS_AT_IMPORT = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
#: the recompute variants, in the order they run
VARIANTS = ("plain", "micro_batch", "reuse")
DETERMINISTIC_VARIANTS = ("deterministic", "deterministic_micro_batch")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def build_parser() -> argparse.ArgumentParser:
    """The command line (also used by ``benchmarks/gpu_suite.py`` to build its settings)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(family_grpo_step.REAL), default="wan")
    p.add_argument("--tiny", action="store_true", help="tiny test components (CPU smoke run, float32)")
    p.add_argument("--batch", type=int, default=2, help="samples of the rollout, all in one network call")
    p.add_argument("--recompute-micro-batch", type=int, default=1,
                   help="micro_batch_size of the 'micro_batch' variant's recompute (must differ from --batch)")
    p.add_argument("--steps", type=int, default=20, help="rollout steps")
    p.add_argument("--trained-steps", type=int, default=2, help="stochastic steps (the first ones) trained")
    p.add_argument("--cfg-scale", type=float, default=5.0)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--no-grad-ckpt", action="store_true")
    p.add_argument("--dtype", default="bfloat16", help="on CUDA; the CPU runs float32")
    p.add_argument("--height", type=int, default=None, help="override the sample height (pixels)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--deterministic", action="store_true",
                   help="also measure the plain and micro-batch recomputes under torch.use_deterministic_algorithms")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (command-line words; None = ``sys.argv[1:]``) with :func:`build_parser` and check the values.

    Raises:
        SystemExit (argparse's error, status 2): ``--batch`` or ``--recompute-micro-batch`` < 1, the two equal (the
            micro-batch variant would repeat the plain one), ``--trained-steps`` < 1 or >= ``--steps``.
    """
    p = build_parser()
    args = p.parse_args(argv)
    if args.batch < 1 or args.recompute_micro_batch < 1:
        p.error(f"--batch and --recompute-micro-batch must be >= 1, got {args.batch} and {args.recompute_micro_batch}")
    if args.recompute_micro_batch == args.batch:
        p.error(f"--recompute-micro-batch {args.recompute_micro_batch} equals --batch: the micro-batch variant must "
                f"use other network calls than the rollout")
    if not 1 <= args.trained_steps < args.steps:
        p.error(f"--trained-steps must be in [1, --steps - 1] (the last step is never stochastic), got "
                f"{args.trained_steps} with --steps {args.steps}")
    args.fsdp2 = False  # family_grpo_step.build_family reads it
    return args


def _pop_kept(live: dict, k: int, cond, uncond) -> torch.Tensor:
    """The log-prob [B] the rollout kept for step ``k`` (``Trajectory.live``), removed from ``live``."""
    return live.pop(k)[0]


def log_ratio_stats(log_ratios: torch.Tensor) -> dict:
    """Summary of a first update's log ratios.

    Args:
        log_ratios: [trained steps, B] recomputed log-prob - rollout log-prob (any float dtype, any device).
    Returns:
        ``{"log_ratio_max_abs", "log_ratio_mean_abs", "ratio_max_abs_dev" (max |exp(log r) - 1|): float,
        "bitwise_equal": bool (every log ratio exactly 0), "count": int}``.
    Raises:
        ValueError: an empty tensor.
    """
    if log_ratios.numel() == 0:
        raise ValueError("no log ratio to summarise: the update had no trained step")
    d = log_ratios.detach().double().cpu()
    return {"log_ratio_max_abs": float(d.abs().max()), "log_ratio_mean_abs": float(d.abs().mean()),
            "ratio_max_abs_dev": float((d.exp() - 1).abs().max()), "bitwise_equal": bool((d == 0).all()),
            "count": d.numel()}


def measure(args: argparse.Namespace) -> dict:
    """Roll out once per path and run GRPO's first update each way; see the module docstring.

    Args:
        args: the namespace of :func:`parse_args` (``--out`` is ignored here; :func:`main` writes it).
    Returns:
        ``{"family", "tiny", "device", "dtype", "height", "width", "num_frames", "batch",
        "recompute_micro_batch", "trained_steps" (list of step indices), ..., "rollout_s", "rollout_peak_gib",
        "variants": {name: { "log_ratio_max_abs", "log_ratio_mean_abs", "ratio_max_abs_dev", "bitwise_equal",
        "count", "micro_batch_size", "velocity_calls" (network calls of the update: trained steps x
        micro-batches; 0 for reuse), "update_s", "update_peak_gib", "rollout_s", "rollout_peak_gib",
        "rollout_plus_update_s"}}}``; seconds and GiB (None off CUDA). With ``--deterministic`` the two
        deterministic variants also carry ``"nondeterministic_ops"`` (the first warnings' texts).
    Raises:
        ValueError: the rollout has no stochastic step, or its trajectory records none (from genrl's sampler).
    """
    from genrl.flow.policy import policy_loss
    from genrl.methods.common import check_no_dropout
    from genrl.rollout.sampler import RolloutConfig, encode_cfg, rollout, transition_log_prob

    _reset_peak("cuda" if torch.cuda.is_available() else "cpu")
    built = family_grpo_step.build_family(args)
    gen, device, dtype, size, prompts = built["gen"], built["device"], built["dtype"], built["size"], built["prompts"]
    config = RolloutConfig(num_steps=args.steps, shift=3.0, kernel="flow_grpo", cfg_scale=args.cfg_scale,
                           sde_steps="prefix", num_sde_steps=args.trained_steps, micro_batch_size=args.batch)
    trainable = [q for q in gen.transformer.parameters() if q.requires_grad]
    snapshot = [q.detach().clone() for q in trainable]
    adv = torch.tensor([(-1.0) ** i for i in range(args.batch)], device=device)  # +1, -1, ...: a real gradient

    def roll(keep_graph: bool):
        """GRPO's collect_flat rollout (eval mode, seed 0, rollout id 0) without the decode; seconds and peak."""
        gen.eval()
        _reset_peak(device)
        _sync(device)
        t = time.perf_counter()
        traj = rollout(gen, prompts, gen.latent_shape, seed=0, config=config, rollout_id=0,
                       grad="sde" if keep_graph else "none")
        _sync(device)
        seconds = time.perf_counter() - t
        gen.train()
        return traj, seconds, _peak_gib(device)

    def update(traj, log_prob_of) -> dict:
        """GRPO's first optimizer step on ``traj`` with the log-probs ``log_prob_of(k)``; weights restored after."""
        cond, uncond = encode_cfg(gen, traj.prompts, config)  # as GRPO's update encodes its mini-batch
        opt = torch.optim.AdamW(trainable, lr=1e-4)
        _reset_peak(device)
        steps = traj.sde_steps
        ratios = []
        calls = [0]
        velocity = gen.velocity

        def counted(*a, **kw):  # counts the network calls the update makes (its forward passes' micro-batches)
            calls[0] += 1
            return velocity(*a, **kw)

        gen.velocity = counted  # an instance attribute over the method, removed below
        try:
            _sync(device)
            t = time.perf_counter()
            for k in steps:
                lp = log_prob_of(k, cond, uncond)
                old = traj.log_probs[:, k].to(lp.device)
                ratios.append(lp.detach() - old)
                loss, _ = policy_loss("clipped", lp, old, adv, clip_range=1e-4)
                (loss.mean() / len(steps)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            seconds = time.perf_counter() - t
        finally:
            del gen.velocity
        rec = {**log_ratio_stats(torch.stack(ratios)), "update_s": round(seconds, 4),
               "update_peak_gib": _peak_gib(device), "velocity_calls": calls[0]}
        with torch.no_grad():
            for q, saved in zip(trainable, snapshot):
                q.copy_(saved)
        del opt
        return rec

    def recompute(micro_batch: int):
        def log_prob_of_in(traj):
            sub = traj if micro_batch == args.batch else dataclasses.replace(
                traj, config=dataclasses.replace(traj.config, micro_batch_size=micro_batch))
            return lambda k, cond, uncond: transition_log_prob(gen, sub, k, cond, uncond)[0]
        return log_prob_of_in

    def with_rollout(rec: dict, seconds: float, peak: float | None, micro_batch: int) -> dict:
        rec.update(micro_batch_size=micro_batch, rollout_s=round(seconds, 4), rollout_peak_gib=peak,
                   rollout_plus_update_s=round(seconds + rec["update_s"], 4))
        return rec

    variants: dict[str, dict] = {}
    traj, rollout_s, rollout_peak = roll(keep_graph=False)
    for name, mb in (("plain", args.batch), ("micro_batch", args.recompute_micro_batch)):
        variants[name] = with_rollout(update(traj, recompute(mb)(traj)), rollout_s, rollout_peak, mb)
    trained = traj.sde_steps
    del traj

    check_no_dropout(gen)  # as GRPO does before reusing the rollout's forwards
    kept, kept_s, kept_peak = roll(keep_graph=True)
    # GRPO's step_loss pops each step's kept (log_prob, velocity, mean), so its graph is freed by that step's backward
    variants["reuse"] = with_rollout(update(kept, functools.partial(_pop_kept, kept.live)), kept_s, kept_peak,
                                     args.batch)
    del kept

    if args.deterministic:
        was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        env_was = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        workspace = os.environ["CUBLAS_WORKSPACE_CONFIG"]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.use_deterministic_algorithms(True, warn_only=True)
                det, det_s, det_peak = roll(keep_graph=False)
                for name, mb in (("deterministic", args.batch),
                                 ("deterministic_micro_batch", args.recompute_micro_batch)):
                    variants[name] = with_rollout(update(det, recompute(mb)(det)), det_s, det_peak, mb)
                del det
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
            if env_was is None:
                os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        ops = sorted({" ".join(str(w.message).split())[:160] for w in caught
                      if "deterministic" in str(w.message).lower()})
        for name in DETERMINISTIC_VARIANTS:
            variants[name].update(nondeterministic_ops=ops[:5],
                                  cublas_workspace_config=workspace,
                                  cublas_workspace_config_at_import=CUBLAS_AT_IMPORT)

    return {
        "family": args.family, "tiny": args.tiny,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": dtype, **size,
        "latent_shape": list(gen.latent_shape), "batch": args.batch, "rollout_micro_batch": args.batch,
        "recompute_micro_batch": args.recompute_micro_batch, "cfg_scale": args.cfg_scale, "steps": args.steps,
        "trained_steps": trained, "kernel": config.kernel, "lora_rank": args.lora_rank,
        "grad_ckpt": not args.no_grad_ckpt, "build_s": round(built["build_s"], 2), "params": built["n_params"],
        "rollout_s": round(rollout_s, 4), "rollout_peak_gib": rollout_peak, "variants": variants,
        "timing": "one synchronised update per variant, no separate warm-up (the rollout's forwards ran first)",
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> dict:
    """The command: :func:`measure`, then one JSON line on stdout (appended to ``--out`` when given)."""
    args = parse_args(argv)
    return family_grpo_step.emit(measure(args), args.out)


if __name__ == "__main__":
    main()
