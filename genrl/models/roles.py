"""Roles: every network a method uses, declared once, as registered child modules Lightning and its strategies see.

A post-training method holds several networks that play different roles (docs/architecture.md, "Roles and
phases"):

============  ==========  ============  ===============================================================
kind          trained     checkpointed  examples
============  ==========  ============  ===============================================================
trainable     yes         yes           the policy / student (``generator``), a critic (fake score), a
                                        discriminator: each with its own optimizer
frozen        no          no            a teacher (real score), the reference policy: ``requires_grad``
                                        off, always in eval mode, rebuilt from its spec on resume
lagged        no (EMA)    yes           the old policy theta_old of RAM / DiffusionNFT / AFD: a lagged copy
                                        of the policy's *trainable* tensors only (the LoRA adapter under
                                        LoRA, never a second full transformer)
rollout       no (sync)   no            a low-precision copy of the policy that rolls out (Sol-RL's FP8 /
                                        NVFP4 candidates): cast or quantized from the live weights, in
                                        place, by :meth:`Roles.sync` after each update (so after a resume)
============  ==========  ============  ===============================================================

A planner (TempAct's LLM that writes the per-segment prompts) is a ``frozen`` role when it is a local network (a
``transformers`` causal LM, sharded with the rest), or no role at all when it is a remote service.

Frozen networks live in one :class:`FrozenRoles` container (``method.frozen``): a ``ModuleDict`` that stays in eval
mode whatever ``train()`` is called with and that adds nothing to a state dict (and expects nothing back), so a
14B teacher is moved, cast and sharded by the strategy like any child but never written to a checkpoint. Lagged
copies are :class:`LaggedCopy` children (buffers: no gradients, no optimizer, exact resume). :class:`Roles` is the
declaration table a method fills in ``configure_model``; it gives the reference context (LoRA disabled, or the
frozen copy), the swap context, the lagged update and :meth:`Roles.shardable` (the one place a strategy finds all
networks to shard).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from genrl.models.compile import compile_like
from genrl.models.quantized import CAST_FORMATS, RolloutPrecision, build_rollout_module, refresh_rollout_module
from genrl.models.sharding import placed_like

__all__ = ["FrozenRoles", "LaggedCopy", "Role", "RoleKind", "Roles", "RolloutCopy", "has_lora", "ramped_decay",
           "swapped_transformer"]

RoleKind = Literal["trainable", "frozen", "lagged", "rollout"]


def has_lora(module: nn.Module) -> bool:
    """Whether ``module`` (a transformer) carries a peft LoRA adapter."""
    return bool(getattr(module, "_hf_peft_config_loaded", False))


@contextmanager
def swapped_transformer(generator: nn.Module, transformer: nn.Module) -> Iterator[nn.Module]:
    """Evaluate ``generator`` (its input handling, text conditioning, causal layout) with another transformer: a
    frozen teacher, a critic or a reference. Restores the live transformer and its causal layout on exit."""
    live, causal = generator.transformer, getattr(generator, "causal", None)
    generator.transformer = transformer
    try:
        yield generator
    finally:
        generator.transformer = live
        if causal is not None:
            generator.causal = causal


class FrozenRoles(nn.ModuleDict):
    """Frozen networks of a method (teacher / real score, reference): registered children, never trained.

    Each module put in is frozen (``requires_grad_(False)``) and put in eval mode; ``train(True)`` leaves it in eval
    mode; :meth:`state_dict` adds nothing and :meth:`load_state_dict` (through the parent) expects nothing, so the
    networks are rebuilt from their spec on resume instead of being stored.
    """

    def __setitem__(self, key: str, module: nn.Module) -> None:
        super().__setitem__(key, module.requires_grad_(False).eval())

    def train(self, mode: bool = True) -> FrozenRoles:
        return super().train(False)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Nothing: frozen roles are rebuilt from their spec, never checkpointed (``destination`` unchanged)."""
        if args:  # positional (destination, prefix, keep_vars), as nn.Module's recursion never passes
            destination = args[0]
        if destination is None:
            from collections import OrderedDict

            destination = OrderedDict()
        return destination

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        self._load_prefix = prefix  # the children's missing keys are dropped by the post hook below
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def __init__(self, modules: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        for k, m in (modules or {}).items():
            self[k] = m
        self._load_prefix = ""
        self.register_load_state_dict_post_hook(FrozenRoles._drop_missing)

    @staticmethod
    def _drop_missing(module: FrozenRoles, incompatible) -> None:
        prefix = module._load_prefix
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(prefix)]


def _buffer_name(param_name: str) -> str:
    return param_name.replace(".", "__")


class LaggedCopy(nn.Module):
    """A lagged copy theta_old of a module's trainable tensors, e.g. RAM's / DiffusionNFT's old policy.

    Only the parameters that require gradients are copied (under LoRA: the adapter weights, a few MB, instead of a
    second full transformer); the frozen base weights are shared with the live module. The copies are buffers: they
    are checkpointed (a resumed run repeats an uninterrupted one), moved and cast with the method, and never trained.

    Args:
        module: the live module (the policy's transformer); its trainable parameters at construction are copied.
    Raises:
        ValueError: ``module`` has no trainable parameter.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError("LaggedCopy of a module without trainable parameters; nothing to lag")
        self.names: list[str] = names
        params = dict(module.named_parameters())
        for n in names:
            self.register_buffer(_buffer_name(n), params[n].detach().clone())

    def numel(self) -> int:
        """Number of lagged elements (what the copy costs in memory, in elements)."""
        return sum(b.numel() for b in self.buffers())

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{parameter name: lagged tensor}``."""
        return {n: getattr(self, _buffer_name(n)) for n in self.names}

    def _pairs(self, module: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
        params = dict(module.named_parameters())
        missing = [n for n in self.names if n not in params]
        if missing:
            raise KeyError(f"the live module has no parameter(s) {missing[:3]}: the lagged copy belongs to another "
                           f"module")
        return [(params[n], getattr(self, _buffer_name(n))) for n in self.names]

    @torch.no_grad()
    def shard_like(self, module: nn.Module) -> int:
        """After ``module`` was sharded (FSDP2), place each lagged tensor like its live parameter: a ``DTensor`` with
        the parameter's mesh and placements (this rank keeps its slice), so :meth:`update` and :meth:`applied` work
        shard by shard and the copy costs ``1/N`` per rank. Tensors already placed are left alone.

        Returns:
            the number of tensors re-placed.
        """
        from torch.distributed.tensor import DTensor

        n = 0
        for name, (p, s) in zip(self.names, self._pairs(module), strict=True):
            if isinstance(p, DTensor) and not isinstance(s, DTensor):
                # an existing buffer name: stays a registered buffer
                setattr(self, _buffer_name(name), placed_like(s, p))
                n += 1
        return n

    @contextmanager
    def applied(self, module: nn.Module) -> Iterator[nn.Module]:
        """Run ``module`` with the lagged weights, restored on exit. Plain tensors are swapped in (no copy); sharded
        (FSDP2) parameters are copied in and back, as FSDP2 gathers from its own storage (``.data`` must not be
        replaced). Use under ``torch.no_grad()`` and take no optimizer step inside."""
        from torch.distributed.tensor import DTensor

        pairs = self._pairs(module)
        swap = [(p, s) for p, s in pairs if not isinstance(p, DTensor)]
        copied = [(p, s, p.detach().clone()) for p, s in pairs if isinstance(p, DTensor)]
        for p, s in swap:
            p.data, s.data = s.data, p.data
        for p, s, _ in copied:
            p.detach().copy_(s)
        try:
            yield module
        finally:
            for p, s in swap:
                p.data, s.data = s.data, p.data
            for p, _, live in copied:
                p.detach().copy_(live)

    @torch.no_grad()
    def update(self, module: nn.Module, decay: float) -> None:
        """theta_old <- decay * theta_old + (1 - decay) * theta (an EMA step toward the live weights).

        Raises:
            ValueError: ``decay`` outside [0, 1].
        """
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        for p, s in self._pairs(module):
            s.lerp_(p.detach().to(s.dtype), 1.0 - decay)


class RolloutCopy(nn.Module):
    """A copy of the policy's transformer in another precision, used only to roll out (Sol-RL's low-precision
    candidate previews; the policy itself is trained and regenerates in its own precision).

    The copy is held by :class:`FrozenRoles` (no gradients, eval mode, never checkpointed): it is a function of the
    live weights, refreshed by :meth:`sync` after every optimizer update and so identical after a resume. It is built
    by :func:`genrl.models.quantized.build_rollout_module` (LoRA merged, the layer policy applied) and refreshed in
    place by :func:`genrl.models.quantized.refresh_rollout_module`: parameters are mutated, never rebound, so a
    compiled copy is never traced again after a sync.

    Args:
        module: the live transformer (LoRA adapters included: they are merged into the copy's weights).
        precision: a :class:`~genrl.models.quantized.RolloutPrecision`, or its format name (``"bf16"``,
            ``"fake_nvfp4"``, ...); None: a copy in the live module's dtype.

    When the live transformer is compiled (``generator.compile``), the copy is compiled with the same options
    (:func:`genrl.models.compile.compile_like`) unless ``precision.compile`` asks for its own compilation: its own
    graphs in its own dtype, compiled at its first rollout and reused after every :meth:`sync`.
    """

    def __init__(self, module: nn.Module, precision: RolloutPrecision | str | None = None) -> None:
        super().__init__()
        if precision is None:
            live = next(module.parameters()).dtype
            precision = next((f for f, d in CAST_FORMATS.items() if d == live), "fp32")
        self.precision = RolloutPrecision(precision) if isinstance(precision, str) else precision
        built, self.report = build_rollout_module(module, self.precision)
        self.module = built if self.precision.compile else compile_like(built, module)
        self.last_sync: dict[str, float] = {}

    @torch.no_grad()
    def sync(self, live: nn.Module) -> dict[str, float]:
        """Refresh the copy from the live transformer in place (:func:`~genrl.models.quantized.refresh_rollout_module`).

        Returns:
            ``{"seconds", "max_weight_change"}`` of this refresh (also kept as ``last_sync``).
        Raises:
            KeyError: the live module lacks a layer or tensor of the copy (the copy belongs to another module).
        """
        self.last_sync = refresh_rollout_module(self.module, live, self.precision)
        return self.last_sync

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def ramped_decay(iteration: int, ramp: float, maximum: float, start: float = 0.0, delay: int = 0) -> float:
    """The old-policy EMA decay of DiffusionNFT / RAM: d = min(ramp * iteration, maximum) (0 at the start: theta_old
    follows theta exactly, then lags more and more, up to ``maximum``).

    With an offset and a delay (CRD's snapshot schedules, arXiv 2603.14128): d = ``start`` while ``iteration`` <
    ``delay``, then min(start + ramp * (iteration - delay), maximum); the defaults give the formula above exactly.
    """
    if iteration < delay:
        return start
    return min(start + ramp * (iteration - delay), maximum)


@dataclass(frozen=True)
class Role:
    """One declared network: its name (the attribute / key it is found under), kind and whether it is stored."""

    name: str
    kind: RoleKind

    @property
    def checkpointed(self) -> bool:
        return self.kind not in ("frozen", "rollout")


class Roles:
    """The declaration table of a method's networks (see the module docstring).

    ``Roles(owner)`` creates ``owner.frozen`` (a :class:`FrozenRoles`); then, in ``configure_model``:
    ``roles.trainable("generator", gen)`` (the policy, registered as ``owner.generator``), ``roles.trainable("critic",
    net)``, ``roles.frozen("teacher", net)`` (``owner.frozen["teacher"]``), ``roles.reference_copy(gen)`` (a frozen copy
    of the policy's initial transformer, unless the policy has LoRA: then the reference is the adapter-disabled
    model), ``roles.lagged("old_policy", gen.transformer)``.

    Args:
        owner: the method (a LightningModule) whose children the networks become.
    """

    def __init__(self, owner: nn.Module) -> None:
        self.owner = owner
        self.table: dict[str, Role] = {}
        if not isinstance(getattr(owner, "frozen", None), FrozenRoles):
            owner.frozen = FrozenRoles()

    def _declare(self, name: str, kind: RoleKind) -> None:
        if name in self.table and self.table[name].kind != kind:
            raise ValueError(f"role {name!r} declared as {self.table[name].kind} and as {kind}")
        self.table[name] = Role(name, kind)

    def trainable(self, name: str, module: nn.Module) -> nn.Module:
        """Register ``module`` as ``owner.<name>`` (trained, checkpointed, own optimizer)."""
        self._declare(name, "trainable")
        setattr(self.owner, name, module)
        return module

    def frozen(self, name: str, module: nn.Module) -> nn.Module:
        """Register ``module`` as ``owner.frozen[name]`` (frozen, eval mode, never checkpointed)."""
        self._declare(name, "frozen")
        self.owner.frozen[name] = module
        return module

    def lagged(self, name: str, module: nn.Module) -> LaggedCopy:
        """Register a :class:`LaggedCopy` of ``module``'s trainable tensors as ``owner.<name>`` (checkpointed)."""
        self._declare(name, "lagged")
        copy_ = LaggedCopy(module)
        setattr(self.owner, name, copy_)
        return copy_

    def rollout_copy(self, name: str, generator: nn.Module,
                     precision: RolloutPrecision | str | None = None) -> RolloutCopy:
        """Register a :class:`RolloutCopy` of ``generator.transformer`` in ``precision`` as ``owner.frozen[name]`` (not
        trained, not checkpointed); evaluate with it through :meth:`swap`, refresh it with :meth:`sync`."""
        self._declare(name, "rollout")
        copy_ = RolloutCopy(generator.transformer, precision)
        self.owner.frozen[name] = copy_
        return copy_

    def sync(self, name: str) -> dict[str, float]:
        """Refresh the rollout copy ``name`` from the live policy's transformer (``owner.generator.transformer``,
        with whatever weights are applied to it: inside ``swap(generator, "old_policy")`` the lagged ones). Returns
        the refresh's ``{"seconds", "max_weight_change"}``."""
        return self.get(name).sync(self.owner.generator.transformer)

    def reference_copy(self, generator: nn.Module) -> None:
        """Declare the reference policy: nothing to store when ``generator.transformer`` has a LoRA adapter (the
        reference is the adapter-disabled model), else a frozen copy of its current (initial) weights, compiled like
        the policy when the policy is compiled."""
        if not has_lora(generator.transformer):
            live = generator.transformer
            self.frozen("reference", compile_like(copy.deepcopy(live), live))

    def get(self, name: str) -> nn.Module:
        """The network of role ``name``. Raises KeyError naming the declared roles."""
        if name not in self.table:
            raise KeyError(f"no role {name!r}; declared: {sorted(self.table)}")
        return self.owner.frozen[name] if self.table[name].kind in ("frozen", "rollout") else getattr(self.owner, name)

    @contextmanager
    def reference(self, generator: nn.Module) -> Iterator[nn.Module]:
        """Evaluate ``generator`` as the frozen reference policy: with a LoRA adapter the adapter-disabled model,
        else the frozen copy declared by :meth:`reference_copy`. Use under ``torch.no_grad()``; restores the policy.

        Raises:
            KeyError: no LoRA adapter and no reference declared.
        """
        if has_lora(generator.transformer):
            generator.transformer.disable_adapters()
            try:
                yield generator
            finally:
                generator.transformer.enable_adapters()
            return
        with swapped_transformer(generator, self.get("reference")) as gen:
            yield gen

    @contextmanager
    def swap(self, generator: nn.Module, name: str) -> Iterator[nn.Module]:
        """Evaluate ``generator`` with the network of role ``name``: a frozen / trainable transformer or a rollout
        copy is swapped in, a lagged copy's tensors are swapped into the live transformer."""
        role = self.get(name)
        if isinstance(role, RolloutCopy):
            role = role.module
        if isinstance(role, LaggedCopy):
            with role.applied(generator.transformer):
                yield generator
            return
        with swapped_transformer(generator, role) as gen:
            yield gen

    def update_lagged(self, name: str, decay: float) -> float:
        """theta_old <- decay theta_old + (1 - decay) theta for the lagged role ``name``; returns ``decay``."""
        self.get(name).update(self.owner.generator.transformer, decay)
        return decay

    def optimizers(self, *, joined: dict[str, list[str]] | None = None, **factories) -> list:
        """One optimizer per trainable role, in the order given: ``factories`` maps a role name to an optimizer
        factory (``OptimizerCallable``) applied to that role's trainable parameters (a generator's transformer's).
        ``joined`` adds further trainable roles' parameters to a named role's optimizer, after its own (TMD's flow
        head is updated with the student: ``joined={"generator": ["flow_head"]}``).

        Raises:
            ValueError: a role that is not trainable, or one without any trainable parameter (names it); a
                ``joined`` key that is not one of ``factories``.
        """
        joined = dict(joined or {})
        if unknown := sorted(set(joined) - set(factories)):
            raise ValueError(f"joined names {unknown}, which get no optimizer; use one of {sorted(factories)}")
        out = []
        for name, factory in factories.items():
            params = []
            for role in [name, *joined.get(name, [])]:
                if role not in self.table or self.table[role].kind != "trainable":
                    raise ValueError(f"optimizers for {role!r}: not a trainable role (trainable: "
                                     f"{sorted(n for n, r in self.table.items() if r.kind == 'trainable')})")
                module = self.get(role)
                own = [p for p in getattr(module, "transformer", module).parameters() if p.requires_grad]
                if not own:
                    raise ValueError(f"no trainable parameters in the {role!r} role; check its lora / spec config")
                params += own
            out.append(factory(params))
        return out

    def shardable(self) -> dict[str, nn.Module]:
        """``{role: module}`` of every network a strategy may wrap or shard (the policy's transformer, trainable and
        frozen networks). Lagged copies follow the policy's parameters; rollout copies are not sharded: each rank
        holds a whole one (low precision, refreshed from gathered live weights)."""
        out = {}
        for name, role in self.table.items():
            if role.kind in ("lagged", "rollout"):
                continue
            module = self.get(name)
            out[name] = getattr(module, "transformer", module)
        return out
