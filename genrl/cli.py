"""The ``genrl`` command: a LightningCLI (``genrl fit|validate|test|predict --config ...``).

Any ``genrl.methods`` LightningModule is a ``model`` and any LightningDataModule a ``data`` (class_path /
init_args in YAML). Config files compose left to right (``--config a.yaml --config b.yaml``), dotted
overrides come last (``--model.cfg_scale=4``), ``--print_config`` prints the resolved typed config, and
``--ckpt_path last`` resumes the newest checkpoint of the run.
"""

from __future__ import annotations


from lightning.pytorch.cli import LightningCLI

__all__ = ["GenRLCLI", "main"]


class GenRLCLI(LightningCLI):
    """LightningCLI with genrl's defaults: subclass mode for model and data, omegaconf interpolation,
    config saved next to the logs (overwritten on resume), optimizers configured by the methods."""

    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf"})
        super().__init__(args=args, run=run, **kwargs)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``genrl`` console script and of ``python -m genrl``."""
    import genrl.data  # noqa: F401  (registers genrl's datamodules for short class names)
    import genrl.methods  # noqa: F401

    GenRLCLI(args=args)


if __name__ == "__main__":
    main()
