"""Generate the teacher ODE pairs of the ODE initialisation of a causal few-step student (CausVid sec. 4.3).

The bidirectional teacher integrates the deterministic Euler probability-flow ODE from Gaussian noise with
classifier-free guidance (standard form, ``v = v_u + w (v_c - v_u)``) over a schedule of ``--teacher-steps``
steps that contains every student sigma exactly; each trajectory's states at the student sigmas and its clean
endpoint x0 are stored (``genrl.data.ode_pairs`` describes the file). CausVid / Self-Forcing
(``scripts/generate_ode_pairs.py``) store the states after fixed step counts of a uniform 48-step shift-8
schedule instead, which sit near, not at, the student's noise levels.

Examples::

    # the shapes world: the shipped DiT as teacher, 40 steps, CFG w = 3, 1024 trajectories on the train captions
    python pipelines/ode_pairs.py --out runs/ode_pairs/shapes.pt
    # Wan2.1-T2V-1.3B (CausVid: 48 steps, shift 8, w = 6), the Self-Forcing student list warped at shift 5
    python pipelines/ode_pairs.py --teacher /models/Wan2.1-T2V-1.3B-Diffusers --prompts prompts.txt \
        --num 1536 --teacher-steps 48 --shift 8 --cfg-scale 6 --student-timesteps 1000 750 500 250 \
        --student-shift 5 --batch-size 1 --out runs/ode_pairs/wan.pt

Resumable: trajectories are generated in shards of ``--batch-size`` written atomically to ``<out>.parts/``;
a rerun skips the shards that exist, then merges them into ``--out`` (atomically) and removes the folder. A
finished ``--out`` made with the same settings is kept as it is (nothing to do); one made with other settings
is an error (delete it or pick another ``--out``). Trajectory i has prompt ``prompts[i mod P]`` and noise
addressed by (``--seed``, i), so it does not depend on its batch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["teacher_schedule", "student_sigmas_of", "generate_ode_pairs", "main"]


def student_sigmas_of(timesteps: Sequence[float], shift: float, warp: bool = True) -> list[float]:
    """The student's S sigmas (without the final 0) of a few-step list, exactly as
    :meth:`genrl.rollout.autoregressive.ChunkSchedule.sigmas` computes them (e.g. the warped
    [1000, 750, 500, 250] at shift 5 gives [1, 0.9375, 0.8333.., 0.625]).

    Raises:
        ValueError: as :class:`~genrl.rollout.autoregressive.ChunkSchedule` (a bad list).
    """
    from genrl.rollout.autoregressive import ChunkSchedule

    return ChunkSchedule(timesteps=list(timesteps), shift=shift, warp=warp).sigmas()[:-1].tolist()


def teacher_schedule(student_sigmas: Sequence[float], teacher_steps: int, shift: float = 1.0) -> torch.Tensor:
    """The teacher's Euler schedule: a shifted uniform grid of ``teacher_steps`` steps that holds every student
    sigma exactly.

    Start from ``sigma_schedule(teacher_steps, shift)`` (``linspace(1, 0, K + 1)`` shifted with
    sigma' = s sigma / (1 + (s - 1) sigma); SD3 sec. 5.3.2) and move, for each student sigma s_i, the nearest
    interior grid point onto s_i (a student sigma of exactly 1 is the grid's start). The first value stays 1
    (trajectories start from pure noise) and the last 0; the number of steps stays ``teacher_steps``.

    Args:
        student_sigmas: the student's sigmas s_0 > s_1 > ... > s_{S-1} > 0 (a trailing 0 is ignored), each in
            (0, 1].
        teacher_steps: K, the teacher's Euler steps (>= S + 1 in practice; finer is better).
        shift: shift s > 0 of the teacher grid.
    Returns:
        float64 [K + 1], strictly descending from 1 to exactly 0, containing every student sigma.
    Raises:
        ValueError: an empty, unsorted or out-of-range student list, or a grid too coarse to give each student
            sigma its own point (the message says to raise ``teacher_steps``).
    """
    from genrl.flow.schedules import sigma_schedule

    sig = [float(s) for s in student_sigmas]
    if sig and sig[-1] == 0.0:
        sig = sig[:-1]
    if not sig or any(not 0.0 < s <= 1.0 for s in sig) or any(a <= b for a, b in zip(sig, sig[1:])):
        raise ValueError(f"student sigmas must be a strictly descending list in (0, 1], got {list(student_sigmas)}")
    if isinstance(teacher_steps, bool) or not isinstance(teacher_steps, int) or teacher_steps < 1:
        raise ValueError(f"teacher_steps must be an int >= 1, got {teacher_steps!r}")
    grid = sigma_schedule(teacher_steps, shift=shift).clone()
    taken: set[int] = set()
    for s in sig:
        if s == 1.0:
            k = 0
        else:
            if teacher_steps < 2:
                raise ValueError(f"teacher_steps={teacher_steps} has no interior point for student sigma {s}; "
                                 f"use more teacher steps")
            k = 1 + int((grid[1:-1] - s).abs().argmin())
        if k in taken:
            raise ValueError(f"teacher_steps={teacher_steps} (shift {shift}) is too coarse: student sigmas "
                             f"{sig} need their own grid points; use more teacher steps")
        taken.add(k)
        grid[k] = s
    values = grid.tolist()
    if not all(a > b for a, b in zip(values, values[1:])):
        raise ValueError(f"teacher_steps={teacher_steps} (shift {shift}) is too coarse for the student sigmas {sig} "
                         f"(merged schedule not strictly descending); use more teacher steps")
    return grid


def _atomic_save(obj, path: Path) -> None:
    from genrl.data.video_io import atomic_write

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _prompts_digest(prompts: Sequence[str]) -> str:
    return hashlib.sha1(json.dumps(list(prompts), ensure_ascii=False).encode()).hexdigest()


def generate_ode_pairs(
    teacher_generator,
    prompts: Sequence[str],
    latent_shape: Sequence[int],
    student_sigmas: Sequence[float],
    teacher_steps: int = 40,
    cfg_scale: float = 3.0,
    shift: float = 1.0,
    seed: int = 0,
    out: str | os.PathLike = "runs/ode_pairs/shapes.pt",
    batch_size: int = 32,
    progress: bool = True,
    *,
    null_prompt: str = "",
    teacher_name: str | None = None,
) -> Path:
    """Integrate the teacher's ODE for every prompt and store the states at the student sigmas (CausVid sec. 4.3).

    Trajectory i (i = 0..N-1, N = ``len(prompts)``) starts from the noise addressed by ``(seed, i)`` and follows
    the deterministic Euler ODE of :func:`genrl.rollout.sampler.rollout` (kernel ``"ode"``, CFG w =
    ``cfg_scale`` in the standard form, Ho & Salimans 2022) over :func:`teacher_schedule`; its states at the
    student sigmas and its final clean latents are kept.

    Args:
        teacher_generator: the bidirectional teacher (any Generator; genrl's DiT or a diffusers family).
        prompts: N prompts, one per trajectory.
        latent_shape: per-sample latent shape in the generator's layout (DiT: (T, C, H, W)).
        student_sigmas: the student's S sigmas s_0 = 1 > ... > s_{S-1} > 0 (a trailing 0 is ignored); e.g.
            :func:`student_sigmas_of`.
        teacher_steps: K, Euler steps of the teacher.
        cfg_scale: CFG scale w (1 = no guidance).
        shift: shift of the teacher's uniform grid.
        seed: noise seed.
        out: the output file; ``<out>.parts/`` holds the shards while generating.
        batch_size: trajectories per shard and network call.
        progress: show a progress bar.
        null_prompt: the unconditional prompt of CFG.
        teacher_name: recorded in the file's settings (e.g. the teacher's path).
    Returns:
        The path of the finished file: float32 ``latents`` [N, S + 1, *latent_shape], ``sigmas`` [S + 1]
        (the student sigmas, then 0), prompts, ``index`` = 0..N-1, the teacher schedule and the settings.
    Raises:
        ValueError: no prompts, ``batch_size < 1``, a bad student list or a too coarse teacher grid, or ``out``
            (or its shard folder) already made with other settings (delete it or choose another ``out``).
    """
    from genrl.data.ode_pairs import ODEPairs, load_ode_pairs, save_ode_pairs
    from genrl.rollout.sampler import RolloutConfig, rollout

    prompts = [str(p) for p in prompts]
    if not prompts:
        raise ValueError("generate_ode_pairs needs at least one prompt")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    schedule = teacher_schedule(student_sigmas, teacher_steps, shift)
    sig = [float(s) for s in student_sigmas if float(s) != 0.0] + [0.0]
    values = schedule.tolist()
    positions = [values.index(s) for s in sig]
    settings = dict(teacher=teacher_name, teacher_steps=int(teacher_steps), cfg_scale=float(cfg_scale),
                    shift=float(shift), seed=int(seed), null_prompt=null_prompt, student_sigmas=sig,
                    latent_shape=[int(d) for d in latent_shape], num_samples=len(prompts),
                    prompts_sha1=_prompts_digest(prompts))
    out = Path(out)
    if out.exists():
        existing = load_ode_pairs(out)
        diff = {k: (existing.settings.get(k), v) for k, v in settings.items() if existing.settings.get(k) != v}
        if diff:
            raise ValueError(f"{str(out)!r} exists and was made with other settings (file vs now: {diff}); delete "
                             f"it or choose another --out")
        if progress:
            print(f"{out} is complete ({existing.num_samples} trajectories, same settings): nothing to do")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = out.with_name(out.name + ".parts")
    parts.mkdir(exist_ok=True)
    meta = parts / "settings.json"
    if meta.is_file():
        old = json.loads(meta.read_text())
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"the shard folder {str(parts)!r} was made with other settings (folder vs now: {diff}); "
                             f"delete it or choose another --out")
    else:
        meta.write_text(json.dumps(settings, indent=1))

    config = RolloutConfig(kernel="ode", num_steps=int(teacher_steps), schedule=values, cfg_scale=float(cfg_scale),
                           null_prompt=null_prompt, micro_batch_size=batch_size)
    n = len(prompts)
    starts = list(range(0, n, batch_size))
    shard = lambda s: parts / f"{s:08d}-{min(n, s + batch_size):08d}.pt"  # noqa: E731
    todo = [s for s in starts if not shard(s).is_file()]

    from contextlib import nullcontext

    bar_ctx = nullcontext()
    if progress:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        bar_ctx = Progress(TextColumn("teacher ODE pairs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TimeRemainingColumn())
    with bar_ctx as bar:
        done = n - sum(min(n, s + batch_size) - s for s in todo)
        task = bar.add_task("pairs", total=n, completed=done) if bar is not None else None
        for s in todo:
            e = min(n, s + batch_size)
            traj = rollout(teacher_generator, prompts[s:e], latent_shape, seed, list(range(s, e)), config, record=True)
            states = traj.latents[:, positions].to(torch.float32).contiguous()  # [b, S + 1, *latent]
            _atomic_save({"latents": states, "start": s, "stop": e}, shard(s))
            if bar is not None:
                bar.advance(task, e - s)

    latents = []
    for s in starts:
        part = torch.load(shard(s), map_location="cpu", weights_only=True)
        if part.get("start") != s or part["latents"].shape[0] != min(n, s + batch_size) - s:
            raise ValueError(f"shard {str(shard(s))!r} does not hold trajectories {s}..{min(n, s + batch_size) - 1}; "
                             f"delete {str(parts)!r} and rerun")
        latents.append(part["latents"])
    pairs = ODEPairs(latents=torch.cat(latents), sigmas=torch.tensor(sig, dtype=torch.float64),
                     teacher_sigmas=schedule, prompts=prompts, index=torch.arange(n, dtype=torch.int64),
                     settings=settings)
    save_ode_pairs(out, pairs)
    shutil.rmtree(parts)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Generate teacher ODE pairs for the ODE initialisation of a causal student.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--teacher", default="assets/shapes-dit",
                   help="genrl DiT folder, diffusers pipeline folder (model_index.json) or a genrl fit .ckpt")
    p.add_argument("--pretrained", default=None, help="checkpoints only: the local base-model folder")
    p.add_argument("--text-encoder", default=None, help="DiT only: local text-encoder folder or 'minilm'")
    p.add_argument("--prompts", default="shapes:train",
                   help="prompt file (.txt/.jsonl/.json) or built-in source (shapes:train, vbench, ...)")
    p.add_argument("--num", type=int, default=1024, help="trajectories N (the prompts are cycled)")
    p.add_argument("--teacher-steps", type=int, default=40, help="teacher Euler steps K")
    p.add_argument("--cfg-scale", type=float, default=3.0, help="teacher CFG scale w (standard form; 1 = off)")
    p.add_argument("--shift", type=float, default=1.0, help="shift of the teacher's uniform grid")
    p.add_argument("--negative-prompt", default="", help="the unconditional prompt of CFG")
    p.add_argument("--student-timesteps", type=float, nargs="+", default=[1000.0, 750.0, 500.0, 250.0],
                   help="the student's few-step list in (0, 1000] (as ChunkSchedule.timesteps)")
    p.add_argument("--student-shift", type=float, default=1.0,
                   help="the student's schedule shift (ChunkSchedule.shift)")
    p.add_argument("--no-warp", action="store_true",
                   help="shift each listed timestep directly (ChunkSchedule.warp false)")
    p.add_argument("--frames", type=int, default=None, help="DiT: latent frames (default 8); families: pixel frames")
    p.add_argument("--height", type=int, default=None, help="pixels (DiT default 16)")
    p.add_argument("--width", type=int, default=None, help="pixels (DiT default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None, help="trajectories per shard (DiT default 32, families 1)")
    p.add_argument("--out", default="runs/ode_pairs/shapes.pt", help="output file")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="family weights dtype (default: bfloat16 on cuda, else float32)")
    return p


def main(argv: list[str] | None = None) -> Path:
    """Run the script; returns the path of the finished pairs file."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--num and --batch-size must be >= 1")

    from genrl.data.prompts import load_prompts
    from genrl.models.generator import DiTGenerator
    from genrl.models.loading import DIT_DEFAULTS, check_sample_size, load_generator

    # checked before the teacher loads; nothing is written on failure
    check_sample_size(args.teacher, args.height, args.width, args.frames)
    if args.pretrained is not None and not Path(args.pretrained).expanduser().is_dir():
        parser.error(f"--pretrained {args.pretrained!r} is not a folder; give the local base-model folder")
    records = load_prompts(args.prompts)
    prompts = [records[i % len(records)].prompt for i in range(args.num)]
    sigmas = student_sigmas_of(args.student_timesteps, args.student_shift, warp=not args.no_warp)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    t0 = time.perf_counter()
    teacher = load_generator(args.teacher, text_encoder=args.text_encoder, height=args.height, width=args.width,
                             num_frames=args.frames, torch_dtype=dtype, pretrained=args.pretrained).to(device)
    teacher.eval()
    if isinstance(teacher, DiTGenerator):
        d = DIT_DEFAULTS
        latent_shape = (args.frames or d["num_frames"], teacher.codec.latent_channels, args.height or d["height"],
                        args.width or d["width"])
        batch_size = args.batch_size or 32
    else:
        latent_shape = tuple(teacher.latent_shape)
        batch_size = args.batch_size or 1
    print(f"loaded teacher {args.teacher} in {time.perf_counter() - t0:.1f} s on {device}: {args.num} trajectories "
          f"of {tuple(latent_shape)}, {args.teacher_steps} Euler steps (shift {args.shift}), CFG w={args.cfg_scale}; "
          f"student sigmas {[round(s, 4) for s in sigmas]}")
    t1 = time.perf_counter()
    with torch.no_grad():
        path = generate_ode_pairs(teacher, prompts, latent_shape, sigmas, args.teacher_steps, args.cfg_scale,
                                  args.shift, args.seed, args.out, batch_size, progress=True,
                                  null_prompt=args.negative_prompt, teacher_name=str(args.teacher))
    print(f"ODE pairs in {path} ({time.perf_counter() - t1:.1f} s)")
    return path


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:  # bad paths / inputs: the message says what to fix
        sys.exit(f"error: {e}")
