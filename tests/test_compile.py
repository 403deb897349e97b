"""Opt-in torch.compile of the denoiser (``generator.compile``): compiled rollouts and training steps equal eager ones,
one compilation per shape and none across iterations (counted), the option through a YAML config into a GRPO run,
state-dict keys and checkpoints unchanged, bad values named.

The fast tests use the ``eager`` / ``aot_eager`` backends: they go through dynamo (tracing, guards, graph counting,
and for ``aot_eager`` AOT autograd's joint forward / backward graph) but run the traced ATen ops as they are, so the
results are bitwise those of the eager model. The inductor tests (generated C++ kernels) are slow (about a minute of
compilation each on 2 cores) and marked ``slow``.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

from genrl.methods.common import build_policy
from genrl.models.compile import (
    CompileCounter,
    compile_counts,
    compile_generator,
    compile_like,
    compile_options,
    compiled_options,
    is_compiled,
)
from genrl.models.families import GeneratorSpec, build_generator
from genrl.models.roles import LaggedCopy, Roles
from genrl.rollout import RolloutConfig, rollout, transition_log_prob

SHAPE = (4, 3, 8, 8)
PROMPTS = ["a red circle moving left slowly", "a blue square", "a green triangle moving up quickly",
           "a red circle", "a cyan square staying still", "a yellow circle moving down slowly"]
#: 6 samples in micro-batches of 4 (the second one padded), CFG doubling each network call to 8
CONFIG = RolloutConfig(num_steps=4, kernel="flow_grpo", cfg_scale=2.0, sde_steps="window", num_sde_steps=2,
                       micro_batch_size=4)
EAGER = {"backend": "eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts from empty dynamo caches, so its first call compiles and the recompile limit is its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _spec(tiny_policy, tiny_text_encoder, compile=False) -> GeneratorSpec:
    return GeneratorSpec(pretrained=tiny_policy, text_encoder=tiny_text_encoder, compile=compile)


def _lora_pair(tiny_policy, tiny_text_encoder, compile):
    """(eager policy, compiled policy) with the same random LoRA adapter (lora_B non-zero, so it changes outputs)."""
    lora = {"rank": 4, "alpha": 8.0}
    eager = build_policy(_spec(tiny_policy, tiny_text_encoder), lora)
    compiled = build_policy(_spec(tiny_policy, tiny_text_encoder, compile), lora)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in eager.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    compiled.transformer.load_state_dict(eager.transformer.state_dict())
    return eager, compiled


def _same_trajectory(a, b, atol: float = 0.0) -> None:
    for name in ("latents", "log_probs", "noises"):
        x, y = getattr(a, name), getattr(b, name)
        if atol == 0.0:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=name)


# ---------------------------------------------------------------------------------------------------- (a) equality
@pytest.mark.compile_count
@pytest.mark.slow  # 15-20 s warm, more on a cold inductor cache: kept out of the default suite's budget
def test_compiled_lora_rollout_and_training_step_equal_eager_bitwise(tiny_policy, tiny_text_encoder):
    """backend aot_eager: the compiled graph (LoRA adapter included, added after compile() but before the first
    call) gives the eager rollout bit for bit, then the eager log-probs and LoRA gradients of a training step."""
    eager, compiled = _lora_pair(tiny_policy, tiny_text_encoder, {"backend": "aot_eager"})
    assert is_compiled(compiled.transformer) and not is_compiled(eager.transformer)
    assert compiled_options(compiled.transformer) == {"backend": "aot_eager", "dynamic": False}
    assert list(compiled.transformer.state_dict()) == list(eager.transformer.state_dict())  # no _orig_mod.
    with CompileCounter() as c:
        b = rollout(compiled, PROMPTS, SHAPE, seed=3, config=CONFIG, rollout_id=1)
    assert c.graphs == 1 and c.graph_breaks == 0  # the whole DiT forward, LoRA layers included, is one graph
    a = rollout(eager, PROMPTS, SHAPE, seed=3, config=CONFIG, rollout_id=1)
    _same_trajectory(a, b)
    # so the adapter is in the compiled graph: without it the (eager) result differs
    eager.transformer.disable_adapters()
    assert not torch.equal(rollout(eager, PROMPTS, SHAPE, seed=3, config=CONFIG, rollout_id=1).final, b.final)
    eager.transformer.enable_adapters()
    # training step: forward + backward through the compiled module (AOT autograd's joint graph)
    k = a.sde_steps[0]
    grads = []
    for gen in (eager, compiled):
        gen.transformer.zero_grad()
        log_prob, _, _ = transition_log_prob(gen, a, k)
        assert torch.equal(log_prob.detach(), a.log_probs[:, k])  # ratio exactly 1, compiled too
        log_prob.mean().backward()
        grads.append({n: p.grad.clone() for n, p in gen.transformer.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


@pytest.mark.slow  # 15-20 s warm, more on a cold inductor cache: kept out of the default suite's budget
def test_reference_rollout_and_lagged_copies_of_a_compiled_policy(tiny_policy, tiny_text_encoder):
    """Deep copies drop torch.compile (nn.Module.__getstate__): the reference policy and the rollout copy are
    compiled again like the policy (compile_like) and compute what eager copies compute; the lagged copy's swapped
    tensors reach the compiled graph (parameters are graph inputs, not constants)."""
    eager = build_policy(_spec(tiny_policy, tiny_text_encoder))
    compiled = build_policy(_spec(tiny_policy, tiny_text_encoder, EAGER))
    assert not is_compiled(copy.deepcopy(compiled.transformer))
    assert compiled_options(copy.deepcopy(compiled.transformer)) is None

    owner = torch.nn.Module()
    roles = Roles(owner)
    roles.trainable("generator", compiled)
    roles.reference_copy(compiled)
    roles.rollout_copy("fast", compiled, "fp64")
    assert compiled_options(roles.get("reference")) == compiled_options(compiled.transformer)
    assert compiled_options(roles.get("fast").module) == compiled_options(compiled.transformer)
    eager_owner = torch.nn.Module()
    eager_roles = Roles(eager_owner)
    eager_roles.trainable("generator", eager)
    eager_roles.rollout_copy("fast", eager, "fp64")
    assert not is_compiled(eager_roles.get("fast").module)  # an eager policy gets eager copies

    # train the live policy a little so the reference (initial weights) and the policy differ
    with torch.no_grad():
        for p_e, p_c in zip(eager.transformer.parameters(), compiled.transformer.parameters()):
            p_e.add_(0.01)
            p_c.add_(0.01)
    lagged = roles.lagged("old", compiled.transformer)
    with torch.no_grad():
        for p_e, p_c in zip(eager.transformer.parameters(), compiled.transformer.parameters()):
            p_e.add_(0.01)
            p_c.add_(0.01)
    x = torch.randn(4, *SHAPE)
    sigma = torch.full((4,), 0.5)
    cond = compiled.encode_prompts(PROMPTS[:4])
    with torch.no_grad():
        with roles.reference(compiled) as gen:
            v_ref = gen.velocity(x, sigma, cond)
        ref = build_generator(_spec(tiny_policy, tiny_text_encoder))  # the initial weights, eager
        assert torch.equal(v_ref, ref.velocity(x, sigma, cond))
        with roles.swap(compiled, "fast") as gen:
            v_fast = gen.velocity(x.double(), sigma.double(), cond)
        with eager_roles.swap(eager, "fast") as gen:
            assert torch.equal(v_fast, gen.velocity(x.double(), sigma.double(), cond))
        with lagged.applied(compiled.transformer):
            v_old = compiled.velocity(x, sigma, cond)
        assert torch.equal(v_old, _eager_velocity_at(eager, lagged, x, sigma, cond))
        v_live = compiled.velocity(x, sigma, cond)
        assert not torch.equal(v_old, v_live)  # the compiled graph read the lagged tensors, then the live ones
        assert torch.equal(v_live, eager.velocity(x, sigma, cond))


def _eager_velocity_at(eager, lagged: LaggedCopy, x, sigma, cond):
    """The eager policy's velocity with the lagged tensors (by name) in place of its own."""
    with lagged.applied(eager.transformer):
        return eager.velocity(x, sigma, cond)


# ---------------------------------------------------------------------------------------------------- (b) counting
@pytest.mark.compile_count
def test_rollouts_of_other_iterations_seeds_and_prompts_compile_once(tiny_policy, tiny_text_encoder):
    """Three rollouts of the same shape (other seeds, iterations, SDE windows, prompts) and three training steps:
    the first of each compiles one graph, the later ones none; a new micro-batch size is a new graph."""
    gen = build_policy(_spec(tiny_policy, tiny_text_encoder, EAGER))  # dynamo's guards do not depend on the backend
    prompt_sets = [PROMPTS, PROMPTS[::-1], ["a magenta square moves left, then moves down"] * 6]
    per_rollout = []
    for it, prompts in enumerate(prompt_sets):
        with CompileCounter() as c:
            traj = rollout(gen, prompts, SHAPE, seed=10 + it, indices=range(6 * it, 6 * it + 6), config=CONFIG,
                           rollout_id=it)
        per_rollout.append(c.counts)
        with CompileCounter() as c:
            log_prob, _, _ = transition_log_prob(gen, traj, traj.sde_steps[-1])
            log_prob.mean().backward()
        per_rollout.append(c.counts)
    graphs = [c.graphs for c in per_rollout]
    assert graphs == [1, 1, 0, 0, 0, 0], f"graphs compiled per rollout / training step: {graphs}"
    assert all(c.graph_breaks == 0 for c in per_rollout)
    # eval mode does not recompile genrl's DiT (it reads no train-mode flag); a new micro-batch does
    gen.transformer.eval()
    with CompileCounter() as c:
        rollout(gen, PROMPTS, SHAPE, seed=1, config=CONFIG)
    assert c.graphs == 0
    with CompileCounter() as c:
        rollout(gen, PROMPTS, SHAPE, seed=1, config=RolloutConfig(num_steps=2, micro_batch_size=3))
    assert c.graphs == 1


@pytest.mark.compile_count
def test_compile_counter_counts_only_inside_its_block():
    counter = CompileCounter()
    with pytest.raises(RuntimeError, match="never entered"):
        _ = counter.graphs
    f = torch.compile(lambda t: t * 2 + 1, backend="eager")
    before = compile_counts()
    with counter:
        f(torch.ones(3))
        f(torch.ones(3))  # same shape: no recompilation
        assert counter.graphs == 1  # live inside the block
    f(torch.ones(5))  # a new static shape after the block: not counted by it
    assert counter.graphs == 1 and counter.frames == 1
    assert (compile_counts() - before).graphs >= 2


# ---------------------------------------------------------------------------------------------------- (c) YAML / fit
@pytest.mark.compile_count
def test_grpo_fit_with_compile_from_yaml(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    """``generator.compile`` from a YAML file through ``genrl fit``: 2 GRPO iterations with LoRA, no compilation in the
    second iteration nor in the validation (CFG on there too: the rollout's batch), the same checkpoint keys as an
    uncompiled policy, and the checkpoint loads into an uncompiled model."""
    from lightning.pytorch.callbacks import Callback

    from genrl.cli import GenRLCLI
    from genrl.models.loading import load_generator

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "compile.yaml").write_text(
        "model:\n  init_args:\n    generator:\n      compile:\n        backend: eager\n"
        "    lora:\n      rank: 4\n    eval_rollout:\n      cfg_scale: 2.0\n"
    )

    class CountPerIteration(Callback):
        def __init__(self):
            self.graphs: list[int] = []  # per training iteration, then per validation

        def _start(self, *args):
            self._counter = CompileCounter().__enter__()

        def _end(self, *args):
            self._counter.__exit__(None, None, None)
            self.graphs.append(self._counter.graphs)

        on_train_batch_start = on_validation_start = _start
        on_train_batch_end = on_validation_end = _end

    cli = GenRLCLI(args=[
        "--config", str(root / "configs/quickstart.yaml"), "--config", str(root / "configs/tiny/grpo.yaml"),
        "--config", "compile.yaml", "--trainer.enable_progress_bar=false", "--trainer.max_steps=2",
        f"--model.init_args.generator.pretrained={tiny_policy}", "--model.init_args.generator.components={}",
        f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
    ], run=False)
    counter = CountPerIteration()
    cli.trainer.callbacks.append(counter)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    model = cli.model
    assert int(model.iteration) == 2
    assert model.hparams["generator"]["compile"] == {"backend": "eager"}
    assert compiled_options(model.generator.transformer) == {"backend": "eager", "dynamic": False}
    # iteration 1 compiles the rollout and the training step (forward + backward); then nothing: iteration 2, and the
    # validation after it (eval mode, the same CFG-doubled batch) reuse the rollout's graph
    assert counter.graphs == [2, 0, 0], counter.graphs

    uncompiled = build_policy(_spec(tiny_policy, tiny_text_encoder), {"rank": 4})
    keys = [k for k in model.state_dict() if k.startswith("generator.")]
    assert keys == [f"generator.transformer.{k}" for k in uncompiled.transformer.state_dict()]
    assert not any("_orig_mod" in k for k in model.state_dict())
    ckpt = torch.load("runs/quickstart/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert sorted(k for k in ckpt["state_dict"] if k.startswith("generator.")) == sorted(keys)
    loaded = load_generator("runs/quickstart/checkpoints/last.ckpt", text_encoder=tiny_text_encoder)
    assert not is_compiled(loaded.transformer)
    trained = model.generator.transformer.state_dict()
    for k, v in loaded.transformer.state_dict().items():
        assert torch.equal(v, trained[k]), k
    assert Path("runs/quickstart/export/config.json").is_file()  # the export of a compiled policy


# ---------------------------------------------------------------------------------------------------- (d) errors
@pytest.mark.parametrize("value,match", [
    ({"mode": "fastest"}, r"mode='fastest' is not an inductor mode.*max-autotune-no-cudagraphs"),
    ({"backend": "tensorrt_llm"}, r"backend='tensorrt_llm' is not a torch.compile backend.*inductor"),
    ({"modes": "default"}, r"unknown key\(s\) \['modes'\].*'mode'"),
    ({"backend": "eager", "mode": "default"}, r"mode / options configure the inductor backend.*backend: inductor"),
    ({"mode": "default", "options": {}}, r"mode='default' or options, not both"),
    ({"dynamic": "yes"}, r"dynamic='yes' must be false"),
    ("inductor", r"compile='inductor' is neither a bool nor a mapping.*backend: eager"),
])
def test_bad_compile_values_name_the_value_and_the_fix(value, match):
    with pytest.raises(ValueError, match=match):
        GeneratorSpec(compile=value)
    with pytest.raises(ValueError, match=match):
        compile_options(value)


def test_good_compile_values_and_off():
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) == {"backend": "inductor", "dynamic": False}
    assert compile_options({"mode": "max-autotune-no-cudagraphs"}) == {
        "backend": "inductor", "dynamic": False, "mode": "max-autotune-no-cudagraphs"}
    assert compile_options({"dynamic": None, "fullgraph": True}) == {
        "backend": "inductor", "dynamic": None, "fullgraph": True}
    gen = torch.nn.Module()
    gen.transformer = torch.nn.Linear(2, 2)
    assert compile_generator(gen, False) is gen and not is_compiled(gen.transformer)
    assert compile_like(torch.nn.Linear(2, 2), gen.transformer) is not None


def test_bad_compile_value_in_a_config_fails_before_building(tmp_path, monkeypatch, tiny_text_encoder):
    from genrl.cli import GenRLCLI

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"mode='fastest' is not an inductor mode"):
        GenRLCLI(args=[
            "--config", str(root / "configs/quickstart.yaml"), "--config", str(root / "configs/tiny/grpo.yaml"),
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
            "--model.init_args.generator.compile={mode: fastest}",
        ], run=False)


# ---------------------------------------------------------------------------------------------------- inductor
#: inductor against eager, float32: fused kernels (layer norm, softmax, GELU, matmul epilogues) sum in another order,
#: which moves a float32 forward by a few ulp; the four sampler steps carry it on with a gain near 1. Measured on this
#: test (2 cores, torch 2.14): latents (|x| up to 3.8) differ by at most 4.8e-7, log-probs by 6e-8. 1e-5 absolute is
#: 20 times that, and far below what a real bug does (a missing adapter or a stale weight moves latents by > 1e-2).
INDUCTOR_ATOL = 1e-5
#: LoRA gradients of one training step, per tensor, relative to the tensor's largest eager entry: measured at most
#: 9e-5 (a tensor whose gradients nearly cancel); 1e-3 is ten times that.
INDUCTOR_GRAD_RTOL = 1e-3


@pytest.mark.compile_count
@pytest.mark.slow
def test_inductor_rollout_and_training_step_match_eager(tiny_policy, tiny_text_encoder):
    eager, compiled = _lora_pair(tiny_policy, tiny_text_encoder, True)
    with CompileCounter() as c:
        b = rollout(compiled, PROMPTS, SHAPE, seed=3, config=CONFIG, rollout_id=1)
    assert c.graphs == 1
    a = rollout(eager, PROMPTS, SHAPE, seed=3, config=CONFIG, rollout_id=1)
    _same_trajectory(a, b, atol=INDUCTOR_ATOL)
    with CompileCounter() as c:
        rollout(compiled, PROMPTS[::-1], SHAPE, seed=4, config=CONFIG, rollout_id=2)
    assert c.graphs == 0
    k = a.sde_steps[0]
    grads = []
    for gen in (eager, compiled):
        gen.transformer.zero_grad()
        log_prob, _, _ = transition_log_prob(gen, a, k)
        log_prob.mean().backward()
        grads.append({n: p.grad.clone() for n, p in gen.transformer.named_parameters() if p.requires_grad})
    for n in grads[0]:
        scale = float(grads[0][n].abs().max())
        assert scale > 0 and float((grads[1][n] - grads[0][n]).abs().max()) <= INDUCTOR_GRAD_RTOL * scale, n


# ---------------------------------------------------------------------------------------------------- families
@pytest.mark.compile_count
def test_a_diffusers_family_compiles_in_place(tmp_path):
    """The same option on a diffusers family (tiny Wan2.1): its transformer is compiled in place (same keys, the
    pipeline's transformer is the same object), gives the eager velocity bit for bit and compiles once per shape."""
    from families_util import save_tiny_pipeline

    from genrl.testing.families import TINY_SIZE

    folder = save_tiny_pipeline("wan", tmp_path / "wan")
    eager = build_generator(GeneratorSpec(family="wan", pretrained=str(folder), **TINY_SIZE["wan"]))
    compiled = build_generator(GeneratorSpec(family="wan", pretrained=str(folder), compile=EAGER,
                                             **TINY_SIZE["wan"]))
    assert is_compiled(compiled.transformer) and compiled.pipeline.transformer is compiled.transformer
    assert list(compiled.transformer.state_dict()) == list(eager.transformer.state_dict())
    cond = eager.encode_prompts(PROMPTS[:2])
    for seed, expect_graphs in ((0, 1), (1, 0)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, *eager.latent_shape, generator=g)
        sigma = torch.rand(2, generator=g)
        with torch.no_grad(), CompileCounter() as c:
            v = compiled.velocity(x, sigma, cond)
        assert c.graphs == expect_graphs
        with torch.no_grad():
            assert torch.equal(v, eager.velocity(x, sigma, cond))


def test_a_compiled_causal_student_warns(tiny_policy, tiny_text_encoder):
    """Chunk-wise rollouts with a KV cache are not static: configure_student says so, naming the key to turn off."""
    from genrl.methods import ODEInit

    student = ODEInit(generator=_spec(tiny_policy, tiny_text_encoder, EAGER))
    with pytest.warns(UserWarning, match=r"causal student.*generator.compile=false"):
        student.configure_model()
    eager = ODEInit(generator=_spec(tiny_policy, tiny_text_encoder))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        eager.configure_model()
