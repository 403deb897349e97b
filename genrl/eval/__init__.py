"""Evaluation metrics shared by ``evaluation/`` (the user-facing runner) and training-time validation.

- :mod:`genrl.eval.dimensions`: VBench-compatible per-video dimensions in torch (temporal flickering, dynamic degree
  and motion smoothness proxies, subject / background consistency, aesthetic and imaging quality);
- :mod:`genrl.eval.vbench`: VBench's prompt suite, normalisation constants and Quality / Semantic / Total composites;
- :mod:`genrl.eval.frechet`: the Frechet distance on features and cached feature statistics;
- :mod:`genrl.eval.fvd` / :mod:`genrl.eval.fid`: FVD with an I3D and FID with an Inception / CLIP from local files.
- :mod:`genrl.eval.gold`: reward-free gold metrics of generated videos (brightness, saturation, near-constant
  frames, flicker, diversity, a pixel-PCA Frechet distance to real videos) for reward-hacking checks.

Import the submodules directly; nothing heavy is imported here.
"""
