"""FSDP2 sharding of the networks a method holds: which submodules are the repeated blocks, how one network is
sharded (``torch.distributed.fsdp.fully_shard``: per block, then the root), and the collective full state dict an
export needs.

Lightning's ``ModelParallelStrategy`` builds the device mesh and runs ``configure_model``; genrl's
:class:`genrl.strategies.FSDP2Strategy` then shards every role of the method (:meth:`genrl.models.roles.Roles.
shardable`) with :func:`shard_module`. A sharded parameter is a ``DTensor`` whose local tensor is this rank's
``1/N`` slice along dim 0 (FSDP2's ``Shard(0)`` placement): the forward pass all-gathers a block's parameters just
before the block runs and frees them after (``reshard_after_forward``), the backward pass reduce-scatters the
gradients, so each rank holds about ``1/N`` of every role's parameters, gradients and optimizer state.

Reference: Zhao et al. 2023, "PyTorch FSDP: experiences on scaling fully sharded data parallel"; the per-parameter
sharding of FSDP2 is ``torch.distributed.fsdp.fully_shard`` (torch >= 2.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

__all__ = ["ShardingConfig", "enable_context_parallel", "full_state_dict", "full_tensor", "is_sharded", "local_numel",
           "placed_like", "repeated_blocks", "reshard", "shard_module", "supports_context_parallel"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of ``module``, the units FSDP2 gathers one at a time.

    A diffusers model names them in ``_no_split_modules`` (Wan2.1: ``WanTransformerBlock``; SD3.5:
    ``JointTransformerBlock``; FLUX.1: both block kinds): every submodule of one of those classes. Otherwise (genrl's
    DiT, the causal DiT, the discriminator) the entries of each outermost ``nn.ModuleList`` holding two or more
    modules of one class.

    Returns:
        the blocks in module order (empty for a network without repeated blocks: it is sharded as one unit).
    """
    names = set(getattr(module, "_no_split_modules", None) or ())
    if names:
        out, inside = [], set()
        for m in module.modules():
            # the class or a base (fully_shard swaps a block's class for an FSDP subclass of it)
            if m is not module and any(c.__name__ in names for c in type(m).__mro__) and id(m) not in inside:
                out.append(m)
                inside.update(id(s) for s in m.modules())
        return out
    out, inside = [], set()
    for m in module.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        if len({type(e) for e in m}) == 1:
            out.extend(m)
            inside.update(id(s) for e in m for s in e.modules())
    return out


@dataclass
class ShardingConfig:
    """How :func:`shard_module` shards a network.

    Attributes:
        param_dtype: dtype the gathered parameters compute in (``"bf16"``: bf16 matmuls over fp32 master weights,
            the usual GPU setting); None keeps the parameters' own dtype.
        reduce_dtype: dtype gradients are reduce-scattered in (``"fp32"`` with a bf16 ``param_dtype``); None: the
            ``param_dtype``.
        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3; least memory);
            False keeps them until the backward (ZeRO-2; one all-gather fewer per step).
        offload_frozen: keep the frozen roles' shards in CPU memory (``CPUOffloadPolicy``), copied to the device
            block by block as they run: a 14B teacher costs no GPU memory at rest.
    Raises:
        ValueError: an unknown dtype name.
    """

    param_dtype: Literal["bf16", "fp16", "fp32"] | None = None
    reduce_dtype: Literal["bf16", "fp16", "fp32"] | None = None
    reshard_after_forward: bool = True
    offload_frozen: bool = False

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and value not in _DTYPES:
                raise ValueError(f"{key} {value!r}: use one of {sorted(_DTYPES)} or null")

    def policies(self, frozen: bool) -> dict:
        """The ``fully_shard`` keyword arguments (mixed precision, resharding, offload) of a trainable or frozen
        network."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=_DTYPES.get(self.param_dtype),
                                  reduce_dtype=_DTYPES.get(self.reduce_dtype))
        kw = {"mp_policy": mp, "reshard_after_forward": self.reshard_after_forward}
        if frozen and self.offload_frozen:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return kw


def shard_module(module: nn.Module, mesh, config: ShardingConfig | None = None,
                 gradient_divide_factor: float | None = None) -> int:
    """Shard ``module`` in place over the 1-d device mesh ``mesh`` with FSDP2: each of its :func:`repeated_blocks`
    is a ``fully_shard`` unit, then the root (everything else: embeddings, heads, a LoRA adapter's tensors outside
    the blocks). A network whose parameters all have ``requires_grad`` False is a frozen role (a teacher, the
    reference): it is sharded the same way (and offloaded with ``config.offload_frozen``).

    A network that sets ``needs_double_backward`` (genrl's discriminator: R1 / R2 differentiate through its input
    gradient, and FSDP2 cannot free and re-gather weights between the two backward passes) keeps its gathered
    weights from its first forward until :func:`reshard` is called (the strategy does it before the network's
    optimizer step and before a checkpoint); its gradients and optimizer state stay sharded.

    ``gradient_divide_factor``: what the reduce-scatter divides the summed gradients by (default: the mesh size, so
    the gradient is the mean over ranks). Under context parallelism each rank of a group holds the gradient of its
    part of the sequence, and the group's gradient is their sum: the factor is then the data-parallel size.

    Returns:
        the number of blocks sharded one by one.
    Raises:
        ValueError: ``module`` is already sharded.
    """
    from torch.distributed.fsdp import fully_shard

    if is_sharded(module):
        raise ValueError(f"{type(module).__name__} is already sharded")
    config = config or ShardingConfig()
    kw = config.policies(frozen=not any(p.requires_grad for p in module.parameters()))
    double_backward = bool(getattr(module, "needs_double_backward", False))
    if double_backward:  # keep the gathered weights for the whole step: the penalty's backward runs twice over them
        kw["reshard_after_forward"] = False
    blocks = repeated_blocks(module)
    for block in blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(module, mesh=mesh, **kw)
    if double_backward:
        for unit in [*blocks, module]:
            unit.set_reshard_after_backward(False)
    if gradient_divide_factor is not None:
        for unit in [*blocks, module]:
            unit.set_gradient_divide_factor(float(gradient_divide_factor))
            unit.set_force_sum_reduction_for_comms(True)  # a sum, then the division (gloo has no PREMUL_SUM)
    return len(blocks)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of ``t``, gathered whole first when it is a sharded ``DTensor`` (then a collective: every
    rank of its mesh must call it)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def placed_like(full: torch.Tensor, param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``full`` (a whole tensor) on ``param``'s device (cast to ``dtype`` when given) and, when ``param`` is a
    ``DTensor``, distributed with its mesh and placements (this rank keeps its slice): the inverse of
    :func:`full_tensor`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(param.device, dtype) if dtype is not None else full.to(param.device)
    return distribute_tensor(full, param.device_mesh, param.placements) if isinstance(param, DTensor) else full


def reshard(module: nn.Module) -> None:
    """Free the gathered weights of every FSDP2 unit in ``module`` (back to this rank's shards), so that the next
    forward gathers the current values; nothing for a plain module."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def supports_context_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is a diffusers model with a context-parallel plan (``_cp_plan``: Wan, among others)."""
    return getattr(module, "_cp_plan", None) is not None and hasattr(module, "enable_parallelism")


def enable_context_parallel(module: nn.Module, mesh) -> None:
    """Split ``module``'s token sequence over the ranks of ``mesh`` with diffusers' context parallelism (Ulysses:
    each rank runs the blocks on ``1/c`` of the tokens; attention exchanges heads for tokens with two all-to-alls,
    Jacobs et al. 2023, "DeepSpeed Ulysses"). The input is split after the rotary embedding and the output gathered
    at ``proj_out``, so the forward returns the whole prediction on every rank of the group; in the backward each
    rank gets the gradient of its tokens only (the group's gradient is the sum, see :func:`shard_module`).

    Args:
        module: a diffusers transformer with a ``_cp_plan`` (:func:`supports_context_parallel`).
        mesh: a 2-d device mesh with dimensions ``("ring", "ulysses")`` of sizes ``(1, c)``: the ranks of one
            context-parallel group.
    Raises:
        ValueError: no context-parallel plan; ``c`` does not divide the attention head count.
    """
    from diffusers import ContextParallelConfig

    if not supports_context_parallel(module):
        raise ValueError(f"{type(module).__name__} has no context-parallel plan (diffusers' _cp_plan); context "
                         f"parallelism applies to diffusers families that have one (Wan): set context_parallel: 1")
    degree = mesh.size()
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if heads is not None and heads % degree:
        raise ValueError(f"context_parallel {degree} does not divide the {heads} attention heads of "
                         f"{type(module).__name__} (Ulysses splits heads); use a divisor of {heads}")
    config = ContextParallelConfig(ulysses_degree=degree, mesh=mesh)
    if mesh.device_type == "cpu":  # diffusers 0.42 takes rank % accelerator count, which is 0 on a CPU-only machine
        count = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: max(count(), 1)
        try:
            module.enable_parallelism(config=config)
        finally:
            torch.accelerator.device_count = count
    else:
        module.enable_parallelism(config=config)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is sharded by FSDP2 (also while its weights are gathered) or any of its parameters is a
    ``DTensor`` (distributed otherwise)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in module.modules()) or \
        any(isinstance(p, DTensor) for p in module.parameters())


def local_numel(module: nn.Module) -> tuple[int, int]:
    """(elements of ``module``'s parameters held by this rank, elements of the whole parameters): for an FSDP2 module
    about (total / N, total); for a plain module (total, total)."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in module.parameters():
        total += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return local, total


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict as full (unsharded) CPU tensors.

    For a sharded module this is a collective: every rank must call it; rank 0 gets the whole dict, the other ranks
    an empty one (the gathered tensors are offloaded to rank 0's CPU memory only). For a plain module every caller
    gets a CPU copy of ``state_dict()``."""
    if not is_sharded(module):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(module)  # a network kept gathered (needs_double_backward) reads its shards

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
