"""RetrologCallback and rl.autolog on Lightning's Trainer: what a run records, and a
replay that restores epochs recomputes every recorded value bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Project, logged_values, read_db

pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py").read_text()
ENV = {"RETROLOG_CHECKPOINTS": "adaptive"}


@pytest.mark.usefixtures("whole_machine")  # torch's default threads
def test_autolog_records_an_unmodified_lightning_script(project: Project) -> None:
    # The example without its callback line: rl.autolog() alone records it. Lightning
    # would send its logs every 50 steps; every step is recorded.
    script = EXAMPLE.replace("    callbacks=[RetrologCallback()],\n", "    log_every_n_steps=50,\n")
    script = script.replace(
        "from retrolog.integrations.lightning import RetrologCallback\n",
        "import retrolog as rl\n\nrl.autolog()\n",
    )
    assert "RetrologCallback" not in script
    project.write("train.py", script)
    project.run("train.py", "--epochs", "3", "--samples", "64", **ENV)
    loops = read_db(project.root, "SELECT name, COUNT(*) FROM loops GROUP BY name ORDER BY name")
    assert loops == [("epoch", 3), ("step", 12)]
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'train_loss_step'") == [
        (12,)
    ]
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints WHERE kind = 'end'") == [(1,)]
    from retrolog import Project as Store

    store = Store(project.root)
    # Typed run-level values: a predicate over the hparams and the Trainer's arguments.
    frame = store.dataframe("train_loss_step", where="lr > 1e-3 AND max_epochs = 3")
    assert len(frame) == 12 and list(frame["step"]) == [0, 1, 2, 3] * 3
    frame = store.dataframe("val_acc")
    assert list(frame["epoch"]) == [0, 1, 2]
    (run_id,) = [str(r) for (r,) in read_db(project.root, "SELECT run_id FROM runs")]
    (series,) = store.series("train_loss_step", [run_id])
    assert series.total == 12 and len(series.x) == 12

    # A replay of the run's own code that restores the epochs the rule kept recomputes
    # every recorded value (validation, the epochs' aggregates) bit for bit.
    kept = read_db(project.root, "SELECT COUNT(*) FROM checkpoints WHERE kind = 'block'")[0][0]
    assert kept
    out = project.cli("replay", "--verify", "--yes", **ENV)
    assert out.returncode == 0, out.stderr
    assert "1 replay exactly" in out.stdout + out.stderr, out.stdout + out.stderr
    assert read_db(project.root, "SELECT restored FROM replay_runs") == [(kept,)]
    # Compared: every value outside the steps (the epochs' aggregates and validation of
    # restored epochs too), and the steps' values of the epochs executed.
    restored = {
        e
        for (e,) in read_db(
            project.root,
            "SELECT l.iteration FROM checkpoints c JOIN loops l ON l.run_id = c.run_id"
            " AND l.ctx_id = c.ctx_id WHERE c.kind = 'block'",
        )
    }
    recorded = logged_values(project.root / ".retrolog" / "retrolog.db")
    expected = sum(1 for (_, _, e, s) in recorded if s is None or e not in restored)
    assert read_db(project.root, "SELECT compared FROM replay_runs") == [(expected,)]


# A few steps, to see what is refused and said: nothing is compared or timed, so the
# test shares the machine (no whole_machine).
def test_an_untested_lightning_records_without_checkpoints_and_says_so(
    project: Project,
) -> None:
    script = EXAMPLE.replace(
        "from retrolog.integrations",
        "import lightning\nlightning.__version__ = '1.9.0'\nfrom retrolog.integrations",
    )
    project.write("train.py", script)
    out = project.run("train.py", "--epochs", "2", "--samples", "32", **ENV)
    lines = [line for line in out.stderr.splitlines() if line.startswith("retrolog:")]
    assert len(lines) == 1 and "Lightning 1.9.0" in lines[0], out.stderr
    assert "without checkpoints" in lines[0]
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints") == [(0,)]
    assert read_db(project.root, "SELECT COUNT(*) FROM loops WHERE name = 'step'") == [(4,)]
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'val_acc'") == [(2,)]


# A few steps, to see what is refused and said: nothing is compared or timed, so the
# test shares the machine (no whole_machine).
def test_a_data_order_it_cannot_capture_records_without_checkpoints(project: Project) -> None:
    # A sampler of the script's own: its position is not in any checkpoint.
    script = EXAMPLE.replace(
        "train = DataLoader(synthetic(opts.samples, opts.seed), batch_size=opts.batch_size, "
        "shuffle=True)",
        "class Reversed(torch.utils.data.Sampler):\n"
        "    def __init__(self, n):\n"
        "        self.n = n\n\n"
        "    def __len__(self):\n"
        "        return self.n\n\n"
        "    def __iter__(self):\n"
        "        return iter(range(self.n - 1, -1, -1))\n\n\n"
        "data = synthetic(opts.samples, opts.seed)\n"
        "train = DataLoader(data, batch_size=opts.batch_size, sampler=Reversed(len(data)))",
    )
    assert "Reversed(len(data))" in script
    project.write("train.py", script)
    out = project.run("train.py", "--epochs", "2", "--samples", "32", **ENV)
    lines = [line for line in out.stderr.splitlines() if line.startswith("retrolog:")]
    assert len(lines) == 1 and "sampler is a Reversed" in lines[0], out.stderr
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints") == [(0,)]
    assert read_db(project.root, "SELECT COUNT(*) FROM loops WHERE name = 'epoch'") == [(2,)]


@pytest.mark.usefixtures("whole_machine")  # torch's default threads
def test_a_torchmetrics_object_makes_its_epochs_execute_and_the_report_says_why(
    project: Project,
) -> None:
    # Its accumulated state is the metric's own, which no checkpoint holds. Every epoch
    # checkpointed (RETROLOG_CHECKPOINTS=every), to see each one refused.
    script = EXAMPLE.replace(
        "        self.save_hyperparameters()\n",
        "        self.save_hyperparameters()\n"
        "        import torchmetrics\n\n"
        "        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=2)\n",
    ).replace(
        '        self.log("train_loss", loss, on_step=True, on_epoch=True)\n',
        '        self.log("train_loss", loss, on_step=True, on_epoch=True)\n'
        "        self.acc.update(self.net(x).argmax(-1), y)\n"
        '        self.log("train_acc", self.acc, on_step=False, on_epoch=True)\n',
    )
    assert script.count("self.acc") == 3
    project.write("train.py", script)
    project.run("train.py", "--epochs", "2", "--samples", "32", RETROLOG_CHECKPOINTS="every")
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints WHERE kind = 'block'") == [(2,)]
    out = project.cli("replay", "--verify", "--yes")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("whose accumulated state the checkpoint does not hold") == 2
    assert "1 replay exactly" in out.stdout + out.stderr
    assert read_db(project.root, "SELECT restored FROM replay_runs") == [(0,)]
