"""genrl.models.planner.LMPlanner on a tiny random LM built in code (word-level tokenizer, 2-layer Llama)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genrl.flow import gspo_loss, k3_kl
from genrl.models.planner import DEFAULT_INSTRUCTION, LMPlanner, build_tiny_planner_lm, planner_words
from genrl.models.plans import FORMAT_FALLBACK, FORMAT_VALID, Plan, parse_plan

ASSET = Path(__file__).resolve().parents[1] / "assets" / "shapes-planner"
PROMPTS = ["a red circle moves right, then moves up", "a blue square moving left", "a green triangle staying still"]
LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> str:
    words = planner_words([DEFAULT_INSTRUCTION, "user assistant chunks prompt steps start end 0 1 2 3 4 5 6",
                           *PROMPTS, "moving moves staying stays"])
    return build_tiny_planner_lm(words, tmp_path_factory.mktemp("tiny_planner_lm"), hidden_size=64, num_layers=2,
                                 num_heads=4)


@pytest.fixture(scope="module")
def planner(tiny_lm) -> LMPlanner:
    torch.manual_seed(0)
    return LMPlanner(tiny_lm, lora=LORA, max_new_tokens=12)


def _keys(plans):
    return [(p.token_ids.tolist(), p.raw_text, p.key()) for p in plans]


def test_sample_shapes_and_masks(planner):
    out = planner.sample(PROMPTS[:2], num_chunks=4, k=3, seed=0)
    assert len(out) == 2 and all(len(row) == 3 for row in out)
    for i, row in enumerate(out):
        prompt_len = len(planner.encode_prompt(PROMPTS[i], 4))
        for j, p in enumerate(row):
            assert isinstance(p, Plan) and p.global_prompt == PROMPTS[i] and p.num_chunks == 4
            L = p.token_ids.numel()
            assert p.token_ids.dtype == torch.int64 and p.answer_mask.dtype == torch.bool
            assert p.behaviour_log_probs.dtype == torch.float32
            assert p.answer_mask.shape == p.behaviour_log_probs.shape == (L,)
            assert 1 <= L - prompt_len <= 12
            assert not p.answer_mask[:prompt_len].any() and p.answer_mask[prompt_len:].all()
            assert torch.all(p.behaviour_log_probs[:prompt_len] == 0)
            assert torch.all(p.behaviour_log_probs[prompt_len:] <= 0)
            assert p.extra["prompt_index"] == i and p.extra["sample"] == j


def test_same_seed_same_plans_and_batch_independent(planner):
    a = planner.sample(PROMPTS, num_chunks=4, k=2, seed=5, iteration=3)
    b = planner.sample(PROMPTS, num_chunks=4, k=2, seed=5, iteration=3)
    assert [_keys(r) for r in a] == [_keys(r) for r in b]
    alone = planner.sample([PROMPTS[1]], num_chunks=4, k=2, seed=5, iteration=3, prompt_indices=[1])
    assert _keys(alone[0]) == _keys(a[1])
    other = planner.sample(PROMPTS, num_chunks=4, k=2, seed=5, iteration=4)
    assert [_keys(r) for r in other] != [_keys(r) for r in a]
    # the two samples of a prompt differ (own generators), and so do the same prompt's at two indices
    assert _keys(a[0])[0] != _keys(a[0])[1]
    dup = planner.sample([PROMPTS[0], PROMPTS[0]], num_chunks=4, k=2, seed=5, iteration=3)
    assert _keys(dup[0]) == _keys(a[0]) and _keys(dup[1]) != _keys(dup[0])


def test_truncated_answer_falls_back_with_format_zero(tiny_lm):
    p = LMPlanner(tiny_lm, max_new_tokens=2)
    plans = p.sample(PROMPTS[:1], num_chunks=4, k=2, seed=0)[0]
    for plan in plans:
        assert plan.format_score == FORMAT_FALLBACK
        assert plan.steps[0].text == PROMPTS[0] and plan.num_chunks == 4
        assert int(plan.answer_mask.sum()) == 2


def test_on_policy_log_probs_equal_behaviour(planner):
    plans = [p for row in planner.sample(PROMPTS, num_chunks=6, k=2, seed=1) for p in row]
    lp, mask = planner.token_log_probs(plans)
    assert lp.requires_grad and lp.shape == mask.shape and lp.shape[0] == len(plans)
    for i, p in enumerate(plans):
        m = p.answer_mask
        assert torch.equal(mask[i, : m.numel()], m) and not mask[i, m.numel():].any()
        torch.testing.assert_close(lp[i, : m.numel()][m].detach(), p.behaviour_log_probs[m], rtol=0, atol=1e-5)


def test_top_p_and_greedy_sampling(tiny_lm):
    greedy = LMPlanner(tiny_lm, temperature=0.0, max_new_tokens=6)
    a = greedy.sample(PROMPTS[:1], num_chunks=4, k=2, seed=0)[0]
    b = greedy.sample(PROMPTS[:1], num_chunks=4, k=1, seed=9)[0]
    assert _keys(a)[0] == _keys(a)[1] == _keys(b)[0]
    nucleus = LMPlanner(tiny_lm, top_p=1e-6, max_new_tokens=6)  # keeps only the most likely token: greedy
    assert _keys(nucleus.sample(PROMPTS[:1], num_chunks=4, k=1, seed=3)[0]) == _keys(b)
    # behaviour log-probs stay those of the temperature-1 full softmax
    lp, _ = greedy.token_log_probs(a[:1])
    m = a[0].answer_mask
    torch.testing.assert_close(lp[0][m].detach(), a[0].behaviour_log_probs[m], rtol=0, atol=1e-5)


def test_reference_kl_zero_at_init_positive_after_perturbation(tiny_lm):
    p = LMPlanner(tiny_lm, lora=LORA, max_new_tokens=10)
    plans = [q for row in p.sample(PROMPTS, num_chunks=4, k=2, seed=2) for q in row]
    lp, mask = p.token_log_probs(plans)
    with p.reference():
        ref, _ = p.token_log_probs(plans)
    assert not ref.requires_grad
    assert torch.all(k3_kl(lp, ref, mask) == 0)
    with torch.no_grad():
        for name, w in p.lm.named_parameters():
            if "lora_B" in name:
                w.add_(0.05 * torch.randn_like(w))
    lp2, _ = p.token_log_probs(plans)
    with p.reference():
        ref2, _ = p.token_log_probs(plans)
    torch.testing.assert_close(ref2, ref, rtol=0, atol=1e-6)  # the reference ignores the adapter
    assert torch.all(k3_kl(lp2, ref2, mask) > 0)


def test_reference_without_lora_is_frozen_copy(tiny_lm):
    p = LMPlanner(tiny_lm, max_new_tokens=6)
    assert all(q.requires_grad for q in p.lm.parameters())
    assert not any(k.startswith("_ref") for k in p.state_dict())
    plans = p.sample(PROMPTS[:1], num_chunks=4, k=1, seed=0)[0]
    with torch.no_grad():
        next(iter(p.lm.parameters())).add_(0.1)
    lp, mask = p.token_log_probs(plans)
    with p.reference():
        ref, _ = p.token_log_probs(plans)
    torch.testing.assert_close(ref[mask], plans[0].behaviour_log_probs[plans[0].answer_mask], rtol=0, atol=1e-5)
    assert float(k3_kl(lp, ref, mask).detach()) > 0


def test_gspo_step_raises_sequence_log_prob(tiny_lm):
    p = LMPlanner(tiny_lm, lora=LORA, max_new_tokens=10)
    plan = p.sample(PROMPTS[:1], num_chunks=4, k=1, seed=4)[0][0]
    params = [q for q in p.parameters() if q.requires_grad]
    assert params and all("lora" in n for n, q in p.named_parameters() if q.requires_grad)
    opt = torch.optim.SGD(params, lr=0.5)
    lp, mask = p.token_log_probs([plan])
    before = float((lp * mask).sum())
    loss, stats = gspo_loss(lp, plan.behaviour_log_probs[None].to(lp.dtype), torch.tensor([1.0]), mask)
    assert abs(float(stats["ratio_mean"]) - 1) < 1e-4
    loss.backward()
    opt.step()
    with torch.no_grad():
        lp2, _ = p.token_log_probs([plan])
    assert float((lp2 * mask).sum()) > before


def test_state_dict_holds_adapter_and_round_trips(tiny_lm):
    p = LMPlanner(tiny_lm, lora=LORA, max_new_tokens=8)
    with torch.no_grad():
        for name, w in p.lm.named_parameters():
            if "lora_B" in name:
                w.add_(0.05 * torch.randn_like(w))
    sd = p.state_dict()
    assert any("lora_A" in k for k in sd) and any("lora_B" in k for k in sd)
    plans = p.sample(PROMPTS[:2], num_chunks=4, k=1, seed=0)
    flat = [q for row in plans for q in row]
    with torch.no_grad():
        lp, _ = p.token_log_probs(flat)
    fresh = LMPlanner(tiny_lm, lora=LORA, max_new_tokens=8)
    fresh.load_state_dict(sd)
    with torch.no_grad():
        lp2, _ = fresh.token_log_probs(flat)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-6)
    assert [_keys(r) for r in fresh.sample(PROMPTS[:2], num_chunks=4, k=1, seed=0)] == [_keys(r) for r in plans]


def test_think_block_is_not_the_answer(planner):
    tok = planner.tokenizer
    think = tok("a red circle", add_special_tokens=False)["input_ids"] + [tok.unk_token_id]
    # the word-level tokenizer has no </think>: emulate it by decoding through a patched decode
    answer = tok('{"steps": [{"prompt": "a red circle moving right"}]}', add_special_tokens=False)["input_ids"]
    orig = tok.decode

    def decode(ids, skip_special_tokens=False, **kw):
        ids = list(ids)
        text = orig(ids, skip_special_tokens=skip_special_tokens, **kw)
        return text.replace("<unk>", "</think>") if not skip_special_tokens else text

    planner.tokenizer.decode = decode
    try:
        prompt_ids = planner.encode_prompt(PROMPTS[0], 4)
        plan = planner._plan(PROMPTS[0], 4, prompt_ids, think + answer, [-1.0] * len(think + answer), {})
    finally:
        del planner.tokenizer.decode
    assert plan.format_score == FORMAT_VALID and plan.steps[0].text == "a red circle moving right"
    start = len(prompt_ids) + len(think)
    assert plan.extra["answer_start"] == start
    assert not plan.answer_mask[:start].any() and plan.answer_mask[start:].all()
    assert torch.all(plan.behaviour_log_probs[:start] == 0)


def test_missing_folder_or_file_raises_naming_path(tmp_path, tiny_lm):
    missing = tmp_path / "no_such_planner"
    with pytest.raises(FileNotFoundError, match="no_such_planner"):
        LMPlanner(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LMPlanner(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="top_p"):
        LMPlanner(tiny_lm, top_p=0.0)
    with pytest.raises(ValueError, match="token_ids"):
        LMPlanner(tiny_lm).token_log_probs([parse_plan("{}", "x", 2)])


def test_shipped_shapes_planner_greedy_plan():
    if not (ASSET / "config.json").is_file():
        pytest.skip(f"the shipped planner {ASSET} is absent (make it with pipelines/train_planner.py)")
    from genrl.data.shapes import ShapesWorldConfig, heldout_combos

    c, s, d = heldout_combos(ShapesWorldConfig())[0]
    second = "up" if d != "up" else "left"
    text = f"a {c} {s} " + ("stays still" if d == "still" else f"moves {d}") + f", then moves {second}"
    planner = LMPlanner(str(ASSET), temperature=0.0)
    (plan,) = planner.sample([text], num_chunks=4, k=1, seed=0)[0]
    assert plan.format_score == FORMAT_VALID, plan.raw_text
    assert len(plan.steps) == 2 and plan.num_chunks == 4
