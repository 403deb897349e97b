"""Train the shipped shapes-world planner: a tiny causal LM supervised to write span-aware plans (TempAct's planner).

The LM (:func:`genrl.models.planner.build_tiny_planner_lm`: word-level tokenizer, Llama architecture) reads the
planner prompt of :class:`genrl.models.planner.LMPlanner` (default instruction, chunk count, global caption) and is
trained with cross-entropy on the answer tokens only (the JSON of :func:`genrl.models.plans.plan_to_json`, then EOS).
The target of a caption is its ground-truth plan: the world's single-step caption of each motion segment
(``genrl.data.shapes.step_captions``) over uniform spans (:func:`genrl.models.plans.uniform_spans`), for 4 or 6
chunks. Captions have 1, 2 or 3 segments (drawn with equal probability), built from the default world's colors,
shapes and directions (consecutive directions differ; single-step captions with and without a speed adverb).

Held out: every caption with a segment whose (color, shape, direction) combination is held out by the world
(``genrl.data.shapes.heldout_combos``) is kept out of training; the evaluation draws 200 captions whose first segment
is held out (the world's definition of a held-out caption), samples one plan each with LMPlanner at temperature 1.0
(top-p 1) and greedily, and reports the fraction with format score 1 and the fraction whose steps (texts and spans)
equal the ground truth. The output folder (config.json, model.safetensors, tokenizer files, README.md with the
measured numbers) loads with ``LMPlanner(out)``.

Example (the shipped asset; about 7 minutes on one CPU thread)::

    python pipelines/train_planner.py --out assets/shapes-planner --steps 2000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch

__all__ = ["local_step_captions", "ground_truth_steps", "train_captions", "heldout_captions", "evaluate", "main"]

NUM_CHUNKS = (4, 6)


def local_step_captions(text: str) -> list[str]:
    """A caption's single-step captions without the world's parser: split on ", then " and give each segment the
    subject ("a red circle") and the world's single-step form ("moving up" / "staying still"). Used only when
    ``genrl.data.shapes.step_captions`` is missing."""
    parts = text.split(", then ")
    if len(parts) == 1:
        return [text]
    words = parts[0].split()
    subject, first = " ".join(words[:3]), " ".join(words[3:])
    segs = [first] + parts[1:]
    return [f"{subject} staying still" if s == "stays still" else f"{subject} moving {s.split()[-1]}" for s in segs]


def _step_captions():
    try:
        from genrl.data.shapes import step_captions
    except ImportError:  # an older shapes world: the local split gives the same captions
        return local_step_captions
    return step_captions


def ground_truth_steps(text: str, num_chunks: int):
    """The ground-truth plan steps of a caption over ``num_chunks`` chunks (uniform spans)."""
    from genrl.models.plans import Step, uniform_spans

    texts = _step_captions()(text)
    return tuple(Step(t, a, b) for t, (a, b) in zip(texts, uniform_spans(len(texts), num_chunks)))


def _subject(color: str, shape: str) -> str:
    return f"{'an' if color[:1] in 'aeiou' else 'a'} {color} {shape}"


def _caption(color: str, shape: str, dirs: tuple[str, ...], adverb: str | None = None) -> str:
    subject = _subject(color, shape)
    if len(dirs) == 1:
        if dirs[0] == "still":
            return f"{subject} staying still"
        return f"{subject} moving {dirs[0]}" + (f" {adverb}" if adverb else "")
    segs = ["stays still" if d == "still" else f"moves {d}" for d in dirs]
    return f"{subject} " + ", then ".join(segs)


def _paths(directions: list[str], n: int) -> list[tuple[str, ...]]:
    """Every sequence of ``n`` directions whose consecutive entries differ."""
    out: list[tuple[str, ...]] = [(d,) for d in directions]
    for _ in range(n - 1):
        out = [p + (d,) for p in out for d in directions if d != p[-1]]
    return out


def train_captions(world) -> dict[int, list[str]]:
    """Captions with 1, 2 and 3 segments none of whose (color, shape, direction) combinations is held out."""
    from genrl.data.shapes import SPEED_ADVERBS, heldout_combos

    held = set(heldout_combos(world))
    adverbs = [None] + [SPEED_ADVERBS[s] for s in world.speeds]
    out: dict[int, list[str]] = {1: [], 2: [], 3: []}
    for c in world.colors:
        for s in world.shapes:
            for n in (1, 2, 3):
                for dirs in _paths(world.directions, n):
                    if any((c, s, d) in held for d in dirs):
                        continue
                    if n == 1 and dirs[0] != "still":
                        out[1] += [_caption(c, s, dirs, a) for a in adverbs]
                    else:
                        out[n].append(_caption(c, s, dirs))
    return out


def heldout_captions(world, n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` (caption, num_chunks) pairs whose first segment's combination is held out: 1, 2 or 3 segments with
    equal probability, later directions uniform among those that differ from the previous one, chunk counts
    alternating 4 and 6; deterministic in ``seed``."""
    from genrl.data.shapes import SPEED_ADVERBS, heldout_combos

    rng = random.Random(seed)
    held = heldout_combos(world)
    adverbs = [None] + [SPEED_ADVERBS[s] for s in world.speeds]
    out = []
    for i in range(n):
        c, s, d = held[rng.randrange(len(held))]
        dirs = [d]
        for _ in range(rng.randrange(3)):
            dirs.append(rng.choice([x for x in world.directions if x != dirs[-1]]))
        adverb = rng.choice(adverbs) if len(dirs) == 1 and d != "still" else None
        out.append((_caption(c, s, tuple(dirs), adverb), NUM_CHUNKS[i % 2]))
    return out


def vocabulary() -> list[str]:
    """Every word the planner's prompts and answers can hold (instruction, template, JSON keys, numbers, the
    world's full vocabulary including the opt-in colors and shapes)."""
    from genrl.data.shapes import KNOWN_DIRECTIONS, KNOWN_SHAPES, PALETTE, SPEED_ADVERBS
    from genrl.models.planner import DEFAULT_INSTRUCTION, planner_words

    texts = [DEFAULT_INSTRUCTION, "user assistant system chunks prompt plan steps start end",
             " ".join(str(i) for i in range(33)), "a an moving moves staying stays still then",
             " ".join(PALETTE), " ".join(KNOWN_SHAPES), " ".join(KNOWN_DIRECTIONS), " ".join(SPEED_ADVERBS.values())]
    return planner_words(texts)


def _example(planner, caption: str, num_chunks: int) -> tuple[list[int], int]:
    """(token ids of prompt + answer JSON + EOS, prompt length)."""
    from genrl.models.plans import plan_to_json

    prompt = planner.encode_prompt(caption, num_chunks)
    answer = planner.tokenizer(plan_to_json(ground_truth_steps(caption, num_chunks)), add_special_tokens=False)
    return prompt + list(answer["input_ids"]) + [planner.eos_token_ids[0]], len(prompt)


def _batch(planner, examples: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, length = len(examples), max(len(ids) for ids, _ in examples)
    ids = torch.full((n, length), planner.pad_token_id, dtype=torch.long)
    attn = torch.zeros(n, length, dtype=torch.long)
    labels = torch.full((n, length), -100, dtype=torch.long)
    for i, (seq, p) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, p: len(seq)] = torch.tensor(seq[p:])
    return ids, attn, labels


def evaluate(planner, items: list[tuple[str, int]], seed: int) -> dict[str, float]:
    """Sample one plan per (caption, num_chunks) with ``planner``'s decoding settings; the fractions with format
    score 1 and with steps equal to the ground truth."""
    from genrl.models.plans import FORMAT_VALID

    valid = exact = 0
    for chunks in sorted({c for _, c in items}):
        idx = [i for i, (_, c) in enumerate(items) if c == chunks]
        plans = planner.sample([items[i][0] for i in idx], chunks, k=1, seed=seed, prompt_indices=idx)
        for i, (plan,) in zip(idx, plans):
            valid += plan.format_score == FORMAT_VALID
            exact += plan.format_score == FORMAT_VALID and plan.steps == ground_truth_steps(items[i][0], chunks)
    return {"format_valid": valid / len(items), "exact": exact / len(items)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="assets/shapes-planner", help="output folder (replaced)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="init, data and evaluation seed")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-3, help="peak AdamW learning rate (linear warm-up, cosine decay)")
    p.add_argument("--hidden", type=int, default=96, help="LM width")
    p.add_argument("--layers", type=int, default=3, help="LM depth")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--eval-num", type=int, default=200, help="held-out captions in the evaluation")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p


def _readme(args, n_params: int, vocab_size: int, counts: dict, train_s: float, stats: dict, size: int,
            command: str) -> str:
    t1, g = stats["temperature_1"], stats["greedy"]
    return f"""# shapes-planner: genrl's language-model planner for the shapes world

A tiny causal LM that splits a shapes-world caption into TempAct's span-aware step prompts: given the planner
prompt of `genrl.models.planner.LMPlanner` (its default instruction, the chunk count and the caption) it writes the
plan JSON of `genrl.models.plans` (`{{"steps": [{{"prompt": ..., "start": ..., "end": ...}}]}}`, spans in chunks,
end exclusive). Load it with `LMPlanner("assets/shapes-planner")` (add `lora=...` to train an adapter on it).

## Architecture

- `LlamaForCausalLM` (transformers): width {args.hidden}, {args.layers} layers, {args.heads} heads, SwiGLU MLP
  width {2 * args.hidden}, RMSNorm, rotary positions, tied input / output embeddings; {n_params:,} parameters,
  float32 (`model.safetensors`); {size / 1e6:.2f} MB with the tokenizer and config files.
- Tokenizer: word level (`tokenizers` WordLevel wrapped as `PreTrainedTokenizerFast`), {vocab_size} entries: the
  special tokens `<pad> <bos> <eos> <unk>`, space, newline, the JSON marks `{{ }} [ ] : , "` and every word of the
  instruction, the template and the world (all colors of `genrl.data.shapes.PALETTE`, all shapes, directions,
  speed adverbs, numbers 0-32), each with and without a leading space; decoding concatenates the pieces. Chat
  template: `<bos>user\\n<message>\\n<bos>assistant\\n`. Built by `genrl.models.planner.build_tiny_planner_lm`.

## Training

```
{command}
```

Cross-entropy on the answer tokens only (plan JSON + EOS), AdamW (lr {args.lr:g}, linear warm-up over 5% of the
steps, cosine decay, weight decay 0.01, gradient clip 1.0), batch {args.batch_size}, {args.steps} steps, seed
{args.seed}, {args.threads} CPU thread(s): {train_s / 60:.1f} minutes of wall time (on a 2-core machine shared
with other jobs). Each example draws 1, 2 or 3 segments with equal probability, then a caption of the default world
(6 colors, 3 shapes, 5 directions; consecutive directions differ; single-step captions without a speed, "slowly" or
"quickly"), then 4 or 6 chunks. The target is the ground-truth plan: the single-step caption of each segment
(`genrl.data.shapes.step_captions`, e.g. "a red circle moving up") over uniform spans
(`genrl.models.plans.uniform_spans`). Captions with any segment whose (color, shape, direction) combination is
held out by the world are never trained on: {counts[1]} one-step, {counts[2]} two-step and {counts[3]} three-step
training captions.

## Measured on held-out captions

{stats['num']} captions whose first segment's (color, shape, direction) combination is held out (the world's
held-out split; 1, 2 or 3 segments with equal probability, chunk counts alternating 4 and 6; evaluation seed
{args.seed}), one plan each sampled by `LMPlanner` (max_new_tokens 96), printed by the command above:

| decoding | format score 1 | steps equal to the ground truth |
|---|---|---|
| temperature 1.0, top-p 1.0 | {t1['format_valid']:.3f} | {t1['exact']:.3f} |
| greedy (temperature 0) | {g['format_valid']:.3f} | {g['exact']:.3f} |

"Steps equal to the ground truth" compares every step's text and span with the world's plan (`step_captions` over
uniform spans). Held-out combinations were never seen in training, neither in captions nor in step texts: the
planner copies the caption's color, shape and directions into its steps rather than recalling known combinations.
"""


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.eval_num < 1:
        raise SystemExit("--steps, --batch-size and --eval-num must be >= 1")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rich import progress as rp

    from genrl.data.shapes import ShapesWorldConfig
    from genrl.models.planner import LMPlanner, build_tiny_planner_lm

    command = "python pipelines/train_planner.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    world = ShapesWorldConfig()
    captions = train_captions(world)
    build_tiny_planner_lm(vocabulary(), tmp, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                          seed=args.seed)
    planner = LMPlanner(str(tmp))
    lm = planner.lm
    lm.train()
    n_params = sum(p.numel() for p in lm.parameters())
    opt = torch.optim.AdamW(lm.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    rng = random.Random(args.seed)
    cache: dict = {}
    t0 = time.perf_counter()
    ema = None
    columns = (rp.TextColumn("planner"), rp.BarColumn(), rp.MofNCompleteColumn(),
               rp.TextColumn("loss {task.fields[loss]}"), rp.TimeElapsedColumn(), rp.TimeRemainingColumn())
    with rp.Progress(*columns) as bar:
        task = bar.add_task("train", total=args.steps, loss="-")
        for _ in range(args.steps):
            examples = []
            for _ in range(args.batch_size):
                n = rng.choice((1, 2, 3))
                key = (rng.choice(captions[n]), rng.choice(NUM_CHUNKS))
                if key not in cache:
                    cache[key] = _example(planner, *key)
                examples.append(cache[key])
            ids, attn, labels = _batch(planner, examples)
            loss = lm(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            opt.step()
            sched.step()
            ema = float(loss) if ema is None else 0.95 * ema + 0.05 * float(loss)
            bar.update(task, advance=1, loss=f"{ema:.4f}")
    train_s = time.perf_counter() - t0
    lm.eval()
    lm.save_pretrained(str(tmp))
    planner.tokenizer.save_pretrained(str(tmp))

    items = heldout_captions(world, args.eval_num, args.seed)
    stats = {"num": len(items)}
    for name, temperature in (("temperature_1", 1.0), ("greedy", 0.0)):
        stats[name] = evaluate(LMPlanner(str(tmp), temperature=temperature), items, args.seed)
        print(f"held-out {name}: {json.dumps(stats[name])}")
    size = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
    counts = {n: len(c) for n, c in captions.items()}
    (tmp / "README.md").write_text(_readme(args, n_params, len(planner.tokenizer), counts, train_s, stats, size,
                                           command))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"wrote {out} ({n_params:,} parameters, {size / 1e6:.2f} MB, trained in {train_s / 60:.1f} min)")
    return stats


if __name__ == "__main__":
    main()
