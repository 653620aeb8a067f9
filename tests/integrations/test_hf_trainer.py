"""RetrologCallback and rl.autolog on transformers' Trainer: what a run records."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Project, read_db

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py").read_text()
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# A few steps, to see what is recorded: nothing is compared or timed, so the test shares
# the machine (no whole_machine).
def test_autolog_records_an_unmodified_trainer_script(project: Project) -> None:
    # The example without its callback line: rl.autolog() alone records it.
    script = EXAMPLE.replace(", RetrologCallback()]", "]").replace(
        "from retrolog.integrations.transformers import RetrologCallback\n",
        "import retrolog as rl\n\nrl.autolog()\n",
    )
    assert "RetrologCallback" not in script
    project.write("train.py", script)
    project.run("train.py", "--epochs", "2", "--samples", "64", **ENV)
    loops = read_db(project.root, "SELECT name, COUNT(*) FROM loops GROUP BY name ORDER BY name")
    assert loops == [("epoch", 2), ("step", 8)]
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'loss'") == [(8,)]
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints WHERE kind = 'end'") == [(1,)]
    # Typed run-level values: a predicate over the training arguments and the config.
    from retrolog import Project as Store

    store = Store(project.root)
    frame = store.dataframe("loss", where='learning_rate > 1e-4 AND "config.hidden_size" = 32')
    assert len(frame) == 8 and list(frame["step"]) == [0, 1, 2, 3] * 2
    # One point per step in the dashboard's series.
    (run_id,) = [r for (r,) in read_db(project.root, "SELECT run_id FROM runs")]
    (series,) = store.series("loss", [str(run_id)])
    assert series.total == 8 and len(series.x) == 8


# A few steps, to see what is refused and said: nothing is compared or timed, so the
# test shares the machine (no whole_machine).
def test_an_untested_transformers_records_without_checkpoints_and_says_so(
    project: Project,
) -> None:
    script = EXAMPLE.replace(
        "from retrolog.integrations",
        "import transformers\ntransformers.__version__ = '4.0.0'\nfrom retrolog.integrations",
    )
    project.write("train.py", script)
    out = project.run("train.py", "--epochs", "1", "--samples", "32", **ENV)
    lines = [line for line in out.stderr.splitlines() if line.startswith("retrolog:")]
    assert len(lines) == 1 and "transformers 4.0.0" in lines[0], out.stderr
    assert "without checkpoints" in lines[0]
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints") == [(0,)]
    assert read_db(project.root, "SELECT COUNT(*) FROM loops WHERE name = 'step'") == [(2,)]


# A few steps, to see what is refused and said: nothing is compared or timed, so the
# test shares the machine (no whole_machine).
def test_an_iterable_dataset_records_without_checkpoints_and_says_so(project: Project) -> None:
    script = (
        EXAMPLE.replace(
            "class Tokens(torch.utils.data.Dataset):",
            "class Tokens(torch.utils.data.IterableDataset):",
        )
        .replace(
            "    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:\n",
            "    def __iter__(self):\n"
            "        return (self[i] for i in range(len(self.ids)))\n\n"
            "    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:\n",
        )
        .replace("    def __len__(self) -> int:\n        return len(self.ids)\n\n", "")
    )
    # An iterable dataset has no length: the Trainer needs max_steps.
    script = script.replace(
        "    num_train_epochs=opts.epochs,\n",
        "    num_train_epochs=opts.epochs,\n    max_steps=4,\n",
    ).replace('eval_strategy="epoch",', 'eval_strategy="no",')
    assert "max_steps=4" in script and 'eval_strategy="no"' in script
    project.write("train.py", script)
    out = project.run("train.py", "--epochs", "1", "--samples", "32", **ENV)
    lines = [line for line in out.stderr.splitlines() if line.startswith("retrolog:")]
    assert len(lines) == 1 and "iterable dataset" in lines[0], out.stderr
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints") == [(0,)]
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'loss'") == [(4,)]
