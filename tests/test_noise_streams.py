"""The noise-stream registry (genrl.noise.STREAMS, docs/testing.md, Noise-stream registry): every stream id range is
registered once, ranges of one seed domain are disjoint unless declared shared, and in a whole run (rollouts and
training iterations of every method that draws noise, on tiny models) no 63-bit noise key is drawn by two different
kinds of draw: two draws that should be independent never read the same numbers. A kind is the draw's call site
(its innermost frame outside genrl/noise.py and that frame's caller, comprehensions folded into their function),
or the registered stream whose ``sites`` lists the innermost frame (a reuse declared on purpose)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import genrl.noise as noise
from genrl.noise import STREAMS, NoiseStream, mix_seed, randn_per_sample, stream_id

ROOT = Path(__file__).resolve().parents[1]

# every registered range with the numbers recorded results were drawn with: a renumbering fails here
PINNED = {
    "rollout.flat": 0, "rollout.initial_by_key": 1, "rollout.ar_chunk": 1, "rollout.history_window": 1000,
    "rollout.transition_inner": 2000, "rollout.sde_random_steps": 98, "rollout.sde_window": 99,
    "rollout.branch_seed": 0xB7A, "rollout.tree_node": 0x7E2, "rollout.ar_exit_step": 0xE817,
    "pretrain.noise": 0, "pretrain.sigma": 1, "pretrain.dropout": 2, "phases.update_order": 11,
    "branch_grpo.order": 13, "dmd.noise": 21, "dmd.critic": 22, "ram.eps": 31, "ram.t": 32, "afd.sigma": 31,
    "afd.eps": 32, "afd.teacher": 33, "distill.fm_sigma": 34, "distill.fm_eps": 35, "tmd.x1": 31, "tmd.outer": 32,
    "tmd.inner_noise": 33, "tmd.inner_time": 3000, "tmd.dropout": 35, "tmd.dmd": 36, "tmd.critic": 37,
    "tmd.gan_real": 38, "preview.select": 41, "rwr.t": 41, "rwr.eps": 42, "distill.pair_sigma": 41,
    "distill.pair_teacher": 42, "distill.pair_student": 43, "dpo.t": 51, "dpo.eps": 52, "tempact.rollout": 51,
    "tempact.fork": 52, "tempact.val": 53, "dgpo.eps": 61, "dgpo.sigma": 62, "crd.eps": 71, "crd.sigma": 72,
    "data.shapes_render": 99, "data.ode_chunk_state": 0x0DE1, "data.online_render": 0x52454E44,
    "data.online_variant": 0x56415249, "data.teacher_pick": 0x54454143, "data.teacher_holdout": 0x484F4C44,
    "reward.image_policy": 7, "planner.plan": 0x9A7,
}


# ------------------------------------------------------------------------------------------ the static registry
def _overlap(a: NoiseStream, b: NoiseStream) -> bool:
    limit = 1 + max(s.first + (s.count or 1) for s in (a, b))
    return bool(set(a.ids(limit)) & set(b.ids(limit)))


def test_registry_numbers_are_pinned_and_entries_well_formed():
    assert {n: s.first for n, s in STREAMS.items()} == PINNED
    for name, s in STREAMS.items():
        assert s.name == name and s.first >= 0 and (s.count is None or s.count >= 1), s
        assert s.owner and s.what and s.domain in {"rollout", "method", "data", "reward", "planner"}, s
        assert (bool(s.shares) or bool(s.sites)) == bool(s.why), f"{name}: a share or a site needs its why"
        assert all(":" in site for site in s.sites), s.sites


def test_ranges_of_one_domain_are_disjoint_unless_declared_shared():
    """Every same-domain overlap is declared on both sides (with a reason), and every declaration is a real
    same-domain overlap (no stale declaration)."""
    undeclared, stale = [], []
    for a in STREAMS.values():
        for b in STREAMS.values():
            if a.name >= b.name or a.domain != b.domain:
                continue
            declared = (b.name in a.shares, a.name in b.shares)
            if _overlap(a, b) and declared != (True, True):
                undeclared.append((a.name, b.name, declared))
        for other in a.shares:
            b = STREAMS.get(other)
            if b is None or b.domain != a.domain or not _overlap(a, b):
                stale.append((a.name, other))
    assert not undeclared, f"overlapping ranges of one domain not declared shared on both sides: {undeclared}"
    assert not stale, f"declared shares that are no same-domain overlap: {stale}"


def test_stream_id_gives_the_id_and_rejects_unknown_names_and_k_outside_the_range():
    assert stream_id("dmd.noise") == 21 and stream_id("tmd.inner_time", 1) == 3001
    assert stream_id("rollout.ar_chunk", 20) == 21 and stream_id("rollout.ar_chunk", 5000) == 5001  # open-ended
    with pytest.raises(ValueError, match=r"unknown noise stream 'dmd\.nosie'.*register it"):
        stream_id("dmd.nosie")
    with pytest.raises(ValueError, match=r"'tmd.inner_time' has 2 id\(s\).*got k=2"):
        stream_id("tmd.inner_time", 2)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="got k="):
            stream_id("rollout.ar_chunk", bad)


def test_call_site_constants_are_registry_aliases():
    """The modules' stream constants are the registry's numbers (a refactor that changes no drawn value)."""
    import genrl.flow.tmd as flow_tmd
    import genrl.methods.afd as afd
    import genrl.methods.dmd as dmd
    import genrl.methods.tmd as tmd
    import genrl.rollout.branches as branches
    import genrl.rollout.history as history
    import genrl.rollout.transition as transition

    assert (dmd._STREAM_DMD_NOISE, dmd._STREAM_CRITIC_NOISE) == (21, 22)
    assert (afd._STREAM_SIGMA, afd._STREAM_EPS, afd._STREAM_TEACHER) == (31, 32, 33)
    assert (tmd._S_X1, tmd._S_OUTER, tmd._S_INNER_NOISE, tmd._S_DROPOUT, tmd._S_DMD) == (31, 32, 33, 35, 36)
    assert (history.WINDOW_STREAM, transition.OUTER_STREAM, transition.INNER_STREAM) == (1000, 0, 2000)
    assert (flow_tmd.INNER_TIME_STREAM, branches.BRANCH_STREAM) == (3000, 0xB7A)


# ------------------------------------------------------------------------------------------ the recorder
_COMPREHENSIONS = {"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "<lambda>"}
_NOISE_FILE = str(Path(noise.__file__).resolve())


@dataclass(frozen=True)
class Draw:
    """One drawn row: its 63-bit key, its call site (innermost frame outside genrl/noise.py, then its caller) and its
    address (seed part, sample index, step, stream)."""

    key: int
    site: tuple[str, ...]
    address: tuple[int, int, int, int]

    @property
    def kind(self) -> str:
        for s in STREAMS.values():
            if self.site[0] in s.sites:
                return f"stream {s.name}"
        return " <- ".join(self.site)


def _site() -> tuple[str, ...]:
    f, out = sys._getframe(2), []
    while f is not None and len(out) < 2:
        if f.f_code.co_name not in _COMPREHENSIONS and str(Path(f.f_code.co_filename).resolve()) != _NOISE_FILE:
            out.append(f"{f.f_globals.get('__name__')}:{f.f_code.co_name}")
        f = f.f_back
    return tuple(out)


def collisions(draws: list[Draw]) -> list[str]:
    """One line per key drawn by two different kinds: the two call sites and their addresses."""
    first: dict[int, Draw] = {}
    out = []
    for d in draws:
        seen = first.setdefault(d.key, d)
        if seen.kind != d.kind:
            out.append(f"key {d.key:#x}: {seen.kind} at (seed, index, step, stream) = {seen.address} and "
                       f"{d.kind} at {d.address}")
    return out


@pytest.fixture
def noise_log(monkeypatch) -> list[Draw]:
    """Records every per-sample draw (``randn_per_sample`` / ``rand_per_sample`` through ``genrl.noise._per_sample``,
    and ``sample_generator`` wherever a genrl module imported it) as :class:`Draw` rows."""
    log: list[Draw] = []
    per_sample, generator = noise._per_sample, noise.sample_generator

    def recording_per_sample(kind, shape, seed, indices, step, stream, *args):
        site, idx = _site(), [int(i) for i in indices]
        log.extend(Draw(k, site, (int(seed), i, int(step), int(stream)))
                   for i, k in zip(idx, noise._keys(seed, idx, step, stream)))
        return per_sample(kind, shape, seed, indices, step, stream, *args)

    def recording_generator(seed, index, step=0, stream=0, device="cpu"):
        log.append(Draw(mix_seed(seed, index, step, stream), _site(), (int(seed), int(index), int(step), int(stream))))
        return generator(seed, index, step, stream, device)

    import genrl.data  # noqa: F401  (every module that may import sample_generator)
    import genrl.methods  # noqa: F401

    monkeypatch.setattr(noise, "_per_sample", recording_per_sample)
    for name, module in list(sys.modules.items()):
        if (name == "genrl" or name.startswith("genrl.")) and getattr(module, "sample_generator", None) is generator:
            monkeypatch.setattr(module, "sample_generator", recording_generator)
    return log


@pytest.mark.call_sites
def test_the_check_names_both_call_sites_and_addresses_of_a_collision(noise_log):
    """The check can fail: one address drawn from two call sites is reported with both; a declared reuse is not."""

    def first_site():
        return randn_per_sample((3,), 5, [0, 1], step=2, stream=21)

    def second_site():
        return noise.sample_generator(5, 1, 2, 21)  # the patched entry point

    first_site(), second_site()
    found = collisions(noise_log)
    assert len(found) == 1 and "test_noise_streams:first_site" in found[0]
    assert "test_noise_streams:second_site" in found[0] and "(5, 1, 2, 21)" in found[0]
    noise_log.clear()
    first_site(), first_site()  # the same site twice: one kind
    assert collisions(noise_log) == [] and len(noise_log) == 4


# ------------------------------------------------------------------------------------------ whole runs
def _fit(*args: str) -> None:
    from genrl.cli import GenRLCLI

    GenRLCLI(args=["fit", "--trainer.enable_progress_bar=false", "--trainer.logger=false", *args], run=True)


def _cfg(*paths: str) -> list[str]:
    return [a for p in paths for a in ("--config", str(ROOT / p))]


def _policy(f) -> list[str]:
    return [f"--model.init_args.generator.pretrained={f('tiny_policy')}",
            f"--model.init_args.generator.text_encoder={f('tiny_text_encoder')}"]


def _shapes_base(method: str, *extra: str) -> Callable:
    def run(f):
        sys.path.insert(0, str(ROOT / "tests"))
        from shapes_cli_util import fit_on_shapes_base

        fit_on_shapes_base(method, f("tiny_policy"), f("tiny_text_encoder"),
                           ["--trainer.max_steps=2", "--trainer.logger=false", *extra])
    return run


def _tree(f):
    from genrl.rollout import RolloutConfig
    from genrl.rollout.tree import TreeConfig, regenerate_leaf, tree_rollout

    gen, shape = f("tiny_dit_generator"), (2, 3, 4, 4)
    config = RolloutConfig(num_steps=4, kernel="dance_grpo", noise_level=0.3, micro_batch_size=4)
    tree = TreeConfig(split_steps=[0, 2], branch_factor=2)
    prompts = ["a red circle", "a blue square"]
    ro = tree_rollout(gen, prompts, shape, seed=3, tree_indices=[5, 9], config=config, tree=tree)
    leaf = 3  # regenerated alone: the same noise as in the tree, declared in STREAMS["rollout.flat"].sites
    t = int(ro.tree[-1][leaf])
    regenerate_leaf(gen, prompts[t], shape, 3, int(ro.tree_indices[t]), int(ro.codes[-1][leaf]), config, tree)


def _flat(f):
    from genrl.rollout import RolloutConfig, rollout

    gen = f("tiny_dit_generator")
    config = RolloutConfig(num_steps=4, kernel="flow_grpo", sde_steps="all", micro_batch_size=4)
    rollout(gen, ["a red circle", "a blue square"], (2, 3, 4, 4), seed=3, indices=[0, 1], config=config)


def _history(f):
    from genrl.flow import HistoryGuidance
    from genrl.rollout import RolloutConfig
    from genrl.rollout.history import history_rollout

    hist = torch.randn(2, 2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    history_rollout(f("tiny_dit_generator"), ["a red circle", "a blue square"], (3, 8, 8), 12, seed=3, history=hist,
                    guidance=HistoryGuidance("vanilla", scale=2.0, stabilization=0.02),
                    config=RolloutConfig(num_steps=2, kernel="ode", micro_batch_size=4), window=4)


def _causal(f):
    """26 chunks: chunk 20 draws stream 21 (DMD's), chunk 25 stream 26."""
    from genrl.models.causal import CausalConfig, ChunkSchedule
    from genrl.models.generator import DiTGenerator
    from genrl.rollout.autoregressive import ar_rollout
    from genrl.testing.causal import HashEncoder, tiny_causal_dit

    gen = DiTGenerator(tiny_causal_dit(4, 8, 0), HashEncoder())
    sch = ChunkSchedule(causal=CausalConfig(2, local_window=4, sink_frames=2), timesteps=[1000, 500], shift=3.0)
    ar_rollout(gen, gen.encode_prompts(["a red circle", "a blue square"]), 26, (4, 4, 4), sch, seed=3)


def _tmd(f, stage: str, *extra: str) -> None:
    _fit(*_cfg(f"configs/tmd/shapes_{stage}.yaml"), *_policy(f), "--data.init_args.batch_size=2",
         "--data.init_args.val_size=2", "--data.init_args.num_workers=0", "--trainer.max_steps=2",
         "--trainer.val_check_interval=2", "--model.init_args.warmup_steps=0", *extra)


def _tmd_dmd(f):
    """Stage 2 (DMD) from a stage-1 export, which is its own run: only stage 2's draws are checked."""
    _tmd(f, "meanflow")
    f("noise_log").clear()
    export = "runs/tmd_shapes_meanflow/export"
    _tmd(f, "dmd", f"--model.init_args.generator.pretrained={export}", f"--model.init_args.head_init={export}",
         f"--model.init_args.teacher.pretrained={f('tiny_policy')}",
         "--model.init_args.critic_updates_per_generator_update=1")


RUNS: dict[str, Callable] = {
    "flat_sde_rollout": _flat,
    "tree_rollout_and_regenerated_leaf": _tree,
    "history_rollout": _history,
    "causal_rollout_26_chunks": _causal,
    "grpo": lambda f: _fit(*_cfg("configs/quickstart.yaml", "configs/tiny/grpo.yaml"), "--trainer.max_steps=2",
                           *_policy(f), "--model.init_args.generator.components={}"),
    "branch_grpo": lambda f: _fit(*_cfg("configs/branch_grpo/shapes.yaml"), "--trainer.max_steps=2",
                                  "--trainer.limit_val_batches=0", *_policy(f),
                                  "--model.init_args.rollout.num_steps=4", "--model.init_args.tree.split_steps=[0,2]",
                                  "--model.init_args.rollout.micro_batch_size=8",
                                  "--model.init_args.rewards=[{name: colorfulness}]"),
    # 22 chunks: the student's chunk 20 draws stream 21, the DMD noising's, under another seed
    "dmd_22_chunks": lambda f: _fit(*_cfg("configs/dmd/shapes.yaml", "configs/tiny/dmd.yaml"), "--trainer.max_steps=2",
                                    "--trainer.val_check_interval=2", "--trainer.callbacks=[]",
                                    "--model.init_args.num_frames=44", *_policy(f),
                                    f"--model.init_args.teacher.pretrained={f('tiny_policy')}"),
    "tmd_meanflow": lambda f: _tmd(f, "meanflow", "--trainer.callbacks=[]"),
    "tmd_dmd": _tmd_dmd,
    "afd": lambda f: _fit(*_cfg("configs/afd/shapes.yaml", "configs/tiny/afd.yaml"), "--trainer.max_steps=2",
                          *_policy(f), f"--data.init_args.folder={f('shapes_teacher')}"),
    "ram": lambda f: _fit(*_cfg("configs/ram/shapes.yaml", "configs/tiny/ram.yaml"), "--trainer.max_steps=2",
                          *f("tiny_policy_args")),
    "dpo": _shapes_base("configs/dpo/shapes.yaml", "--model.init_args.rollout.num_steps=3",
                        "--model.init_args.num_draws=2"),
    "crd": _shapes_base("configs/crd/shapes.yaml", "--model.init_args.rollout.num_steps=4",
                        "--model.init_args.num_timesteps=2", "--model.init_args.micro_batch_size=4"),
    "pretrain": lambda f: _fit(*_cfg("configs/pretrain/shapes.yaml", "configs/tiny/pretrain.yaml"),
                               "--trainer.max_steps=2",
                               f"--model.init_args.generator.text_encoder={f('tiny_text_encoder')}"),
    "tempact": lambda f: _fit(*_cfg("configs/tempact/shapes_executor.yaml", "configs/tiny/tempact.yaml"),
                              "--trainer.max_steps=2", *_policy(f)),
}


@pytest.mark.call_sites
@pytest.mark.parametrize("run", list(RUNS))
def test_no_noise_key_is_drawn_by_two_kinds_of_draw_in_a_whole_run(run, noise_log, request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    RUNS[run](request.getfixturevalue)
    assert noise_log, f"{run} drew no recorded noise (the recorder missed its entry point)"
    found = collisions(noise_log)
    assert not found, f"{run}: {len(found)} noise keys drawn by two kinds of draw:\n" + "\n".join(found[:10])
