"""Shared test fixtures: offline, two threads, tiny models built from config values (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch


def _lightning_init_args_under_mutmut() -> None:
    """mutmut runs a mutated method through a trampoline that calls a copy of it named ``xǁClsǁ__init____mutmut_orig``
    (or ``..._N``); Lightning's ``save_hyperparameters`` collects the constructor's arguments only from a frame named
    ``__init__``, so every method's hparams would come back empty. Under mutmut (``MUTANT_UNDER_TEST`` set) this
    teaches Lightning's frame reader those names; a normal run never patches anything."""
    import inspect
    import re

    from lightning.pytorch.utilities import parsing

    init_name = re.compile(r"(^__init__$)|(ǁ__init____mutmut_(orig|\d+)$)")

    def get_init_args(frame):
        _, _, _, local_vars = inspect.getargvalues(frame)
        if "__class__" not in local_vars or not init_name.search(frame.f_code.co_name):
            return None, {}
        cls = local_vars["__class__"]
        params = inspect.signature(cls.__init__).parameters
        self_var, args_var, kwargs_var = parsing.parse_class_init_keys(cls)
        skip = (*[n for n in (self_var, args_var, kwargs_var) if n], "__class__", "frame", "frame_args")
        args = {k: local_vars[k] for k in params if k in local_vars}
        if kwargs_var:
            args.update(args.get(kwargs_var, {}))
        return local_vars.get(self_var), {k: v for k, v in args.items() if k not in skip}

    parsing._get_init_args = get_init_args


if "MUTANT_UNDER_TEST" in os.environ:
    _lightning_init_args_under_mutmut()

torch.set_num_threads(int(os.environ.get("GENRL_TEST_THREADS", "2")))


TINY_WORDS = (
    "a an the red green blue yellow magenta cyan white orange circle square triangle moving moves then "
    "left right up down still staying slowly quickly , ."
).split()


def build_tiny_text_encoder(folder, hidden_size: int = 16) -> str:
    """Save a tiny random BERT + a word-level tokenizer to ``folder`` (loadable by TextEncoder.from_pretrained)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {w: i for i, w in enumerate(specials + TINY_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        model_max_length=32,
    )
    torch.manual_seed(0)
    model = BertModel(
        BertConfig(
            vocab_size=len(vocab), hidden_size=hidden_size, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64,
        )
    )
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_text_encoder(tmp_path_factory) -> str:
    return build_tiny_text_encoder(tmp_path_factory.mktemp("tiny_bert"))


TINY_DIT = dict(hidden_size=32, num_layers=2, num_attention_heads=2, text_dim=16, patch_size=[2, 2, 2])


@pytest.fixture(scope="module")
def tiny_dit_generator(tiny_text_encoder):
    """A 2-layer VideoDiT (hidden 32, 2 heads) with N(0, 0.1) weights (seed 0) and the tiny text encoder, in eval mode;
    one per test module."""
    from genrl.models import DiTGenerator, TextEncoder, VideoDiT

    torch.manual_seed(0)
    dit = VideoDiT(hidden_size=32, num_layers=2, num_attention_heads=2, text_dim=16)
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0.0, 0.1)
    return DiTGenerator(dit.eval(), TextEncoder.from_pretrained(tiny_text_encoder))


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> str:
    """A tiny VideoDiT with random (not zero-initialised) weights, saved with save_pretrained."""
    from genrl.models import VideoDiT

    torch.manual_seed(0)
    dit = VideoDiT(**TINY_DIT)
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0.0, 0.05)
    folder = tmp_path_factory.mktemp("tiny_policy")
    dit.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def shapes_teacher(tmp_path_factory, tiny_policy, tiny_text_encoder) -> str:
    """A teacher-video folder (pipelines/generate.py's manifest and mp4s) of the tiny random policy: 6 shapes:train
    prompts, 2 Euler steps; AFD's data in the tests."""
    from pipelines.generate import main as generate

    out = tmp_path_factory.mktemp("teacher") / "shapes"
    generate(["--model", tiny_policy, "--text-encoder", tiny_text_encoder, "--prompts", "shapes:train", "--limit", "6",
              "--steps", "2", "--out", str(out), "--device", "cpu"])
    return str(out)


@pytest.fixture
def tiny_causal(tiny_policy, tiny_text_encoder) -> list[str]:
    """CLI overrides that make configs/dmd/shapes.yaml's student and teacher the tiny random policy."""
    return [f"--model.init_args.generator.pretrained={tiny_policy}",
            f"--model.init_args.teacher.pretrained={tiny_policy}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}"]


@pytest.fixture
def tiny_policy_args(tiny_policy, tiny_text_encoder) -> list[str]:
    """CLI overrides that make a shapes-world RL config's policy the tiny random policy (no diffusers components)."""
    return [f"--model.init_args.generator.pretrained={tiny_policy}", "--model.init_args.generator.components={}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}"]


def pytest_collection_modifyitems(config, items):
    """Under mutation testing (mutmut sets MUTANT_UNDER_TEST to a mutant's name), run the covering tests fastest
    first, by the durations mutmut recorded (``mutants/mutmut-stats.json``): pytest stops at the first failure, so a
    mutant a unit test kills no longer waits for the end-to-end tests that also cover it. A normal run is unchanged."""
    if "MUTANT_UNDER_TEST" in os.environ:  # mutmut's stats run and every mutant: its trampolines break graphs and
        def incompatible(item) -> bool:  # rename / add stack frames
            return bool(item.get_closest_marker("compile_count") or item.get_closest_marker("call_sites"))

        dropped = [item for item in items if incompatible(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if not incompatible(item)]
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if "__mutmut_" not in mutant:
        return
    import json
    from pathlib import Path

    stats = Path("mutmut-stats.json")
    if not stats.exists():
        return
    durations = json.loads(stats.read_text()).get("duration_by_test", {})
    # Tests slower than GENRL_MUTATION_MAX_TEST_S seconds in the stats run (default 2: the ~30 CLI / trainer
    # end-to-end tests, two thirds of the suite's time) do not run under a mutant: a surviving mutant would wait
    # for all of them. A mutant only they cover is reported as "no tests" (docs/testing.md, Mutation testing).
    cap = float(os.environ.get("GENRL_MUTATION_MAX_TEST_S", "2"))
    slow = [item for item in items if durations.get(item.nodeid, 0.0) > cap]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if durations.get(item.nodeid, 0.0) <= cap]
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))


# ------------------------------------------------------------ process groups for the in-process strategy tests
@pytest.fixture
def one_process_mesh():
    """A real one-process gloo group and its 1-d CPU mesh (FSDP2 runs for real on it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_group():
    """``make(rank, world)``: this process plays ``rank`` of ``world`` in torch's fake process group (collectives are
    no-ops; meshes, shapes and rank-dependent decisions are real)."""
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

    def make(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=fake_pg.FakeStore())

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()
