"""Notebooks replay like scripts: cells executed by nbclient in a real ipykernel.

A notebook recorded across two versions (a cell edited between), its training cell run
twice in one kernel (two runs), a statement added in today's notebook, replayed from the
command line and from a cell: each replayed value equals, bit for bit, what a fresh
execution of today's notebook logs.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Project, read_db

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.slow

KERNEL = "retrolog-test-python"

SETUP = """\
import torch
from torch import nn

import retrolog as rl

torch.manual_seed(0)
x = torch.randn(64, 4)
y = (x.sum(dim=1) > 0).long()"""

TRAIN_V1 = """\
torch.manual_seed(1)
net = nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
with rl.checkpointing(net=net, opt=opt):
    for epoch in rl.loop("epoch", range(3)):
        for i in rl.loop("step", range(4)):
            opt.zero_grad()
            batch = slice(16 * i, 16 * i + 16)
            loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
            loss.backward()
            opt.step()
            rl.log("loss", loss.item())
        rl.log("acc", (net(x).argmax(1) == y).float().mean().item())"""

# The user's later edit: the batch count named, lines shifted; the same numbers.
TRAIN_V2 = TRAIN_V1.replace(
    "torch.manual_seed(1)\n", "torch.manual_seed(1)\nbatches = 4\n"
).replace('rl.loop("step", range(4))', 'rl.loop("step", range(batches))')

# Today's notebook: hindsight statements at the outer loop's end.
TRAIN_TODAY = TRAIN_V2.replace(
    '        rl.log("acc", ',
    '        rl.log("w_norm", net.weight.norm().item())\n'
    '        rl.log("b_norm", net.bias.norm().item())\n'
    '        rl.log("acc", ',
)

MAGIC = "%time total = float(x.sum())\n!echo shell"


def _notebook(*cells: str) -> Any:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Training")]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in cells]
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": KERNEL, "language": "python"}
    return nb


def _kernelspec(base: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """A kernel on this interpreter, found through JUPYTER_PATH; ``env`` its environment
    (Jupyter Server sets JPY_SESSION_NAME to the notebook's path)."""
    spec = base / "kernels" / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python", "env": env})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(base))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")


def _execute(root: Path, nb: Any, order: list[int]) -> list[list[str]]:
    """Execute ``nb``'s cells (indexes) in ``order`` in one fresh kernel with its cwd at
    ``root``; the text each cell printed."""
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=240,
        startup_timeout=180,  # a busy machine
        resources={"metadata": {"path": str(root)}},
    )
    printed = []
    with client.setup_kernel():
        for index in order:
            client.execute_cell(nb.cells[index], index)
            outputs = nb.cells[index].get("outputs", [])
            printed.append([o.get("text", "") for o in outputs if o.get("output_type") == "stream"])
    return printed


def _values(database: Path, name: str, origin: str | None = None) -> dict[str, dict[int, float]]:
    """Per run, ``name``'s value per epoch."""
    conn = sqlite3.connect(database)
    where = " AND l.origin = ?" if origin else ""
    rows = conn.execute(
        "SELECT l.run_id, e.iteration, l.value FROM logs l JOIN loops e ON e.run_id = l.run_id"
        f" AND e.ctx_id = l.ctx_id AND e.depth = 0 WHERE l.name = ?{where}",
        (name, origin) if origin else (name,),
    ).fetchall()
    conn.close()
    found: dict[str, dict[int, float]] = {}
    for run_id, epoch, value in rows:
        found.setdefault(run_id, {})[epoch] = value
    return found


def test_notebook_records_each_cell_execution_and_replays_exactly(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernelspec(tmp_path / "jupyter", monkeypatch, JPY_SESSION_NAME="train.ipynb")
    notebook = project.root / "train.ipynb"

    # Version 1: every cell in order, then the training cell again (a second run).
    nb = _notebook(SETUP, TRAIN_V1, MAGIC)
    nbformat.write(nb, notebook)
    _execute(project.root, nb, [1, 2, 3, 2])
    # Version 2: the training cell edited, executed once in a new kernel.
    nb = _notebook(SETUP, TRAIN_V2, MAGIC)
    nbformat.write(nb, notebook)
    _execute(project.root, nb, [1, 2])

    runs = read_db(
        project.root, "SELECT run_id, filename, argv, status FROM runs ORDER BY started_at"
    )
    assert [(f, json.loads(str(a)), s) for _, f, a, s in runs] == [
        ("train.ipynb", ["train.ipynb"], "finished")
    ] * 3
    run_ids = [str(r[0]) for r in runs]
    # One epoch row per epoch in each run: the second execution did not add to the first.
    epochs = read_db(
        project.root, "SELECT run_id, COUNT(*) FROM loops WHERE depth = 0 GROUP BY run_id"
    )
    assert sorted(n for _, n in epochs) == [3, 3, 3]

    # The code a run executed shows as the cells that ran, in order, as Python.
    from retrolog import Project as Store

    code = Store(project.root).code(run_ids[1])
    assert code["path"] == "train.ipynb"
    text = code["text"]
    assert "# %% [1]" in text and "# %% [4]" in text and '"cells"' not in text
    assert "# cell [2] trained another run: not run again here" in text
    assert "total = float(x.sum())  # (IPython) %time" in text
    assert "# (IPython, not run outside a kernel) !echo shell" in text
    assert "train.ipynb.json" in code["files"]  # the notebook as saved
    diff = Store(project.root).compare([run_ids[0], run_ids[2]])["diffs"][0]["diff"]
    assert "+batches = 4" in diff and "train.ipynb.json" not in diff

    # Today's notebook: the statements added in its training cell (saved, not executed).
    nb = _notebook(SETUP, TRAIN_TODAY, MAGIC)
    nbformat.write(nb, notebook)
    git_before = project.git("status", "--porcelain")
    out = project.cli("replay", "w_norm", "--script", "train.ipynb", "--yes")
    assert out.returncode == 0, out.stderr
    assert "differs" not in out.stderr

    # From a cell: the API in a kernel.
    ask = _notebook('import retrolog as rl\nprint(rl.replay("b_norm").shape)')
    printed = _execute(project.root, ask, [1])
    assert printed and "(9," in "".join(printed[0])
    assert project.git("status", "--porcelain") == git_before
    assert read_db(project.root, "SELECT COUNT(*) FROM runs") == [(3,)]

    # What a fresh execution of today's notebook logs, in a store of its own.
    fresh_store = tmp_path / "fresh"
    _kernelspec(
        tmp_path / "jupyter",
        monkeypatch,
        JPY_SESSION_NAME="train.ipynb",
        RETROLOG_STORE=str(fresh_store),
    )
    _execute(project.root, nb, [1, 2])
    database = project.root / ".retrolog" / "retrolog.db"
    for name in ("w_norm", "b_norm"):
        (expected,) = _values(fresh_store / "retrolog.db", name).values()
        assert len(expected) == 3
        replayed = _values(database, name, origin="backfilled")
        assert replayed == {run_id: expected for run_id in run_ids}, name
