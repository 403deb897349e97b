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

__all__ = ["ShardingConfig", "full_state_dict", "is_sharded", "local_numel", "repeated_blocks", "shard_module"]

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
            if m is not module and type(m).__name__ in names and id(m) not in inside:
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
            kw["offload_policy"] = CPUOffloadPolicy()
        return kw


def shard_module(module: nn.Module, mesh, config: ShardingConfig | None = None) -> int:
    """Shard ``module`` in place over the 1-d device mesh ``mesh`` with FSDP2: each of its :func:`repeated_blocks`
    is a ``fully_shard`` unit, then the root (everything else: embeddings, heads, a LoRA adapter's tensors outside
    the blocks). A network whose parameters all have ``requires_grad`` False is a frozen role (a teacher, the
    reference): it is sharded the same way (and offloaded with ``config.offload_frozen``).

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
    blocks = repeated_blocks(module)
    for block in blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(module, mesh=mesh, **kw)
    return len(blocks)


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a ``DTensor`` (sharded by FSDP2 or distributed otherwise)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


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

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
