"""Generator adapters: the Generator protocol, genrl's small video DiT, the video discriminator, text encoders, codecs,
model specs."""

from genrl.models.codec import PixelCodec
from genrl.models.discriminator import FeatureGANHeads, TrunkDiscriminator, VideoDiscriminator
from genrl.models.dit import VideoDiT
from genrl.models.generator import DiTGenerator, Generator
from genrl.models.spec import ModelSpec
from genrl.models.text_encoder import MINILM, Conditioning, TextEncoder

__all__ = ["Conditioning", "DiTGenerator", "FeatureGANHeads", "Generator", "MINILM", "ModelSpec", "PixelCodec",
           "TextEncoder", "TrunkDiscriminator", "VideoDiT", "VideoDiscriminator"]
