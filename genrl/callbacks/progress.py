"""A progress bar that counts training steps of a step-bounded run, resumed runs included."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["StepProgressBar"]


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, with the training bar counting ``trainer.global_step`` out of
    ``trainer.max_steps`` when the run is bounded by steps (``max_epochs`` of -1 or None, ``max_steps`` > 0).

    genrl's training data are infinite streams and its runs stop at ``max_steps``. Lightning's own bar then
    reads "Epoch 0/-2" (``max_epochs - 1``) and, on a run resumed at step k, counts the restored batch index
    against the *remaining* steps ("6/3" for a run resumed at step 3 of 6). Here the description is
    ``"Steps"`` and the bar reads ``global_step / max_steps``: resumed at 3 of 6 it starts at 3/6 and ends at
    6/6. For methods that count iterations (DMD, AFD: one generator update and its critic updates) the
    global step is the iteration, so the bar ends at ``max_steps`` of ``max_steps`` there too. Runs bounded by
    epochs keep Lightning's behaviour. The logger's version shows as ``version: 0`` (Lightning's metric
    format turned it into ``v_num: 0.000``).

    :class:`genrl.cli.GenRLCLI` puts it in place of the default bar; add it to ``trainer.callbacks`` yourself
    when building a ``Trainer`` in Python.
    """

    DESCRIPTION = "Steps"

    def _step_bounded(self, trainer: Trainer) -> bool:
        return trainer.max_epochs in (None, -1) and trainer.max_steps is not None and trainer.max_steps > 0

    def _show_steps(self, trainer: Trainer) -> None:
        if self.progress is None or self.train_progress_bar_id is None or not self._step_bounded(trainer):
            return
        self.progress.update(self.train_progress_bar_id, total=trainer.max_steps,
                             completed=min(trainer.global_step, trainer.max_steps), description=self.DESCRIPTION)
        self.refresh()

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Lightning's metrics, with the logger's version as the text ``version`` instead of the number
        ``v_num``."""
        items = super().get_metrics(trainer, pl_module)
        if "v_num" in items:
            items = {"version": str(items.pop("v_num")), **items}
        return items

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Lightning's set-up of the training bar, then total = ``max_steps``, completed = ``global_step``."""
        super().on_train_epoch_start(trainer, pl_module)
        self._show_steps(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Lightning's update (metrics, refresh), then completed = ``global_step`` (the steps done so far)."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._show_steps(trainer)
