"""One prepared GPU suite: every real-size measurement genrl needs, in one call on one H200 (issue 19).

    python benchmarks/gpu_suite.py --out benchmarks/gpu_suite.json --results-md /tmp/t.md   # one H200, < 9 min
    python benchmarks/gpu_suite.py --tiny --out /tmp/suite.json --results-md /tmp/suite.md  # CPU smoke run

Random weights, real architectures (diffusers' published configs), bf16 on CUDA; nothing is downloaded.
Sections, in order (anchors: docs/models.md, "Reference throughput figures"):

1. ``wan_forward``: Wan2.1-1.3B ``WanTransformer3DModel`` at 480x832x81 (latents [1, 16, 21, 60, 104],
   32,760 tokens; text states [1, 512, 4096]): raw forward (ms, median of 5 after a warm-up) and forward +
   backward with gradient checkpointing (ms, median of 3; all weights trained; CUDA peak GiB). Anchors 613 ms,
   2,653 ms and 12.3 GiB.
2. ``wan_grpo``: ``family_grpo_step.measure`` for Wan2.1-1.3B (480x832x81, LoRA r32, CFG 5, 20 steps, 2 trained
   SDE steps): raw guided forward, rollout, sampler overhead (rollout / (steps x raw forward) - 1, target
   <= 5%), decode, GRPO step and peaks (target: under 40 GiB).
   Sections 2, 2b, 3 and F also record GRPO iteration throughput (``grpo_iteration``): videos (images) per
   GPU-second = batch / (rollout + decode + reward + update seconds), each part's seconds (docs/gpu_suite.md,
   "Throughput protocol").
2c. ``on_policy_ratio``: ``on_policy_ratio.measure`` (issue 50): the first GRPO update's max and mean |log ratio|
   (recomputed log-prob - the rollout's) for Wan2.1-1.3B (480x832x81, batch 2, 1 trained step) and SD3.5-M (512 px,
   batch 8, 2 trained steps), LoRA r32, each way the update can get its log-probs: the plain recompute (the
   rollout's micro-batches), a recompute with micro-batches of 1 (batch variance), ``reuse_rollout_forward``
   (ratio 1 by construction) and, for SD3.5-M, both recomputes under ``torch.use_deterministic_algorithms``; the
   update step's seconds and CUDA peak per way. Target: 0, or the bf16 floor with its cause stated.
3. ``sd3_grpo``: the same for SD3.5-M at 512 px, batch 8, CFG 4.5.
4. ``causal_stream``: ``causal_wan_stream.measure`` for the causal Wan2.1-1.3B student (7 chunks of 3 latent
   frames, 4 + 1 passes each): frames/s without decoding, with one decode at the end, with a streamed
   per-chunk decode, with that decode on a second CUDA stream overlapped with the next chunk's denoising (target
   >= 25 frames/s end to end on an H200, >= 20 on an H100; 17 on other cards, Self-Forcing's H100 figure), and a 4x
   longer stream with a 12-frame window + 3 sink
   frames; static KV cache and regionally compiled blocks (``--static-cache --compile``): compile time, dynamo's
   graph counts, time to first frame and the SDPA kernel are recorded. ``fp8_chunk``: the same stream with the
   Linear layers in torchao's row-wise fp8 (``--linear-precision fp8``), denoise frames/s against the bf16 run:
   whether fp8 pays at a chunk's token count.
5. ``fp8_compile``: raw matmul TFLOP/s, bf16 (8192^3) and fp8 e4m3 ``torch._scaled_mm`` (anchors 769 and
   1,387 TFLOP/s); then the section-1 forward compiled with ``torch.compile`` (regional: the repeated
   transformer blocks) in bf16 and with fp8 weights + activations (rowwise scales): torchao's
   ``Float8DynamicActivationFloat8WeightConfig`` when torchao is installed (the ``fp8`` extra), else
   (or when it fails) a plain ``torch._scaled_mm`` linear (``Fp8Linear``).
5b. ``sol_rl_rollout``: genrl's Sol-RL rollout copy (``genrl.models.quantized``) of the section-1 transformer,
   compiled, fp8 (torchao row-wise, layer policy's default skips) vs bf16 (issue 21: goal >= 1.35x), and the
   in-place refresh after a simulated optimizer step (seconds; bitwise equal to a fresh quantization; parameters
   not rebound; no recompilation). ``--tiny``: float32 vs simulated fp8.
6. ``noise``: one step's noise draw per backend (per-sample device generators, counter-based Philox) at the shapes
   world's size and at Wan2.1's (16 x [16, 21, 60, 104]), ms (``sampler_overhead.noise_cost``).
7. ``tmd_fps``: sampling frames/s at 480x832x81 (denoising only, batch 1, median of 3 after a warm-up) of a TMD
   student, genrl's ``TransitionModel`` (``genrl.models.trunk``: the Wan2.1-1.3B generator, random weights, no text
   encoder, + a ``FlowHead`` over its last 5 of 30 blocks, gate open) sampled by ``transition_rollout`` with
   M = 2 outer x N = 2 inner steps (effective NFE 2.33), vs a 4-step Euler sampler on the plain transformer forward
   (the DMD student's 4 forwards); the speed-up, the NFE ratio (1.71) and CUDA peaks. ``--tiny``: the tiny Wan
   transformer with 30 blocks.

F. ``--families wan22 ...`` (or ``all``), not in the default run: ``family_grpo_step.measure`` for each family added
   with Wan2.2 / image-to-video at its released size (the GRPO config's for Wan2.2-A14B and Qwen-Image), random
   weights built directly in bf16: Wan2.2-T2V-A14B, Wan2.1-I2V-14B and Wan2.2-TI2V-5B (image-to-video), SkyReels-V2,
   HunyuanVideo-1.5, LTX-2 (video stream), Qwen-Image, FLUX.2 [dev]; raw forward, rollout, decode, LoRA GRPO step,
   CUDA peaks. Some do not fit one 80 GiB GPU (two 14B experts, FLUX.2's 32B): ask for the H200.

Robustness: each section runs in try/except and records ``"ok"``, ``"error: ..."`` (with a short traceback) or
``"skipped: ..."``; a section starts only if the global budget (``--budget-s``, default 520 s from the start of
the process) leaves its estimated need, else it is recorded as ``"skipped: budget ..."``, and it is stopped at
its own time limit or the end of the budget (SIGALRM); the JSON (``--out``) is rewritten before and after every
section (and after each part of section 5), so a killed run still leaves what it measured. Progress lines go to
stdout, flushed. ``--results-md PATH`` writes the markdown table for benchmarks/RESULTS.md (it is printed too).

``--tiny`` runs every section end to end on the CPU with the tiny test components (``genrl.testing.families``;
float32): the real-size timings and targets do not apply, CUDA memory is ``None``, torchao's fp8 records
``"skipped: needs CUDA"``, the fp8 matmul and ``Fp8Linear`` run on the CPU where this torch has CPU
``_scaled_mm``, and ``torch.compile`` uses the ``eager`` backend (dynamo capture without inductor's C++ build).
"""

from __future__ import annotations

import time

_T_START = time.monotonic()  # the budget counts from the start of the process (imports included)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import causal_wan_stream  # noqa: E402
import family_grpo_step  # noqa: E402
import on_policy_ratio  # noqa: E402
import sampler_overhead  # noqa: E402

#: one-H200 reference figures (docs/models.md, "Reference throughput figures")
ANCHORS = {
    "wan_forward_ms": 613.0,
    "wan_fwd_bwd_ckpt_ms": 2653.0,
    "wan_fwd_bwd_ckpt_peak_gib": 12.3,
    "bf16_tflops": 769.0,
    "fp8_tflops": 1387.0,
}
#: targets of issue 19
TARGETS = {
    "sampler_overhead_max": 0.05,  # rollout / (steps x raw forward) - 1
    "wan_grpo_peak_gib_max": 40.0,  # LoRA GRPO step at 480x832x81
    "stream_e2e_fps_min": 17.0,  # causal Wan2.1-1.3B, pixel frames per second, end to end (Self-Forcing, one H100)
    "stream_e2e_fps_h200": 25.0,  # issue 50's targets: an H200 ...
    "stream_e2e_fps_h100": 20.0,  # ... and an H100
}
#: Wan2.1 480x832x81: latents [16, 21, 60, 104]; text states of 512 tokens
WAN_LATENTS = (16, 21, 60, 104)
WAN_TEXT_TOKENS = 512
TINY_WAN_LATENTS = (16, 3, 8, 8)
TINY_WAN_TEXT_TOKENS = 16
E4M3_MAX = 448.0  # largest finite float8 e4m3fn value


class SectionTimeout(Exception):
    """A section ran past its time limit or the end of the budget."""


class Interrupted(BaseException):
    """SIGTERM / SIGINT: the running section is recorded as interrupted and the JSON written before exit."""


# ---------------------------------------------------------------------------------------------------- helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], object], device: torch.device, warmup: int = 1, reps: int = 3) -> list[float]:
    """Run ``fn`` ``warmup`` times untimed, then ``reps`` times, each bracketed by ``torch.cuda.synchronize``.

    Returns:
        the ``reps`` wall times in milliseconds.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def _median(times: list[float]) -> float:
    return round(statistics.median(times), 2)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def gpu_driver_version() -> str | None:
    """The NVIDIA driver version (e.g. ``"570.124.06"``) from ``nvidia-smi``, or from NVML through
    ``torch.cuda`` when that fails; None when neither answers (no NVIDIA driver, e.g. on a CPU machine)."""
    with contextlib.suppress(Exception):
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        first = run.stdout.strip().splitlines()[0].strip() if run.returncode == 0 and run.stdout.strip() else ""
        if first:
            return first
    with contextlib.suppress(Exception):
        import pynvml  # nvidia-ml-py, which torch.cuda's NVML queries use

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    return None


def cuda_driver_api_version() -> str | None:
    """The CUDA version the installed driver supports (``cuDriverGetVersion``, e.g. ``"13.0"``), or None off CUDA."""
    with contextlib.suppress(Exception):
        v = int(torch._C._cuda_getDriverVersion())
        return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else None
    return None


def environment(device: torch.device) -> dict:
    """Versions, device and date of this run (recorded in the JSON and the markdown header): Python, torch, CUDA
    (the toolkit torch was built with), cuDNN, diffusers / transformers / peft / torchao; on CUDA the GPU's name,
    memory (GiB), compute capability, the NVIDIA driver version (``driver``, :func:`gpu_driver_version`) and the
    CUDA version the driver supports (``cuda_driver_api``); both None on the CPU."""
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "torchao": _version("torchao"),
        "device": str(device),
        "gpu": None,
        "gpu_memory_gib": None,
        "driver": None,
        "cuda_driver_api": None,
        "git_commit": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   compute_capability=f"{props.major}.{props.minor}", driver=gpu_driver_version(),
                   cuda_driver_api=cuda_driver_api_version())
    with contextlib.suppress(Exception):
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    return env


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class SuiteContext:
    """What every section gets: the mode, device and dtype, the budget, and a way to save progress.

    Attributes:
        tiny: CPU smoke run on tiny components.
        device, dtype: ``cuda`` / bfloat16, or ``cpu`` / float32 under ``tiny``.
        deadline: ``time.monotonic()`` value at which the budget ends.
        compile_backend: ``torch.compile`` backend of section 5.
        fp8_native: ``"fallback"`` (Fp8Linear only when torchao's fp8 did not run), ``"always"`` or ``"never"``.
        save: rewrites the JSON (sections call it after each finished part).
        log: prints one progress line (flushed).
    """

    tiny: bool
    device: torch.device
    dtype: torch.dtype
    deadline: float
    compile_backend: str
    fp8_native: str = "fallback"
    save: Callable[[], None] = lambda: None
    log: Callable[[str], None] = print

    def remaining(self) -> float:
        """Seconds left in the budget."""
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Section:
    """One measurement of the suite.

    Attributes:
        name: JSON key; title: the markdown row's label.
        run: ``run(ctx, out)`` fills the dict ``out`` as it measures (partial results survive an error).
        need_s: estimated seconds on one H200; the section starts only with this much budget left.
        limit_s: hard time limit of the section (it also stops at the end of the budget).
        tiny_need_s: the same estimate under ``--tiny``.
    """

    name: str
    title: str
    run: Callable[[SuiteContext, dict], None]
    need_s: float
    limit_s: float
    tiny_need_s: float = 1.0


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise :class:`SectionTimeout` in the main thread after ``seconds`` (no-op off the main thread)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def _expired(signum, frame):
        raise SectionTimeout(f"time limit of {seconds:.0f} s reached")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _interrupts_recorded():
    """Turn SIGTERM (a wrapper's timeout) and SIGINT into :class:`Interrupted` so the JSON is written first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _stop(signum, frame):
        raise Interrupted(f"interrupted by signal {signum}")

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _error_record(err: BaseException) -> tuple[str, str]:
    """(status, short traceback) of an exception; CUDA OOM and timeouts keep their message."""
    message = " ".join(str(err).split())[:400]
    status = f"error: {type(err).__name__}: {message}" if message else f"error: {type(err).__name__}"
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=-6))
    return status, tb[-3000:]


def write_json(path: Path, report: dict) -> None:
    """Write ``report`` to ``path`` atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_sections(sections: list[Section], ctx: SuiteContext, report: dict, selected: set[str] | None = None) -> None:
    """Run ``sections`` in order into ``report["sections"]``, each guarded, timed and budgeted.

    Every section's record is ``{"title", "status", "wall_s", "result"}`` (``"traceback"`` on errors); status is
    ``"ok"``, ``"error: <type>: <message>"`` or ``"skipped: <reason>"``. ``ctx.save`` runs before and after each
    section. :class:`Interrupted` is recorded on the running section, saved, and re-raised.
    """
    records = report.setdefault("sections", {})
    for sec in sections:
        records[sec.name] = {"title": sec.title, "status": "pending", "wall_s": None, "result": {}}
    ctx.save()
    for i, sec in enumerate(sections, 1):
        rec = records[sec.name]
        need = sec.tiny_need_s if ctx.tiny else sec.need_s
        left = ctx.remaining()
        if selected is not None and sec.name not in selected:
            rec["status"] = "skipped: not selected (--sections)"
            continue
        if left < need:
            rec["status"] = f"skipped: budget ({max(left, 0):.0f} s left, the section needs about {need:.0f} s)"
            ctx.log(f"section {i}/{len(sections)} {sec.name}: {rec['status']}")
            ctx.save()
            continue
        ctx.log(f"section {i}/{len(sections)} {sec.name}: start ({left:.0f} s of budget left)")
        rec["status"] = "running"
        ctx.save()
        t0 = time.monotonic()
        out = rec["result"]
        try:
            with _time_limit(min(sec.limit_s, ctx.remaining())):
                sec.run(ctx, out)
            rec["status"] = "ok"
        except Interrupted as err:
            rec["status"] = f"error: {err}"
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            ctx.save()
            raise
        except Exception as err:  # noqa: BLE001 - every failure is recorded and the suite goes on
            rec["status"], rec["traceback"] = _error_record(err)
        finally:
            _free(ctx.device)
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        ctx.log(f"section {i}/{len(sections)} {sec.name}: {rec['status'][:200]} ({rec['wall_s']} s)")
        ctx.save()


# ---------------------------------------------------------------------------------------------------- sections


def _wan_inputs(ctx: SuiteContext, text_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random latents [1, 16, F, h, w], timestep [1] (500) and text states [1, L, text_dim] for the Wan forward."""
    latents = TINY_WAN_LATENTS if ctx.tiny else WAN_LATENTS
    tokens = TINY_WAN_TEXT_TOKENS if ctx.tiny else WAN_TEXT_TOKENS
    g = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(1, *latents, device=ctx.device, dtype=ctx.dtype, generator=g)
    text = torch.randn(1, tokens, text_dim, device=ctx.device, dtype=ctx.dtype, generator=g)
    t = torch.full((1,), 500.0, device=ctx.device)
    return x, t, text


def _wan_config(ctx: SuiteContext, fp8_dims: bool = False) -> dict:
    """Wan2.1-1.3B's transformer config, or the tiny one (with ``fp8_dims``: widths that are multiples of 16, so
    that the tiny run converts its linears to fp8 as the real one does)."""
    from genrl.testing.families import TINY

    if not ctx.tiny:
        return dict(family_grpo_step.REAL["wan"]["transformer"])
    cfg = dict(TINY["wan"]["transformer"])
    if fp8_dims:
        cfg.update(attention_head_dim=16, ffn_dim=64)
    return cfg


def _wan_describe(ctx: SuiteContext, transformer, x: torch.Tensor, text: torch.Tensor) -> dict:
    p = transformer.config.patch_size
    tokens = (x.shape[2] // p[0]) * (x.shape[3] // p[1]) * (x.shape[4] // p[2])
    return {"params_b": round(sum(q.numel() for q in transformer.parameters()) / 1e9, 4),
            "latents": list(x.shape), "tokens": tokens, "text_tokens": text.shape[1], "dtype": str(ctx.dtype)}


def section_wan_forward(ctx: SuiteContext, out: dict) -> None:
    """Section 1: Wan2.1-1.3B raw forward (ms) and forward + backward with gradient checkpointing (ms, GiB)."""
    cfg = _wan_config(ctx)
    torch.manual_seed(0)
    transformer = causal_wan_stream.wan_transformer(cfg, ctx.device, ctx.dtype)
    x, t, text = _wan_inputs(ctx, cfg["text_dim"])
    out.update(_wan_describe(ctx, transformer, x, text))

    def forward():
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    with torch.no_grad():
        times = timed_ms(forward, ctx.device, warmup=1, reps=5)
    out.update(forward_ms=_median(times), forward_ms_all=[round(v, 2) for v in times])
    ctx.log(f"  wan forward {out['forward_ms']} ms (anchor {ANCHORS['wan_forward_ms']:.0f} ms)")

    transformer.enable_gradient_checkpointing()
    transformer.train()
    params = [q for q in transformer.parameters() if q.requires_grad]

    def forward_backward():
        forward().float().square().mean().backward()
        for q in params:
            q.grad = None

    _free(ctx.device)
    _reset_peak(ctx.device)
    times = timed_ms(forward_backward, ctx.device, warmup=1, reps=3)
    out.update(fwd_bwd_ckpt_ms=_median(times), fwd_bwd_ckpt_ms_all=[round(v, 2) for v in times],
               fwd_bwd_ckpt_peak_gib=_peak_gib(ctx.device), trained_params="all")
    ctx.log(f"  wan fwd+bwd (grad ckpt) {out['fwd_bwd_ckpt_ms']} ms, peak {out['fwd_bwd_ckpt_peak_gib']} GiB")


def _family_args(ctx: SuiteContext, words: list[str]):
    return family_grpo_step.parse_args(words + (["--tiny"] if ctx.tiny else []))


def section_wan_grpo(ctx: SuiteContext, out: dict) -> None:
    """Section 2: ``family_grpo_step`` for Wan2.1-1.3B (480x832x81, LoRA r32, CFG 5)."""
    out.update(family_grpo_step.measure(_family_args(ctx, ["--family", "wan"])))
    ctx.log(f"  wan rollout {out['rollout_s']} s, overhead {out['sampler_overhead']:+.2%}, "
            f"GRPO step {out['grpo_step_s']} s, peak {out['peak_gib']} GiB")


def section_wan_grpo_fsdp2(ctx: SuiteContext, out: dict) -> None:
    """Section 2b: the Wan2.1-1.3B LoRA GRPO step with the transformer sharded by FSDP2 (one process, 4-step
    rollout: the step and its peak are what is measured)."""
    import torch.distributed as dist

    try:
        out.update(family_grpo_step.measure(_family_args(ctx, ["--family", "wan", "--fsdp2", "--steps", "4"])))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    ctx.log(f"  wan FSDP2 GRPO step {out['grpo_step_s']} s, peak {out['peak_gib']} GiB")


#: section 2c's parts: (key, on_policy_ratio's words, estimated seconds on one H200 (never run on a GPU yet): build +
#: two rollouts + 3 updates). Wan2.1-1.3B: a 3-step rollout (~1.5 s per guided forward of 2 prompts at CFG 5, so
#: ~3 s per step), 1 trained step (~11.5 s per update of 2 samples, from section 2's 5.7 s per sample and step);
#: SD3.5-M: 10 steps, 2 trained steps, plus the deterministic variants (a third rollout, two more updates).
ON_POLICY_PARTS = (
    ("wan", ["--family", "wan", "--batch", "2", "--steps", "3", "--trained-steps", "1"], 60.0),
    ("sd3", ["--family", "sd3", "--batch", "8", "--cfg-scale", "4.5", "--steps", "10", "--trained-steps", "2",
             "--deterministic"], 25.0),
)


def section_on_policy_ratio(ctx: SuiteContext, out: dict) -> None:
    """Section 2c (issue 50): ``on_policy_ratio.measure`` for Wan2.1-1.3B and then SD3.5-M (``ON_POLICY_PARTS``):
    each part's record is the benchmark's result plus ``"status"``; a part starts only with its estimated seconds
    left in the budget, and a failed part (e.g. CUDA out of memory) does not stop the next one.

    Raises:
        RuntimeError: after both parts ran, when any failed (naming them), so the section is recorded as an error.
    """
    failed = []
    for key, words, need in ON_POLICY_PARTS:
        rec = out.setdefault(key, {})
        need = 5.0 if ctx.tiny else need
        if ctx.remaining() < need:
            rec["status"] = f"skipped: budget ({max(ctx.remaining(), 0):.0f} s left, needs about {need:.0f} s)"
            ctx.save()
            continue
        try:
            rec.update(on_policy_ratio.measure(on_policy_ratio.parse_args(words + (["--tiny"] if ctx.tiny else []))))
            rec["status"] = "ok"
            v = rec["variants"]
            ctx.log(f"  {key} first update max |log ratio|: plain {v['plain']['log_ratio_max_abs']:.3g}, micro-batch "
                    f"{v['micro_batch']['log_ratio_max_abs']:.3g}, reuse {v['reuse']['log_ratio_max_abs']:.3g}")
        except SectionTimeout:
            raise
        except Exception as err:  # noqa: BLE001 - recorded; the next part still runs
            rec["status"], rec["traceback"] = _error_record(err)
            failed.append(key)
        finally:
            _free(ctx.device)
            ctx.save()
    if failed:
        raise RuntimeError(f"on_policy_ratio part(s) failed: {failed} (see each part's status)")


def section_sd3_grpo(ctx: SuiteContext, out: dict) -> None:
    """Section 3: ``family_grpo_step`` for SD3.5-M (512 px, batch 8, CFG 4.5)."""
    out.update(family_grpo_step.measure(_family_args(ctx, ["--family", "sd3", "--batch", "8", "--cfg-scale", "4.5"])))
    ctx.log(f"  sd3 rollout {out['rollout_s']} s, overhead {out['sampler_overhead']:+.2%}, "
            f"GRPO step {out['grpo_step_s']} s, peak {out['peak_gib']} GiB")


def section_causal_stream(ctx: SuiteContext, out: dict) -> None:
    """Section 4: ``causal_wan_stream`` (decode at the end and per chunk; 4x stream with window 12 + sink 3), with the
    static KV cache and the blocks compiled (``--static-cache --compile``; ``aot_eager`` with ``--tiny``)."""
    words = ["--static-cache", "--compile", "--decode-per-chunk", "--overlap-decode", "--local-window", "12", "--sink",
             "3"]
    if ctx.tiny:
        words = ["--tiny", "--static-cache", "--compile", "--decode-per-chunk", "--overlap-decode", "--height", "32",
                 "--width", "32",
                 "--latent-frames", "6",
                 "--local-window", "6", "--sink", "3", "--stream-multiple", "2"]
    out.update(causal_wan_stream.measure(causal_wan_stream.parse_args(words)))
    ctx.save()
    # the baseline in the same call (the first H200 run's setting: dynamic cache, eager), when the budget leaves it
    need = 5.0 if ctx.tiny else 45.0
    if ctx.remaining() >= need:
        _free(ctx.device)
        base_words = _without_options(words, ("--static-cache", "--compile"))  # and no long windowed stream
        base = causal_wan_stream.measure(causal_wan_stream.parse_args(base_words))
        out["baseline_dynamic_eager"] = {k: base.get(k) for k in (
            "denoise_fps", "e2e_fps_decode_at_end", "time_to_first_frame_s", "first_chunk_latency_s")} | {
            "stream_decode_e2e_fps": (base.get("stream_decode") or {}).get("e2e_fps"),
            "overlap_e2e_fps": (base.get("stream_decode_overlap") or {}).get("e2e_fps")}
    else:
        out["baseline_dynamic_eager"] = {"status": f"skipped: budget ({max(ctx.remaining(), 0):.0f} s left)"}
    out["fp8_chunk"] = _causal_fp8_chunk(ctx, words, out)
    ctx.save()
    ctx.log(f"  causal stream: denoise {out['denoise_fps']} fps, decode at end {out['e2e_fps_decode_at_end']} fps, "
            f"streamed decode {out.get('stream_decode', {}).get('e2e_fps')} fps, overlapped "
            f"{out.get('stream_decode_overlap', {}).get('e2e_fps')} fps, first frame "
            f"{out.get('time_to_first_frame_s')} s, compile {(out.get('compile') or {}).get('compile_s')} s, SDPA "
            f"{(out.get('sdpa_kernel') or {}).get('backend')}")


def matmul_tflops(device: torch.device, n: int, kind: str, reps: int, fast_accum: bool = True) -> float:
    """TFLOP/s of an n x n x n matrix product (2 n^3 flops), median of ``reps`` after 3 warm-ups.

    ``kind`` ``"bf16"``: ``a @ b`` in bfloat16. ``"fp8"``: ``torch._scaled_mm`` on float8 e4m3 operands
    (``b`` column-major, unit per-tensor scales, bf16 output, ``use_fast_accum=fast_accum``).
    """
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g)
    b = torch.randn(n, n, device=device, generator=g)
    if kind == "bf16":
        a, b = a.bfloat16(), b.bfloat16()

        def op():
            return a @ b
    elif kind == "fp8":
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants its second operand
        one = torch.ones((), device=device)

        def op():
            return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum)
    else:
        raise ValueError(f"kind must be 'bf16' or 'fp8', got {kind!r}")
    ms = statistics.median(timed_ms(op, device, warmup=3, reps=reps))
    return round(2 * n**3 / (ms * 1e-3) / 1e12, 3 if n < 4096 else 1)


class Fp8Linear(torch.nn.Module):
    """``y = x W^T + b`` with W and x in float8 e4m3 and rowwise scales, through ``torch._scaled_mm``.

    The weight [out, in] is quantised once with one scale per output row (amax / 448); the input [..., in] is
    quantised on every call with one scale per token. The product accumulates in float32 and is returned in
    the original weight's dtype [..., out]. Under ``torch.compile`` the quantisation fuses around the matmul.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX  # [out, 1]
        self.register_buffer("weight_fp8", (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in the weight's original dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float()
        scale = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX  # [M, 1]
        xq = (x2 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                             out_dtype=self.out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def fp8_eligible(module: torch.nn.Module, name: str = "") -> bool:
    """A linear layer fp8 can take: not float32 (the model's kept-in-fp32 modules stay as they are) and both
    dimensions multiples of 16 (a ``_scaled_mm`` requirement)."""
    return (isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def to_fp8_native(model: torch.nn.Module, force: bool = False) -> int:
    """Replace every :func:`fp8_eligible` linear of ``model`` by an :class:`Fp8Linear` in place.

    ``force`` also converts float32 linears (the tiny CPU run, whose model is float32). Returns the count.
    """
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and (fp8_eligible(child) or (
                    force and child.in_features % 16 == 0 and child.out_features % 16 == 0)):
                setattr(parent, child_name, Fp8Linear(child))
                count += 1
    return count


def to_fp8_torchao(model: torch.nn.Module) -> int:
    """Quantise ``model``'s :func:`fp8_eligible` linears with torchao's dynamic fp8 (rowwise), in place."""
    from torchao.quantization import quantize_

    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        # set_inductor_config=False: compile with the same inductor settings as the bf16 variant (torchao's
        # recommended ones turn on coordinate-descent tuning, which lengthens the compile)
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    except ImportError:  # older torchao: the function form
        from torchao.quantization import PerRow, float8_dynamic_activation_float8_weight

        config = float8_dynamic_activation_float8_weight(granularity=PerRow())
    count = sum(1 for name, m in model.named_modules() if fp8_eligible(m, name))
    quantize_(model, config, filter_fn=fp8_eligible)
    return count


def _compile(model: torch.nn.Module, backend: str) -> str:
    """Compile ``model`` in place: its repeated blocks (diffusers' regional compilation) when it has them."""
    if getattr(model, "_repeated_blocks", None) and hasattr(model, "compile_repeated_blocks"):
        model.compile_repeated_blocks(backend=backend)
        return "regional (repeated blocks)"
    model.compile(backend=backend)
    return "whole model"


def _graph_breaks() -> int | None:
    with contextlib.suppress(Exception):
        from torch._dynamo.utils import counters

        return int(sum(counters["graph_break"].values()))
    return None


def section_fp8_compile(ctx: SuiteContext, out: dict) -> None:
    """Section 5: matmul TFLOP/s (bf16, fp8), then the Wan forward compiled in bf16 and in fp8."""
    cuda = ctx.device.type == "cuda"
    n = 256 if ctx.tiny else 8192
    reps = 5 if ctx.tiny else 20
    mm = out.setdefault("matmul", {"n": n, "device": str(ctx.device)})
    mm["bf16_tflops"] = matmul_tflops(ctx.device, n, "bf16", reps)
    for key, fast in (("fp8_tflops", True), ("fp8_tflops_no_fast_accum", False)):
        try:
            mm[key] = matmul_tflops(ctx.device, n, "fp8", reps, fast_accum=fast)
        except Exception as err:  # noqa: BLE001 - e.g. no CPU _scaled_mm in this torch, or a pre-Hopper GPU
            mm[key] = None
            mm[key + "_status"] = _error_record(err)[0]
    ctx.log(f"  matmul {n}^3: bf16 {mm['bf16_tflops']} TFLOP/s, fp8 {mm['fp8_tflops']} TFLOP/s "
            f"(anchors {ANCHORS['bf16_tflops']:.0f} / {ANCHORS['fp8_tflops']:.0f})")
    ctx.save()

    import torch._dynamo

    cfg = _wan_config(ctx, fp8_dims=True)
    torch.manual_seed(0)
    base = causal_wan_stream.wan_transformer(cfg, ctx.device, ctx.dtype)
    x, t, text = _wan_inputs(ctx, cfg["text_dim"])
    out["model"] = _wan_describe(ctx, base, x, text)
    out["compile_backend"] = ctx.compile_backend

    def forward(model):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    with torch.no_grad():
        ref = forward(base).float()
        eager = timed_ms(lambda: forward(base), ctx.device, warmup=1, reps=3)
    out["eager"] = {"status": "ok", "forward_ms": _median(eager)}
    ctx.save()
    part_need = 5.0 if ctx.tiny else 40.0  # one compile + timing: 12-21 s measured on one H200

    def variant(key: str, convert: Callable[[torch.nn.Module], int] | None) -> dict:
        rec = out.setdefault(key, {})
        if ctx.remaining() < part_need:
            rec["status"] = f"skipped: budget ({max(ctx.remaining(), 0):.0f} s left, needs about {part_need:.0f} s)"
            return rec
        ctx.log(f"  {key}: converting and compiling ({ctx.remaining():.0f} s of budget left)")
        torch._dynamo.reset()
        breaks0 = _graph_breaks()
        model = copy.deepcopy(base)
        try:
            if convert is not None:
                rec["fp8_linears"] = convert(model)
                if rec["fp8_linears"] == 0:
                    raise RuntimeError("no linear layer was converted to fp8")
            rec["compiled"] = _compile(model, ctx.compile_backend)
            with torch.no_grad():
                _sync(ctx.device)
                t0 = time.perf_counter()
                y = forward(model)
                _sync(ctx.device)
                rec["first_call_s"] = round(time.perf_counter() - t0, 2)  # compile + one forward
                times = timed_ms(lambda: forward(model), ctx.device, warmup=1, reps=3)
            rec["forward_ms"] = _median(times)
            rec["forward_ms_all"] = [round(v, 2) for v in times]
            rec["speedup_vs_eager"] = round(out["eager"]["forward_ms"] / rec["forward_ms"], 3)
            y = y.float()
            rec["rel_err_vs_eager"] = round(float((y - ref).norm() / ref.norm().clamp(min=1e-30)), 5)
            rec["finite"] = bool(torch.isfinite(y).all())
            if breaks0 is not None:
                rec["graph_breaks"] = _graph_breaks() - breaks0
            rec["status"] = "ok"
        except SectionTimeout:
            raise
        except Exception as err:  # noqa: BLE001 - one failed variant leaves the others
            rec["status"], rec["traceback"] = _error_record(err)
        finally:
            model = None
            _free(ctx.device)
            ctx.save()
        ctx.log(f"  {key}: {rec['status'][:160]} {rec.get('forward_ms', '')} ms")
        return rec

    try:
        bf16 = variant("compiled", None)
        if not cuda:
            out["fp8_torchao"] = {"status": "skipped: needs CUDA (torchao float8 needs compute capability >= 8.9)"}
        elif _version("torchao") == "not installed":
            out["fp8_torchao"] = {"status": "skipped: torchao not installed"}
        else:
            out["fp8_torchao"] = {"torchao": _version("torchao")}
            variant("fp8_torchao", to_fp8_torchao)
        if ctx.fp8_native == "always" or (ctx.fp8_native == "fallback" and out["fp8_torchao"]["status"] != "ok"):
            variant("fp8_native", lambda m: to_fp8_native(m, force=ctx.tiny))
        else:
            out["fp8_native"] = {"status": f"skipped: --fp8-native {ctx.fp8_native}"
                                 + (" (torchao's fp8 measured)" if ctx.fp8_native == "fallback" else "")}
        for key in ("fp8_torchao", "fp8_native"):
            rec = out[key]
            if rec.get("status") == "ok" and bf16.get("status") == "ok":
                rec["speedup_vs_compiled"] = round(bf16["forward_ms"] / rec["forward_ms"], 3)
    finally:
        torch._dynamo.reset()


def _without_options(words: list[str], flags: tuple[str, ...]) -> list[str]:
    """``causal_wan_stream`` command words without the switches ``flags`` and without the long windowed stream
    (``--local-window``, ``--sink``, ``--stream-multiple`` and their values)."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("--local-window", "--sink", "--stream-multiple"):
            skip = True
        elif w not in flags:
            out.append(w)
    return out


def _causal_fp8_chunk(ctx: SuiteContext, words: list[str], bf16: dict) -> dict:
    """Section 4's fp8 row: the same static-cache compiled stream with the transformer's Linear layers in torchao's
    row-wise fp8 (``--linear-precision fp8``; ``fake_fp8``, its simulation, with ``--tiny``), denoising and one
    decode at the end only: does fp8 pay at a chunk's token count (issue 50)? Skipped, with the reason, without a GPU
    of compute capability >= 8.9, without torchao, or when the budget is short."""
    cuda = ctx.device.type == "cuda"
    if not ctx.tiny and not (cuda and torch.cuda.get_device_capability(ctx.device) >= (8, 9)):
        return {"status": "skipped: needs CUDA compute capability >= 8.9 (torchao float8)"}
    if not ctx.tiny and _version("torchao") == "not installed":
        return {"status": "skipped: torchao not installed (the fp8 extra)"}
    need = 20.0 if ctx.tiny else 60.0
    if ctx.remaining() < need:
        return {"status": f"skipped: budget ({max(ctx.remaining(), 0):.0f} s left, needs about {need:.0f} s)"}
    _free(ctx.device)
    # the bf16 run's settings without the per-chunk decodes and the long windowed stream
    fp8_words = _without_options(words, ("--decode-per-chunk", "--overlap-decode"))
    fmt = "fake_fp8" if ctx.tiny else "fp8"
    try:
        rec = causal_wan_stream.measure(causal_wan_stream.parse_args([*fp8_words, "--linear-precision", fmt]))
    except SectionTimeout:
        raise
    except Exception as err:  # noqa: BLE001 - the bf16 figures of the section stand
        status, trace = _error_record(err)
        return {"status": status, "traceback": trace}
    out = {"status": "ok", "linear_precision": rec.get("linear_precision")}
    out |= {k: rec.get(k) for k in ("denoise_fps", "e2e_fps_decode_at_end", "first_chunk_latency_s", "compile")}
    if bf16.get("denoise_fps") and rec.get("denoise_fps"):
        out["denoise_speedup_vs_bf16"] = round(rec["denoise_fps"] / bf16["denoise_fps"], 3)
    ctx.log(f"  causal stream fp8 ({fmt}): denoise {out['denoise_fps']} fps "
            f"({out.get('denoise_speedup_vs_bf16')}x the bf16 static compiled run)")
    return out


def _quantized_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two (possibly torchao-quantized) weights: their quantized data and scales."""
    parts = [n for n in ("qdata", "scale", "per_tensor_scale") if hasattr(a, n)]
    if parts:
        return all(torch.equal(getattr(a, n), getattr(b, n)) for n in parts
                   if getattr(a, n) is not None or getattr(b, n) is not None)
    return torch.equal(a, b)


def section_sol_rl_rollout(ctx: SuiteContext, out: dict) -> None:
    """Section 5b: genrl's Sol-RL rollout copy (``genrl.models.quantized``) of the Wan2.1-1.3B transformer: compiled
    fp8 copy (torchao row-wise, the layer policy's default skips) vs compiled bf16 copy forward, then the in-place
    refresh after a simulated optimizer step: seconds (median of 3), bitwise equal to a fresh quantization of the
    new weights, parameters not rebound, no recompilation at the next call. ``--tiny``: float32 and ``fake_fp8``."""
    import torch._dynamo

    from genrl.models.compile import CompileCounter
    from genrl.models.quantized import RolloutPrecision, build_rollout_module, refresh_rollout_module

    cuda = ctx.device.type == "cuda"
    high, low = ("bf16", "fp8") if cuda else ("fp32", "fake_fp8")
    out.update(high_format=high, low_format=low, compile_backend=ctx.compile_backend)
    cfg = _wan_config(ctx, fp8_dims=True)
    torch.manual_seed(0)
    base = causal_wan_stream.wan_transformer(cfg, ctx.device, ctx.dtype)
    x, t, text = _wan_inputs(ctx, cfg["text_dim"])
    out["model"] = _wan_describe(ctx, base, x, text)

    def forward(model):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    outputs = {}
    try:
        for key, fmt in (("high", high), ("low", low)):
            rec = out.setdefault(key, {"format": fmt})
            torch._dynamo.reset()
            copy_, report = build_rollout_module(base, RolloutPrecision(fmt))
            rec["quantized_linears"], rec["kept_linears"] = len(report.replaced), len(report.kept)
            rec["compiled"] = _compile(copy_, ctx.compile_backend)
            with torch.no_grad():
                _sync(ctx.device)
                t0 = time.perf_counter()
                outputs[key] = forward(copy_).float()
                _sync(ctx.device)
                rec["first_call_s"] = round(time.perf_counter() - t0, 2)
                times = timed_ms(lambda m=copy_: forward(m), ctx.device, warmup=1, reps=3)
            rec["forward_ms"] = _median(times)
            rec["status"] = "ok"
            ctx.save()
            ctx.log(f"  rollout copy {fmt}: {rec['forward_ms']} ms (first call {rec['first_call_s']} s)")
            if key == "low":
                low_copy = copy_
            else:
                copy_ = None
                _free(ctx.device)
        out["speedup"] = round(out["high"]["forward_ms"] / out["low"]["forward_ms"], 3)
        ref = outputs["high"]
        out["rel_err_vs_high"] = round(float((outputs["low"] - ref).norm() / ref.norm().clamp(min=1e-30)), 5)

        # an optimizer step's worth of change, then the in-place refresh
        with torch.no_grad():
            for q in base.parameters():
                q.add_(1e-3 * torch.randn_like(q))
        params = dict(low_copy.named_parameters())
        ids = {n: id(q) for n, q in params.items()}
        precision = RolloutPrecision(low)
        seconds = []
        for _ in range(3):
            _sync(ctx.device)
            seconds.append(refresh_rollout_module(low_copy, base, precision)["seconds"])
            _sync(ctx.device)
        out["refresh_s"] = round(statistics.median(seconds), 4)
        out["refresh_s_all"] = [round(v, 4) for v in seconds]
        fresh, _ = build_rollout_module(base, precision)
        fresh_params = dict(fresh.named_parameters())
        after = dict(low_copy.named_parameters())
        out["params_not_rebound"] = all(id(after[n]) == ids[n] for n in ids)
        out["bitwise_equal_to_fresh"] = all(_quantized_equal(after[n], fresh_params[n]) for n in after)
        with torch.no_grad(), CompileCounter() as counter:
            y = forward(low_copy).float()
        out["recompiled_graphs"] = counter.graphs
        with torch.no_grad():
            y_fresh = forward(fresh).float()
        out["refreshed_vs_fresh_eager_max_abs"] = float((y - y_fresh).abs().max())
        out["stale_differs"] = not torch.equal(y, outputs["low"])
        ctx.log(f"  fp8 copy x{out['speedup']} vs {high}; refresh {out['refresh_s']} s, bitwise "
                f"{out['bitwise_equal_to_fresh']}, recompiled {out['recompiled_graphs']}")
    finally:
        torch._dynamo.reset()


def _wan_generator(ctx: SuiteContext, cfg: dict, latents: tuple[int, int, int, int], text_tokens: int):
    """A genrl :class:`~genrl.models.families.wan.WanGenerator` around a random-weight ``WanTransformer3DModel(**cfg)``
    (``causal_wan_stream.wan_transformer``), with no text encoder and no tokenizer (conditioning is given as random
    text states). Its VAE is the tiny test one (z_dim 16, 4x temporal / 8x spatial: the generator reads only its
    config for the latent shape; nothing is decoded). Sample size from ``latents`` [16, F, h, w]: 8h x 8w pixels,
    4 (F - 1) + 1 frames. Returns (generator, attention backend)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    from genrl.models.families.base import set_attention_backend
    from genrl.models.families.wan import WanGenerator
    from genrl.testing.families import TINY

    transformer = causal_wan_stream.wan_transformer(cfg, ctx.device, ctx.dtype)
    with torch.device(ctx.device):
        vae = AutoencoderKLWan(**TINY["wan"]["vae"]).eval()
    pipeline = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    _, f, h, w = latents
    gen = WanGenerator(pipeline, height=8 * h, width=8 * w, num_frames=4 * (f - 1) + 1,
                       max_sequence_length=text_tokens)
    return gen, set_attention_backend(gen.transformer, "sdpa")


#: section 7's samplers: the TMD student (M outer x N inner steps, a flow head over the last H of L = 30 blocks)
#: and the 4-step Euler student (Self-Forcing / DMD's list [1000, 750, 500, 250], shift 5)
TMD_SAMPLER = {"outer_steps": 2, "inner_steps": 2, "head_layers": 5}
EULER_TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)
EULER_SHIFT = 5.0


def section_tmd_fps(ctx: SuiteContext, out: dict) -> None:
    """Section 7: sampling frames/s of a TMD student (``genrl.models.trunk`` + ``genrl.rollout.transition``:
    M = 2, N = 2, a flow head over the last H = 5 of Wan2.1-1.3B's 30 blocks; effective NFE 2.33) vs a 4-step
    Euler student (the plain transformer forward, 4 calls: the DMD student's cost), 480x832x81, denoising only
    (no decode), batch 1, seconds per video (median of 3 after a warm-up) -> frames/s, CUDA peak per sampler.
    Random weights; the head's zero-initialised output layers get small random weights and its gate logit is 0
    (sigmoid 0.5), so the fusion path and the delta-time embedding carry signal. ``--tiny``: the tiny Wan
    transformer with 30 blocks (the same L, H and so the same effective NFE), float32, on the CPU."""
    from genrl.flow import shift_sigmas
    from genrl.models.text_encoder import Conditioning
    from genrl.models.trunk import FlowHead, TransitionModel, trunk_adapter
    from genrl.noise import randn_per_sample
    from genrl.rollout.transition import TransitionConfig, transition_rollout

    cfg = _wan_config(ctx)
    if ctx.tiny:
        cfg["num_layers"] = 30  # Wan2.1-1.3B's depth, so H / L and the effective NFE are the real ones
    latents = TINY_WAN_LATENTS if ctx.tiny else WAN_LATENTS
    tokens = TINY_WAN_TEXT_TOKENS if ctx.tiny else WAN_TEXT_TOKENS
    torch.manual_seed(0)
    gen, backend = _wan_generator(ctx, cfg, latents, tokens)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    text = torch.randn(1, tokens, cfg["text_dim"], device=ctx.device, dtype=ctx.dtype, generator=g)
    cond = Conditioning(text, torch.ones(1, tokens, dtype=torch.bool, device=ctx.device), ["random text states"])
    out["model"] = _wan_describe(ctx, gen.transformer, torch.empty(1, *latents, device="meta"), text)
    frames = gen.num_frames
    out.update(pixel_frames=frames, pixels=[gen.height, gen.width], batch=1, attention_backend=backend,
               timing="denoising only (no decode), seconds per video: median of 3 after a warm-up")

    adapter = trunk_adapter(gen)
    head = FlowHead(adapter, num_layers=TMD_SAMPLER["head_layers"], gate_init=0.0, head_time="inner")
    with torch.no_grad():
        for layer in (head.fusion_mod[1], head.delta_embed[2]):
            torch.nn.init.normal_(layer.weight, std=0.01)
    head = head.to(ctx.device, ctx.dtype).eval()
    model = TransitionModel(gen, head)
    sampler = TransitionConfig(outer_steps=TMD_SAMPLER["outer_steps"], inner_steps=TMD_SAMPLER["inner_steps"],
                               micro_batch_size=1)
    shape = tuple(gen.latent_shape)
    last: dict = {}  # the last timed run's output (checked for finiteness; no extra untimed run)

    def tmd():
        last["tmd"] = transition_rollout(model, cond, shape, 0, [0], sampler)

    _free(ctx.device)
    _reset_peak(ctx.device)
    times = timed_ms(tmd, ctx.device, warmup=1, reps=3)
    res = last.pop("tmd")
    s_tmd = statistics.median(times) / 1e3
    out["tmd"] = {
        "outer_steps": sampler.outer_steps, "inner_steps": sampler.inner_steps, "head_layers": model.head_layers,
        "num_layers": model.num_layers, "head_time": head.head_time, "gate": round(float(head.gate.detach()), 4),
        "head_params_m": round(sum(q.numel() for q in head.parameters()) / 1e6, 3), "head_dtype": str(ctx.dtype),
        "effective_nfe": round(res.effective_nfe, 4), "backbone_calls": res.backbone_calls,
        "head_calls": res.head_calls, "s_per_video": round(s_tmd, 4), "s_all": [round(v / 1e3, 4) for v in times],
        "fps": round(frames / s_tmd, 2), "peak_gib": _peak_gib(ctx.device),
        "finite": bool(torch.isfinite(res.latents).all()),
    }
    del res
    ctx.save()
    ctx.log(f"  TMD (M 2, N 2, H 5): {out['tmd']['s_per_video']} s/video, {out['tmd']['fps']} frames/s, effective "
            f"NFE {out['tmd']['effective_nfe']}")

    sigmas = shift_sigmas(torch.tensor([*EULER_TIMESTEPS, 0.0], dtype=torch.float64) / 1000.0, EULER_SHIFT).tolist()

    def euler():
        x = randn_per_sample(shape, 0, [0], step=0, device=ctx.device)
        with torch.no_grad():
            for s, s_next in zip(sigmas[:-1], sigmas[1:]):
                v = gen.velocity(x, torch.full((1,), s, device=ctx.device), cond)
                x = x + (s_next - s) * v.float()
        last["euler"] = x

    _free(ctx.device)
    _reset_peak(ctx.device)
    times = timed_ms(euler, ctx.device, warmup=1, reps=3)
    s_euler = statistics.median(times) / 1e3
    out["euler"] = {
        "steps": len(EULER_TIMESTEPS), "nfe": float(len(EULER_TIMESTEPS)), "sigmas": [round(v, 4) for v in sigmas],
        "s_per_video": round(s_euler, 4), "s_all": [round(v / 1e3, 4) for v in times],
        "fps": round(frames / s_euler, 2), "peak_gib": _peak_gib(ctx.device),
        "finite": bool(torch.isfinite(last.pop("euler")).all()),
    }
    out["speedup"] = round(s_euler / s_tmd, 3)  # TMD frames/s over the 4-step student's
    out["nfe_ratio"] = round(out["euler"]["nfe"] / out["tmd"]["effective_nfe"], 3)  # what the NFE count predicts
    out["tmd_measured_nfe"] = round(out["euler"]["nfe"] * s_tmd / s_euler, 3)  # TMD's cost in measured forwards
    peaks = [p for p in (out["tmd"]["peak_gib"], out["euler"]["peak_gib"]) if p is not None]
    out["peak_gib"] = max(peaks) if peaks else None
    ctx.log(f"  4-step Euler: {out['euler']['s_per_video']} s/video, {out['euler']['fps']} frames/s; TMD "
            f"x{out['speedup']} (NFE ratio {out['nfe_ratio']}), peak {out['peak_gib']} GiB")


def noise_reproducibility(device: torch.device) -> dict:
    """On ``device``: is each backend's row bitwise the same drawn in a batch of 6 and in a reordered sub-batch of 3
    (``*_bitwise_across_batches``)? And the largest difference between Philox drawn on ``device`` and on the CPU
    (``philox_max_abs_diff_vs_cpu``: 0 for the uniforms' integer stream, an ulp or so for the normals)."""
    from genrl.noise import rand_per_sample, randn_per_sample

    out = {}
    shape, idx, sub = (4, 8, 8), [3, 9, 40, 7, 12, 5], [7, 3, 12]
    for backend in ("generator", "philox"):
        full = randn_per_sample(shape, 11, idx, step=2, device=device, backend=backend)
        part = randn_per_sample(shape, 11, sub, step=2, device=device, backend=backend)
        out[f"{backend}_bitwise_across_batches"] = bool(
            torch.equal(part[0], full[3]) and torch.equal(part[1], full[0]) and torch.equal(part[2], full[4]))
    z_dev = randn_per_sample(shape, 11, idx, step=2, device=device, backend="philox").cpu()
    z_cpu = randn_per_sample(shape, 11, idx, step=2, backend="philox")
    u_dev = rand_per_sample(shape, 11, idx, step=2, device=device, backend="philox").cpu()
    u_cpu = rand_per_sample(shape, 11, idx, step=2, backend="philox")
    out["philox_normal_max_abs_diff_vs_cpu"] = float((z_dev - z_cpu).abs().max())
    out["philox_uniform_max_abs_diff_vs_cpu"] = float((u_dev - u_cpu).abs().max())
    return out


def section_noise(ctx: SuiteContext, out: dict) -> None:
    """Section 6: one step's noise draw (``genrl.noise.randn_per_sample``) per backend, at the shapes world's size and
    at Wan2.1's (16 x [16, 21, 60, 104]), on the suite's device (``sampler_overhead.noise_cost``)."""
    sizes = sampler_overhead.NOISE_SIZES[:1] if ctx.tiny else sampler_overhead.NOISE_SIZES
    for row in sampler_overhead.noise_cost(str(ctx.device), repeats=3 if ctx.tiny else 5, sizes=sizes):
        out[f"{row['noise_cost']}_{row['backend']}_ms"] = round(1e3 * row["s_per_step"], 3)
    out.update(noise_reproducibility(ctx.device))
    ctx.log("  noise per step: " + ", ".join(f"{k} {v}" for k, v in out.items()))


# need_s: the section's wall time on one H200 (2026-12-04, benchmarks/gpu_suite.json) rounded up, except 5b, whose
# 203.5 s there was 188 s of a torchao-tuned compile that genrl no longer asks for (estimated from section 5's)
SECTIONS = [
    Section("wan_forward", "1. Wan2.1-1.3B transformer, 480x832x81, bf16", section_wan_forward,
            need_s=40, limit_s=150),
    Section("wan_grpo", "2. Wan2.1-1.3B rollout + LoRA r32 GRPO step, 480x832x81, CFG 5", section_wan_grpo,
            need_s=90, limit_s=240),
    Section("wan_grpo_fsdp2", "2b. Wan2.1-1.3B LoRA r32 GRPO step under FSDP2 (1 GPU), 480x832x81, grad ckpt",
            section_wan_grpo_fsdp2, need_s=55, limit_s=150),
    # an estimate (never run on a GPU): the sum of ON_POLICY_PARTS' estimates
    Section("on_policy_ratio", "2c. First GRPO update's log ratio per recompute path (Wan2.1-1.3B 480x832x81, "
            "SD3.5-M 512 px), LoRA r32", section_on_policy_ratio, need_s=85, limit_s=240, tiny_need_s=10.0),
    Section("sd3_grpo", "3. SD3.5-M rollout + LoRA r32 GRPO step, 512 px, batch 8, CFG 4.5", section_sd3_grpo,
            need_s=40, limit_s=150),
    Section("causal_stream", "4. causal Wan2.1-1.3B streaming, 480x832x81, 4 steps/chunk", section_causal_stream,
            need_s=45, limit_s=300),  # compile + baseline + fp8 row: the rows after the first skip on a short budget
    Section("fp8_compile", "5. matmul TFLOP/s; Wan forward compiled, bf16 vs fp8", section_fp8_compile,
            need_s=40, limit_s=400),
    Section("sol_rl_rollout", "5b. Sol-RL rollout copy of Wan2.1-1.3B: compiled fp8 vs bf16, in-place refresh",
            section_sol_rl_rollout, need_s=45, limit_s=300),
    Section("noise", "6. noise draw per step: per-sample device generators vs Philox", section_noise,
            need_s=10, limit_s=60, tiny_need_s=5.0),
    # about 2.33 + 4 forwards of 613 ms per round, 4 rounds (a warm-up + 3): ~16 s, plus building the model (41 s)
    Section("tmd_fps", "7. TMD student (M = 2, N = 2, H = 5) vs a 4-step student, Wan2.1-1.3B, 480x832x81",
            section_tmd_fps, need_s=45, limit_s=120, tiny_need_s=3.0),
]


def _family_section(family: str) -> Callable[[SuiteContext, dict], None]:
    def run(ctx: SuiteContext, out: dict) -> None:
        out.update(family_grpo_step.measure(_family_args(ctx, ["--family", family])))
        ctx.log(f"  {family} forward {out['raw_forward_s']} s, rollout {out['rollout_s']} s, GRPO step "
                f"{out['grpo_step_s']} s, peak {out['peak_gib']} GiB")

    run.__doc__ = f"``family_grpo_step`` for ``{family}`` at its released (or its GRPO config's) size."
    return run


#: the families added with Wan2.2 / image-to-video (issue 49) at their released sizes, random weights: LoRA r32, CFG
#: 5, 20 steps, 2 trained SDE steps (family_grpo_step's settings; sizes: its SIZES). Not in the default run (their
#: weights alone are 10-57 GiB and building them takes minutes): ``--families all`` or ``--families wan22 ...``.
#: need_s are guesses (never run on a GPU yet): build + 20-step rollout + 2 GRPO steps.
FAMILY_SECTIONS = [
    Section(f"family_{name}", f"F. {title}", _family_section(name), need_s=need, limit_s=3 * need, tiny_need_s=5.0)
    for name, title, need in (
        ("wan22", "Wan2.2-T2V-A14B (2 x 14B experts), 480x832x81, rollout + LoRA GRPO step", 300),
        ("wan_i2v", "Wan2.1-I2V-14B image-to-video, 480x832x81, rollout + LoRA GRPO step", 240),
        ("wan22_ti2v", "Wan2.2-TI2V-5B image-to-video, 704x1280x121, rollout + LoRA GRPO step", 200),
        ("skyreels_v2", "SkyReels-V2-DF-1.3B, 544x960x97, rollout + LoRA GRPO step", 90),
        ("hunyuan_video15", "HunyuanVideo-1.5 (8.3B), 480x848x121, rollout + LoRA GRPO step", 240),
        ("ltx2", "LTX-2 (19B, video stream), 512x768x121, rollout + LoRA GRPO step", 240),
        ("qwen_image", "Qwen-Image (20B), 512 px, rollout + LoRA GRPO step", 150),
        ("flux2", "FLUX.2 [dev] (32B), 1024 px, rollout + LoRA GRPO step", 300),
    )
]


# ---------------------------------------------------------------------------------------------------- the table


def _num(v, digits: int = 0, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    text = f"{v:,.{digits}f}"
    return f"{text} {unit}".strip()


def _check(ok: bool | None) -> str:
    return "" if ok is None else (" (met)" if ok else " (missed)")


def _row_wan_forward(r: dict, tiny: bool) -> tuple[str, str]:
    gib = r.get("fwd_bwd_ckpt_peak_gib")
    measured = (f"forward {_num(r.get('forward_ms'), 1, 'ms')}; fwd+bwd (grad ckpt) "
                f"{_num(r.get('fwd_bwd_ckpt_ms'), 1, 'ms')}, peak {_num(gib, 1, 'GiB')}")
    anchor = (f"{_num(ANCHORS['wan_forward_ms'], 0, 'ms')}; {_num(ANCHORS['wan_fwd_bwd_ckpt_ms'], 0, 'ms')}, "
              f"{ANCHORS['wan_fwd_bwd_ckpt_peak_gib']} GiB")
    return measured, anchor


def _row_family(r: dict, tiny: bool, peak_max: float | None) -> tuple[str, str]:
    over = r.get("sampler_overhead")
    cfg = r.get("cfg_scale", 1.0) or 1.0
    rows = (2 if cfg != 1.0 else 1) * (r.get("batch") or 1)  # CFG: cond and uncond in one batch
    raw_ms = None if r.get("raw_forward_s") is None else 1e3 * r["raw_forward_s"]
    measured = (f"raw guided forward {_num(raw_ms, 0, 'ms')} (batch {rows}); rollout {r.get('steps', '?')} steps "
                f"{_num(r.get('rollout_s'), 2, 's')} (overhead {'n/a' if over is None else f'{over:+.1%}'}); "
                f"decode {_num(r.get('decode_s'), 2, 's')}; "
                f"GRPO step ({r.get('trained_steps', '?')} trained steps) {_num(r.get('grpo_step_s'), 2, 's')}; "
                f"peak {_num(r.get('peak_gib'), 1, 'GiB')} (GRPO {_num(r.get('grpo_peak_gib'), 1, 'GiB')})")
    it = r.get("grpo_iteration") or {}
    if it:
        size = f"{it.get('height')}x{it.get('width')}" + (f"x{it['num_frames']}" if (it.get("num_frames") or 1) > 1
                                                          else "")
        measured += (f"; GRPO iteration {_num(it.get('per_gpu_s'), 3)} {it.get('unit', 'samples')}/GPU-s (batch "
                     f"{it.get('batch')}, {size}: rollout {_num(it.get('rollout_s'), 2)} + decode "
                     f"{_num(it.get('decode_s'), 2)} + reward {_num(it.get('reward_s'), 3)} + update "
                     f"{_num(it.get('update_s'), 2)} s)")
    ok_over = None if (tiny or over is None) else over <= TARGETS["sampler_overhead_max"]
    target = f"overhead <= {TARGETS['sampler_overhead_max']:.0%}{_check(ok_over)}"
    if peak_max is not None:
        peak = r.get("peak_gib")
        ok_peak = None if (tiny or peak is None) else peak < peak_max
        target += f"; peak < {peak_max:.0f} GiB{_check(ok_peak)}"
    return measured, target


def _row_causal(r: dict, tiny: bool) -> tuple[str, str]:
    sd = r.get("stream_decode") or {}
    ov = r.get("stream_decode_overlap") or {}
    st = r.get("streaming") or {}
    mem = r.get("peak_memory_gib") or {}
    measured = (f"denoise only {_num(r.get('denoise_fps'), 1)} frames/s; decode at end "
                f"{_num(r.get('e2e_fps_decode_at_end'), 1)} frames/s; streamed decode {_num(sd.get('e2e_fps'), 1)} "
                f"frames/s, on a second stream overlapped with denoising {_num(ov.get('e2e_fps'), 1)} frames/s; "
                f"first chunk {_num(r.get('first_chunk_latency_s'), 3, 's')}; first frame "
                f"{_num(r.get('time_to_first_frame_s'), 3, 's')}; peak {_num(mem.get('with_decode'), 1, 'GiB')}")
    comp = r.get("compile") or {}
    if r.get("static_cache") or comp:
        measured += (f"; static cache {bool(r.get('static_cache'))}, compiled {comp.get('backend', 'no')} (compile "
                     f"{_num(comp.get('compile_s'), 1, 's')}, graphs {comp.get('graphs_after_warmup')} -> "
                     f"{comp.get('graphs_after_measured')}); SDPA {(r.get('sdpa_kernel') or {}).get('backend')}")
    if st:
        measured += (f"; {st.get('latent_frames')}-latent-frame stream (window {st.get('local_window')} + sink "
                     f"{st.get('sink_frames')}): denoise only {_num(st.get('denoise_fps'), 1)} frames/s, with the "
                     f"streamed decode {_num(st.get('e2e_fps'), 1)} frames/s, steady chunk "
                     f"{_num(st.get('steady_chunk_s'), 3, 's')}, peak {_num(st.get('peak_memory_gib'), 1, 'GiB')}")
    fp8 = r.get("fp8_chunk") or {}
    if "denoise_fps" in fp8:
        measured += (f"; fp8 Linears ({(fp8.get('linear_precision') or {}).get('format')}): denoise only "
                     f"{_num(fp8.get('denoise_fps'), 1)} frames/s ({_num(fp8.get('denoise_speedup_vs_bf16'), 2)}x)")
    base = r.get("baseline_dynamic_eager") or {}
    if "denoise_fps" in base:
        measured += (f"; baseline in the same call (dynamic cache, eager): denoise only "
                     f"{_num(base.get('denoise_fps'), 1)} frames/s, overlapped decode "
                     f"{_num(base.get('overlap_e2e_fps'), 1)} frames/s")
    best = max([v for v in (r.get("e2e_fps_decode_at_end"), sd.get("e2e_fps"), ov.get("e2e_fps")) if v is not None],
               default=None)
    device = str(r.get("device") or "")
    target = (TARGETS["stream_e2e_fps_h200"] if "H200" in device else TARGETS["stream_e2e_fps_h100"] if "H100" in device
              else TARGETS["stream_e2e_fps_min"])
    ok = None if (tiny or best is None) else best >= target
    return measured, f">= {target:.0f} frames/s end to end{_check(ok)} (issue 50: 25 on an H200, 20 on an H100)"


def _tflops(v) -> str:
    return _num(v, 1 if isinstance(v, float) and v >= 10 else 3)


def _row_fp8(r: dict, tiny: bool) -> tuple[str, str]:
    mm = r.get("matmul") or {}
    parts = [f"matmul {mm.get('n', '?')}^3 bf16 {_tflops(mm.get('bf16_tflops'))} / fp8 "
             f"{_tflops(mm.get('fp8_tflops'))} TFLOP/s"]
    dtype = "float32" if tiny else "bf16"
    eager = (r.get("eager") or {}).get("forward_ms")
    parts.append(f"Wan forward eager {dtype} {_num(eager, 1, 'ms')}")
    for key, label in (("compiled", f"compiled {dtype}"), ("fp8_torchao", "compiled fp8 (torchao)"),
                       ("fp8_native", "compiled fp8 (_scaled_mm)")):
        rec = r.get(key) or {}
        status = rec.get("status", "n/a")
        if status == "ok":
            extra = f", x{rec['speedup_vs_compiled']:.2f} vs compiled {dtype}" if "speedup_vs_compiled" in rec else ""
            parts.append(f"{label} {_num(rec.get('forward_ms'), 1, 'ms')}{extra}, rel. err "
                         f"{_num(rec.get('rel_err_vs_eager'), 4)}")
        else:
            parts.append(f"{label}: {status[:90]}")
    anchor = f"{_num(ANCHORS['bf16_tflops'], 0)} / {_num(ANCHORS['fp8_tflops'], 0)} TFLOP/s"
    return "; ".join(parts), anchor


def _row_sol_rl(r: dict, tiny: bool) -> tuple[str, str]:
    high, low = r.get("high") or {}, r.get("low") or {}
    parts = [f"compiled {high.get('format', 'bf16')} copy {_num(high.get('forward_ms'), 1, 'ms')}, compiled "
             f"{low.get('format', 'fp8')} copy {_num(low.get('forward_ms'), 1, 'ms')} "
             f"({low.get('quantized_linears', '?')} Linears quantized)"]
    if r.get("speedup") is not None:
        parts.append(f"x{r['speedup']:.2f}, rel. err {_num(r.get('rel_err_vs_high'), 4)}")
    if r.get("refresh_s") is not None:
        parts.append(f"refresh {_num(r['refresh_s'], 3, 's')}, bitwise = fresh {r.get('bitwise_equal_to_fresh')}, "
                     f"not rebound {r.get('params_not_rebound')}, recompiled graphs {r.get('recompiled_graphs')}")
    return "; ".join(parts), "fp8 >= 1.35x compiled bf16 (1.43x on a 1.2B DiT); refresh ~0.03-0.05 s"


def _row_noise(r: dict, tiny: bool) -> tuple[str, str]:
    parts = [f"{size} {backend} {_num(r.get(f'{size}_{backend}_ms'), 2, 'ms')}"
             for size in ("shapes", "wan2.1_480x832x81") for backend in ("generator", "philox")]
    parts.append("bitwise across batch compositions: generator "
                 f"{r.get('generator_bitwise_across_batches')}, philox {r.get('philox_bitwise_across_batches')}")
    parts.append(f"philox vs CPU max diff: normals {r.get('philox_normal_max_abs_diff_vs_cpu')}, uniforms "
                 f"{r.get('philox_uniform_max_abs_diff_vs_cpu')}")
    return "; ".join(parts), "small next to the 613 ms Wan forward; bitwise True"


def _row_tmd(r: dict, tiny: bool) -> tuple[str, str]:
    t, e = r.get("tmd") or {}, r.get("euler") or {}
    nfe = t.get("effective_nfe")

    def speed(d: dict) -> str:
        return f"{_num(d.get('s_per_video'), 3)} s/video = {_num(d.get('fps'), 1)} frames/s"

    measured = (f"TMD (M {t.get('outer_steps', '?')}, N {t.get('inner_steps', '?')}, H {t.get('head_layers', '?')}"
                f"/{t.get('num_layers', '?')}, effective NFE {_num(nfe, 2)}) {speed(t)}; {e.get('steps', 4)}-step "
                f"Euler {speed(e)}")
    if r.get("speedup") is not None:
        measured += (f"; x{r['speedup']:.2f} (NFE ratio {_num(r.get('nfe_ratio'), 2)}; TMD costs "
                     f"{_num(r.get('tmd_measured_nfe'), 2)} measured forwards)")
    measured += (f"; peak {_num(t.get('peak_gib'), 1, 'GiB')} / {_num(e.get('peak_gib'), 1, 'GiB')}; no decode")
    nfe_tmd = 2 * (1 + 5 / 30)  # M (1 + (N - 1) H / L)
    fwd = ANCHORS["wan_forward_ms"] / 1e3
    anchor = (f"about {81 / (nfe_tmd * fwd):.0f} vs {81 / (4 * fwd):.0f} frames/s ({nfe_tmd:.2f} vs 4 forwards of "
              f"{ANCHORS['wan_forward_ms']:.0f} ms): x{4 / nfe_tmd:.2f}")
    return measured, anchor


def _log_ratio(v) -> str:
    if v is None:
        return "n/a"
    return "0" if v == 0 else f"{v:.2e}"


#: section 2c's parts and the variants its row shows, with their labels
_ON_POLICY_LABELS = (("wan", "Wan2.1-1.3B"), ("sd3", "SD3.5-M"))
_VARIANT_LABELS = (("plain", "plain recompute"), ("micro_batch", "micro-batch {mb} recompute"),
                   ("reuse", "reuse_rollout_forward"), ("deterministic", "deterministic plain"),
                   ("deterministic_micro_batch", "deterministic micro-batch {mb}"))


def _row_on_policy(r: dict, tiny: bool) -> tuple[str, str]:
    parts, zero = [], []
    for key, label in _ON_POLICY_LABELS:
        rec = r.get(key) or {}
        status = rec.get("status", "n/a")
        if status != "ok":
            parts.append(f"{label}: {status[:90]}")
            continue
        frames = f"x{rec['num_frames']}" if (rec.get("num_frames") or 1) > 1 else ""
        head = (f"{label} ({rec.get('height')}x{rec.get('width')}{frames}, batch {rec.get('batch')}, "
                f"{rec.get('dtype')}, trained steps {rec.get('trained_steps')}) max |log ratio|")
        cells = []
        for name, text in _VARIANT_LABELS:
            v = (rec.get("variants") or {}).get(name)
            if not v:
                continue
            cells.append(f"{text.format(mb=v.get('micro_batch_size'))} {_log_ratio(v.get('log_ratio_max_abs'))} "
                         f"(mean {_log_ratio(v.get('log_ratio_mean_abs'))}; update {_num(v.get('update_s'), 2, 's')}, "
                         f"peak {_num(v.get('update_peak_gib'), 1, 'GiB')})")
        reuse = (rec.get("variants") or {}).get("reuse") or {}
        if reuse.get("rollout_s") is not None:
            cells.append(f"reuse's rollout {_num(reuse['rollout_s'], 2, 's')} (peak "
                         f"{_num(reuse.get('rollout_peak_gib'), 1, 'GiB')}) vs {_num(rec.get('rollout_s'), 2, 's')}")
        parts.append(f"{head}: " + ", ".join(cells))
        v = rec.get("variants") or {}
        zero.append(all((v.get(n) or {}).get("log_ratio_max_abs") == 0 for n in ("plain", "reuse")))
    target = "first update max |log ratio| 0 (plain and reuse), or the bf16 floor with its cause stated"
    if not tiny and zero:
        target += " (met)" if all(zero) else " (plain not 0: state the floor's cause)"
    return "; ".join(parts), target


ROWS: dict[str, Callable[[dict, bool], tuple[str, str]]] = {
    "wan_forward": _row_wan_forward,
    "wan_grpo": lambda r, tiny: _row_family(r, tiny, TARGETS["wan_grpo_peak_gib_max"]),
    "wan_grpo_fsdp2": lambda r, tiny: _row_family(r, tiny, TARGETS["wan_grpo_peak_gib_max"]),
    "on_policy_ratio": _row_on_policy,
    "sd3_grpo": lambda r, tiny: _row_family(r, tiny, None),
    **{s.name: (lambda r, tiny: _row_family(r, tiny, None)) for s in FAMILY_SECTIONS},
    "causal_stream": _row_causal,
    "fp8_compile": _row_fp8,
    "sol_rl_rollout": _row_sol_rl,
    "noise": _row_noise,
    "tmd_fps": _row_tmd,
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    """The markdown block for benchmarks/RESULTS.md: a header line (command, date, device, versions) and a table
    with one row per section (measured values, anchor / target, status)."""
    env = report.get("env", {})
    tiny = report.get("tiny", False)
    where = (f"{env.get('gpu')} ({env.get('gpu_memory_gib')} GiB), driver {env.get('driver')}, CUDA {env.get('cuda')}"
             if env.get("gpu") else f"{env.get('device', 'cpu')}")
    lines = [
        f"`{report.get('command', 'python benchmarks/gpu_suite.py')}`, {env.get('date_utc', '?')}, {where}; torch "
        f"{env.get('torch')}, diffusers {env.get('diffusers')}, torchao {env.get('torchao')}; "
        f"{report.get('elapsed_s', '?')} s of a {report.get('budget_s', '?')} s budget"
        + (" (--tiny: CPU smoke run on tiny models, float32; timings are not figures)" if tiny else "") + ".",
        "",
        "| section | measured | anchor / target | status |",
        "|---|---|---|---|",
    ]
    for name, rec in report.get("sections", {}).items():
        status = rec.get("status", "?")
        result = rec.get("result") or {}
        if result and name in ROWS:
            try:
                measured, anchor = ROWS[name](result, tiny)
            except Exception as err:  # noqa: BLE001 - a partial result must not break the table
                measured, anchor = f"(partial result: {type(err).__name__})", ""
        else:
            measured, anchor = "", ""
        if name in ROWS and not anchor:
            anchor = ROWS[name]({}, tiny)[1]
        wall = f" ({rec['wall_s']} s)" if rec.get("wall_s") is not None else ""
        lines.append(f"| {_cell(rec.get('title', name))} | {_cell(measured) or '-'} | {_cell(anchor) or '-'} | "
                     f"{_cell(status[:160])}{wall} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- command


def build_parser() -> argparse.ArgumentParser:
    """The suite's command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results (default benchmarks/gpu_suite.json; under --tiny a file in the temp folder)")
    p.add_argument("--results-md", type=Path, default=None, help="also write the markdown table to this file")
    p.add_argument("--budget-s", type=float, default=520.0,
                   help="seconds from the start of the process; sections that would not fit are skipped")
    p.add_argument("--tiny", action="store_true", help="tiny components on the CPU (smoke run, float32)")
    p.add_argument("--sections", nargs="+", choices=[s.name for s in SECTIONS], default=None,
                   help="run only these sections (the others are recorded as not selected)")
    p.add_argument("--families", nargs="+", default=[],
                   choices=["all"] + [s.name.removeprefix("family_") for s in FAMILY_SECTIONS],
                   help="also run the real-size sections of these families (issue 49; not in the default run), "
                        "after the selected sections; 'all' for every one")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; eager on CPU)")
    p.add_argument("--fp8-native", choices=["fallback", "always", "never"], default="fallback",
                   help="run the plain _scaled_mm fp8 linear: only when torchao's fp8 did not run (default), "
                        "always, or never")
    return p


def main(argv: list[str] | None = None, start: float | None = None) -> dict:
    """Run the suite; returns the report (also written to ``--out``). ``start``: monotonic time the budget
    counts from (default: now). Exits with status 2, writing nothing, without CUDA unless ``--tiny``."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(words)
    start = time.monotonic() if start is None else start
    if not args.tiny and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device found; the suite measures real sizes on a GPU. Run with --tiny for a CPU "
              "smoke run.", file=sys.stderr)
        raise SystemExit(2)
    out = args.out or (Path(tempfile.gettempdir()) / "genrl_gpu_suite_tiny.json" if args.tiny
                       else ROOT / "benchmarks" / "gpu_suite.json")
    device = torch.device("cpu" if args.tiny else "cuda")
    report: dict = {
        "suite": "genrl gpu_suite (issue 19)",
        "command": " ".join(["python", "benchmarks/gpu_suite.py", *words]),
        "tiny": args.tiny,
        "budget_s": args.budget_s,
        "anchors": ANCHORS,
        "targets": TARGETS,
        "finished": False,
        "elapsed_s": 0.0,
    }

    def log(message: str) -> None:
        print(f"[gpu_suite {time.monotonic() - start:6.1f} s] {message}", flush=True)

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        write_json(out, report)

    report["env"] = environment(device)
    log(f"device {report['env'].get('gpu') or device}, torch {torch.__version__}, diffusers "
        f"{report['env']['diffusers']}, torchao {report['env']['torchao']}; writing {out}")
    missing = [name for name in ("diffusers", "transformers", "peft") if report["env"][name] == "not installed"]
    if missing:
        log(f"missing packages {missing}: sections 1-4, 5b, 7 and the model part of 5 will fail; carry them as wheels "
            f"(docs/gpu_suite.md)")
    ctx = SuiteContext(tiny=args.tiny, device=device, dtype=torch.float32 if args.tiny else torch.bfloat16,
                       deadline=start + args.budget_s,
                       compile_backend=args.compile_backend or ("eager" if device.type == "cpu" else "inductor"),
                       fp8_native=args.fp8_native, save=save, log=log)
    try:
        with _interrupts_recorded():
            families = [s for s in FAMILY_SECTIONS
                        if "all" in args.families or s.name.removeprefix("family_") in args.families]
            selected = set(args.sections) if args.sections else {s.name for s in SECTIONS}
            run_sections(SECTIONS + families, ctx, report, selected | {s.name for s in families})
        report["finished"] = True
    finally:
        save()
        table = markdown(report)
        print(table, flush=True)
        if args.results_md is not None:
            args.results_md.parent.mkdir(parents=True, exist_ok=True)
            args.results_md.write_text(table)
        log(f"wrote {out}" + (f" and {args.results_md}" if args.results_md else ""))
    return report


if __name__ == "__main__":
    _report = main(start=_T_START)
    sys.exit(1 if any(r["status"].startswith("error") for r in _report["sections"].values()) else 0)
