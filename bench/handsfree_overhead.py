"""Record overhead of ``retrolog run`` (hands-free) against the instrumented script.

examples/train_digits.py as it is (``python train.py``) and with every ``rl.`` call but
``rl.log`` removed (``retrolog run train.py``), each in its own git project, run in
alternating pairs (A/B, then B/A) so machine load falls on both alike. Prints each
pair's wall times and the median ratio.

    PYTHONPATH=src .venv/bin/python bench/handsfree_overhead.py --pairs 4 --repeat 4
    PYTHONPATH=src .venv/bin/python bench/handsfree_overhead.py --pairs 4 --repeat 4 --aa
"""

from __future__ import annotations

import argparse
import ast
import os
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


def _timed(cmd: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, env=_env(), capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=4, help="training set repetitions")
    parser.add_argument(
        "--aa", action="store_true", help="the A/A floor: the instrumented script against itself"
    )
    opts = parser.parse_args()
    source = EXAMPLE.read_text().replace(".repeat(16", f".repeat({opts.repeat}")
    source = source.replace("repeat(16)", f"repeat({opts.repeat})")
    stripped = ast.unparse(ast.fix_missing_locations(_Strip().visit(ast.parse(source))))
    with tempfile.TemporaryDirectory() as tmp:
        inst = _project(Path(tmp) / "instrumented", source)
        free = _project(Path(tmp) / "handsfree", stripped)
        a = [sys.executable, "train.py"]
        b = [sys.executable, "-m", "retrolog", "run", "train.py"]
        if opts.aa:
            b, free = [sys.executable, "train.py"], _project(Path(tmp) / "again", source)
        ratios = []
        for i in range(opts.pairs):
            order = [(a, inst), (b, free)] if i % 2 == 0 else [(b, free), (a, inst)]
            times = {id(cmd): _timed(cmd, cwd) for cmd, cwd in order}
            ta, tb = times[id(a)], times[id(b)]
            ratios.append(tb / ta)
            print(f"pair {i}: instrumented {ta:.2f}s, hands-free {tb:.2f}s, ratio {tb / ta:.3f}")
        print(f"median ratio hands-free/instrumented: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
