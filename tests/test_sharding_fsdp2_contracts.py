"""Contracts of FSDP2 sharding and of the FSDP2 strategy, checked in process (issue 51: mutation survivors of
genrl/models/sharding.py and genrl/strategies/fsdp2.py).

* ``repeated_blocks``: the blocks a diffusers model names in ``_no_split_modules`` (outermost only, matched through
  the class's bases) or, without such names, the entries of the outermost ``nn.ModuleList`` of one class;
* ``ShardingConfig`` validation and its offload policy, ``shard_module`` putting every unit on the mesh it is given;
* ``full_tensor`` / ``placed_like`` / ``local_numel`` / ``full_state_dict`` on a real one-process gloo group and on
  torch's fake process group (this process playing rank r of 2);
* ``supports_context_parallel`` / ``enable_context_parallel``: the plan check, the head-count check, the diffusers
  config and the CPU accelerator-count workaround (restored afterwards);
* ``FSDP2Strategy``: its arguments reach Lightning and the sharding config, the (data-parallel, context-parallel) mesh
  sizes are integers, ``setup`` (methods without a policy, the trainer handed on, the networks kept gathered and
  the optimizer hooks that reshard them), the state dict reshards first, and the atomic checkpoint protocol
  (``save_checkpoint`` -> ``publish_checkpoint`` / ``remove_published`` on a real folder).
"""

from __future__ import annotations

import errno
import os
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig
from lightning.pytorch.strategies import ModelParallelStrategy
from strategy_util import ContextParallelNet as _CP
from strategy_util import DoubleBackward as _DoubleBackward
from strategy_util import Gen as _Gen
from strategy_util import Net as _Net
from torch import nn

import genrl.strategies.fsdp2 as fsdp2
from genrl.models.roles import LaggedCopy, Roles
from genrl.models.sharding import (
    ShardingConfig,
    enable_context_parallel,
    full_state_dict,
    full_tensor,
    local_numel,
    placed_like,
    repeated_blocks,
    shard_module,
    supports_context_parallel,
)
from genrl.strategies import FSDP2Strategy
from genrl.strategies.fsdp2 import _remove_versions, publish_checkpoint, remove_published


# ---------------------------------------------------------------------------------------------- process groups
@pytest.fixture
def gloo_mesh():
    """A real one-process gloo group and its 1-d CPU mesh named ``("shard",)`` (unlike FSDP2's default mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()




# ---------------------------------------------------------------------------------------------- repeated_blocks
class _Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


class _TBlock(nn.Module):
    """The block class a diffusers model names in ``_no_split_modules``."""

    def __init__(self, nested: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        if nested:
            self.inner = _TBlock()


class _ShardedTBlock(_TBlock):
    """What fully_shard makes of a block: a subclass of its class (matched through the bases)."""


class _Diffusers(nn.Module):
    _no_split_modules = ["_TBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 2)
        self.first = _TBlock(nested=True)  # holds another _TBlock: only the outer one is a unit
        self.stack = nn.Sequential(_ShardedTBlock(), nn.ReLU())  # not a ModuleList: found by class all the same
        self.pair = nn.ModuleList([_Leaf(), _Leaf()])  # repeated, but the names decide for a diffusers model


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Leaf(), _Leaf()])


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)
        self.stages = nn.ModuleList([_Stage(), _Stage()])  # outermost list of one class: its entries are the blocks
        self.mixed = nn.ModuleList([_Leaf(), nn.Linear(2, 2)])  # two classes: not blocks
        self.single = nn.ModuleList([_Leaf()])  # one module: not blocks


def test_repeated_blocks_of_a_diffusers_model_are_the_outermost_named_blocks():
    """With ``_no_split_modules``, the blocks are the submodules whose class (or a base of it) is named, in module
    order, the outermost only (a named block inside one is part of it), never the model itself, and no ModuleList
    entries."""
    model = _Diffusers()
    assert [id(b) for b in repeated_blocks(model)] == [id(model.first), id(model.stack[0])]
    model.first.inner.register_module("deeper", _TBlock())
    assert [id(b) for b in repeated_blocks(model)] == [id(model.first), id(model.stack[0])]


def test_repeated_blocks_without_names_are_the_entries_of_outermost_module_lists():
    """Without ``_no_split_modules``: the entries of each outermost ModuleList of two or more modules of one class;
    the ModuleLists inside those entries are part of them; mixed or single-entry lists are not blocks."""
    model = _Plain()
    assert [id(b) for b in repeated_blocks(model)] == [id(s) for s in model.stages]
    assert repeated_blocks(nn.Linear(2, 2)) == []


# ---------------------------------------------------------------------------------------------- ShardingConfig
@pytest.mark.parametrize("key", ["param_dtype", "reduce_dtype"])
def test_sharding_config_rejects_an_unknown_dtype_name(key):
    """A dtype name outside bf16 / fp16 / fp32 / None is refused when the config is made."""
    with pytest.raises(ValueError, match=key):
        ShardingConfig(**{key: "bf32"})
    assert getattr(ShardingConfig(**{key: "fp16"}), key) == "fp16"


def test_offloaded_frozen_shards_are_pinned_exactly_when_cuda_is_available():
    """A frozen role's CPU-offloaded shards use pinned memory iff CUDA is available (pinning needs a CUDA host)."""
    kw = ShardingConfig(offload_frozen=True).policies(frozen=True)
    assert kw["offload_policy"].pin_memory is torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- shard_module / tensors
def test_shard_module_puts_every_unit_on_the_mesh_it_is_given(gloo_mesh):
    """Every parameter (the blocks' and the root's) is a DTensor on the given mesh, not on FSDP2's default mesh."""
    from torch.distributed.tensor import DTensor

    net = _Net()
    assert shard_module(net, gloo_mesh) == 2
    params = dict(net.named_parameters())
    assert set(params) == {"blocks.0.lin.weight", "blocks.0.lin.bias", "blocks.1.lin.weight", "blocks.1.lin.bias",
                           "head.weight", "head.bias"}
    for name, p in params.items():
        assert isinstance(p, DTensor) and p.device_mesh == gloo_mesh, name
        assert p.device_mesh.mesh_dim_names == ("shard",), name


def test_full_tensor_returns_a_plain_detached_cpu_copy(gloo_mesh):
    """full_tensor of a sharded DTensor is the whole tensor as a plain torch.Tensor; of a plain tensor, a detached
    copy of it."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    whole = torch.arange(12.0).reshape(4, 3)
    out = full_tensor(distribute_tensor(whole, gloo_mesh, [Shard(0)]))
    assert type(out) is torch.Tensor and not isinstance(out, DTensor)
    assert out.device.type == "cpu" and torch.equal(out, whole)
    leaf = whole.clone().requires_grad_(True)
    out = full_tensor(leaf)
    assert type(out) is torch.Tensor and not out.requires_grad and torch.equal(out, whole)


def test_placed_like_distributes_as_the_parameter_and_casts_only_when_asked(gloo_mesh):
    """placed_like(full, param): for a DTensor param, a DTensor on its mesh with its placements holding ``full``
    (the inverse of full_tensor); for a plain param, ``full`` on the param's device; the dtype only changes when
    given."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    whole = torch.arange(12.0).reshape(4, 3)
    param = distribute_tensor(torch.zeros(4, 3), gloo_mesh, [Shard(0)])
    for dtype in (None, torch.float64):
        out = placed_like(whole, param, dtype)
        assert isinstance(out, DTensor) and out.device_mesh == gloo_mesh and tuple(out.placements) == (Shard(0),)
        assert out.device_mesh.mesh_dim_names == ("shard",)  # not a default (unnamed) mesh
        assert out.dtype == (dtype or torch.float32)
        assert torch.equal(out.full_tensor(), whole.to(out.dtype))
    plain = torch.zeros(4, 3, dtype=torch.float16)
    out = placed_like(whole, plain)
    assert type(out) is torch.Tensor and out.dtype == torch.float32 and torch.equal(out, whole)
    meta = torch.empty(4, 3, device="meta", dtype=torch.float16)  # another device than full's
    out = placed_like(whole, meta)
    assert (out.device.type, out.dtype) == ("meta", torch.float32)
    out = placed_like(whole, meta, torch.bfloat16)
    assert (out.device.type, out.dtype, out.shape) == ("meta", torch.bfloat16, (4, 3))


def test_local_numel_counts_this_ranks_slice_and_the_whole(fake_group):
    """local_numel: (elements this rank holds, whole elements), summed over every parameter, a DTensor counting its
    local shard, a plain parameter whole; here rank 1 of 2 holds half of each Shard(0) parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    fake_group(1, 2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    net = nn.Module()
    net.a = nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False))  # whole: 4 x 3
    net.b = nn.Parameter(torch.zeros(5))
    net.c = nn.Parameter(DTensor.from_local(torch.zeros(1, 7), mesh, [Shard(0)], run_check=False))  # whole: 2 x 7
    assert local_numel(net) == (6 + 5 + 7, 12 + 5 + 14)
    assert local_numel(nn.Linear(3, 2)) == (8, 8)
    sharded = _Net()
    shard_module(sharded, mesh)
    assert local_numel(sharded) == (25, 50)


def test_full_state_dict_of_a_plain_module_is_an_independent_cpu_copy():
    """A plain module's full state dict: every entry of state_dict(), equal values, and a copy (writing into it leaves
    the module unchanged)."""
    net = nn.BatchNorm1d(3)
    net.running_mean.add_(2.0)
    ref = {k: v.clone() for k, v in net.state_dict().items()}
    out = full_state_dict(net)
    assert set(out) == set(ref)
    for k, v in out.items():
        assert v.device.type == "cpu" and torch.equal(v, ref[k]), k
        v.add_(1)
    for k, v in net.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_full_state_dict_of_a_sharded_module_is_whole_plain_tensors(gloo_mesh):
    """A sharded module (also one kept gathered after a forward, needs_double_backward): plain CPU tensors equal to
    the unsharded weights."""
    from torch.distributed.tensor import DTensor

    for cls in (_Net, _DoubleBackward):
        ref = _Net().state_dict()
        net = cls()
        shard_module(net, gloo_mesh)
        net(torch.randn(2, 4))
        out = full_state_dict(net)
        assert set(out) == set(ref)
        for k, v in out.items():
            assert type(v) is torch.Tensor and not isinstance(v, DTensor), k
            assert v.device.type == "cpu" and torch.equal(v, ref[k]), k


@pytest.mark.parametrize("rank", [0, 1])
def test_full_state_dict_goes_to_rank_zero_only(fake_group, rank):
    """Over 2 ranks the gathered dict is offloaded to rank 0 only: rank 0 gets every entry whole, rank 1 an empty
    dict."""
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(rank, 2)
    net = _Net()
    shard_module(net, init_device_mesh("cpu", (2,), mesh_dim_names=("shard",)))
    out = full_state_dict(net)
    if rank == 0:
        shapes = {k: tuple(v.shape) for k, v in _Net().state_dict().items()}
        assert {k: tuple(v.shape) for k, v in out.items()} == shapes
        assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in out.values())
    else:
        assert out == {}


# ---------------------------------------------------------------------------------------------- context parallelism
class _Wanish(nn.Module):
    """A diffusers-like transformer with a context-parallel plan; records what enable_parallelism saw."""

    _cp_plan: dict = {}

    def __init__(self, heads: int | None = None, config: bool = True) -> None:
        super().__init__()
        if config:
            self.config = SimpleNamespace(num_attention_heads=heads) if heads is not None else SimpleNamespace()
        self.seen = []

    def enable_parallelism(self, config=None) -> None:
        count = torch.accelerator.device_count
        self.seen.append((config, count, count()))


def test_supports_context_parallel_needs_a_plan_and_enable_parallelism():
    """A module supports context parallelism only with both a (non-None) ``_cp_plan`` and ``enable_parallelism``."""
    class PlanOnly(nn.Module):
        _cp_plan: dict = {}

    class MethodOnly(nn.Module):
        _cp_plan = None

        def enable_parallelism(self, config=None) -> None:  # pragma: no cover - never called
            pass

    assert supports_context_parallel(_Wanish())
    assert not supports_context_parallel(PlanOnly())
    assert not supports_context_parallel(MethodOnly())
    assert not supports_context_parallel(nn.Linear(2, 2))


def test_enable_context_parallel_refuses_a_module_without_a_plan():
    """No ``_cp_plan``: a ValueError naming the plan, nothing enabled."""
    with pytest.raises(ValueError, match="context-parallel plan"):
        enable_context_parallel(nn.Linear(2, 2), SimpleNamespace(size=lambda: 2, device_type="cpu"))


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("heads, config", [(4, True), (None, True), (None, False)])
def test_enable_context_parallel_hands_diffusers_a_ulysses_config(monkeypatch, device_type, heads, config):
    """The module gets ContextParallelConfig(ulysses_degree=mesh size, mesh=mesh) (a head count of 4 divides 2; a
    module without a head count, or without a config, is not checked); on a CPU mesh enable_parallelism sees an
    accelerator count of at least 1 (diffusers takes rank % count), on a GPU mesh the real one, and the real
    function is back afterwards."""

    real = torch.accelerator.device_count
    monkeypatch.setattr(torch.accelerator, "device_count", real)  # restored even if a failure leaves it replaced
    mesh = SimpleNamespace(size=lambda: 2, device_type=device_type)
    module = _Wanish(heads, config)
    enable_context_parallel(module, mesh)
    assert torch.accelerator.device_count is real
    [(cp_config, count, value)] = module.seen
    assert isinstance(cp_config, ContextParallelConfig)
    assert (cp_config.ulysses_degree, cp_config.ring_degree, cp_config.mesh) == (2, 1, mesh)
    if device_type == "cpu":
        assert value == max(real(), 1)
    else:
        assert count is real


def test_enable_context_parallel_refuses_a_degree_that_does_not_divide_the_heads(monkeypatch):
    """Ulysses splits heads: 4 ranks and 6 heads is a ValueError naming both, nothing enabled."""
    monkeypatch.setattr(torch.accelerator, "device_count", torch.accelerator.device_count)
    module = _Wanish(6)
    with pytest.raises(ValueError, match="context_parallel 4 does not divide the 6 attention heads"):
        enable_context_parallel(module, SimpleNamespace(size=lambda: 4, device_type="cpu"))
    assert module.seen == []


def test_enable_context_parallel_restores_the_accelerator_count_when_diffusers_fails(monkeypatch):
    """The CPU workaround is undone even when enable_parallelism raises."""
    real = torch.accelerator.device_count
    monkeypatch.setattr(torch.accelerator, "device_count", real)

    class Failing(_Wanish):
        def enable_parallelism(self, config=None) -> None:
            raise RuntimeError("diffusers failed")

    with pytest.raises(RuntimeError, match="diffusers failed"):
        enable_context_parallel(Failing(2), SimpleNamespace(size=lambda: 2, device_type="cpu"))
    assert torch.accelerator.device_count is real


# ---------------------------------------------------------------------------------------------- FSDP2Strategy args
def test_strategy_defaults():
    """Defaults: no mixed precision, ZeRO-3 resharding, no offload, no context parallelism, distributed (atomic)
    checkpoints, the backend chosen by Lightning."""

    strategy = FSDP2Strategy()
    assert strategy.sharding == ShardingConfig(None, None, True, False)
    assert strategy.context_parallel == 1
    assert strategy._save_distributed_checkpoint is True and strategy.atomic_checkpoints is True
    assert strategy.process_group_backend is None


def test_strategy_arguments_reach_the_sharding_config_and_lightning():
    """Every argument lands where it acts: the four sharding ones in ShardingConfig, the checkpoint format, the
    backend and any other keyword (the collective timeout) in Lightning's ModelParallelStrategy."""

    strategy = FSDP2Strategy(param_dtype="bf16", reduce_dtype="fp32", reshard_after_forward=False,
                             offload_frozen=True, context_parallel=2, save_distributed_checkpoint=False,
                             process_group_backend="gloo", timeout=timedelta(seconds=7))
    assert strategy.sharding == ShardingConfig("bf16", "fp32", False, True)
    assert strategy.sharding.reshard_after_forward is False
    assert strategy.context_parallel == 2
    assert strategy._save_distributed_checkpoint is False and strategy.atomic_checkpoints is False
    assert strategy.process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=7)
    with pytest.raises(ValueError, match="context_parallel 0"):
        FSDP2Strategy(context_parallel=0)


@pytest.mark.parametrize("world, cp", [(2, 2), (4, 2), (4, 4)])
def test_strategy_mesh_sizes_are_integers_a_real_mesh_accepts(monkeypatch, fake_group, world, cp):
    """setup_environment's (data-parallel, context-parallel) sizes are the integers W // c and c: the device mesh
    Lightning builds from them (real, on the fake group) has that shape."""
    from lightning.fabric.strategies.model_parallel import _setup_device_mesh


    monkeypatch.setattr(ModelParallelStrategy, "setup_environment", lambda self: None)
    monkeypatch.setattr(FSDP2Strategy, "num_processes", property(lambda self: world))
    strategy = FSDP2Strategy(context_parallel=cp)
    strategy.setup_environment()
    sizes = (strategy._data_parallel_size, strategy._tensor_parallel_size)
    assert sizes == (world // cp, cp) and all(type(s) is int for s in sizes)
    fake_group(0, world)
    mesh = _setup_device_mesh(*sizes, world, torch.device("cpu"))
    assert tuple(mesh.shape) == (world // cp, cp)


# ---------------------------------------------------------------------------------------------- FSDP2Strategy.setup
def _probe(monkeypatch, world: int, cp: int, **kwargs):
    """An FSDP2Strategy whose setup runs its own decisions over W ranks (the meshes real, on the fake group) and
    records what it shards and what it hands Lightning; Lightning's own setup is recorded, not run."""


    calls = SimpleNamespace(shard=[], cp=[], lagged=[], trainer=[], reshard=[])
    monkeypatch.setattr(fsdp2, "shard_module", lambda net, mesh, config, gradient_divide_factor=None:
                        calls.shard.append((net, mesh, gradient_divide_factor)))
    monkeypatch.setattr(fsdp2, "enable_context_parallel", lambda net, mesh: calls.cp.append((net, mesh)))
    monkeypatch.setattr(fsdp2, "is_sharded", lambda net: False)
    monkeypatch.setattr(fsdp2, "reshard", lambda net: calls.reshard.append(net))
    monkeypatch.setattr(ModelParallelStrategy, "setup", lambda self, trainer: calls.trainer.append(trainer))
    monkeypatch.setattr(LaggedCopy, "shard_like", lambda self, module: calls.lagged.append((self, module)))

    class Probe(fsdp2.FSDP2Strategy):
        world_size = world
        root_device = torch.device("cpu")
        device_mesh = {"data_parallel": "data-parallel mesh"}
        optimizers = []
        lightning_module = None

    return Probe(context_parallel=cp, **kwargs), calls


def test_setup_refuses_a_module_without_roles(monkeypatch):
    """A LightningModule that is not a genrl method (no ``roles``) is a TypeError."""
    strategy, calls = _probe(monkeypatch, 2, 1)
    strategy.lightning_module = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="has no `roles`"):
        strategy.setup(trainer=None)
    assert calls.shard == [] and calls.trainer == []


def test_setup_of_a_method_without_a_policy_shards_its_roles_and_leaves_lagged_copies(monkeypatch):
    """A method with no ``generator`` (a critic and its lagged copy): the critic is sharded, the lagged copy is not
    placed like a policy, and Lightning's setup gets the trainer."""
    strategy, calls = _probe(monkeypatch, 2, 1)
    method = strategy.lightning_module = nn.Module()
    method.roles = Roles(method)
    critic = method.roles.trainable("critic", _Net())
    method.roles.lagged("old_critic", critic)
    trainer = object()
    strategy.setup(trainer=trainer)
    assert [(id(n), m, d) for n, m, d in calls.shard] == [(id(critic), "data-parallel mesh", None)]
    assert calls.lagged == [] and calls.trainer == [trainer]


@pytest.mark.parametrize("world, cp", [(2, 2), (4, 2)])
def test_setup_builds_integer_context_parallel_meshes(monkeypatch, fake_group, world, cp):
    """Under context parallelism setup builds real meshes: parameters over all W ranks, and a (W / c, 1, c) mesh
    whose (ring, ulysses) part, c ranks, is handed to the networks with a plan (factor W // c)."""
    fake_group(0, world)
    strategy, calls = _probe(monkeypatch, world, cp)
    method = strategy.lightning_module = nn.Module()
    method.roles = Roles(method)
    policy = method.roles.trainable("generator", _Gen(_CP(0))).transformer
    strategy.setup(trainer=None)
    [(net, mesh, divide)] = calls.shard
    assert net is policy and divide == world // cp and tuple(mesh.shape) == (world,)
    [(net, cp_mesh)] = calls.cp
    assert net is policy and tuple(cp_mesh.shape) == (1, cp) and cp_mesh.mesh_dim_names == ("ring", "ulysses")


def test_setup_keeps_double_backward_networks_gathered_and_reshards_them_before_their_step(monkeypatch):
    """The networks that set needs_double_backward are kept gathered; each optimizer over one of their parameters
    reshards exactly those networks before its step; an optimizer over other networks does not."""
    strategy, calls = _probe(monkeypatch, 2, 1)
    method = strategy.lightning_module = nn.Module()
    method.roles = Roles(method)
    policy = method.roles.trainable("generator", _Gen(_Net(0))).transformer
    disc = method.roles.trainable("discriminator", _DoubleBackward(1))
    teacher = method.roles.frozen("teacher", _Net(2).requires_grad_(False))
    opt_policy = torch.optim.SGD(policy.parameters(), lr=0.1)
    opt_disc = torch.optim.SGD([{"params": list(disc.blocks.parameters())},
                                {"params": list(disc.head.parameters())}], lr=0.1)
    strategy.optimizers = [opt_policy, opt_disc]
    strategy.setup(trainer=None)
    assert [id(n) for n in strategy._kept_gathered] == [id(disc)]
    assert teacher not in strategy._kept_gathered
    opt_policy.step()
    assert calls.reshard == []
    opt_disc.step()
    assert [id(n) for n in calls.reshard] == [id(disc)]


def test_lightning_module_state_dict_reshards_the_kept_gathered_networks_first(monkeypatch):
    """The checkpointed state dict is Lightning's, read after every kept-gathered network is resharded (none before
    setup has run)."""


    events = []
    monkeypatch.setattr(fsdp2, "reshard", lambda net: events.append(("reshard", net)))
    monkeypatch.setattr(ModelParallelStrategy, "lightning_module_state_dict",
                        lambda self: events.append("state_dict") or {"w": 1})
    strategy = fsdp2.FSDP2Strategy()
    assert strategy.lightning_module_state_dict() == {"w": 1} and events == ["state_dict"]
    events.clear()
    nets = [_DoubleBackward(0), _DoubleBackward(1)]
    strategy._kept_gathered = nets
    assert strategy.lightning_module_state_dict() == {"w": 1}
    assert events == [("reshard", nets[0]), ("reshard", nets[1]), "state_dict"]


# ---------------------------------------------------------------------------------------------- atomic checkpoints
def _checkpointing(monkeypatch, tmp_path, kill_at: str | None = None, **kwargs):
    """An FSDP2Strategy on rank 0 whose collectives are recorded (broadcast returns its object) and whose Lightning
    write makes the folder it is given (a ``meta.pt`` naming the checkpoint); ``kill_at``: the barrier that raises
    (a rank killed there)."""


    events = []

    def write(self, checkpoint, filepath, storage_options=None):
        events.append(("write", checkpoint, Path(filepath), storage_options))
        assert Path(filepath).parent == tmp_path  # never outside the run folder
        if self._save_distributed_checkpoint:
            Path(filepath).mkdir()
            (Path(filepath) / "meta.pt").write_text(checkpoint["name"])

    monkeypatch.setattr(ModelParallelStrategy, "save_checkpoint", write)
    monkeypatch.chdir(tmp_path)

    class Rank0(FSDP2Strategy):
        is_global_zero = True

        def broadcast(self, obj, src=0):
            events.append(("broadcast", obj))
            return obj

        def barrier(self, name=None):
            events.append(("barrier", name))
            if name == kill_at:
                raise RuntimeError(f"killed at {name}")

    return Rank0(**kwargs), events


def test_save_checkpoint_writes_a_hidden_folder_then_publishes_it(monkeypatch, tmp_path):
    """A distributed save: rank 0's path and a nonce are broadcast, every rank writes ``.<name>.<nonce>`` beside the
    name (with the checkpoint and storage options given), a barrier, rank 0 points the name at the folder, a second
    barrier; a second save replaces the first and removes its folder."""
    strategy, events = _checkpointing(monkeypatch, tmp_path)
    path = tmp_path / "last.ckpt"
    options = {"opt": 1}
    before = time.time_ns()
    strategy.save_checkpoint({"name": "one"}, path, options)
    (kind, (sent, nonce)), (write, checkpoint, folder, storage), *barriers = events
    assert (kind, write) == ("broadcast", "write")
    assert sent == str(path) and before <= nonce <= time.time_ns()
    assert (checkpoint, folder, storage) == ({"name": "one"}, tmp_path / f".last.ckpt.{nonce}", options)
    assert barriers == [("barrier", "genrl_checkpoint_written"), ("barrier", "genrl_checkpoint_published")]
    assert path.is_symlink() and os.readlink(path) == folder.name and (path / "meta.pt").read_text() == "one"
    events.clear()
    strategy.save_checkpoint({"name": "two"}, str(path))
    assert (path / "meta.pt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.readlink(path), "last.ckpt"])


def test_a_rank_killed_before_the_publish_leaves_the_previous_checkpoint(monkeypatch, tmp_path):
    """A failure at the ``genrl_checkpoint_written`` barrier (what genrl.testing.distributed.KillDuringCheckpoint
    triggers) happens before the name moves: it still reads the previous checkpoint."""
    path = tmp_path / "last.ckpt"
    strategy, _ = _checkpointing(monkeypatch, tmp_path)
    strategy.save_checkpoint({"name": "one"}, path)
    strategy, _ = _checkpointing(monkeypatch, tmp_path, kill_at="genrl_checkpoint_written")
    with pytest.raises(RuntimeError, match="killed"):
        strategy.save_checkpoint({"name": "two"}, path)
    assert (path / "meta.pt").read_text() == "one"


def test_single_file_checkpoints_go_through_lightning_unchanged(monkeypatch, tmp_path):
    """save_distributed_checkpoint False: Lightning's own write with the arguments as given, no broadcast, no
    barrier, no link."""
    strategy, events = _checkpointing(monkeypatch, tmp_path, save_distributed_checkpoint=False)
    path = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"name": "one"}, path, {"opt": 1})
    assert events == [("write", {"name": "one"}, path, {"opt": 1})]
    assert not path.is_symlink()


def _folder(parent: Path, name: str, text: str) -> Path:
    folder = parent / name
    folder.mkdir()
    (folder / "meta.pt").write_text(text)
    return folder


@pytest.mark.parametrize("folder_name, nonce", [(".last.ckpt.17", "17"), ("shards", "shards")])
def test_publish_replaces_a_stale_link_of_a_killed_publish(tmp_path, folder_name, nonce):
    """The temporary link is ``.<name>.link-<nonce>``, the nonce being what follows the folder's last dot (the whole
    name of a folder without one): a link of that name left by a publish killed before its rename is replaced, and
    after the publish only the name and its folder remain."""

    path = tmp_path / "last.ckpt"
    folder = _folder(tmp_path, folder_name, folder_name)
    (tmp_path / "elsewhere").mkdir()
    os.symlink("elsewhere", tmp_path / f".last.ckpt.link-{nonce}", target_is_directory=True)
    publish_checkpoint(folder, path)
    assert os.readlink(path) == folder_name and (path / "meta.pt").read_text() == folder_name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["elsewhere", folder_name, "last.ckpt"])


def test_publish_moves_a_plain_checkpoint_aside_and_deletes_it(tmp_path):
    """A single-file or folder checkpoint at the name (written without the strategy) is replaced by the link and
    deleted; a missing folder is a FileNotFoundError."""

    path = tmp_path / "last.ckpt"
    path.write_text("single file")
    folder = _folder(tmp_path, ".last.ckpt.1", "one")
    publish_checkpoint(folder, path)
    assert (path / "meta.pt").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.ckpt.1", "last.ckpt"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        publish_checkpoint(tmp_path / ".last.ckpt.2", path)
    assert (path / "meta.pt").read_text() == "one"


def test_publish_deletes_only_this_names_older_versions(tmp_path):
    """After a publish the older ``.<name>.<digits>`` folders and files are gone; the new folder, other names'
    versions, other hidden entries and links are kept."""

    path = tmp_path / "last.ckpt"
    keep = ["epoch=1.ckpt", ".last.ckpt.tmp", ".last-v1.ckpt.5", ".lastXckpt.6", "last.ckpt.7"]
    for name in keep:
        _folder(tmp_path, name, name)
    _folder(tmp_path, ".last.ckpt.3", "old")
    (tmp_path / ".last.ckpt.4").write_text("old single file")
    os.symlink("epoch=1.ckpt", tmp_path / ".last.ckpt.8", target_is_directory=True)  # a link is never deleted
    publish_checkpoint(_folder(tmp_path, ".last.ckpt.9", "new"), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, ".last.ckpt.8", ".last.ckpt.9", "last.ckpt"])
    publish_checkpoint(_folder(tmp_path, ".last.ckpt.10", "newer"), path)  # the link it named before is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, ".last.ckpt.8", ".last.ckpt.10", "last.ckpt"])
    assert (path / "meta.pt").read_text() == "newer"


def test_an_old_version_that_cannot_be_removed_does_not_fail_the_publish(monkeypatch, tmp_path):
    """Removing old versions is best effort: a folder whose removal fails (a file held open on NFS leaves it not
    empty) stays, and the publish still succeeds."""

    stuck = _folder(tmp_path, ".last.ckpt.1", "old")
    real_rmdir = os.rmdir

    def rmdir(p, *args, **kwargs):
        if Path(p).name == stuck.name:
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(p))
        return real_rmdir(p, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir)
    path = tmp_path / "last.ckpt"
    publish_checkpoint(_folder(tmp_path, ".last.ckpt.2", "new"), path)
    assert (path / "meta.pt").read_text() == "new" and stuck.is_dir()


def test_remove_published_deletes_the_link_its_folder_or_a_plain_checkpoint(tmp_path):
    """remove_published / the strategy's remove_checkpoint (rank 0): a published name loses its link and folder (and
    any half-written version), a plain folder or file is deleted, a missing name is nothing."""

    path = tmp_path / "last.ckpt"
    publish_checkpoint(_folder(tmp_path, ".last.ckpt.1", "one"), path)
    _folder(tmp_path, ".last.ckpt.2", "half written")
    _folder(tmp_path, "other.ckpt", "other")
    FSDP2Strategy().remove_checkpoint(str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.ckpt"]
    remove_published(tmp_path / "other.ckpt")
    (tmp_path / "file.ckpt").write_text("x")
    remove_published(tmp_path / "file.ckpt")
    remove_published(tmp_path / "missing.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_remove_versions_in_a_missing_folder_is_nothing(tmp_path):
    """Cleaning the versions of a name whose folder does not exist does nothing (no error)."""

    _remove_versions(tmp_path / "missing" / "last.ckpt", keep=None)
    assert list(tmp_path.iterdir()) == []


def test_remove_versions_skips_a_version_another_process_removed_meanwhile(tmp_path, monkeypatch):
    """A moved-aside single-file version that is gone by the time it is deleted (another process cleaned the same
    folder between the listing and the unlink) is not an error; the other versions are still removed."""

    (tmp_path / ".last.ckpt.1").write_text("old")
    real_iterdir = Path.iterdir

    def iterdir(self):
        yield self / ".last.ckpt.7"  # listed, but already deleted: no such file
        yield from real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    _remove_versions(tmp_path / "last.ckpt", keep=None)
    assert list(real_iterdir(tmp_path)) == []
