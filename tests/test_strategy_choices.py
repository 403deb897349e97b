"""Choices made under a strategy, checked in process (issue 51): the slow multi-process tests
(tests/test_distributed.py, ``-m slow``) are the only other place these run, so the default suite checks each choice
here with a one-process gloo group, torch's fake process group (one process playing rank r of W) or the pure
decision with a world size.

* which modules FSDP2 wraps per role and with which policies (trainable, frozen, frozen offloaded, a partly frozen
  LoRA policy, a double-backward discriminator kept gathered): :func:`genrl.models.sharding.shard_module` on a real
  one-process FSDP2 mesh, read back from the FSDP2 units;
* the gradient scale: a divide factor f gives exactly the single-process gradient / f (real backward through FSDP2);
  under context parallelism the strategy picks f = W / c for the networks with a plan and the default (the mean over
  the mesh) for the others, for W = 1, 2, 4 and c = 1, 2, 4;
* which roles the strategy shards (trainable and frozen, not the lagged or rollout copies, not twice), on which mesh
  (all W ranks), and which it puts under context parallelism; the lagged copy placed like the policy;
* the (data-parallel, context-parallel) mesh: data-parallel size W / c, and global rank r in data-parallel slice r // c
  (torch's mesh layout, read on the fake group for every rank), which is what ``gather_batch`` / ``gather_objects``
  assume when they keep one copy of each group's rows; the gathers see every slice once, in order.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from strategy_util import ContextParallelNet as _CP
from strategy_util import DoubleBackward as _DoubleBackward
from strategy_util import Gen as _Gen
from strategy_util import Net as _Net
from torch import nn

from genrl.models.roles import LaggedCopy, Roles, RolloutCopy
from genrl.models.sharding import ShardingConfig, shard_module

WORLD_CP = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4)]


# ---------------------------------------------------------------------------------------------- process groups


def _group(unit):
    return unit._get_fsdp_state()._fsdp_param_group


# ---------------------------------------------------------------------------------------------- sharding policies
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("dtypes", [(None, None), ("bf16", "fp32")])
def test_sharding_policies_offload_only_frozen_roles(frozen, offload, reshard, dtypes):
    from torch.distributed.fsdp import CPUOffloadPolicy

    kw = ShardingConfig(*dtypes, reshard_after_forward=reshard, offload_frozen=offload).policies(frozen=frozen)
    assert set(kw) == {"mp_policy", "reshard_after_forward"} | ({"offload_policy"} if frozen and offload else set())
    assert kw["reshard_after_forward"] is reshard
    if frozen and offload:
        assert isinstance(kw["offload_policy"], CPUOffloadPolicy)
    names = {None: None, "bf16": torch.bfloat16, "fp32": torch.float32}
    assert (kw["mp_policy"].param_dtype, kw["mp_policy"].reduce_dtype) == tuple(names[d] for d in dtypes)


# role -> (network, sharding config, offloaded?, reshard after forward?)
def _roles():
    lora_like = _Net()
    for n, p in lora_like.named_parameters():
        p.requires_grad_(n.startswith("blocks.0."))  # a policy with a trainable adapter: partly frozen, not frozen
    return {
        "trainable": (_Net(), ShardingConfig(offload_frozen=True), False, True),
        "lora_policy": (lora_like, ShardingConfig(offload_frozen=True), False, True),
        "frozen": (_Net().requires_grad_(False), ShardingConfig(), False, True),
        "frozen_offloaded": (_Net().requires_grad_(False), ShardingConfig(offload_frozen=True), True, True),
        "frozen_zero2": (_Net().requires_grad_(False), ShardingConfig(reshard_after_forward=False), False, False),
        "double_backward": (_DoubleBackward(), ShardingConfig(), False, False),
    }


@pytest.mark.parametrize("role", list(_roles()))
def test_shard_module_wraps_the_blocks_and_the_root_with_the_roles_policy(one_process_mesh, role):
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    net, config, offloaded, reshard = _roles()[role]
    x = torch.randn(3, 4)
    ref = _Net()
    ref.load_state_dict(net.state_dict())
    assert shard_module(net, one_process_mesh, config) == 2
    units = [m for m in net.modules() if isinstance(m, FSDPModule)]
    assert units == [net, *net.blocks]  # the blocks one by one, then the root (the head): nothing else
    for unit in units:
        group = _group(unit)
        assert isinstance(group.offload_policy, CPUOffloadPolicy) == offloaded, unit
        assert (group.post_forward_mesh_info is not None) == reshard, unit
        assert group.reshard_after_backward == (role != "double_backward"), unit
        assert group.gradient_divide_factor is None and not group.force_sum_reduction_for_comms
    with torch.no_grad():
        assert torch.equal(net(x), ref(x))
    with pytest.raises(ValueError, match="already sharded"):
        shard_module(net, one_process_mesh, config)


@pytest.mark.parametrize("factor", [None, 1])
def test_gradient_divide_factor_on_one_rank_keeps_the_gradient(one_process_mesh, factor):
    """On one rank the reduce-scatter is a copy: the sharded gradient is the single-process gradient bitwise, with
    no factor (FSDP2's mean over a mesh of 1) and with factor 1 (a context-parallel group of the whole world). (torch
    2.14's one-rank path divides by a factor f twice, f^2, where W ranks divide once; genrl never gives a factor on
    one rank: context parallelism needs c >= 2 ranks; test_gradient_is_summed_then_divided_once_by_the_factor checks
    the W-rank path.)"""
    net, ref = _Net(), _Net()
    shard_module(net, one_process_mesh, gradient_divide_factor=factor)
    x = torch.randn(5, 4)
    net(x).square().sum().backward()
    ref(x).square().sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in net.named_parameters()}
    for n, p in ref.named_parameters():
        assert torch.equal(grads[n], p.grad), n
    for unit in [*net.blocks, net]:
        assert _group(unit).gradient_divide_factor == (None if factor is None else float(factor))
        assert _group(unit).force_sum_reduction_for_comms == (factor is not None)


@pytest.mark.parametrize("world, cp", [(w, c) for w, c in WORLD_CP if c > 1])
def test_gradient_is_summed_then_divided_once_by_the_factor(one_process_mesh, world, cp):
    """What shard_module's factor makes FSDP2 do over W ranks (its reduce plan for a group of size W, fp32): a SUM
    reduce-scatter (no pre-division, gloo has no PREMUL_SUM) and one division by the factor W / c the strategy gives:
    the gradient is sum over ranks / (W / c), the mean over the W / c slices of each group's summed parts. Without
    the factor (a network with no plan) the default is the mean over all W ranks."""
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    net = _Net()
    shard_module(net, one_process_mesh, gradient_divide_factor=world // cp)
    group = _group(net)
    group_of_w = SimpleNamespace(size=lambda: world)
    pre, post, rs_op, _ = _get_gradient_divide_factors(group_of_w, None, torch.float32, "cpu",
                                                       group.gradient_divide_factor,
                                                       group.force_sum_reduction_for_comms)
    assert (pre, post, rs_op) == (None, world / cp, ReduceOp.SUM)
    # g_r of rank r: the reduced gradient is sum_r g_r / post, with the slices' group sums averaged
    parts = torch.randn(world, 6, dtype=torch.float64)
    group_sums = parts.reshape(world // cp, cp, 6).sum(1)
    torch.testing.assert_close(parts.sum(0) / post, group_sums.mean(0), rtol=1e-12, atol=1e-12)
    pre, post, rs_op, _ = _get_gradient_divide_factors(group_of_w, None, torch.float32, "cpu", None, False)
    assert (pre, post, rs_op) == (None, None, ReduceOp.AVG)  # no factor: the mean over all W ranks


# ---------------------------------------------------------------------------------------------- FSDP2Strategy.setup
class _Method(nn.Module):
    """A genrl method's roles: a CP-capable policy (trainable), a critic without a plan (trainable), a CP-capable
    frozen teacher, a frozen reference already sharded, a lagged old policy and a rollout copy."""

    def __init__(self, policy_cp: bool = True, teacher_cp: bool = True) -> None:
        super().__init__()
        self.roles = Roles(self)
        self.roles.trainable("generator", _Gen((_CP if policy_cp else _Net)(0)))
        self.roles.trainable("critic", _Net(1))
        self.roles.frozen("teacher", (_CP if teacher_cp else _Net)(2))
        reference = self.roles.frozen("reference", _Net(3))
        reference.already_sharded = True
        self.roles.lagged("old_policy", self.generator.transformer)
        self.roles.rollout_copy("rollout", self.generator, "fp32")


class _Mesh:
    def __init__(self, shape, names) -> None:
        self.shape, self.names = tuple(shape), tuple(names)

    def __getitem__(self, names):
        names = (names,) if isinstance(names, str) else tuple(names)
        return ("submesh", self, names)


def _probe_strategy(monkeypatch, world: int, cp: int, **kwargs):
    """An FSDP2Strategy whose setup runs its own decisions with the world size W and records what it shards, where
    and with which divide factor (Lightning's own setup, the meshes and the collectives are replaced)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    import genrl.strategies.fsdp2 as fsdp2

    calls = SimpleNamespace(shard=[], cp=[], meshes=[], lagged=[])
    monkeypatch.setattr(fsdp2, "shard_module", lambda net, mesh, config, gradient_divide_factor=None:
                        calls.shard.append((net, mesh, config, gradient_divide_factor)))
    monkeypatch.setattr(fsdp2, "enable_context_parallel", lambda net, mesh: calls.cp.append((net, mesh)))
    monkeypatch.setattr(fsdp2, "is_sharded", lambda net: getattr(net, "already_sharded", False))

    def init_device_mesh(kind, shape, mesh_dim_names):
        calls.meshes.append(mesh := _Mesh(shape, mesh_dim_names))
        assert kind == "cpu"
        return mesh

    monkeypatch.setattr("torch.distributed.device_mesh.init_device_mesh", init_device_mesh)
    monkeypatch.setattr(ModelParallelStrategy, "setup", lambda self, trainer: None)
    monkeypatch.setattr(LaggedCopy, "shard_like", lambda self, module: calls.lagged.append((self, module)))

    class Probe(fsdp2.FSDP2Strategy):
        world_size = world
        root_device = torch.device("cpu")
        device_mesh = {"data_parallel": "data-parallel mesh"}
        optimizers = []
        lightning_module = None

    return Probe(context_parallel=cp, **kwargs), calls


@pytest.mark.parametrize("world, cp", WORLD_CP)
def test_strategy_shards_each_role_once_and_scales_context_parallel_gradients_by_w_over_c(monkeypatch, world, cp):
    strategy, calls = _probe_strategy(monkeypatch, world, cp, offload_frozen=True, reshard_after_forward=False)
    method = strategy.lightning_module = _Method()
    strategy.setup(trainer=None)
    sharded = {id(net): (mesh, config, divide) for net, mesh, config, divide in calls.shard}
    assert len(sharded) == len(calls.shard) == 3  # each role once
    nets = {"generator": method.generator.transformer, "critic": method.critic, "teacher": method.frozen["teacher"]}
    assert set(sharded) == {id(n) for n in nets.values()}  # not the reference (sharded), old policy or rollout copy
    if cp == 1:
        shard_mesh = "data-parallel mesh"
        assert calls.meshes == [] and calls.cp == []
    else:  # parameters over all W ranks; a (W / c, 1, c) mesh whose (ring, ulysses) part is one group
        shard_mesh, cp_mesh = calls.meshes
        assert (shard_mesh.shape, shard_mesh.names) == ((world,), ("shard",))
        assert (cp_mesh.shape, cp_mesh.names) == ((world // cp, 1, cp), ("dp", "ring", "ulysses"))
        assert [(id(n), m) for n, m in calls.cp] == [(id(nets["generator"]), ("submesh", cp_mesh, ("ring", "ulysses"))),
                                                     (id(nets["teacher"]), ("submesh", cp_mesh, ("ring", "ulysses")))]
    for name, net in nets.items():
        mesh, config, divide = sharded[id(net)]
        assert mesh is shard_mesh and config is strategy.sharding, name
        assert config.offload_frozen and not config.reshard_after_forward
        # a context-parallel group's gradient is the sum of its c parts, averaged over the W / c slices
        assert divide == (world // cp if cp > 1 and name != "critic" else None), name
    assert [(lag, mod) for lag, mod in calls.lagged] == [(method.old_policy, method.generator.transformer)]
    assert isinstance(method.frozen["rollout"], RolloutCopy)


def test_context_parallel_without_a_plan_is_refused(monkeypatch):
    strategy, calls = _probe_strategy(monkeypatch, 4, 2)
    strategy.lightning_module = _Method(policy_cp=False, teacher_cp=False)
    with pytest.raises(ValueError, match="context-parallel plan"):
        strategy.setup(trainer=None)
    assert calls.shard == []
    strategy, calls = _probe_strategy(monkeypatch, 4, 1)  # without context parallelism: sharded as usual
    strategy.lightning_module = _Method(policy_cp=False, teacher_cp=False)
    strategy.setup(trainer=None)
    assert [d for *_, d in calls.shard] == [None, None, None]


# ---------------------------------------------------------------------------------------------- the mesh and gathers
@pytest.mark.parametrize("world, cp", WORLD_CP)
def test_data_parallel_slice_of_every_rank_is_rank_over_c(monkeypatch, fake_group, world, cp):
    """setup_environment asks Lightning for a (W / c, c) mesh; on it (built on the fake group as rank r of W) the
    sampler's slice of rank r is r // c of W / c, what data_parallel_of and the gathers read."""
    from lightning.fabric.strategies.model_parallel import _setup_device_mesh
    from lightning.pytorch.strategies import ModelParallelStrategy

    from genrl.data.shapes_datamodule import data_parallel_of
    from genrl.strategies import FSDP2Strategy

    monkeypatch.setattr(ModelParallelStrategy, "setup_environment", lambda self: None)
    monkeypatch.setattr(FSDP2Strategy, "num_processes", property(lambda self: world))
    strategy = FSDP2Strategy(context_parallel=cp)
    strategy.setup_environment()
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (world // cp, cp)
    for rank in range(world):
        fake_group(rank, world)
        strategy._device_mesh = _setup_device_mesh(world // cp, cp, world, torch.device("cpu"))
        assert strategy.distributed_sampler_kwargs == {"num_replicas": world // cp, "rank": rank // cp}
        assert data_parallel_of(SimpleNamespace(strategy=strategy, global_rank=rank, world_size=world)) == (
            rank // cp, world // cp)
    if cp > 1:
        monkeypatch.setattr(FSDP2Strategy, "num_processes", property(lambda self: world + 1))
        with pytest.raises(ValueError, match="does not divide"):
            FSDP2Strategy(context_parallel=cp).setup_environment()


@pytest.mark.parametrize("world, cp", WORLD_CP)
def test_gathers_see_every_slice_once_in_order(monkeypatch, world, cp):
    """W processes in groups of c hold W / c slices of n rows (rank r: slice r // c); gather_batch and gather_objects
    return the global batch, every slice once in slice order; rank_slice takes each rank's rows back; a global
    mini-batch M is M / (W / c) rows per rank."""
    import genrl.methods.common as common

    dp, n = world // cp, 3
    rows = torch.arange(dp * n * 2, dtype=torch.float32).reshape(dp, n, 2)  # slice d: rows[d]
    for rank in range(world):
        module = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace(
            distributed_sampler_kwargs={"rank": rank // cp, "num_replicas": dp})), device=torch.device("cpu"))

        def all_gather(t, rank=rank):
            assert torch.equal(t, rows[rank // cp])
            return torch.stack([rows[r // cp] for r in range(world)])  # [processes, n, 2]: global rank order

        module.all_gather = all_gather
        out = common.gather_batch(module, rows[rank // cp])
        assert torch.equal(out, rows.reshape(dp * n, 2))
        assert torch.equal(common.rank_slice(module, out, n), rows[rank // cp])
        assert common.local_mini_batch(module, dp * n, n) == n and common.local_mini_batch(module, None, n) == n
        if dp > 1:
            assert common.local_mini_batch(module, dp, n) == 1

        names = [[f"p{d}.{i}" for i in range(n)] for d in range(dp)]
        monkeypatch.setattr(dist, "get_world_size", lambda *a: world)
        monkeypatch.setattr(dist, "all_gather_object", lambda out, items, names=names: out.__setitem__(
            slice(None), [names[r // cp] for r in range(world)]))
        assert common.gather_objects(module, names[rank // cp]) == [x for part in names for x in part]
