"""What the Lightning callback adds to each training step, in Python calls: Lightning
dispatches a hook to every callback that has it, so the callback leaves the per-batch
hooks it does not use off its instance (a subclass that defines one keeps it)."""

from __future__ import annotations

import pytest

from conftest import Project

pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

# One fit without the callback and one with it, the same module and data; the calls of
# 24 steps inside the second epoch counted by cProfile (the run's start and the epochs'
# ends, checkpoints included, are not per-step costs).
SCRIPT = """\
import cProfile
import pstats

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retrolog.integrations.lightning import RetrologCallback

STEPS = 24


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Window(pl.Callback):
    # Counts the calls of STEPS whole training steps in the second epoch.

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 1 and batch_idx == 4:
            self.profile = cProfile.Profile()
            self.profile.enable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1 and batch_idx == 4 + STEPS:
            self.profile.disable()
            self.calls = pstats.Stats(self.profile).total_calls


class Counted(RetrologCallback):
    batch_ends = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        Counted.batch_ends += 1


def fit(callbacks):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(Module(), DataLoader(data, batch_size=8, shuffle=True))


plain, recorded = Window(), Window()
fit([plain])
fit([recorded, RetrologCallback()])
fit([Counted()])
print("EXTRA_CALLS_PER_STEP", (recorded.calls - plain.calls) / STEPS)
print("BATCH_ENDS", Counted.batch_ends)
"""


def test_the_callback_adds_few_calls_per_step_and_a_subclass_keeps_its_hooks(
    project: Project,
) -> None:
    project.write("fit.py", SCRIPT)
    out = project.run("fit.py").stdout
    found = dict(line.split() for line in out.splitlines() if line.startswith(("EXTRA", "BATCH")))
    # The subclass's own per-batch hook runs at every one of the 3 epochs' 32 steps.
    assert int(found["BATCH_ENDS"]) == 96
    # About 80 calls: the step's context and reading and storing its values. Dispatching
    # the per-step hooks it does not use cost about 100 more, on_train_batch_start 16.
    assert float(found["EXTRA_CALLS_PER_STEP"]) < 100, out
