"""Stream-generate with the causal Wan2.1-1.3B adapter (random weights, real architecture) and time it.

    python benchmarks/causal_wan_stream.py --out benchmarks/causal_wan_stream.json              # one GPU, bf16
    python benchmarks/causal_wan_stream.py --decode-per-chunk --local-window 12 --sink 3        # + streaming run
    python benchmarks/causal_wan_stream.py --tiny --decode-per-chunk --local-window 6 --sink 3  # CPU smoke run
    python benchmarks/causal_wan_stream.py --static-cache --compile --decode-per-chunk --local-window 12 --sink 3

The main run is Self-Forcing's inference setting (docs/methods/distillation.md): 21 latent frames
(81 frames at 480x832 -> latents 16 x 21 x 60 x 104, 1560 tokens per latent frame) in chunks of 3 latent frames,
each chunk denoised with the warped few-step list [1000, 750, 500, 250] (shift 5) by genrl's chunk sampler
(``ar_rollout``), then committed to the KV cache by one context pass (4 + 1 transformer passes per chunk).
Text states are random [B, 512, 4096] (no text encoder is built). The VAE is the real-size AutoencoderKLWan
(default config) with random weights.

Reported (JSON on stdout and in ``--out``): first-chunk latency (s; denoise + commit of chunk 0), denoise-only
frames/s (pixel frames / rollout time), end-to-end frames/s with one VAE decode of the whole video at the end,
and with ``--decode-per-chunk`` a streaming decode (each chunk decoded as soon as it is committed, the VAE's
causal feature cache carried across chunks), peak GPU memory, KV-cache size. A warm-up run of the same
work is excluded; every timing is bracketed by ``torch.cuda.synchronize()``. With ``--local-window`` (latent
frames) and ``--sink``, a second streaming run generates ``--stream-multiple`` x 21 latent frames with the
rolling cache (LongLive-style window + frame sink) and reports steady-state per-chunk latency and memory, after an
untimed warm-up stream long enough for the window to fill (with a static cache, the full-window graphs compile
there, not in the timed run).
With ``--overlap-decode`` (implies ``--decode-per-chunk``) a third 81-frame run decodes each committed chunk on a
second CUDA stream while the next chunk is denoised on the default one (the decodes stay in order on their stream, so
the VAE's feature cache is carried as before): end-to-end frames/s (host clock, one synchronisation at the end) and
first-pixels latency (a CUDA event), the pixels equal to the sequential streamed decode. On a CPU there is one
stream and the run is the sequential one.

``--static-cache`` keeps the KV cache in fixed-shape buffers written in place (``CausalConfig.static_cache``;
:class:`genrl.models.causal.StaticKVCache`): every chunk's forward has the same shapes (the 81-frame run without a
window sizes the buffers by its 21 latent frames, ``max_frames``). ``--compile`` compiles the transformer's repeated
blocks (regional ``torch.compile``, inductor on CUDA, ``aot_eager`` with ``--tiny`` so no C++ toolchain is needed;
``--compile-mode`` picks inductor's mode); the warm-up run pays the compilation, reported as ``compile_s`` (warm-up
time minus the measured run's) with dynamo's graph counts (``compile.graphs_after_warmup`` /
``graphs_after_measured``: equal when nothing recompiled). Also reported: ``time_to_first_frame_s`` (chunk 0
denoised, committed and its pixels decoded: the streamed decode's first-pixels latency with ``--decode-per-chunk``,
else chunk 0's time plus one decode of its latents) and ``sdpa_kernel`` (which PyTorch SDPA kernel the causal
attention call of these shapes runs: :func:`genrl.models.families.wan_causal.sdpa_backend`).

``--linear-precision fp8`` runs the transformer's Linear layers in torchao's row-wise dynamic fp8 (the layer policy
of Sol-RL's rollout copies, ``genrl.models.quantized``): whether fp8 pays at a chunk's token count (4,680 tokens of
3 latent frames at 480x832), where the GPU suite's full-video measurement (section 5) does not apply.

``measure(parse_args([...]))`` runs the same measurement from Python (``benchmarks/gpu_suite.py`` does);
``wan_transformer`` builds a random-weight Wan transformer cast as ``from_pretrained`` casts a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


class NoCudaError(RuntimeError):
    """A real-size run was asked for on a machine without a CUDA device."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wan_transformer(config: dict, device: torch.device | str, dtype: torch.dtype):
    """A ``WanTransformer3DModel(**config)`` with random weights, built on ``device`` in eval mode.

    Cast to ``dtype`` as ``from_pretrained(torch_dtype=dtype)`` casts a real checkpoint: the model's
    ``_keep_in_fp32_modules`` (rope, time embedder, modulation tables, norms) stay float32.
    """
    from diffusers import WanTransformer3DModel

    with torch.device(device):
        transformer = WanTransformer3DModel(**config).to(dtype).eval()
    keep = set(transformer._keep_in_fp32_modules or [])
    for name, tensor in [*transformer.named_parameters(), *transformer.named_buffers()]:
        if keep & set(name.split(".")):
            tensor.data = tensor.data.float()
    return transformer


def build(args):
    """The causal Wan generator (real-size or tiny) with random weights, and random text conditioning.

    Args:
        args: the namespace of :func:`parse_args` (after :func:`measure` filled the size defaults).
    Returns:
        (generator, conditioning with text states [B, text_tokens, text_dim], device, attention backend name,
        transformer parameter count).
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    from genrl.models.causal import CausalConfig
    from genrl.models.families.base import set_attention_backend
    from genrl.models.families.wan_causal import CausalWanGenerator
    from genrl.models.text_encoder import Conditioning
    from genrl.testing.families import TINY

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else getattr(torch, args.dtype)
    vae_dtype = torch.float32 if args.tiny else getattr(torch, args.vae_dtype)
    tcfg = dict(TINY["wan"]["transformer"]) if args.tiny else dict(WAN_1_3B)
    vcfg = dict(TINY["wan"]["vae"]) if args.tiny else {}
    torch.manual_seed(args.seed)
    transformer = wan_transformer(tcfg, device, dtype)
    with torch.device(device):
        vae = AutoencoderKLWan(**vcfg).to(vae_dtype).eval()
    pipeline = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=args.shift))
    num_frames = 4 * (args.latent_frames - 1) + 1
    gen = CausalWanGenerator(pipeline, height=args.height, width=args.width, num_frames=num_frames,
                             max_sequence_length=args.text_tokens, causal=CausalConfig(chunk_size=args.chunk))
    backend = set_attention_backend(gen.transformer, args.attention_backend)
    text = torch.randn(args.batch, args.text_tokens, tcfg["text_dim"], device=device, dtype=dtype)
    cond = Conditioning(text, torch.ones(args.batch, args.text_tokens, dtype=torch.bool, device=device),
                        [f"random text states {i}" for i in range(args.batch)])
    n_params = sum(p.numel() for p in gen.transformer.parameters())
    return gen, cond, device, backend, n_params


class StreamingDecoder:
    """Decode latent chunks one after another with AutoencoderKLWan's causal feature cache carried over, so the
    concatenated pixels equal one decode of the whole video (the VAE decodes latent frame by latent frame)."""

    def __init__(self, gen) -> None:
        self.gen, self.vae = gen, gen.pipeline.vae
        if self.vae.config.patch_size is not None:
            raise ValueError("streaming decode supports the Wan2.1 VAE (no patch_size)")
        self.reset()

    def reset(self) -> None:
        self.vae.clear_cache()
        self.first = True

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, f, h, w] (normalised) -> pixels float32 [B, T, 3, H, W] in [0, 1]."""
        vae = self.vae
        z = latents.to(vae.device, vae.dtype)
        mean, std = self.gen._latent_stats(z.device, z.dtype)
        x = vae.post_quant_conv(z * std + mean)  # 1x1x1 conv: no temporal context
        outs = []
        for i in range(x.shape[2]):
            vae._conv_idx = [0]
            outs.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                    first_chunk=self.first))
            self.first = False
        video = torch.cat(outs, dim=2).clamp(-1.0, 1.0)
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)


def stream(gen, cond, schedule, frame_shape, num_chunks, device, seed, decoder=None, overlap=False):
    """One video chunk by chunk (``ar_rollout`` one chunk at a time, persistent state); returns timings.

    ``overlap`` (with a decoder, on CUDA): :func:`stream_overlapped` instead."""
    from genrl.rollout.autoregressive import ar_rollout

    if overlap and decoder is not None and device.type == "cuda":
        return stream_overlapped(gen, cond, schedule, frame_shape, num_chunks, device, seed, decoder)
    chunk_s, decode_s, state, pixels = [], [], None, []
    first_pixels_s = None
    if decoder is not None:
        decoder.reset()
    _sync(device)
    t_start = time.perf_counter()
    with torch.no_grad():
        for k in range(num_chunks):
            t0 = time.perf_counter()
            res = ar_rollout(gen, cond if state is None else None, 1, frame_shape, schedule, seed=seed, state=state)
            state = res.state
            _sync(device)
            chunk_s.append(time.perf_counter() - t0)
            if decoder is not None:
                t0 = time.perf_counter()
                pixels.append(decoder(res.latents))
                _sync(device)
                decode_s.append(time.perf_counter() - t0)
                if k == 0:
                    first_pixels_s = time.perf_counter() - t_start
    total = time.perf_counter() - t_start
    return dict(state=state, chunk_s=chunk_s, decode_s=decode_s, total_s=total, first_pixels_s=first_pixels_s,
                pixels=torch.cat(pixels, dim=1) if pixels else None)


def stream_overlapped(gen, cond, schedule, frame_shape, num_chunks, device, seed, decoder):
    """:func:`stream` with each chunk's decode on a second CUDA stream: the host queues chunk k's decode right after
    its denoising and goes on to chunk k + 1 without waiting, so the GPU can run both at once. Chunk k's latents are
    handed over with an event (the side stream waits for the default stream's work up to there) and
    ``record_stream`` (the allocator does not reuse them before the decode has read them). The total is the host clock
    around one synchronisation at the end, the first-pixels latency a CUDA event; no per-chunk synchronisation, so
    ``chunk_s`` / ``decode_s`` are not separable and are returned empty.
    Returns the same keys as :func:`stream`."""
    from genrl.rollout.autoregressive import ar_rollout

    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    start, first_done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    decoder.reset()
    state, pixels = None, []
    torch.cuda.synchronize(device)
    t_start = time.perf_counter()
    start.record(main)
    with torch.no_grad():
        for k in range(num_chunks):
            res = ar_rollout(gen, cond if state is None else None, 1, frame_shape, schedule, seed=seed, state=state)
            state = res.state
            ready = torch.cuda.Event()
            ready.record(main)
            with torch.cuda.stream(side):
                side.wait_event(ready)
                res.latents.record_stream(side)
                pixels.append(decoder(res.latents))
                if k == 0:
                    first_done.record(side)
    torch.cuda.synchronize(device)
    total = time.perf_counter() - t_start
    return dict(state=state, chunk_s=[], decode_s=[], total_s=total,
                first_pixels_s=start.elapsed_time(first_done) / 1e3, pixels=torch.cat(pixels, dim=1))


def _graphs() -> int:
    """Graphs dynamo has traced so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile(gen, args) -> dict:
    """Compile the transformer's repeated blocks in place (diffusers' regional compilation); returns the record."""
    import torch._dynamo

    backend = args.compile_backend or ("aot_eager" if args.tiny else "inductor")
    kwargs = {"backend": backend, "dynamic": False}
    if args.compile_mode != "default" and backend == "inductor":
        kwargs["mode"] = args.compile_mode
    torch._dynamo.reset()
    gen.transformer.compile_repeated_blocks(**kwargs)
    return {"backend": backend, "mode": args.compile_mode if backend == "inductor" else None,
            "regional": "repeated blocks", "dynamic": False}


def _low_precision_linears(gen, fmt: str) -> dict:
    """Swap the generator's transformer for a copy whose Linear layers run in ``fmt`` (the layer policy of Sol-RL's
    rollout copies, :func:`genrl.models.quantized.build_rollout_module`: ``fp8`` is torchao's row-wise dynamic fp8 on
    CUDA, ``fake_fp8`` its simulation on any device). The copy keeps the causal attention processors (a deep copy of
    the transformer gets its own causal context). Returns ``{"format", "replaced", "kept"}`` (layer counts)."""
    from genrl.models.quantized import RolloutPrecision, build_rollout_module

    copy, report = build_rollout_module(gen.transformer, RolloutPrecision(format=fmt))
    if not report.replaced:
        raise RuntimeError(f"--linear-precision {fmt}: no Linear layer is eligible ({len(report.kept)} kept)")
    gen.transformer = gen.pipeline.transformer = copy
    return {"format": fmt, "replaced": len(report.replaced), "kept": len(report.kept)}


def _pixel_frames(latent_frames: int) -> int:
    return 4 * (latent_frames - 1) + 1


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script (also used by ``benchmarks/gpu_suite.py`` to build its settings)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny random model on the CPU (smoke run, float32)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here too")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--height", type=int, default=None, help="pixels (default 480; tiny 64)")
    p.add_argument("--width", type=int, default=None, help="pixels (default 832; tiny 64)")
    p.add_argument("--latent-frames", type=int, default=21)
    p.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    p.add_argument("--first-chunk", type=int, default=None, help="size of chunk 0 (e.g. 1); default = --chunk")
    p.add_argument("--timesteps", type=float, nargs="+", default=[1000.0, 750.0, 500.0, 250.0])
    p.add_argument("--shift", type=float, default=5.0)
    p.add_argument("--text-tokens", type=int, default=None, help="default 512 (tiny 16)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vae-dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="sdpa")
    p.add_argument("--positions", default="absolute", choices=["absolute", "relative"])
    p.add_argument("--decode-per-chunk", action="store_true", help="also time a streaming per-chunk VAE decode")
    p.add_argument("--overlap-decode", action="store_true",
                   help="also time the per-chunk decode on a second CUDA stream, overlapped with the next chunk's "
                        "denoising (implies --decode-per-chunk)")
    p.add_argument("--local-window", type=int, default=None,
                   help="latent frames; adds a long streaming run with a rolling window + sink")
    p.add_argument("--sink", type=int, default=0, help="sink latent frames of the streaming run")
    p.add_argument("--stream-multiple", type=int, default=4, help="streaming run length in units of --latent-frames")
    p.add_argument("--static-cache", action="store_true",
                   help="fixed-shape KV cache written in place (CausalConfig.static_cache): one compiled graph")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer's repeated blocks (regional)")
    p.add_argument("--compile-mode", default="default",
                   choices=["default", "max-autotune-no-cudagraphs", "reduce-overhead"],
                   help="inductor mode of --compile")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend of --compile (default inductor; aot_eager with --tiny)")
    p.add_argument("--linear-precision", default=None,
                   help="run the transformer's Linear layers in this rollout-copy format (fp8 on CUDA with torchao; "
                        "fake_fp8 simulates it anywhere; genrl.models.quantized.RolloutPrecision lists them)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (a list of command-line words; None = ``sys.argv[1:]``) with :func:`build_parser`."""
    return build_parser().parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    """Build the causal Wan student (real size, or ``--tiny``) and time the streaming runs.

    Args:
        args: the namespace of :func:`parse_args` (``--out`` is ignored here; :func:`main` writes it).
    Returns:
        the report dict of the module docstring (seconds, frames/s, GiB; memory ``None`` off CUDA).
    Raises:
        NoCudaError: a real-size run (no ``--tiny``) without a CUDA device.
    """
    args.height = args.height or (64 if args.tiny else 480)
    args.width = args.width or (64 if args.tiny else 832)
    args.text_tokens = args.text_tokens or (16 if args.tiny else 512)
    if not args.tiny and not torch.cuda.is_available():
        raise NoCudaError("causal_wan_stream: no CUDA device found. The real-size benchmark needs a GPU (bf16, "
                           "~20 GiB); run with --tiny for a CPU smoke run.")

    import diffusers

    from genrl.models.causal import CausalConfig
    from genrl.models.families.wan_causal import sdpa_backend
    from genrl.rollout.autoregressive import ChunkSchedule

    t_build = time.perf_counter()
    gen, cond, device, backend, n_params = build(args)
    linears = _low_precision_linears(gen, args.linear_precision) if args.linear_precision else None
    build_s = time.perf_counter() - t_build
    c, (lf, h, w) = 16, (args.latent_frames, args.height // 8, args.width // 8)
    frame_shape = (c, h, w)
    causal = CausalConfig(chunk_size=args.chunk, first_chunk_size=args.first_chunk, positions=args.positions,
                          static_cache=args.static_cache, max_frames=lf if args.static_cache else None)
    compile_info = _compile(gen, args) if args.compile else None
    num_chunks = causal.num_chunks(lf)
    schedule = ChunkSchedule(causal=causal, timesteps=args.timesteps, shift=args.shift, warp=True)
    pix = _pixel_frames(lf) * args.batch
    args.decode_per_chunk = args.decode_per_chunk or args.overlap_decode
    decoder = StreamingDecoder(gen) if args.decode_per_chunk else None

    # warm-up (excluded; it pays the compilation): the same rollout and decodes
    warm = stream(gen, cond, schedule, frame_shape, num_chunks, device, args.seed, decoder)
    warm_denoise_s = sum(warm["chunk_s"])
    if compile_info is not None:
        compile_info["graphs_after_warmup"] = _graphs()
    with torch.no_grad():
        gen.decode(warm["state"].latents)
    if args.overlap_decode:
        try:
            warm = stream(gen, cond, schedule, frame_shape, num_chunks, device, args.seed, decoder, overlap=True)
        except Exception:  # noqa: BLE001 - the measured overlapped run below records the error
            pass
    del warm
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    run = stream(gen, cond, schedule, frame_shape, num_chunks, device, args.seed + 1)
    peak_denoise = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    latents = run["state"].latents
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        video = gen.decode(latents)
    _sync(device)
    decode_s = time.perf_counter() - t0
    peak_total = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    denoise_s = sum(run["chunk_s"])
    if compile_info is not None:
        compile_info["graphs_after_measured"] = _graphs()
        compile_info["compile_s"] = round(warm_denoise_s - denoise_s, 4)
    first_len = causal.chunk_len(0)
    first_decoder = StreamingDecoder(gen)
    _sync(device)
    t0 = time.perf_counter()
    first_decoder(latents[:, :, :first_len])
    _sync(device)
    first_decode_s = time.perf_counter() - t0
    cache = run["state"].cache
    s_tokens = (h // 2) * (w // 2)
    k_frames = (cache.capacity if args.static_cache else lf - causal.chunk_size) + causal.chunk_size
    blk = gen.transformer.blocks[0].attn1
    try:
        sdpa = sdpa_backend(args.batch, blk.heads, causal.chunk_size * s_tokens, k_frames * s_tokens,
                            blk.inner_dim // blk.heads, gen.dtype, device, masked=True)
    except Exception as err:  # noqa: BLE001 - recorded, the other figures stand
        sdpa = {"backend": None, "status": f"error: {type(err).__name__}: {err}"[:300]}
    report = {
        "benchmark": "causal_wan_stream",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "diffusers": diffusers.__version__,
        "model": ("tiny random Wan (tests' TINY['wan'])" if args.tiny
                  else "Wan2.1-T2V-1.3B architecture, random weights"),
        "transformer_params_m": round(n_params / 1e6, 3),
        "dtype": "float32" if args.tiny else args.dtype, "vae_dtype": "float32" if args.tiny else args.vae_dtype,
        "attention_backend": backend, "build_s": round(build_s, 2),
        "static_cache": bool(args.static_cache), "compile": compile_info, "linear_precision": linears,
        "sdpa_kernel": sdpa, "warmup_denoise_s": round(warm_denoise_s, 4),
        "time_to_first_frame_s": round(run["chunk_s"][0] + first_decode_s, 4),
        "batch": args.batch, "pixels": [args.height, args.width], "latent_frames": lf,
        "pixel_frames": _pixel_frames(lf),
        "latents": [args.batch, c, lf, h, w], "tokens_per_latent_frame": (h // 2) * (w // 2),
        "chunks": num_chunks, "chunk_frames": args.chunk, "first_chunk_frames": args.first_chunk or args.chunk,
        "timesteps_warped": [round(1000 * s, 2) for s in schedule.sigmas().tolist()[:-1]],
        "transformer_passes_per_chunk": schedule.num_steps + 1,
        "first_chunk_latency_s": round(run["chunk_s"][0], 4),
        "per_chunk_s": [round(s, 4) for s in run["chunk_s"]],
        "denoise_s": round(denoise_s, 4),
        "denoise_fps": round(pix / denoise_s, 2),
        "decode_at_end_s": round(decode_s, 4),
        "e2e_s_decode_at_end": round(denoise_s + decode_s, 4),
        "e2e_fps_decode_at_end": round(pix / (denoise_s + decode_s), 2),
        "kv_cache_mib": round(cache.nbytes() / 2**20, 1),
        "peak_memory_gib": {"denoise": _gib(peak_denoise) if peak_denoise else None,
                            "with_decode": _gib(peak_total) if peak_total else None},
        "finite": bool(torch.isfinite(latents).all()),
    }

    if decoder is not None:
        srun = stream(gen, cond, schedule, frame_shape, num_chunks, device, args.seed + 1, decoder)
        report["stream_decode"] = {
            "first_pixels_latency_s": round(srun["first_pixels_s"], 4),
            "decode_per_chunk_s": [round(s, 4) for s in srun["decode_s"]],
            "e2e_s": round(srun["total_s"], 4),
            "e2e_fps": round(pix / srun["total_s"], 2),
            "max_abs_diff_vs_decode_at_end": float((srun["pixels"] - video).abs().max()),
        }
        report["time_to_first_frame_s"] = round(srun["first_pixels_s"], 4)
        if args.overlap_decode:
            try:  # not yet run on a GPU: a failure here is recorded and leaves the other figures
                orun = stream(gen, cond, schedule, frame_shape, num_chunks, device, args.seed + 1, decoder,
                              overlap=True)
                report["stream_decode_overlap"] = {
                    "second_cuda_stream": device.type == "cuda",
                    "first_pixels_latency_s": round(orun["first_pixels_s"], 4),
                    "e2e_s": round(orun["total_s"], 4),
                    "e2e_fps": round(pix / orun["total_s"], 2),
                    "max_abs_diff_vs_sequential_stream": float((orun["pixels"] - srun["pixels"]).abs().max()),
                }
                del orun
            except Exception as err:  # noqa: BLE001 - reported in the JSON, the run goes on
                report["stream_decode_overlap"] = {"status": f"error: {type(err).__name__}: {err}"[:300]}
        del srun

    if args.local_window is not None:
        long_causal = CausalConfig(chunk_size=args.chunk, first_chunk_size=args.first_chunk,
                                   local_window=args.local_window, sink_frames=args.sink, positions=args.positions,
                                   static_cache=args.static_cache)
        long_frames = lf * args.stream_multiple
        long_chunks = long_causal.num_chunks(long_frames)
        long_schedule = ChunkSchedule(causal=long_causal, timesteps=args.timesteps, shift=args.shift, warp=True)
        # untimed warm-up until the window has filled and one chunk has run on a full window: a static cache adds
        # its full-window graphs then (compile time never inside the timed figure: docs/gpu_suite.md's protocol)
        first = args.first_chunk or args.chunk
        warm_frames = min(long_frames, first + args.sink + args.local_window + 2 * args.chunk)
        stream(gen, cond, long_schedule, frame_shape, long_causal.num_chunks(warm_frames), device, args.seed + 3,
               decoder)
        long_graphs_warm = _graphs() if compile_info is not None else None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        lrun = stream(gen, cond, long_schedule, frame_shape, long_chunks, device, args.seed + 2, decoder)
        long_pix = _pixel_frames(long_frames) * args.batch
        steady = lrun["chunk_s"][len(lrun["chunk_s"]) // 2:]
        report["streaming"] = {
            "local_window": args.local_window, "sink_frames": args.sink, "positions": args.positions,
            "latent_frames": long_frames, "pixel_frames": _pixel_frames(long_frames), "chunks": long_chunks,
            "denoise_s": round(sum(lrun["chunk_s"]), 4),
            "denoise_fps": round(long_pix / sum(lrun["chunk_s"]), 2),
            "e2e_fps": round(long_pix / lrun["total_s"], 2) if decoder is not None else None,
            "steady_chunk_s": round(statistics.mean(steady), 4),
            "first_chunk_s": round(lrun["chunk_s"][0], 4), "last_chunk_s": round(lrun["chunk_s"][-1], 4),
            "cache_frames_at_end": lrun["state"].cache.frames.tolist(),
            "kv_cache_mib": round(lrun["state"].cache.nbytes() / 2**20, 1),
            "warmup_latent_frames": warm_frames, "graphs_after_warmup": long_graphs_warm,
            "graphs_after": _graphs() if compile_info is not None else None,
            "peak_memory_gib": _gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
            "finite": bool(torch.isfinite(lrun["state"].latents).all()),
        }

    return report


def main(argv: list[str] | None = None) -> None:
    """The command: :func:`measure`, then the JSON report on stdout (and in ``--out`` when given)."""
    args = parse_args(argv)
    try:
        report = measure(args)
    except NoCudaError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
