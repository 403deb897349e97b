"""The language-model planner of TempAct: a causal LM that splits a global video prompt into span-aware steps.

:class:`LMPlanner` wraps any local transformers causal-LM folder (``AutoModelForCausalLM`` + ``AutoTokenizer``,
``local_files_only``) with an optional LoRA adapter (peft). It writes the plan JSON of :mod:`genrl.models.plans`
for a prompt and a chunk count, K samples per prompt, and gives the per-token log-probabilities that the planner's
group-RL losses (:func:`genrl.flow.gspo_loss`, :func:`genrl.flow.token_grpo_loss`) need: under the current weights
(:meth:`LMPlanner.token_log_probs`), under the sampling policy (``Plan.behaviour_log_probs``, recorded while
sampling) and under the reference policy (the same call inside :meth:`LMPlanner.reference`).

The prompt is the tokenizer's chat template applied to one user message (``instruction``, the chunk count and the
global prompt) with the generation prompt added, or, for a tokenizer without a chat template, a plain-text template
(:meth:`LMPlanner.prompt_text`). The answer is the JSON of :func:`genrl.models.plans.plan_to_json`; if the LM writes
``</think>``, only the text after it is the answer (and only those tokens are trained).

:func:`build_tiny_planner_lm` builds a small word-level tokenizer and a tiny Llama-architecture LM in code and saves
them as such a folder (tests use it with random weights; ``pipelines/train_planner.py`` trains one on the shapes
world, shipped as ``assets/shapes-planner``).

Source: Wang et al. 2026, TempAct (arXiv 2606.28016), section 3 (the planner, its prompt and its GSPO training;
LoRA r 32 / alpha 64, temperature 1.0, top-p 0.7).
"""

from __future__ import annotations

import copy
import inspect
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from genrl.models.lora import LoraSpec
from genrl.models.plans import Plan, parse_plan
from genrl.noise import mix_seed

__all__ = ["PLANNER_LORA_TARGETS", "DEFAULT_INSTRUCTION", "THINK_END", "TINY_CHAT_TEMPLATE", "TINY_SPLIT_PATTERN",
           "LMPlanner", "check_lm_folder", "planner_words", "build_tiny_planner_lm"]

#: LoRA targets of a Llama / Qwen-family LM when ``LoraSpec.target_modules`` is unset: the attention and MLP
#: projections (the ones the LM has are used; the embeddings and the LM head are never adapted).
PLANNER_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: The planner's default instruction (the first part of its user message).
DEFAULT_INSTRUCTION = (
    'Split the video prompt into steps in time order, one per motion. Answer with JSON: a list "steps" of objects '
    'with "prompt", "start" and "end" (chunk indices, end exclusive) that cover every chunk.'
)
"""Kept short on purpose: a small LM trained from scratch (``assets/shapes-planner``) learns to read the caption
much more slowly behind a long constant instruction. Pass a longer one (e.g. with a worked example) for a general
pretrained LM."""

#: End of a thinking block: only the text after it is the answer.
THINK_END = "</think>"

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def check_lm_folder(path: str | os.PathLike) -> Path:
    """Check that ``path`` is a local causal-LM folder: ``config.json``, weights (``*.safetensors`` or
    ``pytorch_model*.bin``) and tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ...).

    Raises:
        FileNotFoundError: the folder or one of the three is missing (the message names the path and what is
            missing).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"planner LM folder {str(path)!r} does not exist; give a local transformers causal-LM "
                                f"folder (config.json, weights, tokenizer files), e.g. assets/shapes-planner")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"planner LM folder {str(path)!r} has no config.json (a transformers model config)")
    if not any((folder / f).is_file() for f in _WEIGHT_FILES) and not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"planner LM folder {str(path)!r} has no weights (expected one of "
                                f"{', '.join(_WEIGHT_FILES)} or another *.safetensors file)")
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"planner LM folder {str(path)!r} has no tokenizer files (expected one of "
                                f"{', '.join(_TOKENIZER_FILES)})")
    return folder


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)} or a torch.dtype")
    return _DTYPES[str(dtype).lower()]


class LMPlanner(nn.Module):
    """A causal-LM planner: K sampled plans per prompt and the per-token log-probs its RL losses need.

    Args:
        path: a local transformers causal-LM folder (:func:`check_lm_folder`); loaded with
            ``AutoModelForCausalLM`` / ``AutoTokenizer`` and ``local_files_only=True``.
        lora: a :class:`~genrl.models.lora.LoraSpec` (or a dict of its fields) to train a LoRA adapter (peft) on
            a frozen base; its ``target_modules`` default to the :data:`PLANNER_LORA_TARGETS` the LM has. None:
            the whole LM is trainable. The adapter weights are kept in float32.
        max_new_tokens: the most answer tokens sampled per plan (>= 1); an answer cut there usually fails to parse
            and gets the fallback plan (format score 0).
        temperature: sampling temperature (> 0), or 0 for greedy decoding (argmax).
        top_p: nucleus sampling mass in (0, 1] (1: no truncation).
        instruction: the first part of the user message (:data:`DEFAULT_INSTRUCTION`).
        max_steps: plans with more steps fall back (None: at most one step per chunk).
        dtype: the LM's weight dtype ("float32", "bfloat16", "float16" or a torch.dtype).

    Reference policy: with LoRA, the base LM with the adapter disabled; without LoRA, a frozen deep copy of the
    LM made here (it doubles the LM's memory, is not in ``state_dict()`` and follows ``.to()``).

    ``state_dict()`` holds the LM (and its adapter), so a Lightning checkpoint of a module that owns the planner
    restores it; load it into a planner made with the same ``path`` and ``lora``.

    Sampling and :meth:`token_log_probs` leave the module's train / eval mode as it is: the on-policy ratio is 1 only
    for an LM without active dropout (the Llama / Qwen configs' default, and LoRA's ``lora_dropout`` 0).

    Raises:
        FileNotFoundError: as :func:`check_lm_folder`.
        ValueError: an argument out of range (named), an unknown dtype, or LoRA targets the LM does not have.
    """

    def __init__(
        self,
        path: str,
        lora: LoraSpec | dict | None = None,
        max_new_tokens: int = 96,
        temperature: float = 1.0,
        top_p: float = 1.0,
        instruction: str = DEFAULT_INSTRUCTION,
        max_steps: int | None = None,
        dtype: str | torch.dtype = "float32",
    ) -> None:
        super().__init__()
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not float(temperature) >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        if not 0 < float(top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        folder = check_lm_folder(path)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = str(path)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.instruction = str(instruction)
        self.max_steps = max_steps
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        lm = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=_as_dtype(dtype))
        self.eos_token_ids = self._eos_ids(lm)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_ids[0])
        self.lora = None if lora is None else (lora if isinstance(lora, LoraSpec) else LoraSpec(**dict(lora)))
        if self.lora is not None:
            from peft import LoraConfig, get_peft_model

            targets = self.lora.target_modules
            if targets is None:
                have = {name.rsplit(".", 1)[-1] for name, _ in lm.named_modules()}
                targets = [t for t in PLANNER_LORA_TARGETS if t in have]
                if not targets:
                    raise ValueError(f"the LM at {self.path!r} has none of the default LoRA targets "
                                     f"{PLANNER_LORA_TARGETS}; set lora.target_modules")
            lm = get_peft_model(lm, LoraConfig(r=self.lora.rank, lora_alpha=self.lora.alpha,
                                               target_modules=list(targets),
                                               init_lora_weights=self.lora.init_lora_weights))
            for p in lm.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
            ref = None
        else:
            for p in lm.parameters():
                p.requires_grad_(True)
            ref = copy.deepcopy(lm).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
        self.lm = lm
        # the KV-cache argument / output field: ``cache`` in transformers >= 5.2x, ``past_key_values`` before
        base = lm.get_base_model() if self.lora is not None else lm
        self._cache_arg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        self.__dict__["_ref_lm"] = ref  # not a registered submodule: kept out of state_dict() and parameters()
        self._reference_mode = False

    # ------------------------------------------------------------------------------------------ plumbing
    def _eos_ids(self, lm) -> list[int]:
        ids: list[int] = []
        for value in (self.tokenizer.eos_token_id, getattr(getattr(lm, "generation_config", None), "eos_token_id",
                                                           None)):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v is not None and int(v) not in ids:
                    ids.append(int(v))
        if not ids:
            raise ValueError(f"the tokenizer at {self.path!r} has no eos token; the planner needs one to end answers")
        return ids

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if self._ref_lm is not None:  # keep the unregistered reference copy on the LM's device / dtype
            self._ref_lm._apply(fn)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Within this context :meth:`token_log_probs` gives the reference policy's log-probs (without grad): the
        base LM with the LoRA adapter disabled, or (without LoRA) the frozen copy made at construction."""
        self._reference_mode = True
        try:
            if self.lora is not None:
                with self.lm.disable_adapter():
                    yield
            else:
                yield
        finally:
            self._reference_mode = False

    # ------------------------------------------------------------------------------------------ prompts
    def user_message(self, global_prompt: str, num_chunks: int) -> str:
        """The user message: the instruction, the chunk count and the global prompt, one per line."""
        return f"{self.instruction}\nchunks: {int(num_chunks)}\nprompt: {global_prompt}"

    def prompt_text(self, global_prompt: str, num_chunks: int) -> str:
        """The text the answer continues: the chat template (one user message, generation prompt added, thinking
        off where the template knows the ``enable_thinking`` switch), else ``"<user message>\\nplan:\\n"``."""
        message = self.user_message(global_prompt, num_chunks)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                      add_generation_prompt=True, enable_thinking=False)
        return f"{message}\nplan:\n"

    def encode_prompt(self, global_prompt: str, num_chunks: int) -> list[int]:
        """Token ids of :meth:`prompt_text` (the tokenizer's BOS added for the plain template only: a chat
        template writes its own)."""
        chat = bool(getattr(self.tokenizer, "chat_template", None))
        ids = self.tokenizer(self.prompt_text(global_prompt, num_chunks), add_special_tokens=not chat)["input_ids"]
        if not ids:
            raise ValueError(f"the planner prompt for {global_prompt!r} tokenizes to nothing")
        return [int(i) for i in ids]

    # ------------------------------------------------------------------------------------------ sampling
    def _draw(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """One token from a row of logits: argmax (temperature 0), else inverse-CDF sampling of the temperature /
        top-p distribution with one uniform from ``generator`` (a CPU generator: the draw is device-independent)."""
        if self.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        order = None
        if self.top_p < 1:
            probs, order = probs.sort(descending=True)
            keep = (probs.cumsum(0) - probs) < self.top_p  # the smallest prefix with mass >= top_p
            probs = probs * keep
        cum = probs.double().cumsum(0)
        u = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cum[-1])
        j = int(torch.searchsorted(cum, torch.tensor([u], dtype=cum.dtype, device=cum.device), right=True))
        j = min(j, probs.numel() - 1)
        if float(probs[j]) <= 0:  # u rounded to the total: take the last token with mass
            j = int(torch.nonzero(probs > 0).max())
        return int(order[j]) if order is not None else j

    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], generators: list[torch.Generator]) -> list[tuple[list[int], list]]:
        """Sample one answer per generator, the K rows batched (same prompt, so no padding), KV-cached."""
        k = len(generators)
        ids = torch.tensor([prompt_ids] * k, dtype=torch.long, device=self.device)
        tokens: list[list[int]] = [[] for _ in range(k)]
        logps: list[list[float]] = [[] for _ in range(k)]
        done = [False] * k
        past = None
        for _ in range(self.max_new_tokens):
            out = self.lm(input_ids=ids, use_cache=True, **{self._cache_arg: past})
            past = getattr(out, self._cache_arg)
            logits = out.logits[:, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            nxt = []
            for r in range(k):
                if done[r]:
                    nxt.append(self.pad_token_id)
                    continue
                t = self._draw(logits[r], generators[r])
                tokens[r].append(t)
                logps[r].append(float(logp[r, t]))
                done[r] = t in self.eos_token_ids
                nxt.append(t)
            if all(done):
                break
            ids = torch.tensor(nxt, dtype=torch.long, device=self.device)[:, None]
        return list(zip(tokens, logps))

    def _answer_start(self, answer_ids: list[int]) -> int:
        """Index of the first answer token after ``</think>`` (0 when the LM wrote none)."""
        if THINK_END not in self.tokenizer.decode(answer_ids, skip_special_tokens=False):
            return 0
        for j in range(len(answer_ids)):
            if THINK_END in self.tokenizer.decode(answer_ids[: j + 1], skip_special_tokens=False):
                return j + 1
        return 0  # pragma: no cover (the full decode contained it)

    def _plan(self, global_prompt: str, num_chunks: int, prompt_ids: list[int], answer_ids: list[int],
              answer_logps: list[float], extra: dict) -> Plan:
        start = self._answer_start(answer_ids)
        body = [t for t in answer_ids[start:] if t not in self.eos_token_ids]
        text = self.tokenizer.decode(body, skip_special_tokens=True).strip()
        plan = parse_plan(text, global_prompt, num_chunks, max_steps=self.max_steps)
        n_prompt, n = len(prompt_ids), len(prompt_ids) + len(answer_ids)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n_prompt + start:] = True
        behaviour = torch.zeros(n, dtype=torch.float32)
        behaviour[n_prompt + start:] = torch.tensor(answer_logps[start:], dtype=torch.float32)
        plan.token_ids = torch.tensor(prompt_ids + answer_ids, dtype=torch.long)
        plan.answer_mask = mask
        plan.behaviour_log_probs = behaviour
        plan.extra.update(extra, finished=bool(answer_ids) and answer_ids[-1] in self.eos_token_ids,
                          answer_start=n_prompt + start)
        return plan

    def sample(self, global_prompts: Sequence[str], num_chunks: int, k: int, seed: int, iteration: int = 0,
               prompt_indices: Sequence[int] | None = None) -> list[list[Plan]]:
        """K plans per prompt, sampled with the planner's temperature / top-p (no grad).

        Sample j of prompt index i draws from its own CPU ``torch.Generator`` seeded with
        ``mix_seed(seed, iteration, i, j)``, one uniform per token (inverse-CDF sampling), and the K samples of a
        prompt are decoded together, apart from other prompts: a prompt's plans depend only on (the weights, the
        prompt, ``num_chunks``, ``k``, ``seed``, ``iteration``, its index), not on the other prompts of the call.
        ``prompt_indices`` gives the indices used in the seeds (default ``0 .. P - 1``; pass global indices when a
        batch is split, e.g. across ranks).

        Each plan comes from :func:`~genrl.models.plans.parse_plan` (never raises: a malformed answer gives the
        fallback plan, format score 0) and carries ``token_ids`` (int64 [L]: prompt + sampled answer, EOS included
        when sampled), ``answer_mask`` (bool [L]: the answer tokens, after ``</think>`` if the LM wrote one, EOS
        included) and ``behaviour_log_probs`` (float32 [L], 0 outside the answer). ``plan.extra`` holds
        ``prompt_index``, ``sample``, ``seed`` (the generator's), ``finished`` (EOS sampled) and ``answer_start``.

        Behaviour log-probs are those of the full softmax at temperature 1 (the LM's own distribution), not of
        the temperature-scaled, top-p-truncated distribution actually sampled from: they are what
        :meth:`token_log_probs` computes, so the importance ratio is exactly 1 on-policy (TempAct's default
        temperature 1.0; as in TempAct, the top-p truncation is not corrected for).

        Args:
            global_prompts: P prompts.
            num_chunks: chunks of the rollout each plan must cover (>= 1).
            k: plans per prompt (>= 1).
            seed, iteration: the sampling stream (e.g. the run's seed and the training step).
            prompt_indices: P ints (default ``range(P)``).

        Returns:
            P lists of K :class:`~genrl.models.plans.Plan`.

        Raises:
            ValueError: ``k < 1``, ``num_chunks < 1`` or ``prompt_indices`` of another length than the prompts.
        """
        if isinstance(global_prompts, str):
            global_prompts = [global_prompts]
        if k < 1:
            raise ValueError(f"k (plans per prompt) must be >= 1, got {k}")
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        indices = list(range(len(global_prompts))) if prompt_indices is None else [int(i) for i in prompt_indices]
        if len(indices) != len(global_prompts):
            raise ValueError(f"{len(indices)} prompt_indices for {len(global_prompts)} prompts")
        out = []
        for i, prompt in zip(indices, global_prompts):
            prompt_ids = self.encode_prompt(prompt, num_chunks)
            seeds = [mix_seed(int(seed), int(iteration), i, j) for j in range(k)]
            gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
            rows = self._generate(prompt_ids, gens)
            out.append([self._plan(prompt, num_chunks, prompt_ids, ids, lps,
                                   {"prompt_index": i, "sample": j, "seed": seeds[j]})
                        for j, (ids, lps) in enumerate(rows)])
        return out

    # ------------------------------------------------------------------------------------------ log-probs
    def token_log_probs(self, plans: Sequence[Plan]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the plans' tokens under the current weights (or the reference, inside
        :meth:`reference`), right-padded into one batch.

        Returns:
            ``(log_probs, mask)``: float32 [N, L] (L the longest plan; position t holds log p(token_t | tokens
            before t) of the full softmax at temperature 1; 0 at position 0 and on padding), with grad unless under
            :meth:`reference`; and bool [N, L], each plan's ``answer_mask`` (False on padding). Both on the LM's
            device.

        Raises:
            ValueError: no plans, or a plan without ``token_ids`` / ``answer_mask`` (e.g. a template planner's).
        """
        if not plans:
            raise ValueError("token_log_probs needs at least one plan")
        for i, p in enumerate(plans):
            if p.token_ids is None or p.answer_mask is None:
                raise ValueError(f"plan {i} has no token_ids / answer_mask: only plans sampled by an LMPlanner have "
                                 f"token log-probs")
        n, length = len(plans), max(int(p.token_ids.numel()) for p in plans)
        ids = torch.full((n, length), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros(n, length, dtype=torch.long)
        mask = torch.zeros(n, length, dtype=torch.bool)
        for i, p in enumerate(plans):
            m = int(p.token_ids.numel())
            ids[i, :m] = p.token_ids
            attn[i, :m] = 1
            mask[i, :m] = p.answer_mask
        ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
        model = self._ref_lm if (self._reference_mode and self._ref_lm is not None) else self.lm
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self._reference_mode):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            lp = torch.cat([torch.zeros(n, 1, dtype=lp.dtype, device=lp.device), lp], dim=1)
            lp = lp * attn.to(lp.dtype)
        return lp, mask


# ---------------------------------------------------------------------------------------------- tiny LM in code
#: The tiny tokenizer's pre-tokenizer pattern: a word with its leading space, a JSON punctuation mark with its
#: leading space, or one whitespace character. Pieces are vocabulary entries; decoding concatenates them (Fuse).
TINY_SPLIT_PATTERN = r' ?[^\s{}\[\]:,"]+| ?[{}\[\]:,"]|\s'
_PUNCT = list('{}[]:,"')
_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]

#: The tiny tokenizer's chat template: ``<bos>role\ncontent\n`` per message, then ``<bos>assistant\n``.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<bos>{{ message['role'] }}\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)


def planner_words(texts: Iterable[str]) -> list[str]:
    """The words (without their leading space, JSON punctuation and whitespace left out) of ``texts`` as the tiny
    tokenizer splits them, sorted: the ``vocab_words`` of :func:`build_tiny_planner_lm` that cover the texts."""
    words = set()
    for text in texts:
        for piece in re.findall(TINY_SPLIT_PATTERN, text):
            w = piece.strip()
            if w and w not in _PUNCT:
                words.add(w)
    return sorted(words)


def build_tiny_planner_lm(
    vocab_words: Iterable[str],
    folder: str | os.PathLike,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
) -> str:
    """Save a word-level tokenizer and a randomly initialised tiny causal LM to ``folder`` (loadable by
    :class:`LMPlanner`).

    Tokenizer (``tokenizers``, wrapped as a transformers ``PreTrainedTokenizerFast``): a WordLevel model whose
    vocabulary is the special tokens ``<pad> <bos> <eos> <unk>``, the space, the newline, the JSON marks
    ``{ } [ ] : , "`` with and without a leading space and every word of ``vocab_words`` with and without a
    leading space; the pre-tokenizer splits text by :data:`TINY_SPLIT_PATTERN` and the decoder concatenates, so
    ``decode(encode(text)) == text`` for text made of known words and single spaces. Chat template:
    :data:`TINY_CHAT_TEMPLATE`. Unknown words become ``<unk>``.

    LM: ``LlamaForCausalLM`` (RMSNorm, rotary positions, SwiGLU MLP, q/k/v/o and gate/up/down projections, tied
    input / output embeddings), ``hidden_size`` wide, ``num_layers`` deep, ``num_heads`` heads, MLP width
    ``intermediate_size`` (default ``2 * hidden_size``), initialised from ``torch.manual_seed(seed)``; saved as
    ``config.json`` + ``model.safetensors`` (float32).

    Args:
        vocab_words: the words (e.g. :func:`planner_words` of the prompts and answers), without spaces.
        folder: where to save (created).

    Returns:
        ``str(folder)``.

    Raises:
        ValueError: a word containing whitespace or JSON punctuation, or a width not divisible by the heads.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    entries = list(_SPECIALS) + [" ", "\n"] + _PUNCT + [" " + p for p in _PUNCT]
    for w in dict.fromkeys(str(w) for w in vocab_words):
        if not w or re.search(r'[\s{}\[\]:,"]', w):
            raise ValueError(f"vocabulary word {w!r} is empty or holds whitespace / JSON punctuation")
        entries += [w, " " + w]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(entries))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(TINY_SPLIT_PATTERN), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", chat_template=TINY_CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False, model_max_length=max_positions)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"], rms_norm_eps=1e-6,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    Path(folder).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    fast.save_pretrained(str(folder))
    return str(folder)
