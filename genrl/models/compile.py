"""Opt-in ``torch.compile`` of a generator's denoiser network (``generator.compile`` of a
:class:`~genrl.models.families.GeneratorSpec`), and counters that show it compiles once.

**What is compiled.** Only the denoiser: genrl's :class:`~genrl.models.dit.VideoDiT` or a diffusers family's
transformer (``generator.transformer``). The text encoders, the VAE / pixel codec and the sampler's step math stay
eager. The network is compiled *in place* with :meth:`torch.nn.Module.compile`: the module object, its parameter
names and its state-dict keys are unchanged (no ``_orig_mod.`` prefix), so checkpoints, LoRA (peft) adapters, the EMA
callback, the lagged old policy, the reference policy, ``save_pretrained`` exports and :func:`load_generator` work as
without compilation, and a checkpoint of a compiled run loads into an uncompiled model. Compilation is lazy: the
graph is traced at the first call, so a LoRA adapter added after the build (as :func:`genrl.methods.common.
build_policy` does) is part of the compiled graph. Training steps go through the same module, so the forward and the
backward of the policy loss run compiled too (a separate graph: grad mode is part of the guard).

**Static shapes.** The default is ``dynamic=False``: every distinct input shape gets its own specialised graph, and a
shape seen before reuses its graph without tracing. genrl's sampler makes the shapes of a run static: the network runs
in fixed micro-batches (``rollout.micro_batch_size``; the last one is padded by repetition) and text is padded to a
fixed length, so rollouts of different iterations, seeds and prompts reuse one graph.

**What recompiles** (each distinct value adds one graph, once; none of them changes between iterations of a run):

- the micro-batch (``micro_batch_size``); CFG on (``cfg_scale != 1``) doubles the batch of a network call, so a
  rollout with CFG and a validation without it are two graphs;
- the text length (``generator.max_sequence_length``), the latent shape (``latent_shape``, or a diffusers family's
  height / width / frames), the dtype and the device;
- grad mode: no-grad rollouts and the training forward (with its backward) are two graphs;
- train / eval mode, only for networks that read it (dropout layers, e.g. some diffusers transformers; genrl's DiT
  does not read it);
- which tensors require gradients, a LoRA adapter enabled or disabled (the LoRA reference policy), an adapter added
  after the first call, gradient checkpointing switched on or off, per-sample sigma ``[B]`` against per-frame
  ``[B, T]``.

Causal (chunk-wise, KV-cache) rollouts are not static: the cache grows every chunk and its bookkeeping breaks the
graph, so a causal student recompiles per chunk until dynamo's ``recompile_limit`` (8 per function) makes it fall
back to eager; leave ``compile`` off for causal students.

**Counting compilations.** :func:`compile_counts` reads dynamo's process-wide counters (graphs compiled, frames
compiled, graph breaks); :class:`CompileCounter` is a context manager that gives the compilations made inside it.
A steady state is reached when a :class:`CompileCounter` around later iterations reports ``graphs == 0``. To see why
something recompiles, run with ``TORCH_LOGS=recompiles``; to make a recompilation an error, wrap the code in
``torch.compiler.set_stance("fail_on_recompile")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["COMPILE_KEYS", "CompileCounter", "CompileCounts", "compile_counts", "compile_generator", "compile_like",
           "compile_module", "compile_options", "compiled_options", "is_compiled"]

#: the ``torch.compile`` keywords a ``compile:`` block may set.
COMPILE_KEYS = ("backend", "mode", "options", "dynamic", "fullgraph")

_ATTR = "_genrl_compile_options"  # the options a module was compiled with (read through ``compiled_options``)


def _fix(where: str) -> str:
    return (f"use {where}: true (inductor, default mode, static shapes), or a mapping such as "
            f"{where}: {{mode: max-autotune-no-cudagraphs}} or {where}: {{backend: eager}}")


def compile_options(value: bool | dict[str, Any] | None, where: str = "generator.compile") -> dict[str, Any] | None:
    """The ``torch.compile`` keywords of a ``compile`` setting, checked; None when compilation is off.

    Args:
        value: False / None (off), True (inductor, default mode, ``dynamic=False``) or a mapping of
            :data:`COMPILE_KEYS`: ``backend`` (a name of ``torch._dynamo.list_backends(exclude_tags=())``, default
            ``"inductor"``), ``mode`` (an inductor mode of ``torch._inductor.list_mode_options()``: ``"default"``,
            ``"reduce-overhead"``, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``, ...), ``options`` (inductor
            options, a mapping; not with ``mode``), ``dynamic`` (default False: static shapes), ``fullgraph``.
        where: the config key named in errors.
    Returns:
        a new dict with ``backend`` and ``dynamic`` always set, or None.
    Raises:
        ValueError: an unknown key, backend or mode, ``mode`` or ``options`` with a backend other than inductor, both
            ``mode`` and ``options``, or a value of the wrong type; each names the value and the fix.
    """
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}={value!r} is neither a bool nor a mapping; {_fix(where)}")
    unknown = sorted(set(value) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; the torch.compile keywords it takes are "
                         f"{list(COMPILE_KEYS)}; {_fix(where)}")
    out = {"backend": "inductor", "dynamic": False, **value}
    backend = out["backend"]
    if not isinstance(backend, str):
        raise ValueError(f"{where}.backend={backend!r} is not a backend name; use one of "
                         f"torch._dynamo.list_backends(exclude_tags=()), e.g. 'inductor' or 'eager'")
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ValueError(f"{where}.backend={backend!r} is not a torch.compile backend; known: {backends} "
                         f"('inductor' compiles, 'eager' / 'aot_eager' only trace, for debugging)")
    mode, options = out.get("mode"), out.get("options")
    if (mode is not None or options is not None) and backend != "inductor":
        raise ValueError(f"{where}: mode / options configure the inductor backend, not backend={backend!r}; drop "
                         f"them or use backend: inductor")
    if mode is not None and options is not None:
        raise ValueError(f"{where}: give mode={mode!r} or options, not both (torch.compile takes one of them); put "
                         f"the mode's settings into options instead")
    if mode is not None:
        import torch._inductor

        modes = sorted(torch._inductor.list_mode_options())
        if mode not in modes:
            raise ValueError(f"{where}.mode={mode!r} is not an inductor mode; known modes: {modes} (on a CPU: "
                             f"'default' or 'max-autotune-no-cudagraphs'); {_fix(where)}")
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"{where}.options={options!r} must be a mapping of inductor options (torch._inductor."
                         f"list_options()), e.g. {{epilogue_fusion: true}}")
    if out["dynamic"] not in (True, False, None):
        raise ValueError(f"{where}.dynamic={out['dynamic']!r} must be false (static shapes, default), true or null")
    if not isinstance(out.get("fullgraph", False), bool):
        raise ValueError(f"{where}.fullgraph={out['fullgraph']!r} must be true or false")
    return out


def compile_module(module: nn.Module, value: bool | dict[str, Any] | None, where: str = "generator.compile"):
    """Compile ``module`` in place (:meth:`torch.nn.Module.compile`) with the options of ``value`` (see
    :func:`compile_options`); nothing when ``value`` is off. Tracing happens at the first call. Returns ``module``.

    Raises:
        ValueError: a bad ``value`` (see :func:`compile_options`).
    """
    options = compile_options(value, where)
    if options is None:
        return module
    module.compile(**options)
    setattr(module, _ATTR, dict(options))
    return module


def compile_generator(generator, value: bool | dict[str, Any] | None, where: str = "generator.compile"):
    """Compile ``generator.transformer`` (the denoiser of a DiT or diffusers-family generator) in place; returns
    ``generator``. See the module docstring for what this compiles and what recompiles.

    Raises:
        ValueError: a bad ``value`` (see :func:`compile_options`).
    """
    compile_module(generator.transformer, value, where)
    return generator


def is_compiled(module: nn.Module) -> bool:
    """Whether calls to ``module`` go through ``torch.compile`` (:meth:`torch.nn.Module.compile` was called on it; a
    deep copy of a compiled module is not compiled)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_options(module: nn.Module) -> dict[str, Any] | None:
    """The options :func:`compile_module` compiled ``module`` with, or None when it is not compiled (deep copies
    carry the recorded options but not the compiled call, so they report None)."""
    options = getattr(module, _ATTR, None)
    return dict(options) if options is not None and is_compiled(module) else None


def compile_like(module: nn.Module, source: nn.Module) -> nn.Module:
    """Compile ``module`` (e.g. a deep copy of ``source``: the frozen reference policy, a rollout copy) with the
    options ``source`` was compiled with; leaves it eager when ``source`` is not compiled. Returns ``module``.

    A deep copy drops the compiled call (``nn.Module.__getstate__``), so a copy of a compiled policy would run eager
    without this. A copy with the same structure, shapes and dtype reuses the source's graphs (dynamo guards on the
    module's structure and the tensors' metadata, not on their identity); one in another dtype gets its own."""
    options = compiled_options(source)
    if options is not None:
        compile_module(module, options)
    elif getattr(module, _ATTR, None) is not None:
        delattr(module, _ATTR)  # an eager copy of an eager module: no stale record
    return module


@dataclass(frozen=True)
class CompileCounts:
    """Dynamo's process-wide compilation counters (``torch._dynamo.utils.counters``), or a difference of two.

    Attributes:
        graphs: graphs compiled (``stats.unique_graphs``): one per compiled frame, more with graph breaks. After
            the first call of each distinct shape / mode, every further graph is a recompilation.
        frames: Python frames compiled successfully (``frames.ok``; a recompilation compiles its frame again).
        graph_breaks: graph breaks met while tracing (sum over ``graph_break``; 0 for genrl's DiT on flat rollouts).
    """

    graphs: int = 0
    frames: int = 0
    graph_breaks: int = 0

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.graphs - other.graphs, self.frames - other.frames,
                             self.graph_breaks - other.graph_breaks)


def compile_counts() -> CompileCounts:
    """The current :class:`CompileCounts` of this process (every compiled function counts, not only generators)."""
    from torch._dynamo.utils import counters

    return CompileCounts(graphs=int(counters["stats"]["unique_graphs"]), frames=int(counters["frames"]["ok"]),
                         graph_breaks=int(sum(counters["graph_break"].values())))


class CompileCounter:
    """Count the compilations made inside a ``with`` block::

        with CompileCounter() as c:
            rollout(generator, ...)
        assert c.graphs == 0          # nothing was (re)compiled: the steady state

    The counts are live inside the block and frozen at its exit: ``graphs``, ``frames``, ``graph_breaks`` (see
    :class:`CompileCounts`), or ``counts`` for all three. They are process-wide: other compiled code running in the
    block (another thread too) counts as well.
    """

    def __init__(self) -> None:
        self._start: CompileCounts | None = None
        self._end: CompileCounts | None = None

    def __enter__(self) -> CompileCounter:
        self._start, self._end = compile_counts(), None
        return self

    def __exit__(self, *exc) -> None:
        self._end = compile_counts()

    @property
    def counts(self) -> CompileCounts:
        """The compilations since the block was entered (until it was left).

        Raises:
            RuntimeError: the counter was never entered.
        """
        if self._start is None:
            raise RuntimeError("CompileCounter was never entered; use it as `with CompileCounter() as c: ...`")
        return (self._end or compile_counts()) - self._start

    @property
    def graphs(self) -> int:
        return self.counts.graphs

    @property
    def frames(self) -> int:
        return self.counts.frames

    @property
    def graph_breaks(self) -> int:
        return self.counts.graph_breaks
