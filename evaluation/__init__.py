"""genrl's evaluation scripts (run from the repository root): ``python -m evaluation run | compare | report |
dimensions | vbench-import``; ``evaluation/shapes_eval.py`` scores a model on the shapes world directly.

The metrics themselves live in the installed package (:mod:`genrl.eval`); this folder holds the runner, the report
writer and the comparison table. See ``evaluation/README.md``.
"""
