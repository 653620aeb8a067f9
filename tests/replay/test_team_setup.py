"""The team path as a user takes it, under the defaults users run with.

A torch script shaped like a real one (argparse, its loops in a function, a DataLoader,
a scheduler) is recorded with torch's own threads and the adaptive checkpoint rule;
the store's objects are moved to S3 with ``retrolog migrate``; then a new statement is
replayed as Ray tasks with the default number of workers, the nodes reading code and
checkpoints from S3 alone (the local objects are gone). The backfilled values must be
exactly what a fresh recording of the new script logs, and the checkpoints the rule
chose must have been restored rather than retrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training_scripts import REAL_SHAPED, W_NORM, fresh_w_norms, new_project

from conftest import ray_env, read_db, values_by_run

pytestmark = pytest.mark.slow

DEFAULTS = {"RETROLOG_CHECKPOINTS": ""}  # the suite pins "every"; users don't
LRS = ("0.1", "0.05")


@pytest.mark.usefixtures("whole_machine")
def test_a_migrated_store_replays_on_ray_exactly_under_default_settings(
    tmp_path: Path, s3_url: str, ray_address: str
) -> None:
    project = new_project(tmp_path / "proj")
    project.write("train.py", REAL_SHAPED)
    project.git("add", "-A")
    project.git("commit", "-qm", "train")
    for lr in LRS:
        project.run("train.py", "--lr", lr, **DEFAULTS)
    chosen = [
        json.loads(str(c)) for (c,) in read_db(project.root, "SELECT checkpointing FROM runs")
    ]
    assert all(c["written"] == c["chosen"] for c in chosen), chosen

    out = project.cli("migrate", "--objects", s3_url, "--yes")
    assert out.returncode == 0, out.stderr
    objects = project.root / ".retrolog" / "objects"
    objects.rename(tmp_path / "objects-aside")  # from now on only S3 has them

    project.write("train.py", REAL_SHAPED.replace("# HINDSIGHT", W_NORM))
    out = project.cli(
        "replay", "w_norm", "--yes", "--executor", "ray", **ray_env(ray_address), **DEFAULTS
    )
    assert out.returncode == 0, out.stderr
    assert f"workers run as Ray tasks on the cluster at {ray_address}" in out.stderr
    assert "was not restored" not in out.stderr, out.stderr
    assert "Replayed 2 run(s)" in out.stderr, out.stderr
    assert not objects.exists()  # nothing was read back into a local directory

    # Epochs of real length: the rule kept block checkpoints, and the nodes restored them
    # from S3. How many per run is the rule's and the planner's choice, by the load.
    restored = dict(read_db(project.root, "SELECT run_id, restored FROM replay_runs"))
    assert len(restored) == 2 and sum(int(str(r or 0)) for r in restored.values()) > 0, (
        restored,
        out.stderr,
    )

    replayed = values_by_run(project.root, "w_norm")
    by_lr = {}
    for run_id, argv in read_db(project.root, "SELECT run_id, argv FROM runs"):
        args = json.loads(str(argv))
        by_lr[args[args.index("--lr") + 1]] = replayed[str(run_id)]
    for lr in LRS:
        expected = [norm for _, norm in fresh_w_norms("--lr", lr)]
        assert len(expected) == 4 and by_lr[lr] == expected, lr


NODE_WITHOUT_CREDENTIALS = """\
import json, sys
from retrolog._replay.ray_executor import SegmentTask, WorkerRows, run_segment

code = {"run_id": "r1", "code_commit": "c" * 40, "code_tree": "a" * 40, "code_manifest": "b" * 64}
task = SegmentTask(
    key="r1#0", spec={"run_id": "r1", "objects": sys.argv[1]}, argv=["train.py"],
    filename="train.py", cwd=".", source="", skipped=[], numerics=None, code=code,
    git_dir="/nonexistent", commit="c" * 40, project="/nonexistent", store="/nonexistent",
    log_path="/nonexistent/r1.log",
)
print(json.dumps(run_segment(task, WorkerRows(loops=[], checkpoints=[]))))
"""


def test_a_node_that_cannot_read_the_object_store_is_told_what_to_configure(
    tmp_path: Path, s3_url: str
) -> None:
    """The body of a Ray task on a node whose environment has no S3 credentials: one
    paragraph naming the store and what every node needs, not the client's bare error."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=os.environ["AWS_ENDPOINT_URL"],  # reachable, but no credentials
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    out = subprocess.run(
        [sys.executable, "-c", NODE_WITHOUT_CREDENTIALS, s3_url],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["returncode"] is None and result["output"] is None
    error = result["error"]
    assert f"cannot read the run's code from the object store at {s3_url}" in error
    assert "NoCredentialsError" in error
    assert "give the nodes its address and credentials" in error
    assert "\n" not in error and "Traceback" not in error
