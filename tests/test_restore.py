"""rl.restore: a recorded checkpoint of any run back into live objects, exactly."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import retrolog as rl
from retrolog._restore import RestoredCheckpoint
from retrolog.errors import CheckpointTargetError, RunNotFoundError, StoreError, UsageError
from training_scripts import NUMPY_TRAIN, digest, shared_torch_runs

from conftest import Project, read_db


@pytest.fixture(scope="module")
def torch_template() -> Path:
    """Two recorded torch runs (every block checkpointed), recorded once for the session
    and copied by each test."""
    return shared_torch_runs()


@pytest.fixture
def recorded(
    torch_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Project]:
    root = tmp_path / "proj"
    shutil.copytree(torch_template, root, symlinks=True)
    monkeypatch.chdir(root)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Project(root)
    torch.set_num_threads(threads)


def fresh_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The script's model and optimizer, untrained: restoring must make them the recorded ones."""
    torch.manual_seed(1234)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return net, torch.optim.Adam(net.parameters(), lr=0.05)


def runs(project: Project) -> list[str]:
    return [r for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]


def logged(project: Project, run_id: str, name: str) -> dict[int | None, object]:
    """``name``'s values in ``run_id`` by epoch (None: logged after the loop)."""
    rows = read_db(
        project.root,
        "SELECT e.iteration, l.value FROM logs l LEFT JOIN loops e ON e.run_id = l.run_id"
        " AND e.ctx_id = l.ctx_id WHERE l.run_id = ? AND l.name = ?",
        (run_id, name),
    )
    return dict(rows)


def test_restore_by_run_id_and_iteration_is_the_recorded_state(recorded: Project) -> None:
    run_id = runs(recorded)[1]
    digests = logged(recorded, run_id, "digest")
    assert len(digests) == 5
    net, opt = fresh_model()
    for epoch in (3, 0, 4, 2):
        result = rl.restore(run_id, at=epoch, net=net, opt=opt)
        assert digest(net, opt) == digests[epoch], epoch
        assert result == RestoredCheckpoint(
            run_id=run_id,
            at=epoch,
            loop_name="epoch",
            manifest=result.manifest,
            names=("net", "opt"),
            available=("net", "opt"),
            rng=False,
        )
    # The restored state trains on like the recorded one: the optimizer's state is live.
    net(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_default_is_the_end_checkpoint_and_a_prefix_names_the_run(recorded: Project) -> None:
    run_id = runs(recorded)[0]
    net, opt = fresh_model()
    result = rl.restore(run_id[:-2], net=net, opt=opt)
    assert (result.run_id, result.at) == (run_id, "end")
    assert digest(net, opt) == logged(recorded, run_id, "final_digest")[None]
    assert rl.restore(run_id, at="end", net=net).at == "end"


def test_restore_from_a_dataframe_row(recorded: Project) -> None:
    frame = rl.dataframe("val_acc", "val_loss")
    best = frame.loc[frame["val_loss"].idxmin()]  # seed 0 bottoms at epoch 3, seed 1 at 2
    net, opt = fresh_model()
    result = rl.restore(best, net=net, opt=opt)
    assert (result.run_id, result.at) == (best["run_id"], int(best["epoch"]))
    assert digest(net, opt) == logged(recorded, best["run_id"], "digest")[int(best["epoch"])]

    one_row = frame[(frame["run_id"] == runs(recorded)[1]) & (frame["epoch"] == 4)]
    assert rl.restore(one_row, net=net, opt=opt).at == 4
    assert digest(net, opt) == logged(recorded, runs(recorded)[1], "digest")[4]
    # An explicit position wins over the row's.
    assert rl.restore(one_row, at=1, net=net, opt=opt).at == 1

    # A run-level value's row has no epoch: the end checkpoint, where the value was logged.
    final = rl.dataframe("final_digest")
    row = final.iloc[1]
    assert "epoch" not in final.columns
    assert rl.restore(row, net=net, opt=opt).at == "end"
    assert digest(net, opt) == row["final_digest"]


def test_a_subset_of_the_objects_and_the_random_states(recorded: Project) -> None:
    run_id = runs(recorded)[0]
    net, opt = fresh_model()
    untouched = {k: v.clone() for k, v in net.state_dict().items()}
    result = rl.restore(run_id, at=2, opt=opt)  # the optimizer alone
    assert result.names == ("opt",) and result.available == ("net", "opt")
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in untouched.items())
    assert opt.state_dict()["state"]  # Adam's moments came back

    # By default the process's random state is left alone ...
    torch.manual_seed(99)
    state = torch.get_rng_state()
    rl.restore(run_id, at=2, net=net)
    assert torch.equal(torch.get_rng_state(), state)
    # ... and with rng=True it is the one the run had where the block ended: the next
    # draw is the one the script logged right after it.
    assert rl.restore(run_id, at=2, net=net, rng=True).rng
    assert torch.rand(1).item() == logged(recorded, run_id, "draw")[2]


def test_errors_name_the_problem_and_the_choices(recorded: Project) -> None:
    run_id = runs(recorded)[0]
    net, _ = fresh_model()
    with pytest.raises(CheckpointTargetError, match="no object named 'model'; it holds 'net'"):
        rl.restore(run_id, at=1, model=net)
    with pytest.raises(RunNotFoundError, match=r"no checkpoint at epoch 9; .* epoch 0-4, end"):
        rl.restore(run_id, at=9, net=net)
    with pytest.raises(UsageError, match="at= takes an outer-loop iteration"):
        rl.restore(run_id, at="last", net=net)
    with pytest.raises(UsageError, match="at= takes"):
        rl.restore(run_id, at=True, net=net)
    with pytest.raises(UsageError, match="rng= is a flag"):
        rl.restore(run_id, net=net, rng=torch.Generator())  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="needs the live objects"):
        rl.restore(run_id, at=1)
    with pytest.raises(UsageError, match="takes a run id"):
        rl.restore(42, net=net)
    with pytest.raises(UsageError, match="not 10 rows"):
        rl.restore(rl.dataframe("val_acc"), net=net)
    with pytest.raises(RunNotFoundError, match="No run has the id 'nope'"):
        rl.restore("nope", net=net)

    # After gc, what is left is listed, and gc is named as a reason.
    out = recorded.cli("gc", "--keep", "last:1", "--grace", "0", "--yes")
    assert out.returncode == 0, out.stderr
    with pytest.raises(
        RunNotFoundError, match=r"at epoch 1; it has checkpoints at epoch 4, end\. .*retrolog gc"
    ):
        rl.restore(run_id, at=1, net=net)

    # A checkpoint whose object is gone says which checkpoint could not be restored.
    (manifest,) = read_db(
        recorded.root,
        "SELECT manifest FROM checkpoints WHERE run_id = ? AND kind = 'block'",
        (run_id,),
    )[0]
    (recorded.root / ".retrolog" / "objects" / manifest[:2] / manifest[2:]).unlink()
    with pytest.raises(
        StoreError, match=f"Cannot restore the checkpoint at epoch 4 of run {run_id}"
    ):
        rl.restore(run_id, at=4, net=net)


def test_a_run_without_checkpoints(project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    project.write("train.py", NUMPY_TRAIN.replace("with rl.checkpointing(w=w):", "if True:"))
    project.run("train.py", "--kwargs", "epochs=1")
    monkeypatch.chdir(project.root)
    (run_id,) = runs(project)
    with pytest.raises(RunNotFoundError, match="no checkpoint to restore"):
        rl.restore(run_id, w=[])
