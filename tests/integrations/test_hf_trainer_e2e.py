"""transformers' Trainer recorded with RetrologCallback and replayed, end to end.

examples/hf_trainer.py (a tiny BERT built from its config, synthetic tokens) is
recorded in two code versions at default settings. Today's code adds a weight norm
in the example's epoch hook (outer level: the epochs the adaptive rule kept are
restored, not trained) and a gradient norm in its pre-optimizer-step hook (inner:
the steps execute). Every backfilled value is compared bit for bit with fresh runs
of today's code.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from conftest import Project, logged_values, read_db

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py").read_text()
V1 = EXAMPLE
# A later version: the evaluation batch named before use.
V2 = V1.replace(
    "args = TrainingArguments(\n", "EVAL_BATCH = 64\nargs = TrainingArguments(\n"
).replace("per_device_eval_batch_size=64", "per_device_eval_batch_size=EVAL_BATCH")
NEWEST = (
    V2.replace(
        "from retrolog.integrations.transformers",
        "import retrolog as rl\nfrom retrolog.integrations.transformers",
    )
    .replace(
        "    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):\n"
        "        pass\n",
        "    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):\n"
        '        rl.log("grad", sum(p.grad.norm().item() for p in model.parameters()'
        " if p.grad is not None))\n",
    )
    .replace(
        "    def on_epoch_end(self, args, state, control, model=None, **kwargs):\n        pass\n",
        "    def on_epoch_end(self, args, state, control, model=None, **kwargs):\n"
        '        rl.log("w_norm", sum(p.norm().item() for p in model.parameters()))\n',
    )
)
CONFIGS = [
    ["--epochs", "3", "--samples", "96"],
    ["--epochs", "2", "--samples", "96", "--lr", "5e-4"],
]
# Default settings, offline: nothing may be downloaded.
ENV = {
    "RETROLOG_CHECKPOINTS": "adaptive",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.mark.usefixtures("whole_machine")  # torch's default threads
def test_trainer_records_every_step_and_replays_exactly(project: Project) -> None:
    assert NEWEST.count("rl.log(") == 2
    project.write(".gitignore", "hf_out/\n")
    project.write("train.py", V1)
    project.run("train.py", *CONFIGS[0], **ENV)
    project.write("train.py", V2)
    project.run("train.py", *CONFIGS[1], **ENV)
    project.write("train.py", NEWEST)
    runs = [str(r) for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]
    database = project.root / ".retrolog" / "retrolog.db"

    recorded = logged_values(database, "WHERE l.run_id = ?", (runs[0],))
    # Every step's loss, whatever logging_steps is (6 steps per epoch, logging_steps=5).
    assert {(e, s) for (_, n, e, s) in recorded if n == "loss"} == {
        (e, s) for e in range(3) for s in range(6)
    }
    assert {e for (_, n, e, s) in recorded if n == "eval_accuracy" and s is None} == {0, 1, 2}
    assert any(n == "train/epoch" for (_, n, _, _) in recorded)  # the Trainer's own `epoch`
    assert read_db(
        project.root,
        "SELECT value FROM logs WHERE run_id = ? AND name = 'learning_rate' AND ctx_id IS NULL",
        (runs[0],),
    ) == [(0.0003,)]  # TrainingArguments, typed, at run level
    kept = read_db(
        project.root,
        "SELECT COUNT(*) FROM checkpoints WHERE run_id = ? AND kind = 'block'",
        (runs[0],),
    )[0][0]
    assert kept, "the adaptive rule kept no epoch"

    out = project.cli("replay", "w_norm", "--yes", **ENV)
    assert out.returncode == 0, out.stderr
    assert "outer loop" in out.stderr and "eval_runtime" in out.stderr
    assert "differs" not in out.stderr
    assert read_db(
        project.root, "SELECT restored FROM replay_runs WHERE run_id = ?", (runs[0],)
    ) == [(kept,)]
    out = project.cli("replay", "grad", "--yes", **ENV)
    assert out.returncode == 0, out.stderr

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
