"""genrl's own small video DiT as a generator family (``family: dit``), so every method takes one ``generator:``.

The DiT is a diffusers ``ModelMixin`` (:class:`genrl.models.dit.VideoDiT`) conditioned on a sentence-embedding text
encoder (:class:`genrl.models.text_encoder.TextEncoder`, MiniLM-L6 by default) with the identity pixel codec, behind
the same Generator protocol as the diffusers families (:class:`genrl.models.generator.DiTGenerator`).
"""

from __future__ import annotations

from genrl.models.generator import DiTGenerator
from genrl.models.spec import ModelSpec
from genrl.models.text_encoder import MINILM, TextEncoder

__all__ = ["DIT_TEXT_LENGTH", "build_dit"]

#: text tokens per prompt of the DiT's encoder when ``max_sequence_length`` is not set.
DIT_TEXT_LENGTH = 32


def build_dit(spec) -> DiTGenerator:
    """The :class:`DiTGenerator` of a ``family: dit`` :class:`~genrl.models.families.GeneratorSpec`.

    ``pretrained`` is a folder written by ``VideoDiT.save_pretrained`` (e.g. ``assets/shapes-dit``, or an export of a
    run); ``components: {transformer: {...VideoDiT values}}`` builds random weights instead (drawn from the global
    generator, as ``seed_everything`` left it). ``text_encoder`` is a local
    sentence-transformers folder or ``"minilm"`` (the packaged MiniLM-L6). ``height`` / ``width`` / ``num_frames`` are
    the diffusers families' sample size and are not used: a DiT method's ``latent_shape`` fixes the sample size.

    Raises:
        ValueError: a component other than ``transformer``, or both / neither of pretrained and components.
        FileNotFoundError: missing weights (names the folder).
    """
    unknown = sorted(set(spec.components) - {"transformer"})
    if unknown:
        raise ValueError(f"dit: unknown components {unknown}; the DiT family has one component, 'transformer' "
                         f"(VideoDiT config values, e.g. {{hidden_size: 32, num_layers: 2, text_dim: 16}})")
    encoder = TextEncoder.from_pretrained(spec.text_encoder or MINILM,
                                          max_length=spec.max_sequence_length or DIT_TEXT_LENGTH)
    transformer = ModelSpec(pretrained=spec.pretrained, config=dict(spec.components.get("transformer", {})),
                            gradient_checkpointing=spec.gradient_checkpointing,
                            dtype=None if spec.torch_dtype == "float32" else spec.torch_dtype).build()
    return DiTGenerator(transformer, encoder)
