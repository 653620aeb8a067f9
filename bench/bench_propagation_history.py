"""Benchmark: propagating two statements into every past version of a real training script.

Run from the repository root with the project's venv, on a repository fetched at
run time (nothing of it is kept in this project):

    python -m bench.bench_propagation_history --git DIR --file PATH [--file PATH ...]
    python -m bench.bench_propagation_history --git DIR --file mnist/main.py --verbose
    python -m bench.bench_propagation_history --git DIR --all \
        --json bench/results/propagation_history.json

DIR is a git directory (bare or ``.git``); PATH a file in its newest commit, or
in the newest commit that still has it. For each file the benchmark

1. *adopts* the newest version as a user would: ``import retrolog as rl``, the
   epoch and batch loops wrapped in ``rl.loop("epoch", ...)`` /
   ``rl.loop("step", ...)`` (inside or outside ``enumerate(...)``, as the spec
   for that file says), and two statements a user would add, one in each loop;
2. walks the file's history (``git log --follow``), keeping distinct contents
   only (commits that did not change the file's bytes are counted and skipped);
3. propagates the two statements from the adopted file into each version as it
   is in history (never adopted: runs before retrolog existed in the project);
4. judges each outcome with the file's *oracle*: a rule written by a human
   reading that file's history, which says from the syntax of one version
   alone, without the aligner, where the statement belongs there (e.g. right
   after the statement that steps the optimizer, or nowhere).

Outcomes per statement: ``correct`` (placed where the oracle says),
``misplaced`` (placed anywhere else, or placed where the oracle says nothing
fits), ``refused-should-place`` (refused although the oracle found its place)
and ``refused-nothing-fits`` (refused, and the oracle agrees there is no place:
the concept did not exist yet, or the version does not parse). A version is
correct when both of its statements are correct or rightly refused and, if
anything was placed, ``import retrolog as rl`` was added at module level among
the leading imports (after a docstring and ``__future__`` imports) and the file
still compiles. See bench/README.md for the rules per file.

``--json PATH`` writes the figures: commits, blob hashes, line numbers and
outcomes, never the repository's source text.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrolog._replay.propagate import propagate

OUTCOMES = ("correct", "misplaced", "refused-should-place", "refused-nothing-fits")
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


# --- The oracle: where a statement belongs, from one version's syntax --------------------------


class Ambiguous(Exception):
    """The rule matches more than one place: the spec must be made more precise."""


class _Tree:
    """A parsed version with parent links."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.module = ast.parse(source)
        self.parent: dict[int, tuple[ast.AST, str]] = {}
        for node in ast.walk(self.module):
            for name, value in ast.iter_fields(node):
                for child in value if isinstance(value, list) else [value]:
                    if isinstance(child, ast.AST):
                        self.parent[id(child)] = (node, name)

    def ancestors(self, node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
        while id(node) in self.parent:
            node, name = self.parent[id(node)]
            yield node, name

    def calls(self, pattern: str) -> list[ast.Call]:
        """Calls whose callee, as written, matches ``pattern`` exactly (``optimizer\\.step``)."""
        return [
            node
            for node in ast.walk(self.module)
            if isinstance(node, ast.Call) and re.fullmatch(pattern, ast.unparse(node.func))
        ]

    def statement_of(self, node: ast.AST) -> ast.stmt:
        """The innermost statement holding ``node`` (itself if it is one)."""
        if isinstance(node, ast.stmt):
            return node
        for parent, _ in self.ancestors(node):
            if isinstance(parent, ast.stmt):
                return parent
        raise ValueError("a node outside any statement")

    def training_loop(self, node: ast.AST) -> ast.stmt | None:
        """The innermost loop whose body holds ``node``, not counting loops over parameters.

        ``for p in model.parameters(): p.data.add_(...)`` is an update, not a training loop.
        """
        for parent, name in self.ancestors(node):
            if isinstance(parent, _LOOPS) and name == "body" and not _over_parameters(parent):
                return parent
        return None

    def body_child(self, node: ast.AST, loop: ast.stmt) -> ast.stmt:
        """The statement of ``loop``'s body that holds ``node``."""
        current = node
        for parent, name in self.ancestors(node):
            if parent is loop and name == "body":
                assert isinstance(current, ast.stmt)
                return current
            current = parent
        raise ValueError("node outside the loop")

    def common_statement(self, nodes: list[ast.AST]) -> ast.stmt:
        """The smallest statement holding all ``nodes``."""
        chains = [[n, *(p for p, _ in self.ancestors(n))] for n in nodes]
        common = [n for n in chains[0] if all(any(n is m for m in c) for c in chains[1:])]
        for node in common:
            if isinstance(node, ast.stmt):
                return node
        raise Ambiguous("the matches lie in different top-level statements")

    def binds(self, name: str) -> bool:
        """True if the file binds ``name`` anywhere (assignment, parameter, def, import, for)."""
        for node in ast.walk(self.module):
            bound: list[str] = []
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                bound = [node.id]
            elif isinstance(node, ast.arg):
                bound = [node.arg]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound = [node.name]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound = [alias.asname or alias.name.split(".")[0] for alias in node.names]
            if name in bound:
                return True
        return False


def _over_parameters(loop: ast.stmt) -> bool:
    return isinstance(loop, ast.For) and bool(
        re.fullmatch(r".*\.parameters\(\)", ast.unparse(loop.iter))
    )


@dataclass(frozen=True)
class Rule:
    """Where a statement belongs in one version: right after the anchor this finds.

    describe: the rule in words, for the report and the README.
    anchor: the statement to follow, None when the version has no place for it.
    """

    describe: str
    anchor: Callable[[_Tree], ast.stmt | None]


def after_update(pattern: str) -> Rule:
    """After the smallest statement holding every call matching ``pattern``.

    A call inside ``for p in model.parameters(): ...`` is part of that loop, which is then
    the statement (the update is the whole loop over parameters).
    """

    def anchor(tree: _Tree) -> ast.stmt | None:
        calls = tree.calls(pattern)
        if not calls:
            return None
        statement = tree.common_statement(list(calls))
        for parent, _ in tree.ancestors(statement):
            if isinstance(parent, ast.For) and _over_parameters(parent):
                statement = parent
        return statement

    return Rule(
        f"right after the smallest statement holding every `{pattern}(...)` call (a loop over "
        "`.parameters()` around it counts as the statement)",
        anchor,
    )


def after_call_in_loop(pattern: str) -> Rule:
    """After the statement of a training loop's body that calls ``pattern``."""

    def anchor(tree: _Tree) -> ast.stmt | None:
        found: list[ast.stmt] = []
        for call in tree.calls(pattern):
            loop = tree.training_loop(call)
            if loop is not None:
                child = tree.body_child(call, loop)
                if not any(child is f for f in found):
                    found.append(child)
        if len(found) > 1:
            raise Ambiguous(f"{len(found)} loop statements call `{pattern}`")
        return found[0] if found else None

    return Rule(
        f"right after the statement of the innermost training loop's body that calls "
        f"`{pattern}(...)`",
        anchor,
    )


def after_training(train: str, update: str) -> Rule:
    """After the statement of the epoch loop that trains: a ``train(...)`` call, or the loop
    holding the parameter updates (the epoch loop is the training loop around it)."""

    def anchor(tree: _Tree) -> ast.stmt | None:
        found = after_call_in_loop(train).anchor(tree)
        if found is not None:
            return found
        calls = tree.calls(update)
        if not calls:
            return None
        batch_loop = tree.training_loop(tree.common_statement(list(calls)))
        epoch_loop = tree.training_loop(batch_loop) if batch_loop is not None else None
        return tree.body_child(batch_loop, epoch_loop) if epoch_loop is not None else None

    return Rule(
        f"right after the statement of the epoch loop that trains: the one calling `{train}"
        f"(...)`, or the batch loop holding `{update}(...)`",
        anchor,
    )


def first_of(*rules: Rule) -> Rule:
    """The first rule that finds a place."""

    def anchor(tree: _Tree) -> ast.stmt | None:
        for rule in rules:
            found = rule.anchor(tree)
            if found is not None:
                return found
        return None

    return Rule("; where that finds nothing, ".join(rule.describe for rule in rules), anchor)


def after_loop_of(pattern: str) -> Rule:
    """After the innermost training loop holding every call matching ``pattern``."""

    def anchor(tree: _Tree) -> ast.stmt | None:
        calls = tree.calls(pattern)
        if not calls:
            return None
        return tree.training_loop(tree.common_statement(list(calls)))

    return Rule(f"right after the innermost training loop holding `{pattern}(...)`", anchor)


def loop_of(pattern: str) -> Callable[[_Tree], ast.stmt | None]:
    """The innermost training loop holding every call matching ``pattern`` (to adopt it)."""

    def find(tree: _Tree) -> ast.stmt | None:
        calls = tree.calls(pattern)
        return tree.training_loop(tree.common_statement(list(calls))) if calls else None

    return find


def loop_around(inner: Callable[[_Tree], ast.stmt | None]) -> Callable[[_Tree], ast.stmt | None]:
    """The training loop directly around the loop ``inner`` finds."""

    def find(tree: _Tree) -> ast.stmt | None:
        loop = inner(tree)
        return tree.training_loop(loop) if loop is not None else None

    return find


# --- Per-file specs, chosen by reading each file's history -----------------------------------


@dataclass(frozen=True)
class LoopSpec:
    """A loop the user wraps in ``rl.loop(name, ...)`` when adopting retrolog."""

    name: str
    find: Callable[[_Tree], ast.stmt | None]
    inside: bool  # wrap the first argument of enumerate(...) rather than the whole iterable


@dataclass(frozen=True)
class StatementSpec:
    """A statement the user adds, and the rule saying where it belongs in any version."""

    name: str
    text: str
    rule: Rule
    reads: tuple[str, ...] = ()  # names a version must bind for the statement to make sense


@dataclass(frozen=True)
class FileSpec:
    path: str
    loops: tuple[LoopSpec, ...]
    statements: tuple[StatementSpec, ...]


def _w_norm(model: str) -> str:
    return f"sum(p.norm().item() ** 2 for p in {model}.parameters()) ** 0.5"


_STEP = r"optimizer\.step"
_STEP_OPTIMIZER = loop_of(_STEP)
# The word language model updates by hand (``p.data.add_(...)`` in a loop over parameters)
# and, since 2025, optionally through an optimizer.
_UPDATE = r"optimizer\.step|\w+(\.data)?\.(add|sub)_"

SPECS: dict[str, FileSpec] = {
    # train(args, model, ...) and the epoch loop in main(); before 2018-09 train(epoch) with
    # globals and the epoch loop at module level.
    "mnist/main.py": FileSpec(
        "mnist/main.py",
        (
            LoopSpec("epoch", loop_of(r"train"), inside=False),
            LoopSpec("step", _STEP_OPTIMIZER, inside=True),
        ),
        (
            StatementSpec(
                "w_norm",
                f'rl.log("w_norm", {_w_norm("model")})',
                first_of(after_call_in_loop(r"test"), after_training(r"train", _STEP)),
                ("model",),
            ),
            StatementSpec("loss", 'rl.log("loss", loss.item())', after_update(_STEP), ("loss",)),
        ),
    ),
    # train() with a manual SGD update (``for p in model.parameters(): p.data.add_``), later
    # behind ``if args.use_optimizer: optimizer.step() else: ...``; the epoch loop at module
    # level inside ``try``. The first versions train inline in the epoch loop, the oldest
    # with a ``while`` over tokens that updates every bptt steps.
    "word_language_model/main.py": FileSpec(
        "word_language_model/main.py",
        (
            LoopSpec("epoch", loop_of(r"train"), inside=False),
            LoopSpec("step", loop_of(_UPDATE), inside=False),
        ),
        (
            StatementSpec(
                "w_norm",
                f'rl.log("w_norm", {_w_norm("model")})',
                first_of(after_call_in_loop(r"evaluate"), after_training(r"train", _UPDATE)),
                ("model",),
            ),
            StatementSpec(
                "loss",
                'rl.log("loss", loss.item())',
                after_update(_UPDATE),
                ("loss",),
            ),
        ),
    ),
    # main() -> main_worker(gpu, ngpus_per_node, args) -> train(train_loader, model, ...);
    # the oldest versions have the epoch loop in main().
    "imagenet/main.py": FileSpec(
        "imagenet/main.py",
        (
            LoopSpec("epoch", loop_of(r"train"), inside=False),
            LoopSpec("step", _STEP_OPTIMIZER, inside=False),
        ),
        (
            StatementSpec(
                "w_norm",
                f'rl.log("w_norm", {_w_norm("model")})',
                first_of(after_call_in_loop(r"validate"), after_training(r"train", _STEP)),
                ("model",),
            ),
            StatementSpec("loss", 'rl.log("loss", loss.item())', after_update(_STEP), ("loss",)),
        ),
    ),
    # Everything at module level, two optimizers; the statements follow the generator's step
    # and the end of the batch loop.
    "dcgan/main.py": FileSpec(
        "dcgan/main.py",
        (
            LoopSpec("epoch", loop_around(loop_of(r"optimizerG\.step")), inside=False),
            LoopSpec("step", loop_of(r"optimizerG\.step"), inside=True),
        ),
        (
            StatementSpec(
                "g_norm",
                f'rl.log("g_norm", {_w_norm("netG")})',
                after_loop_of(r"optimizerG\.step"),
                ("netG",),
            ),
            StatementSpec(
                "loss_g",
                'rl.log("loss_g", errG.item())',
                after_update(r"optimizerG\.step"),
                ("errG",),
            ),
        ),
    ),
    # train(epoch)/test(epoch) with globals; the epoch loop moved under
    # ``if __name__ == "__main__":``; the first versions iterate ``for batch in loader``.
    "vae/main.py": FileSpec(
        "vae/main.py",
        (
            LoopSpec("epoch", loop_of(r"train"), inside=False),
            LoopSpec("step", _STEP_OPTIMIZER, inside=True),
        ),
        (
            StatementSpec(
                "w_norm",
                f'rl.log("w_norm", {_w_norm("model")})',
                first_of(after_call_in_loop(r"test"), after_training(r"train", _STEP)),
                ("model",),
            ),
            StatementSpec("loss", 'rl.log("loss", loss.item())', after_update(_STEP), ("loss",)),
        ),
    ),
    # Episodes and environment steps; the loops moved from module level into main().
    "reinforcement_learning/actor_critic.py": FileSpec(
        "reinforcement_learning/actor_critic.py",
        (
            LoopSpec("episode", loop_of(r"finish_episode"), inside=False),
            LoopSpec("step", loop_of(r"env\.step"), inside=False),
        ),
        (
            StatementSpec(
                "running_reward",
                'rl.log("running_reward", running_reward)',
                after_call_in_loop(r"finish_episode"),
                ("running_reward",),
            ),
            StatementSpec(
                "reward", 'rl.log("reward", reward)', after_update(r"env\.step"), ("reward",)
            ),
        ),
    ),
    # Module level throughout; ``loss.backward(); opt.step()`` share a line.
    "snli/train.py": FileSpec(
        "snli/train.py",
        (
            LoopSpec("epoch", loop_around(loop_of(r"opt\.step")), inside=False),
            LoopSpec("step", loop_of(r"opt\.step"), inside=True),
        ),
        (
            StatementSpec(
                "train_acc",
                'rl.log("train_acc", 100.0 * n_correct / n_total)',
                after_loop_of(r"opt\.step"),
                ("n_correct", "n_total"),
            ),
            StatementSpec(
                "loss", 'rl.log("loss", loss.item())', after_update(r"opt\.step"), ("loss",)
            ),
        ),
    ),
    # Held out: the three specs below were written after the aligner work on the files
    # above was done, to see how it does on histories it was not developed against.
    "reinforcement_learning/reinforce.py": FileSpec(
        "reinforcement_learning/reinforce.py",
        (
            LoopSpec("episode", loop_of(r"finish_episode"), inside=False),
            LoopSpec("step", loop_of(r"env\.step"), inside=False),
        ),
        (
            StatementSpec(
                "running_reward",
                'rl.log("running_reward", running_reward)',
                after_call_in_loop(r"finish_episode"),
                ("running_reward",),
            ),
            StatementSpec(
                "reward", 'rl.log("reward", reward)', after_update(r"env\.step"), ("reward",)
            ),
        ),
    ),
    "fast_neural_style/neural_style/neural_style.py": FileSpec(
        "fast_neural_style/neural_style/neural_style.py",
        (
            LoopSpec("epoch", loop_around(_STEP_OPTIMIZER), inside=False),
            LoopSpec("step", _STEP_OPTIMIZER, inside=True),
        ),
        (
            StatementSpec(
                "content_loss",
                'rl.log("content_loss", agg_content_loss / count)',
                after_loop_of(_STEP),
                ("agg_content_loss", "count"),
            ),
            StatementSpec(
                "total_loss",
                'rl.log("total_loss", total_loss.item())',
                after_update(_STEP),
                ("total_loss",),
            ),
        ),
    ),
    "mnist_hogwild/train.py": FileSpec(
        "mnist_hogwild/train.py",
        (
            LoopSpec("epoch", loop_of(r"train_epoch"), inside=False),
            LoopSpec("step", _STEP_OPTIMIZER, inside=True),
        ),
        (
            StatementSpec(
                "w_norm",
                f'rl.log("w_norm", {_w_norm("model")})',
                first_of(after_call_in_loop(r"train_epoch"), after_training(r"train", _STEP)),
                ("model",),
            ),
            StatementSpec("loss", 'rl.log("loss", loss.item())', after_update(_STEP), ("loss",)),
        ),
    ),
}


# --- Adopting the newest version ----------------------------------------------------------------


def _offset(lines: list[str], lineno: int, byte_col: int) -> int:
    """A character offset into the text from ast's (line, UTF-8 byte column)."""
    before = sum(len(line) for line in lines[: lineno - 1])
    return before + len(lines[lineno - 1].encode()[:byte_col].decode())


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def adopt(source: str, spec: FileSpec) -> str:
    """The newest version as a user adopting retrolog would write it (see the module doc)."""
    for statement in spec.statements:
        tree = _Tree(source)
        anchor = statement.rule.anchor(tree)
        if anchor is None:
            raise SystemExit(f"{spec.path}: the newest version has no place for {statement.name}")
        lines = source.splitlines(keepends=True)
        end = anchor.end_lineno or anchor.lineno
        indent = _indent(lines[anchor.lineno - 1])
        lines.insert(end, f"{indent}{statement.text}\n")
        source = "".join(lines)
    for loop_spec in spec.loops:
        tree = _Tree(source)
        loop = loop_spec.find(tree)
        if not isinstance(loop, ast.For):
            raise SystemExit(f"{spec.path}: the newest version has no {loop_spec.name} loop")
        target: ast.expr = loop.iter
        if loop_spec.inside:
            if not (isinstance(target, ast.Call) and target.args):
                raise SystemExit(f"{spec.path}: the {loop_spec.name} loop wraps no iterable")
            target = target.args[0]
        lines = source.splitlines(keepends=True)
        start = _offset(lines, target.lineno, target.col_offset)
        stop = _offset(lines, target.end_lineno or target.lineno, target.end_col_offset or 0)
        wrapped = f'rl.loop("{loop_spec.name}", {source[start:stop]})'
        source = source[:start] + wrapped + source[stop:]
    tree = _Tree(source)
    last = _leading_imports(tree.module)[-1]
    lines = source.splitlines(keepends=True)
    lines.insert(last.end_lineno or last.lineno, "import retrolog as rl\n")
    return "".join(lines)


def _leading_imports(module: ast.Module) -> list[ast.stmt]:
    """The module docstring, then the run of imports at its top (at least the docstring slot)."""
    found: list[ast.stmt] = []
    for index, stmt in enumerate(module.body):
        docstring = (
            index == 0
            and isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str)
        )
        if not (docstring or isinstance(stmt, (ast.Import, ast.ImportFrom))):
            break
        found.append(stmt)
    if not found:
        raise SystemExit("the newest version starts with no import")
    return found


# --- History ------------------------------------------------------------------------------------


@dataclass
class Version:
    commit: str
    date: str
    path: str
    blob: str = ""
    source: str = ""
    same_as: str = ""  # for a commit whose content an earlier-listed commit already has


def _git(git_dir: str, *args: str, partial: bool = False) -> str:
    result = subprocess.run(
        ["git", "--git-dir", git_dir, *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0 and not partial:
        raise RuntimeError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def _log(git_dir: str, *args: str) -> dict[str, tuple[int, str, str]]:
    """commit -> (commit time, date, the file's path there), for commits that keep the file."""
    # A snapshot may lack some large blobs of other files; ``--follow`` then stops at the
    # commit whose rename detection needs one, so its output is taken as far as it goes.
    out = _git(git_dir, "log", "--format=%x00%H %ct %cs", "--name-status", *args, partial=True)
    found: dict[str, tuple[int, str, str]] = {}
    for record in out.split("\0")[1:]:
        head, *rest = record.strip("\n").split("\n")
        commit, stamp, date = head.split()
        statuses = [line.split("\t") for line in rest if line.strip()]
        if statuses and not statuses[0][0].startswith("D"):
            found[commit] = (int(stamp), date, statuses[0][-1])
    return found


def history(git_dir: str, path: str) -> tuple[list[Version], list[Version], list[str]]:
    """The file's versions newest first: distinct contents, skipped duplicates, problems.

    ``git log --follow`` finds the names the file had; each name's own log (no rename
    detection, which needs every blob of a commit) then finds every commit of that name.
    """
    followed = _log(git_dir, "--follow", "--", path)
    commits = dict(followed)
    for name in {path} | {p for _, _, p in followed.values()}:
        commits.update(_log(git_dir, "--no-renames", "--", name))
    ordered = sorted(commits.items(), key=lambda item: item[1][0], reverse=True)
    distinct: list[Version] = []
    skipped: list[Version] = []
    problems: list[str] = []
    seen: dict[str, str] = {}
    for commit, (_, date, name) in ordered:
        version = Version(commit, date, name)
        try:
            version.blob = _git(git_dir, "rev-parse", f"{commit}:{name}").strip()
            if version.blob in seen:
                version.same_as = seen[version.blob]
                skipped.append(version)
                continue
            version.source = _git(git_dir, "cat-file", "blob", version.blob)
        except (RuntimeError, UnicodeDecodeError) as exc:
            problems.append(f"{commit[:7]}: unreadable ({exc})")
            continue
        seen[version.blob] = commit
        distinct.append(version)
    return distinct, skipped, problems


# --- Judging one version -------------------------------------------------------------------------


@dataclass
class StatementResult:
    name: str
    outcome: str
    expected_after: int | None  # old line the oracle anchors on (end line), None: nowhere
    placed_line: int | None  # line in the propagated file
    detail: str = ""  # the refusal reason or what went wrong (terminal only: it quotes code)


@dataclass
class VersionResult:
    version: Version
    lines: int
    seconds: float
    statements: list[StatementResult] = field(default_factory=list)
    import_ok: bool | None = None  # None: nothing placed, so no import needed
    import_detail: str = ""
    ambiguous: str = ""
    parses: bool = True

    @property
    def correct(self) -> bool:
        fine = all(s.outcome in ("correct", "refused-nothing-fits") for s in self.statements)
        return fine and self.import_ok is not False


def _is_log_of(stmt: ast.AST, name: str) -> bool:
    value = getattr(stmt, "value", None)
    return (
        isinstance(stmt, (ast.Expr, ast.Assign))
        and isinstance(value, ast.Call)
        and ast.unparse(value.func).split(".")[-1] == "log"
        and bool(value.args)
        and isinstance(value.args[0], ast.Constant)
        and value.args[0].value == name
    )


def _expected(tree: _Tree | None, spec: StatementSpec) -> ast.stmt | None:
    """The oracle's anchor, None where nothing fits (raises Ambiguous)."""
    if tree is None:
        return None  # a version that does not parse runs nowhere
    anchor = spec.rule.anchor(tree)
    if anchor is not None and not all(tree.binds(name) for name in spec.reads):
        return None  # the statement's variables did not exist yet
    return anchor


def judge(new: str, version: Version, spec: FileSpec) -> VersionResult:
    names = [s.name for s in spec.statements]
    start = time.perf_counter()
    result = propagate(new, version.source, names)
    seconds = time.perf_counter() - start
    out = VersionResult(version, len(version.source.splitlines()), seconds)
    try:
        old_tree: _Tree | None = _Tree(version.source)
    except SyntaxError:
        old_tree = None
        out.parses = False
    try:
        propagated: _Tree | None = _Tree(result.source)
        compile(result.source, version.path, "exec")
    except SyntaxError as exc:
        propagated = None
        out.import_detail = f"the propagated file does not compile: {exc}"
    placed = {p.name: p for p in result.placements}
    refused = {p.name: p.reason for p in result.problems}
    requested = set(names)
    for statement in spec.statements:
        try:
            expected = _expected(old_tree, statement)
        except Ambiguous as exc:
            out.ambiguous = f"{statement.name}: {exc}"
            expected = None
        expected_end = (expected.end_lineno or expected.lineno) if expected else None
        if statement.name in refused:
            kind = "refused-should-place" if expected is not None else "refused-nothing-fits"
            out.statements.append(
                StatementResult(statement.name, kind, expected_end, None, refused[statement.name])
            )
            continue
        placement = placed[statement.name]
        ok, detail = False, ""
        if propagated is None:
            detail = "the propagated file does not compile"
        elif expected is None:
            detail = "placed, but the oracle finds no place for it in this version"
        else:
            ok, detail = _placed_after_anchor(propagated, statement, requested)
        out.statements.append(
            StatementResult(
                statement.name,
                "correct" if ok else "misplaced",
                expected_end,
                placement.line,
                detail or placement.anchor,
            )
        )
    if result.placements:
        out.import_ok, out.import_detail = _import_ok(propagated, version.source)
    return out


def _placed_after_anchor(tree: _Tree, spec: StatementSpec, requested: set[str]) -> tuple[bool, str]:
    """Whether the statement directly follows the oracle's anchor in the propagated file."""
    found = [s for s in ast.walk(tree.module) if _is_log_of(s, spec.name)]
    if len(found) != 1:
        return False, f"{len(found)} statements log {spec.name!r} in the propagated file"
    statement = found[0]
    anchor = spec.rule.anchor(tree)
    if anchor is None:
        return False, "the oracle's anchor is gone from the propagated file"
    parent, name = tree.parent[id(statement)]
    block = getattr(parent, name)
    index = next(i for i, s in enumerate(block) if s is statement)
    before = index - 1
    while before >= 0 and any(_is_log_of(block[before], r) for r in requested):
        before -= 1
    if before >= 0 and block[before] is anchor:
        return True, ""
    return False, f"placed at line {statement.lineno}, expected after line {anchor.end_lineno}"


def _import_ok(tree: _Tree | None, old_source: str) -> tuple[bool, str]:
    """``rl`` reaches retrolog: imported once, at module level, among the leading imports."""
    if tree is None:
        return False, "the propagated file does not compile"
    aliases = {
        alias.asname or alias.name
        for node in tree.module.body
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "retrolog"
    }
    used = {
        ast.unparse(node.func).split(".")[0]
        for node in ast.walk(tree.module)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func).endswith(".log")
        and isinstance(node.func, ast.Attribute)
    } & (aliases or {"rl"})
    if not aliases:
        return False, "the propagated file does not import retrolog at module level"
    for alias in used:
        if _Tree(old_source).binds(alias):
            return False, f"the old version binds {alias!r} itself"
    leading = 0
    for index, stmt in enumerate(tree.module.body):
        docstring = (
            index == 0
            and isinstance(stmt, ast.Expr)
            and isinstance(getattr(stmt, "value", None), ast.Constant)
        )
        if not (docstring or isinstance(stmt, (ast.Import, ast.ImportFrom))):
            break
        leading = index + 1
    imports = [
        i
        for i, s in enumerate(tree.module.body)
        if isinstance(s, ast.Import) and any(a.name == "retrolog" for a in s.names)
    ]
    if len(imports) != 1 or (imports[0] >= leading and leading > 0):
        return False, "the retrolog import is not among the leading imports"
    return True, ""


# --- Reporting ------------------------------------------------------------------------------------


def run_file(git_dir: str, path: str, verbose: bool) -> dict[str, Any]:
    spec = SPECS[path]
    versions, skipped, problems = history(git_dir, path)
    if not versions:
        raise SystemExit(f"{path}: no readable version in {git_dir}")
    newest = versions[0]
    new = adopt(newest.source, spec)
    print(
        f"\n== {path}: {len(versions)} distinct versions, newest {newest.commit[:7]} "
        f"({newest.date}); {len(skipped)} commits skipped (same bytes)",
        flush=True,
    )
    for problem in problems:
        print(f"   {problem}")
    results = [judge(new, version, spec) for version in versions]
    names = [s.name for s in spec.statements]
    header = f"   {'commit':8} {'date':10} {'lines':>5}  " + "  ".join(f"{n:22}" for n in names)
    print(header + "  version")
    for r in results:
        cells = "  ".join(f"{s.outcome:22}" for s in r.statements)
        flag = "ok" if r.correct else "WRONG"
        if r.import_ok is False:
            flag += " (import)"
        if r.ambiguous:
            flag += " (oracle ambiguous)"
        print(f"   {r.version.commit[:7]:8} {r.version.date:10} {r.lines:5}  {cells}  {flag}")
        if verbose or not r.correct:
            for s in r.statements:
                if s.outcome != "correct":
                    print(f"        {s.name}: {s.outcome}: {s.detail}")
            if r.import_ok is False:
                print(f"        import: {r.import_detail}")
            if r.ambiguous:
                print(f"        oracle: {r.ambiguous}")
    summary = _summary(results, names)
    summary.update(skipped_same_bytes=len(skipped), unreadable=len(problems))
    print("   " + _summary_line(summary))
    return {
        "file": path,
        "newest_commit": newest.commit,
        "rules": {s.name: s.rule.describe for s in spec.statements},
        "summary": summary,
        "skipped": [{"commit": v.commit, "same_as": v.same_as} for v in skipped],
        "versions": [
            {
                "commit": r.version.commit,
                "date": r.version.date,
                "path": r.version.path,
                "blob": r.version.blob,
                "lines": r.lines,
                "seconds": round(r.seconds, 4),
                "correct": r.correct,
                "import_ok": r.import_ok,
                "oracle_ambiguous": bool(r.ambiguous),
                "parses": r.parses,
                "statements": {
                    s.name: {
                        "outcome": s.outcome,
                        "expected_after_line": s.expected_after,
                        "placed_line": s.placed_line,
                    }
                    for s in r.statements
                },
            }
            for r in results
        ],
    }


def _summary(results: list[VersionResult], names: list[str]) -> dict[str, Any]:
    per_statement: dict[str, dict[str, int]] = {}
    for name in names:
        mine = [s for r in results for s in r.statements if s.name == name]
        found = Counter(s.outcome for s in mine)
        per_statement[name] = {outcome: found[outcome] for outcome in OUTCOMES}
        per_statement[name]["with_a_place"] = sum(s.expected_after is not None for s in mine)
    times = [r.seconds for r in results]
    return {
        "versions": len(results),
        "versions_correct": sum(r.correct for r in results),
        "versions_with_misplacement": sum(
            any(s.outcome == "misplaced" for s in r.statements) for r in results
        ),
        "import_wrong": sum(r.import_ok is False for r in results),
        "oracle_ambiguous": sum(bool(r.ambiguous) for r in results),
        "not_parsing": sum(not r.parses for r in results),
        "statements": per_statement,
        "seconds_median": round(statistics.median(times), 4),
        "seconds_max": round(max(times), 4),
    }


def _counts_text(counts: dict[str, int]) -> str:
    placed = counts["correct"]
    fits = counts["with_a_place"]
    rate = f" ({100 * placed / fits:.1f}% of {fits} with a place)" if fits else ""
    return (
        f"{placed} placed correctly{rate}, {counts['misplaced']} misplaced, "
        f"{counts['refused-should-place']} refused where a place exists, "
        f"{counts['refused-nothing-fits']} refused where nothing fits"
    )


def _summary_line(summary: dict[str, Any]) -> str:
    n = summary["versions"]
    parts = [
        f"versions correct {summary['versions_correct']}/{n} "
        f"({100 * summary['versions_correct'] / n:.0f}%)",
        f"with a misplacement {summary['versions_with_misplacement']}",
        f"not parsing {summary['not_parsing']}",
    ]
    for name, counts in summary["statements"].items():
        parts.append(f"{name}: {_counts_text(counts)}")
    parts.append(
        f"propagate median {summary['seconds_median'] * 1000:.0f} ms, "
        f"max {summary['seconds_max'] * 1000:.0f} ms"
    )
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git", required=True, help="the repository's git directory")
    parser.add_argument("--file", action="append", default=[], help="a file with a spec")
    parser.add_argument("--all", action="store_true", help="every file with a spec")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--verbose", action="store_true", help="details of every outcome")
    args = parser.parse_args(argv)
    files = list(SPECS) if args.all else args.file
    unknown = [f for f in files if f not in SPECS]
    if not files or unknown:
        parser.error(
            f"no spec for {', '.join(unknown) or 'any file'}; files with a spec: "
            + ", ".join(SPECS)
        )
    started = time.time()
    reports = [run_file(args.git, path, args.verbose) for path in files]
    total = {
        "versions": sum(r["summary"]["versions"] for r in reports),
        "versions_correct": sum(r["summary"]["versions_correct"] for r in reports),
        "versions_with_misplacement": sum(
            r["summary"]["versions_with_misplacement"] for r in reports
        ),
        "statements": {
            key: sum(c[key] for r in reports for c in r["summary"]["statements"].values())
            for key in (*OUTCOMES, "with_a_place")
        },
    }
    n = total["versions"]
    print(
        f"\nall files: versions correct {total['versions_correct']}/{n} "
        f"({100 * total['versions_correct'] / max(n, 1):.1f}%), with a misplacement "
        f"{total['versions_with_misplacement']}; statements: " + _counts_text(total["statements"])
    )
    if args.json:
        head = _git(args.git, "rev-parse", "HEAD").strip()
        document = {
            "benchmark": "propagation_history",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.time() - started, 1),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "nproc": os.cpu_count(),
            "repository_head": head,
            "command": "python -m bench.bench_propagation_history "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "total": total,
            "files": reports,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    ambiguous = sum(r["summary"]["oracle_ambiguous"] for r in reports)
    return 1 if ambiguous else 0


if __name__ == "__main__":
    sys.exit(main())
