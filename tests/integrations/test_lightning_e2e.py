"""Lightning's Trainer recorded with RetrologCallback and replayed, end to end.

examples/lightning_train.py (an MLP built from its hyper-parameters, synthetic data)
is recorded in two code versions at default settings. Today's code adds a weight norm
in the module's on_train_epoch_end (outer level: the epochs the adaptive rule kept are
restored, not trained, and validation runs) and a gradient norm in its
on_before_optimizer_step (inner: the steps execute). Every backfilled value is compared
bit for bit with fresh runs of today's code.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from conftest import Project, logged_values, read_db

pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py").read_text()
V1 = EXAMPLE
# A later version: the validation batch named before use.
V2 = V1.replace(
    "val = DataLoader(synthetic(128, opts.seed + 1), batch_size=64)",
    "VAL_BATCH = 64\nval = DataLoader(synthetic(128, opts.seed + 1), batch_size=VAL_BATCH)",
)
NEWEST = (
    V2.replace(
        "from retrolog.integrations.lightning",
        "import retrolog as rl\nfrom retrolog.integrations.lightning",
    )
    .replace(
        "    def on_before_optimizer_step(self, optimizer):\n        pass\n",
        "    def on_before_optimizer_step(self, optimizer):\n"
        '        rl.log("grad", sum(p.grad.norm().item() for p in self.parameters()))\n',
    )
    .replace(
        "    def on_train_epoch_end(self):\n        pass\n",
        "    def on_train_epoch_end(self):\n"
        '        rl.log("w_norm", sum(p.norm().item() for p in self.parameters()))\n',
    )
)
CONFIGS = [
    ["--epochs", "4", "--samples", "96"],
    ["--epochs", "3", "--samples", "96", "--lr", "0.02"],
]
# Default settings: the adaptive rule chooses the checkpoints.
ENV = {"RETROLOG_CHECKPOINTS": "adaptive"}


@pytest.mark.usefixtures("whole_machine")  # torch's default threads
def test_lightning_records_every_step_and_replays_exactly(project: Project) -> None:
    assert V2 != V1 and NEWEST.count("rl.log(") == 2
    project.write("train.py", V1)
    project.run("train.py", *CONFIGS[0], **ENV)
    project.write("train.py", V2)
    project.run("train.py", *CONFIGS[1], **ENV)
    project.write("train.py", NEWEST)
    runs = [str(r) for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]
    database = project.root / ".retrolog" / "retrolog.db"

    recorded = logged_values(database, "WHERE l.run_id = ?", (runs[0],))
    # Every step's self.log value, whatever log_every_n_steps is (6 batches an epoch).
    assert {(e, s) for (_, n, e, s) in recorded if n == "train_loss_step"} == {
        (e, s) for e in range(4) for s in range(6)
    }
    for name in ("val_loss", "val_acc", "train_loss_epoch"):
        assert {e for (_, n, e, s) in recorded if n == name and s is None} == {0, 1, 2, 3}
    # hparams and the Trainer's arguments, typed, at run level.
    for name, value in (("lr", 0.01), ("hidden", 32), ("max_epochs", 4), ("seed", 0)):
        assert read_db(
            project.root,
            "SELECT value FROM logs WHERE run_id = ? AND name = ? AND ctx_id IS NULL",
            (runs[0], name),
        ) == [(value,)], name
    kept = read_db(
        project.root,
        "SELECT COUNT(*) FROM checkpoints WHERE run_id = ? AND kind = 'block'",
        (runs[0],),
    )[0][0]
    assert kept, "the adaptive rule kept no epoch"

    out = project.cli("replay", "w_norm", "--yes", **ENV)
    assert out.returncode == 0, out.stderr
    assert "outer loop" in out.stderr, out.stderr
    assert "differs" not in out.stderr and "executing" not in out.stderr, out.stderr
    assert read_db(
        project.root, "SELECT restored FROM replay_runs WHERE run_id = ?", (runs[0],)
    ) == [(kept,)]
    out = project.cli("replay", "grad", "--yes", **ENV)
    assert out.returncode == 0, out.stderr
    assert "differs" not in out.stderr, out.stderr

    for run_id, config in zip(runs, CONFIGS, strict=True):
        with tempfile.TemporaryDirectory() as tmp:
            project.run("train.py", *config, RETROLOG_STORE=str(Path(tmp) / "s"), **ENV)
            fresh = logged_values(Path(tmp) / "s" / "retrolog.db")
        replayed = logged_values(
            database, "WHERE l.run_id = ? AND l.origin = 'backfilled'", (run_id,)
        )
        for name in ("w_norm", "grad"):
            expected = {k[1:]: v for k, v in fresh.items() if k[1] == name}
            assert expected, name
            got = {k[1:]: v for k, v in replayed.items() if k[1] == name}
            assert got == expected, (run_id, name)
