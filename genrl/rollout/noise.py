"""Re-export of :mod:`genrl.noise` (addressable randomness), kept so ``genrl.rollout.noise`` imports keep working.

The functions live in the leaf module :mod:`genrl.noise` so that the layers below the rollout sampler
(``genrl.flow``, ``genrl.models``) can draw addressed noise without importing ``genrl.rollout``. New code imports
``genrl.noise``.
"""

from genrl.noise import mix_seed, rand_per_sample, randn_per_sample, sample_generator

__all__ = ["mix_seed", "sample_generator", "randn_per_sample", "rand_per_sample"]
