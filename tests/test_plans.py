"""Plans and the template planner (genrl/models/plans.py; TempAct spec section 4, invariant 7): the validator, the
parser's fallback (never an exception), uniform spans, the candidate set, reproducible batch-independent sampling,
and the planner-level KL / ratio at initialisation."""

from __future__ import annotations

import pytest
import torch

from genrl.flow.sequence_policy import gspo_loss, k3_kl
from genrl.models.plans import (
    FORMAT_FALLBACK,
    FORMAT_REPAIRED,
    FORMAT_VALID,
    Plan,
    Step,
    TemplatePlanner,
    parse_plan,
    plan_to_json,
    split_then,
    template_plan,
    uniform_spans,
    validate_steps,
)

TWO = "a red circle moves right, then moves up"


@pytest.mark.parametrize("steps,num_chunks,match", [
    ([Step("a", 1, 4)], 4, "starts at chunk 1"),
    ([Step("a", 0, 2), Step("b", 3, 4)], 4, "starts at chunk 3"),
    ([Step("a", 0, 2), Step("b", 1, 4)], 4, "starts at chunk 1"),
    ([Step("a", 0, 2), Step("b", 2, 2)], 2, "at least one chunk"),
    ([Step("a", 0, 3)], 4, r"cover chunks \[0, 3\)"),
    ([Step(" ", 0, 4)], 4, "empty text"),
    ([], 4, "at least one step"),
])
def test_validator_names_the_broken_rule(steps, num_chunks, match):
    with pytest.raises(ValueError, match=match):
        validate_steps(steps, num_chunks)


def test_validator_accepts_contiguous_covering_steps():
    validate_steps([Step("a", 0, 1), Step("b", 1, 4)], 4)


@pytest.mark.parametrize("n,c,spans", [(2, 4, [(0, 2), (2, 4)]), (3, 4, [(0, 2), (2, 3), (3, 4)]),
                                       (3, 6, [(0, 2), (2, 4), (4, 6)]), (1, 5, [(0, 5)])])
def test_uniform_spans(n, c, spans):
    assert uniform_spans(n, c) == spans


def test_uniform_spans_refuse_more_steps_than_chunks():
    with pytest.raises(ValueError, match="3 steps cannot each get a chunk of 2"):
        uniform_spans(3, 2)


@pytest.mark.parametrize("text", ["", "not json", "{", '{"steps": []}', '{"steps": [{"text": "x"}]}',
                                  '{"steps": "abc"}', '[1, 2]', '{"steps": [{"prompt": ""}]}',
                                  '{"steps": [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]}'])
def test_malformed_answers_fall_back_with_format_zero(text):
    plan = parse_plan(text, "the global prompt", num_chunks=2)
    assert plan.format_score == FORMAT_FALLBACK
    assert plan.steps == (Step("the global prompt", 0, 2),)
    assert plan.extra["fallback_reason"]


def test_valid_answers_parse_with_spans_or_uniform_ones():
    explicit = parse_plan('x {"steps": [{"prompt": "a", "start": 0, "end": 1}, {"prompt": "b", "start": 1, '
                          '"end": 4}]} y', "g", 4)
    assert explicit.format_score == FORMAT_VALID and explicit.steps == (Step("a", 0, 1), Step("b", 1, 4))
    implicit = parse_plan('{"steps": [{"prompt": "a"}, {"prompt": "b  c"}]}', "g", 4)
    assert implicit.format_score == FORMAT_VALID and implicit.steps == (Step("a", 0, 2), Step("b c", 2, 4))
    repaired = parse_plan('{"steps": [{"prompt": "a", "start": 0, "end": 3}, {"prompt": "b", "start": 2, '
                          '"end": 4}]}', "g", 4)
    assert repaired.format_score == FORMAT_REPAIRED and repaired.steps == (Step("a", 0, 2), Step("b", 2, 4))
    assert parse_plan(plan_to_json(explicit), "g", 4).steps == explicit.steps
    assert parse_plan(implicit.raw_text, "g", 4, max_steps=1).format_score == FORMAT_FALLBACK


def test_plan_lookup():
    plan = Plan("g", (Step("a", 0, 1), Step("b", 1, 4)))
    assert [plan.text_at(k) for k in range(4)] == ["a", "b", "b", "b"]
    assert plan.boundaries == [1] and plan.step_index(3) == 1
    with pytest.raises(IndexError, match="chunk 4"):
        plan.text_at(4)


def test_split_then():
    assert split_then("a cat jumps, then lands") == ["a cat jumps", "lands"]
    assert split_then("first a, then b, finally c") == ["a", "b", "c"]
    assert split_then("one step") == ["one step"]


def test_template_candidates():
    steps = ["r", "u", "l"]
    spans = {k: [(s.text, s.start, s.end) for s in template_plan(k, "g", steps, 6).steps]
             for k in ("ordered", "reversed", "merged", "front_loaded", "back_loaded")}
    assert spans["ordered"] == [("r", 0, 2), ("u", 2, 4), ("l", 4, 6)]
    assert spans["reversed"] == [("l", 0, 2), ("u", 2, 4), ("r", 4, 6)]
    assert spans["merged"] == [("g", 0, 6)]
    assert spans["front_loaded"] == [("r", 0, 3), ("u", 3, 5), ("l", 5, 6)]
    assert spans["back_loaded"] == [("r", 0, 1), ("u", 1, 3), ("l", 3, 6)]
    for k in spans:
        validate_steps(template_plan(k, "g", steps, 6).steps, 6)
    with pytest.raises(ValueError, match="unknown template candidate"):
        template_plan("shuffled", "g", steps, 6)


def test_template_sampling_is_reproducible_and_batch_independent():
    planner = TemplatePlanner(init_logits=[2.0, 0.0, -1.0, 0.5, 0.0])
    both = planner.sample([TWO, "a b"], 4, 6, seed=3, iteration=2, prompt_indices=[7, 9])
    alone = planner.sample(["a b"], 4, 6, seed=3, iteration=2, prompt_indices=[9])
    assert [p.candidate for p in both[1]] == [p.candidate for p in alone[0]]
    again = planner.sample([TWO], 4, 6, seed=3, iteration=2, prompt_indices=[7])
    assert [p.candidate for p in both[0]] == [p.candidate for p in again[0]]
    it2 = planner.sample([TWO] * 8, 4, 6, seed=3, iteration=2, prompt_indices=list(range(8)))
    it3 = planner.sample([TWO] * 8, 4, 6, seed=3, iteration=3, prompt_indices=list(range(8)))
    assert [p.candidate for r in it2 for p in r] != [p.candidate for r in it3 for p in r]  # iterations differ
    logp = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0, 0.5, 0.0]), 0)
    for p in both[0]:
        assert torch.allclose(p.behaviour_log_probs, logp[p.candidate].reshape(1))


def test_template_sampling_frequencies_follow_the_logits():
    planner = TemplatePlanner(init_logits=[1.0, 0.0, 0.0, 0.0, 0.0])
    picks = [p.candidate for row in planner.sample(["a, then b"] * 400, 4, 5, seed=0, iteration=0,
                                                   prompt_indices=list(range(400))) for p in row]
    freq = torch.bincount(torch.tensor(picks), minlength=5).float() / len(picks)
    expect = torch.softmax(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]), 0)
    assert torch.allclose(freq, expect, atol=0.02)


def test_template_planner_kl_and_ratio_at_initialisation_and_after_an_update():
    planner = TemplatePlanner()
    plans = [p for row in planner.sample([TWO], 4, 4, seed=0) for p in row]
    lp, mask = planner.token_log_probs(plans)
    with planner.reference():
        ref, _ = planner.token_log_probs(plans)
    assert torch.equal(k3_kl(lp, ref.detach(), mask), torch.zeros(4))
    old = torch.stack([p.behaviour_log_probs for p in plans])
    loss, stats = gspo_loss(lp, old, torch.tensor([1.0, -1.0, 0.5, 0.0]), mask)
    assert float(stats["ratio_mean"]) == 1.0
    loss.backward()
    with torch.no_grad():
        planner.logits.add_(torch.tensor([0.3, -0.2, 0.1, 0.0, 0.0]))
    lp2, _ = planner.token_log_probs(plans)
    with planner.reference():
        ref2, _ = planner.token_log_probs(plans)
    assert bool((k3_kl(lp2, ref2, mask) > 0).all())


def test_template_planner_refuses_bad_arguments():
    with pytest.raises(ValueError, match="distinct names"):
        TemplatePlanner(candidates=["ordered", "ordered"])
    with pytest.raises(ValueError, match="2 values for 5 candidates"):
        TemplatePlanner(init_logits=[0.0, 1.0])
    with pytest.raises(ValueError, match="sampled by this TemplatePlanner"):
        TemplatePlanner().token_log_probs([Plan("g", (Step("g", 0, 4),))])
