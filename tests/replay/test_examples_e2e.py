"""The example ports of well-known training scripts, recorded and replayed as a user would.

For each of ``examples/mnist_cnn.py``, ``examples/word_lm.py``,
``examples/dcgan.py`` and ``examples/actor_critic.py``: an older version (a real
kind of change: another optimizer, another default, a flag that did not exist)
is committed and run, then the example as it is now is committed and run with a
flag changed (both runs on a quarter of the default training data, through the script's
own flag, to keep the suite short); today's edit adds one statement in the outer
(epoch) loop and one in the inner (step) loop. Everything runs with default
settings: torch's own thread count, the adaptive checkpoint policy, the default
number of replay workers. Each backfilled value must equal, bit for bit, what a
fresh run of the run's version with both statements propagated into it logs
(``retrolog propagate``; each replay ran that file less the other statement's
line).

The actor-critic's older version kept the autograd graph in ``model.saved_actions``: its
block checkpoints cannot hold that, and the plan must say so and execute those step loops;
today's keeps data there, which its checkpoints carry, and its outer statement reads
``len(model.rewards)``, an attribute only a restored checkpoint puts back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import Project, logged_values, read_db

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# What the user's shell may hold: these tests start from none of it, as a default shell would.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _edit(text: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert old in text, f"the example no longer contains {old!r}"
        text = text.replace(old, new)
    return text


@dataclass(frozen=True)
class Case:
    script: str
    older: Callable[[str], str]  # the example as it was one commit ago
    old_args: tuple[str, ...]
    new_args: tuple[str, ...]
    outer: tuple[str, str, str]  # name, the line it follows, the statement (indented)
    inner: tuple[str, str, str]
    where: str  # a predicate on an argparse flag that picks the newer run only
    plan_says: str | None = None  # what the outer replay's plan must say

    def today(self, text: str) -> str:
        for _, after, statement in (self.outer, self.inner):
            text = _edit(text, (after, after + statement))
        return text


def _mnist_older(text: str) -> str:
    # Before Adadelta with a StepLR schedule, the script trained with SGD and momentum.
    return _edit(
        text,
        (
            'parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step'
            ' gamma")',
            'parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")',
        ),
        ('type=float, default=1.0, help="learning rate"', 'type=float, default=0.05, help="lr"'),
        (
            "    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)\n"
            "    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)\n",
            "    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr,"
            " momentum=args.momentum)\n",
        ),
        (
            "rl.checkpointing(model=model, optimizer=optimizer, scheduler=scheduler)",
            "rl.checkpointing(model=model, optimizer=optimizer)",
        ),
        ("            scheduler.step()\n", ""),
    )


def _word_lm_older(text: str) -> str:
    # Before --dropout existed, the model used its default of 0.5; clipping was looser.
    return _edit(
        text,
        (
            'parser.add_argument("--dropout", type=float, default=0.2, help="dropout applied'
            ' to layers")\n',
            "",
        ),
        ('"--clip", type=float, default=0.25', '"--clip", type=float, default=0.5'),
        (
            "RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)",
            "RNNModel(ntokens, args.emsize, args.nhid, args.nlayers)",
        ),
    )


def _dcgan_older(text: str) -> str:
    # Before --beta1, both optimizers used Adam's default betas.
    return _edit(
        text,
        (
            '    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam")\n',
            "",
        ),
        (
            "netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))",
            "netD.parameters(), lr=opt.lr)",
        ),
        (
            "netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))",
            "netG.parameters(), lr=opt.lr)",
        ),
    )


def _actor_critic_older(text: str) -> str:
    # Before the update ran the network again over the episode's states, each step kept
    # its log-probability and value tensors, graph and all, as the original script does.
    return _edit(
        text,
        (
            "        default=False,\n        help=\"keep each step's",
            "        default=True,\n        help=\"keep each step's",
        ),
    )


CASES = {
    "mnist_cnn": Case(
        script="mnist_cnn.py",
        older=_mnist_older,
        old_args=("--train-size", "256"),
        new_args=("--train-size", "256", "--lr", "0.5"),
        outer=(
            "w_norm",
            '            rl.log("accuracy", accuracy)\n',
            '            rl.log("w_norm", sum(p.norm().item() ** 2 for p in model.parameters())'
            " ** 0.5)\n",
        ),
        inner=(
            "grad_norm",
            "        optimizer.step()\n",
            '        rl.log("grad_norm", model.conv2.weight.grad.norm().item())\n',
        ),
        where="gamma = 0.7",
    ),
    "word_lm": Case(
        script="word_lm.py",
        older=_word_lm_older,
        old_args=("--tokens", "6000"),
        new_args=("--tokens", "6000", "--lr", "10"),
        outer=(
            "emb_norm",
            '        rl.log("val_loss", val_loss)\n',
            '        rl.log("emb_norm", model.encoder.weight.norm().item())\n',
        ),
        inner=(
            "hidden_norm",
            "        loss = criterion(output, targets)\n",
            '        rl.log("hidden_norm", hidden[0].norm().item())\n',
        ),
        where="dropout = 0.2",
    ),
    "dcgan": Case(
        script="dcgan.py",
        older=_dcgan_older,
        old_args=("--images", "256"),
        new_args=("--images", "256", "--lr", "0.0005"),
        outer=(
            "g_norm",
            '            rl.log("fake_mean", fake.mean().item())\n',
            '            rl.log("g_norm", sum(p.norm().item() ** 2 for p in netG.parameters())'
            " ** 0.5)\n",
        ),
        inner=(
            "d_x",
            "                optimizerG.step()\n",
            '                rl.log("d_x", D_x)\n',
        ),
        where="beta1 = 0.5",
    ),
    "actor_critic": Case(
        script="actor_critic.py",
        older=_actor_critic_older,
        old_args=("--episodes", "16"),
        new_args=("--episodes", "16", "--lr", "0.01"),
        outer=(
            "steps",
            "            running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward\n",
            '            rl.log("steps", len(model.rewards))\n',
        ),
        inner=(
            "pole_angle",
            "                ep_reward += reward\n",
            '                rl.log("pole_angle", float(state[2]))\n',
        ),
        where="lr = 0.01",
        plan_says="cannot restore what their block changed, so those blocks are executed: "
        "model.saved_actions (it holds tensors that carry autograd history",
    ),
}


def _env(project: Project, **extra: str) -> dict[str, str]:
    """A default shell: no thread variables; the adaptive rule (Project.env pins "every")."""
    env = project.env(RETROLOG_CHECKPOINTS="adaptive", **extra)
    return {k: v for k, v in env.items() if k not in THREAD_VARIABLES}


def _run(project: Project, script: str, args: tuple[str, ...]) -> None:
    subprocess.run(
        [sys.executable, script, *args], cwd=project.root, env=_env(project), check=True,
        capture_output=True, timeout=300,
    )  # fmt: skip


def _cli(project: Project, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "retrolog", *args], cwd=project.root, env=_env(project),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


_values = logged_values


def _worker_outputs(project: Project, run_id: str) -> list[dict[str, Any]]:
    newest = sorted((project.root / ".retrolog" / "replays").iterdir())[-1]
    return [json.loads(p.read_text()) for p in newest.glob(f"{run_id}*.out.json")]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.usefixtures("whole_machine")
def test_example_replays_bit_exact_under_default_settings(project: Project, name: str) -> None:
    case = CASES[name]
    current = (EXAMPLES / case.script).read_text()
    outer, inner = case.outer[0], case.inner[0]

    project.write(case.script, case.older(current))
    project.git("add", case.script)
    project.git("commit", "--quiet", "-m", "older version")
    _run(project, case.script, case.old_args)
    project.write(case.script, current)
    project.git("commit", "--quiet", "-am", "the example as it is now")
    _run(project, case.script, case.new_args)
    runs = [str(r) for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]
    argv = {
        str(r): json.loads(str(a))
        for r, a in read_db(project.root, "SELECT run_id, argv FROM runs")
    }
    # The argparse flags are run-level values a where clause can select on.
    picked = _cli(project, "dataframe", "lr", "--where", case.where, "--json")
    assert picked.returncode == 0, picked.stderr
    assert [row["run_id"] for row in json.loads(picked.stdout)] == [runs[1]]

    project.write(case.script, case.today(current))  # today's edit, not committed

    out = _cli(project, "replay", outer, "--yes")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "differs" not in out.stderr and "inexact" not in out.stderr, out.stderr
    if case.plan_says is not None:
        assert case.plan_says in " ".join((out.stdout + out.stderr).split()), out.stderr
    restored = sum(o["restored"] for run in runs for o in _worker_outputs(project, run))
    assert restored >= 1, f"no epoch was restored from a checkpoint:\n{out.stderr}"
    out = _cli(project, "replay", inner, "--yes")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "differs" not in out.stderr and "inexact" not in out.stderr, out.stderr
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE inexact IS NOT NULL") == [(0,)]
    # Every script run to its end (a verifying replay recomputes every recorded statement),
    # by workers forked from the fork server, which leave without finalizing their modules.
    out = _cli(project, "replay", "--verify", "--yes")
    assert out.returncode == 0, out.stdout + out.stderr
    both = out.stdout + out.stderr
    assert f"Verified {len(runs)} run(s): {len(runs)} replay exactly" in both, both
    assert "forked from" in both, both

    store = project.root / ".retrolog" / "retrolog.db"
    code = dict(read_db(project.root, "SELECT run_id, code_commit FROM runs"))
    for run_id in runs:
        recorded = _keyed(_values(store, "WHERE l.run_id = ? AND l.origin = 'recorded'", (run_id,)))
        # One fresh run stands for both replays: the run's version with both statements
        # propagated, which is what each replay ran plus the other statement's line.
        old = project.git("show", f"{code[run_id]}:{case.script}")
        both = _propagated(project, case.script, old, f"{outer},{inner}")
        lines = both.splitlines(keepends=True)
        fresh = _fresh(project, case.script, both, argv[run_id][1:])
        assert {k: v for k, v in fresh.items() if k in recorded} == recorded, run_id
        for (wanted, statement), (_, other) in (
            ((outer, case.outer[2]), (inner, case.inner[2])),
            ((inner, case.inner[2]), (outer, case.outer[2])),
        ):
            rows = read_db(
                project.root,
                "SELECT DISTINCT code_object FROM logs WHERE run_id = ? AND name = ?",
                (run_id, wanted),
            )
            assert len(rows) == 1, rows
            code_git = str(project.root / ".retrolog" / "code.git")  # what replay executed
            ran = project.git("--git-dir", code_git, "cat-file", "-p", str(rows[0][0]))
            assert statement.strip() in ran, (run_id, statement)
            assert ran == "".join(x for x in lines if x.strip() != other.strip()), run_id
            expected = {k: v for k, v in fresh.items() if k[0] == wanted}
            assert expected, (run_id, wanted)
            where = "WHERE l.run_id = ? AND l.name = ? AND l.origin = 'backfilled'"
            assert _keyed(_values(store, where, (run_id, wanted))) == expected, (run_id, wanted)


def _propagated(project: Project, script: str, old: str, names: str) -> str:
    """``retrolog propagate`` of today's statements into ``old``, as a user would review it."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / script).write_text(old)
        out = _cli(project, "propagate", script, str(Path(tmp) / script), "--names", names)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _keyed(values: dict[Any, Any]) -> dict[Any, Any]:
    """(run_id, name, epoch, step) -> (name, epoch, step)."""
    return {k[1:]: v for k, v in values.items()}


def _fresh(project: Project, script: str, source: str, args: list[str]) -> dict[Any, Any]:
    """What a fresh run of ``source`` with ``args`` logs, keyed by (name, epoch, step)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        (where / script).write_text(source)
        proc = subprocess.run(
            [sys.executable, script, *args], cwd=where,
            env=_env(project, RETROLOG_STORE=str(where / "store")),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return _keyed(_values(where / "store" / "retrolog.db"))
