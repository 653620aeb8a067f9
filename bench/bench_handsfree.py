"""Record overhead of ``retrolog run`` (hands-free) against the instrumented script.

examples/train_digits.py as it is (``python train.py``), the same again in another
project (the A/A floor), and with every ``rl.`` call but ``rl.log`` removed
(``retrolog run train.py``), each in its own git project, in rounds whose order rotates
so machine load falls on each alike. Whole processes: the hands-free side pays its
analysis and rewrite too. Each is timed twice: wall time, and CPU time (user + sys of the
process tree, ``getrusage(RUSAGE_CHILDREN)`` deltas around it), which carries much less
of other users' load on a shared machine; each has its own A/A floor. Prints each round
and the median ratios with their spread.

    .venv/bin/python -m bench.bench_handsfree --rounds 6 --json bench/results/handsfree.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"


class _Strip(ast.NodeTransformer):
    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        named = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
        if named and func.value.id == "rl" and func.attr in ("loop", "arg"):  # type: ignore[attr-defined]
            return node.args[1]
        return node

    def visit_With(self, node: ast.With) -> ast.AST | list[ast.stmt]:
        self.generic_visit(node)
        call = node.items[0].context_expr
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "checkpointing":
            return node.body
        return node


def _project(root: Path, text: str) -> Path:
    root.mkdir()
    (root / "train.py").write_text(text)
    for args in (["init", "-q"], ["add", "train.py"], ["commit", "-q", "-m", "v"]):
        subprocess.run(["git", *args], cwd=root, check=True, env=_env())
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    env.update(RETROLOG_PROGRESS="0", GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b",
               GIT_COMMITTER_NAME="b", GIT_COMMITTER_EMAIL="b@b")  # fmt: skip
    return env


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(cmd: list[str], cwd: Path) -> tuple[float, float]:
    """Wall time and CPU time (user + sys of the process and the children it waited for)."""
    cpu, started = _children_cpu(), time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, env=_env(), capture_output=True)
    return time.perf_counter() - started, _children_cpu() - cpu


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=4, help="training set repetitions")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    opts = parser.parse_args()
    source = EXAMPLE.read_text().replace(".repeat(16", f".repeat({opts.repeat}")
    source = source.replace("repeat(16)", f"repeat({opts.repeat})")
    stripped = ast.unparse(ast.fix_missing_locations(_Strip().visit(ast.parse(source))))
    with tempfile.TemporaryDirectory() as tmp:
        # A: the instrumented script; A2: the same again, in a project of its own (the A/A
        # floor); B: the stripped script under `retrolog run`. Each round runs all three,
        # in an order that rotates, so load falls on each alike.
        commands = {
            "instrumented": ([sys.executable, "train.py"], _project(Path(tmp) / "a", source)),
            "instrumented_again": (
                [sys.executable, "train.py"],
                _project(Path(tmp) / "a2", source),
            ),
            "handsfree": (
                [sys.executable, "-m", "retrolog", "run", "train.py"],
                _project(Path(tmp) / "b", stripped),
            ),
        }
        names = list(commands)
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        for i in range(opts.rounds):
            order = names[i % 3 :] + names[: i % 3]
            for name in order:
                command, cwd = commands[name]
                wall, used = _timed(command, cwd)
                times[name].append(wall)
                cpu[name].append(used)
            print(
                f"round {i}: "
                + ", ".join(
                    f"{name} {times[name][-1]:.2f}s ({cpu[name][-1]:.2f}s CPU)" for name in names
                ),
                flush=True,
            )
    result: dict[str, object] = {
        "rounds": opts.rounds,
        "repeat": opts.repeat,
        "load_average_after": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for kind, measured in (("wall", times), ("cpu", cpu)):
        a, a2, b = measured["instrumented"], measured["instrumented_again"], measured["handsfree"]
        figures = {
            "seconds": {name: _spread(values) for name, values in measured.items()},
            "ratio_handsfree_to_instrumented": _spread([y / x for x, y in zip(a, b, strict=True)]),
            "ratio_aa_floor": _spread([y / x for x, y in zip(a, a2, strict=True)]),
            "extra_seconds": _spread([y - x for x, y in zip(a, b, strict=True)]),
            "aa_seconds": _spread([y - x for x, y in zip(a, a2, strict=True)]),
        }
        result[kind] = figures
        for label, key in (
            ("hands-free / instrumented", "ratio_handsfree_to_instrumented"),
            ("A/A floor", "ratio_aa_floor"),
        ):
            print(f"{kind}: {label}: median {{median:.3f}} [{{min:.3f}}..{{max:.3f}}]".format(
                **figures[key]))  # fmt: skip
        print(
            f"{kind}: hands-free - instrumented: median {figures['extra_seconds']['median']:+.2f}s"
            f"; A/A: median {figures['aa_seconds']['median']:+.2f}s"
        )
    if opts.json is not None:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
