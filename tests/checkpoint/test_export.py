"""`retrolog checkpoint export` and `Project.export_checkpoint`: a recorded checkpoint as the
file torch.save writes, read back with torch.load(..., weights_only=True)."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import retrolog
from training_scripts import digest, shared_torch_runs

from conftest import Project, read_db


@pytest.fixture(scope="module")
def torch_template() -> Path:
    """Two recorded torch runs (every block checkpointed), recorded once for the session
    and copied by each test."""
    return shared_torch_runs()


@pytest.fixture
def torch_runs(torch_template: Path, tmp_path: Path) -> Project:
    root = tmp_path / "proj"
    shutil.copytree(torch_template, root, symlinks=True)
    return Project(root)


def first_run(project: Project) -> str:
    return str(read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")[0][0])


def logged(project: Project, run_id: str, name: str) -> dict[int | None, object]:
    rows = read_db(
        project.root,
        "SELECT e.iteration, l.value FROM logs l LEFT JOIN loops e ON e.run_id = l.run_id"
        " AND e.ctx_id = l.ctx_id WHERE l.run_id = ? AND l.name = ?",
        (run_id, name),
    )
    return dict(rows)


def test_exported_file_loads_with_weights_only_into_the_recorded_state(
    torch_runs: Project, tmp_path: Path
) -> None:
    run_id = first_run(torch_runs)
    out = tmp_path / "epoch2.pt"
    done = torch_runs.cli("checkpoint", "export", run_id[:-2], "2", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert f"epoch 2 of run {run_id}" in done.stderr
    loaded = torch.load(out, weights_only=True)
    assert sorted(loaded) == ["net", "opt"]
    torch.manual_seed(99)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    net.load_state_dict(loaded["net"])
    opt.load_state_dict(loaded["opt"])
    assert digest(net, opt) == logged(torch_runs, run_id, "digest")[2]

    # Without AT: the end checkpoint. An existing file is kept unless --force.
    end = tmp_path / "end.pt"
    end.write_bytes(b"mine")
    refused = torch_runs.cli("checkpoint", "export", run_id, "-o", str(end))
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert end.read_bytes() == b"mine"
    done = torch_runs.cli("checkpoint", "export", run_id, "-o", str(end), "--force")
    assert done.returncode == 0, done.stderr
    loaded = torch.load(end, weights_only=True)
    net.load_state_dict(loaded["net"])
    opt.load_state_dict(loaded["opt"])
    assert digest(net, opt) == logged(torch_runs, run_id, "final_digest")[None]


def test_a_position_without_a_checkpoint_says_which_there_are(
    torch_runs: Project, tmp_path: Path
) -> None:
    run_id = first_run(torch_runs)
    out = tmp_path / "x.pt"
    missing = torch_runs.cli("checkpoint", "export", run_id, "9", "-o", str(out))
    assert missing.returncode == 1
    assert "no checkpoint at epoch 9" in missing.stderr
    assert "epoch 0, 1, 2, 3, 4, end" in missing.stderr.replace("\n", " ")
    assert "Traceback" not in missing.stderr
    bad = torch_runs.cli("checkpoint", "export", run_id, "last", "-o", str(out))
    assert bad.returncode == 2 and "neither an iteration number nor 'end'" in bad.stderr
    assert not out.exists()


PLAIN = """\
import random

import numpy as np

import retrolog as rl

state = {"w": np.arange(6.0).reshape(2, 3), "n": 0, "tags": frozenset({"a"}),
         "count": np.int64(7)}
rng = random.Random(5)
with rl.checkpointing(state=state, rng=rng):
    for epoch in rl.loop("epoch", range(2)):
        state["w"] += 1
        state["n"] = epoch
        rng.random()
"""


def test_arrays_and_plain_values_come_out_as_torch_loads_them(
    project: Project, tmp_path: Path
) -> None:
    project.write("plain.py", PLAIN)
    project.run("plain.py")
    run_id = first_run(project)
    out = tmp_path / "plain.pt"
    done = retrolog.Project(project.root).export_checkpoint(run_id, 1, out)
    assert (done["loop"], done["at"], done["names"]) == ("epoch", 1, ["state", "rng"])
    loaded = torch.load(out, weights_only=True)
    state = loaded["state"]
    assert torch.equal(state["w"], torch.from_numpy(np.arange(6.0).reshape(2, 3) + 2))
    assert (state["n"], state["tags"], state["count"]) == (1, {"a"}, 7)
    expected = random.Random(5)
    expected.random()
    expected.random()
    assert loaded["rng"] == expected.getstate()


PICKLED = """\
import retrolog as rl


class Box:
    def __init__(self):
        self.v = 1


state = {"box": Box()}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(1)):
        state["box"].v += 1
"""


def test_a_checkpoint_holding_a_pickle_is_refused_even_when_trusted(
    project: Project, tmp_path: Path
) -> None:
    project.write("pickled.py", PICKLED)
    project.run("pickled.py", RETROLOG_ALLOW_PICKLES="1")
    out = tmp_path / "p.pt"
    run_id = first_run(project)
    refused = project.cli("checkpoint", "export", run_id, "0", "-o", str(out),
                          RETROLOG_TRUST_PICKLES="1")  # fmt: skip
    assert refused.returncode == 1
    assert "holds a pickled object" in refused.stderr
    assert "never unpickles" in refused.stderr.replace("\n", " ")
    assert not out.exists() and not list(tmp_path.glob(".p.pt*"))


def test_without_torch_the_error_says_to_install_it(project: Project, tmp_path: Path) -> None:
    project.write("plain.py", PLAIN)
    project.run("plain.py")
    out = tmp_path / "plain.pt"
    without_torch = (
        "import sys; sys.modules['torch'] = None; from retrolog.cli import main; "
        f"sys.argv = ['retrolog', 'checkpoint', 'export', {first_run(project)!r}, '1', "
        f"'-o', {str(out)!r}]; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", without_torch], cwd=project.root, env=project.env(),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    text = done.stderr.replace("\n", " ")
    assert "needs torch, which is not installed" in text
    assert "pip install 'retrolog[torch]'" in text
    assert not out.exists()
