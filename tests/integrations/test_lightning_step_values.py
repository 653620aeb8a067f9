"""The Lightning callback reads a step's logged values from the result collection
itself; they are what Lightning's own loggers would be given at that step."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retrolog.integrations.lightning import _step_values


class Logging(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("both", loss, on_step=True, on_epoch=True)  # forked: both_step, both_epoch
        self.log("step_only", loss * 2, on_step=True, on_epoch=False)
        self.log("epoch_only", loss * 3, on_step=False, on_epoch=True)
        self.log("not_for_loggers", loss * 4, on_step=True, logger=False)
        self.log("in_the_bar", loss * 5, on_step=True, prog_bar=True)
        self.log("a_number", float(batch_idx), on_step=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Compare(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[dict[str, float], dict[str, float]]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        assert trainer._results is not None
        ours = {name: value.item() for name, value in _step_values(trainer._results)}
        theirs = {
            name: value.item() for name, value in trainer._logger_connector.metrics["log"].items()
        }
        self.steps.append((ours, theirs))


# Lightning's own use of torch's pytree (not this test's) warns on this torch.
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)`:FutureWarning")
def test_a_steps_values_are_what_lightnings_loggers_get() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    compare = Compare()
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[compare],
    )
    trainer.fit(Logging(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    assert len(compare.steps) == 6
    for ours, theirs in compare.steps:
        assert ours == theirs
        assert set(ours) == {"both_step", "step_only", "in_the_bar", "a_number"}
