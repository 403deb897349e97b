"""Word-level tokenizers built from plain values, for tiny random family models (no downloads).

Real checkpoints bring their own tokenizer files (T5 / UMT5 sentencepiece, CLIP BPE, Gemma); tests and
configs that build a family from config values need a tokenizer too, so this builds a
``transformers.PreTrainedTokenizerFast`` over a small word vocabulary that every diffusers pipeline's
``encode_prompt`` can call like the real one (``padding="max_length"``, truncation, attention masks).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["word_level_tokenizer", "DEFAULT_WORDS"]

#: The shapes-world caption words plus common prompt words (anything else maps to the unknown token).
DEFAULT_WORDS = (
    "a an the red green blue yellow magenta cyan white orange black circle square triangle moving moves then "
    "left right up down still staying slowly quickly , . photo of cat dog on in with and"
).split()


def word_level_tokenizer(
    specials: Sequence[str] = ("<pad>", "</s>", "<unk>"),
    words: Sequence[str] | None = None,
    model_max_length: int = 16,
    pad_token: str = "<pad>",
    eos_token: str | None = "</s>",
    unk_token: str = "<unk>",
    bos_token: str | None = None,
    add_bos: bool = False,
    add_eos: bool = True,
    newline_token: bool = False,
):
    """A fast word-level tokenizer: ``specials`` take ids 0..len-1 in order, then ``words``. Every special is one
    token wherever it occurs in a text (a chat-template marker such as ``<|im_start|>`` is not split).

    Args:
        specials: special tokens in id order (T5 / UMT5: pad 0, eos 1, unk 2; CLIP: bos 0, pad 1, eos 2
            matches ``CLIPTextConfig(bos_token_id=0, pad_token_id=1, eos_token_id=2)``).
        words: the vocabulary (default :data:`DEFAULT_WORDS`); lower-cased whitespace / punctuation split.
        model_max_length: the tokenizer's maximum length (pipelines pad CLIP slots to it).
        pad_token, eos_token, unk_token, bos_token: which specials play which role (all must be in ``specials``).
        add_bos, add_eos: wrap every sequence with ``bos`` / ``eos``.
        newline_token: keep each line break as the token ``"\n"`` (added after ``words``) instead of dropping it as
            whitespace, as BPE tokenizers do; chat templates separate their turns by line breaks, and a pipeline that
            drops a fixed number of template tokens counts them (Qwen-Image's ``prompt_template_encode_start_idx``).
    Returns:
        ``PreTrainedTokenizerFast`` whose vocabulary size is ``len(specials) + len(words)`` (+ 1 with
        ``newline_token``).
    Raises:
        ValueError: a role token is not among ``specials``.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(specials)
    for role, tok in (("pad", pad_token), ("eos", eos_token), ("unk", unk_token), ("bos", bos_token)):
        if tok is not None and tok not in specials:
            raise ValueError(f"{role}_token {tok!r} is not in specials {specials}")
    vocab = {w: i for i, w in enumerate(specials)}
    for w in [*(words if words is not None else DEFAULT_WORDS), *(["\n"] if newline_token else [])]:
        vocab.setdefault(str(w).lower(), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
    tok.normalizer = normalizers.Lowercase()
    # Whitespace() is this split without the line break
    tok.pre_tokenizer = (pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True)
                         if newline_token else pre_tokenizers.Whitespace())
    tok.add_special_tokens(specials)
    single = " ".join(([bos_token] if add_bos and bos_token else []) + ["$A"]
                      + ([eos_token] if add_eos and eos_token else []))
    used = [t for t in (bos_token if add_bos else None, eos_token if add_eos else None) if t]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[(t, vocab[t]) for t in used])
    kwargs = {"pad_token": pad_token, "unk_token": unk_token}
    if eos_token:
        kwargs["eos_token"] = eos_token
    if bos_token:
        kwargs["bos_token"] = bos_token
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **kwargs)
