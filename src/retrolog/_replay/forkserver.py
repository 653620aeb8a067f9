"""Replay workers forked from a server that has already imported the script's heavy modules.

Every replay worker used to start as a new interpreter and repeat the script's
imports: ``import torch`` and the modules torch loads at the first optimizer
take 3.5 s here, more than a replayed epoch. A fork server pays that once per
replay: it starts with the worker's environment, imports what the recorded run
had imported by its first loop (runtime/modules.py), and forks one worker per
segment, which then runs the script as ``python script argv...`` would
(_replay/forkserver_main.py).

Where that is not safe, or not what a new interpreter would do, workers start
as new interpreters and the plan says why (:func:`start_plan`):

- not Linux (forking a process that loaded system frameworks is unsafe on
  macOS), or ``RETROLOG_FORKSERVER=0``;
- the script writes environment variables or ``sys.path`` (a module it imports
  afterwards may read them when imported, or be found elsewhere), except for
  literal environment writes at its top before anything but standard-library
  imports (``os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")``): the
  server makes those same writes before its imports (:attr:`StartPlan.environ`);
- the script imports no installed package, or the run recorded none by its
  first loop;
- at run time: the imports started Python threads, native threads other than
  OpenBLAS's pool (which stops itself at a fork), or initialised CUDA; or the
  server died. Then the replay says so and goes on with new interpreters.

Only installed packages that the replayed script itself imports are
pre-imported, and only names found in the recorded list under them; the
project's own modules never are (they are the run's version: a checkout's).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrolog._config import lookup
from retrolog.runtime.modules import STDLIB, valid_name

FORKSERVER_ENV = "RETROLOG_FORKSERVER"  # "0": every worker starts as a new interpreter
# What a worker imports of retrolog before the script's own work: the package, the replay
# runtime its import sets up, and what that runtime loads at the script's first call. A
# fork server times a child importing them (forkserver_main.time_a_start) for the plan.
WORKER_MODULES = (
    "retrolog",
    "retrolog.runtime.replay_worker",
    "retrolog.runtime.isolation",
    "retrolog.checkpoint.prefetch",
    "retrolog.store.backends",
)
_ZYGOTE = Path(__file__).with_name("forkserver_main.py")
# Loads forkserver_main.py as a module of its own (not as part of retrolog) and serves.
_BOOT = (
    "import sys\n"
    "if sys.path and sys.path[0] == '': sys.path.pop(0)\n"
    "import importlib.util as u\n"
    "s = u.spec_from_file_location('_retrolog_zygote', sys.argv[1])\n"
    "m = u.module_from_spec(s); sys.modules['_retrolog_zygote'] = m\n"
    "s.loader.exec_module(m)\n"
    "m.main(int(sys.argv[2]))\n"
)


# -- deciding, per job -------------------------------------------------------------------


@dataclass(frozen=True)
class StartPlan:
    """How a job's worker starts: forked after importing ``warm``, or new (``reason``)."""

    warm: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()  # the script's installed packages that ``warm`` covers
    reason: str = ""  # why a new interpreter; "" when forked
    digest: str | None = None  # the run's recorded module set (runtime/modules.py)
    # What an earlier fork server of these modules took to start and import them.
    warm_seconds: float | None = None
    # What this replay's server measured a forked child to take from the fork to having
    # imported WORKER_MODULES; None: not measured (a dry run, an older server).
    forked_start: float | None = None
    # The script's environment writes made before its first import of an installed
    # package, in order: (operation, name, value), see :func:`with_writes`.
    environ: tuple[tuple[str, str, str], ...] = ()

    @property
    def forked(self) -> bool:
        return bool(self.warm)

    def server_environment(self, env: Mapping[str, str]) -> dict[str, str]:
        """A fork server's environment for this plan: the worker's ``env`` with the
        script's early writes made, as they were when the script imported its packages."""
        return with_writes(env, self.environ)


def with_writes(env: Mapping[str, str], writes: Sequence[Sequence[str]]) -> dict[str, str]:
    """``env`` after ``writes``: ("set", name, value) is ``os.environ[name] = value``,
    ("setdefault", ...) ``os.environ.setdefault(name, value)``, ("pop", name, "")
    ``os.environ.pop(name, None)``."""
    out = dict(env)
    for operation, name, value in writes:
        if operation == "set":
            out[name] = value
        elif operation == "setdefault":
            out.setdefault(name, value)
        elif operation == "pop":
            out.pop(name, None)
    return out


def start_plan(
    source: str, recorded: Sequence[str] | None, *, root: Path, script_dir: Path
) -> StartPlan:
    """How a worker running ``source`` (the propagated script) should start.

    recorded: the installed modules the run had imported at its first loop (None:
        recorded before retrolog kept them; then the packages themselves are
        pre-imported). root, script_dir: the project and the script's directory,
        whose own modules are never pre-imported.
    """
    if (lookup(FORKSERVER_ENV) or "1").strip().lower() in {"0", "no", "false", "off"}:
        return StartPlan(reason=f"{FORKSERVER_ENV}=0")
    if not sys.platform.startswith("linux"):
        return StartPlan(reason="fork servers are used on Linux only")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return StartPlan(reason="the script does not parse")
    prelude, made = _environment_prelude(tree)
    writes = _environment_writes(tree, made)
    if writes:
        return StartPlan(
            reason=f"the script changes {writes}, which the modules it imports may read"
        )
    local = {p.stem for d in {root, script_dir} if d.is_dir() for p in d.iterdir()}
    packages = [
        name
        for name in script_packages(tree)
        if name not in STDLIB and name != "retrolog" and name not in local
    ]
    if not packages:
        return StartPlan(reason="the script imports no installed package to pre-import")
    allowed = set(packages)
    if recorded is None:
        warm = list(packages)
    else:
        warm = [n for n in recorded if valid_name(n) and n.partition(".")[0] in allowed]
    if not warm:
        return StartPlan(reason="the run had imported none of the script's packages by its loop")
    covered = {n.partition(".")[0] for n in warm}
    return StartPlan(
        warm=tuple(warm), packages=tuple(p for p in packages if p in covered), environ=prelude
    )


def script_packages(tree: ast.AST) -> list[str]:
    """Top-level names of the absolute imports anywhere in ``tree``, in order of appearance."""
    found: list[str] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        for name in names:
            top = name.partition(".")[0]
            if top not in found:
                found.append(top)
    return found


_ENV_METHODS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
_PATH_METHODS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__"}


def _environment_prelude(tree: ast.Module) -> tuple[tuple[tuple[str, str, str], ...], set[int]]:
    """The environment writes at the top of the script, before any statement but a
    docstring and imports of the standard library (or ``import retrolog``), whose names
    and values are string literals: a fork server makes the same writes before importing
    what the script imports after them. The writes, in order, and the ids of their nodes."""
    writes: list[tuple[str, str, str]] = []
    made: set[int] = set()
    for stmt in tree.body:
        if _docstring_or_stdlib_import(stmt):
            continue
        found = _literal_write(stmt)
        if found is None:
            break
        node, new = found
        writes.extend(new)
        made.add(id(node))
    return tuple(writes), made


def _docstring_or_stdlib_import(stmt: ast.stmt) -> bool:
    """A docstring, or an import of the standard library or of retrolog's package alone
    (which imports no framework; a server never imports it, each worker does)."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return isinstance(stmt.value.value, str)
    if isinstance(stmt, ast.Import):
        return all(
            alias.name.partition(".")[0] in STDLIB or alias.name == "retrolog"
            for alias in stmt.names
        )
    if isinstance(stmt, ast.ImportFrom):
        module = stmt.module or ""
        return not stmt.level and (module.partition(".")[0] in STDLIB or module == "retrolog")
    return False


def _literal_write(stmt: ast.stmt) -> tuple[ast.AST, list[tuple[str, str, str]]] | None:
    """``os.environ["N"] = "V"``, ``os.environ.setdefault("N", "V")``,
    ``os.environ.update({"N": "V"})`` / ``update(N="V")``, ``os.environ.pop("N", ...)``:
    the node a walk finds it by and its writes; None for any other statement."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        if (
            isinstance(target, ast.Subscript)
            and _which(target.value) == "os.environ"
            and _text(target.slice) is not None
            and _text(stmt.value) is not None
        ):
            return stmt, [("set", _text(target.slice) or "", _text(stmt.value) or "")]
        return None
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    call = stmt.value
    func = call.func
    if not (isinstance(func, ast.Attribute) and _which(func.value) == "os.environ"):
        return None
    args = [_text(a) for a in call.args]
    if func.attr == "setdefault" and len(args) == 2 and None not in args and not call.keywords:
        return call, [("setdefault", args[0] or "", args[1] or "")]
    if func.attr == "pop" and len(call.args) == 2 and args[0] is not None and not call.keywords:
        if isinstance(call.args[1], ast.Constant):
            return call, [("pop", args[0], "")]
        return None
    if func.attr == "update":
        pairs: list[tuple[str | None, str | None]] = []
        if len(call.args) == 1 and isinstance(call.args[0], ast.Dict) and not call.keywords:
            pairs = [
                (_text(k) if k is not None else None, _text(v))
                for k, v in zip(call.args[0].keys, call.args[0].values, strict=True)
            ]
        elif not call.args:
            pairs = [(k.arg, _text(k.value)) for k in call.keywords]
        if pairs and all(k is not None and v is not None for k, v in pairs):
            return call, [("set", k or "", v or "") for k, v in pairs]
    return None


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _environment_writes(tree: ast.AST, made: Collection[int] = frozenset()) -> str:
    """'os.environ (line 3)' when the script writes the environment or sys.path, else ''.
    The nodes in ``made`` are writes a fork server makes as well (:func:`_environment_prelude`)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt | ast.expr) or id(node) in made:
            continue
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript) and _which(target.value):
                return f"{_which(target.value)} (line {node.lineno})"
            if _which(target):  # os.environ = ..., sys.path = ..., sys.path += ...
                return f"{_which(target)} (line {node.lineno})"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            owner = _which(func.value)
            if owner == "os.environ" and func.attr in _ENV_METHODS:
                return f"os.environ (line {node.lineno})"
            if owner == "sys.path" and func.attr in _PATH_METHODS:
                return f"sys.path (line {node.lineno})"
            if func.attr in {"putenv", "unsetenv", "addsitedir"}:
                return f"the environment (line {node.lineno})"
    return ""


def _which(node: ast.AST) -> str:
    """'os.environ' or 'sys.path' when ``node`` names one of them (also as bare imports)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.attr == "environ" and node.value.id == "os":
            return "os.environ"
        if node.attr == "path" and node.value.id == "sys":
            return "sys.path"
    if isinstance(node, ast.Name) and node.id == "environ":
        return "os.environ"
    return ""


def describe(plans: Sequence[StartPlan]) -> str:
    """One line for the replay plan: how its workers start."""
    forked = [p for p in plans if p.forked]
    fresh = sorted({p.reason for p in plans if not p.forked})
    parts = []
    if forked:
        packages = sorted({name for p in forked for name in p.packages})
        text = (
            f"workers of {len(forked)} of {len(plans)} run(s) start from a fork server that "
            f"imports {', '.join(packages)} once"
        )
        measured = sorted(p.forked_start for p in forked if p.forked_start is not None)
        if measured:
            text += (
                f"; a forked worker's own start (the fork, importing retrolog) measured at "
                f"{measured[len(measured) // 2]:.2f}s"
            )
        parts.append(text)
    if fresh:
        parts.append(
            f"workers of {len(plans) - len(forked)} run(s) start as new interpreters "
            f"({'; '.join(fresh)})"
        )
    return "; ".join(parts)


# -- running -----------------------------------------------------------------------------


class ForkServer:
    """The coordinator's side of one fork server process."""

    def __init__(
        self, *, python: str, env: Mapping[str, str], warm: Sequence[str], log_path: Path,
        preexec: Callable[[], None] | None, probe: Sequence[str] = WORKER_MODULES,
    ) -> None:  # fmt: skip
        """probe: the modules whose import in a forked child the server times
        (:attr:`forked_start`)."""
        self.warm = tuple(warm)
        self.log_path = log_path
        ours, theirs = socket.socketpair()
        self.sock = ours
        self._buffer = b""
        self.ready: dict[str, Any] | None = None
        self.unsafe: str | None = None
        self.dead = False
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self._started: dict[str, int] = {}
        self._launched = 0
        spawned = time.monotonic()
        with log_path.open("wb") as log:
            try:
                self.process = subprocess.Popen(
                    [python, "-c", _BOOT, str(_ZYGOTE), str(theirs.fileno())],
                    cwd=log_path.parent,
                    env=dict(env),
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            finally:
                theirs.close()
        self.started_at = time.perf_counter()
        self._send({"warm": list(self.warm), "spawned": spawned, "probe": list(probe)})

    def _send(self, message: Mapping[str, Any]) -> None:
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            self._died()

    def fileno(self) -> int:
        return self.sock.fileno()

    def pump(self, timeout: float | None = 0.0) -> None:
        """Read what the server has said, waiting up to ``timeout`` for the first of it."""
        if self.dead:
            return
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return
        try:
            data = self.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._died()
            return
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._handle(json.loads(line))

    def _handle(self, message: Mapping[str, Any]) -> None:
        if "ready" in message:
            self.ready = dict(message)
        elif "unsafe" in message:
            self.unsafe = str(message["unsafe"])
        elif "started" in message:
            pid = int(message["started"])
            self._started[str(message.get("key"))] = pid
            self.children.add(pid)
        elif "exited" in message:
            self.exits[int(message["exited"])] = int(message["returncode"])

    def _died(self) -> None:
        """The server is gone: its workers were killed with it (their parent-death signal)."""
        self.dead = True
        for pid in self.children:
            self.exits.setdefault(pid, -signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.sock.close()

    @property
    def saved_seconds(self) -> float:
        """What each worker forked from this server does not repeat: a new interpreter's
        start and the imports (0 before the server is ready)."""
        if self.ready is None:
            return 0.0
        boot = self.ready.get("boot")
        return float(self.ready.get("ready", 0.0)) + (
            float(boot) if isinstance(boot, int | float) else 0.0
        )

    @property
    def forked_start(self) -> float | None:
        """What the server measured a forked child to take from the fork to having imported
        retrolog's worker modules (None before it is ready, or when not measured)."""
        value = (self.ready or {}).get("forked_start")
        return float(value) if isinstance(value, int | float) and value >= 0 else None

    def wait_ready(self) -> bool:
        """Block until the server has imported its modules; False if it cannot serve."""
        while self.ready is None and self.unsafe is None and not self.dead:
            self.pump(None)
        return self.ready is not None and not self.dead

    def launch(
        self, *, argv: Sequence[str], cwd: Path, env: Mapping[str, str], log_path: Path
    ) -> ForkedProcess | None:
        """Fork a worker; None when the server could not."""
        if not self.wait_ready():
            return None
        self._launched += 1
        key = str(self._launched)
        self._send(
            {"run": {"argv": list(argv), "cwd": str(cwd), "env": dict(env),
                     "log": str(log_path), "key": key}}
        )  # fmt: skip
        while key not in self._started and not self.dead:
            self.pump(None)
        pid = self._started.pop(key, None)
        return None if pid is None else ForkedProcess(self, pid)

    def close(self) -> None:
        """Hang up (the server exits) and reap it; one still importing is killed."""
        with contextlib.suppress(OSError):
            self.sock.close()
        self.dead = True
        if self.ready is None and self.process.returncode is None:
            # It has forked no worker, and would hear the hang-up only after its imports.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class ForkedProcess:
    """A worker forked by a :class:`ForkServer`, with the part of Popen's interface we use."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.pump(0.0)
            self.returncode = self.server.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            self.server.pump(remaining)
        assert self.returncode is not None
        return self.returncode

    def wait_fd(self) -> int | None:
        """What becomes readable when this worker's exit can be known (the server's socket)."""
        return None if self.server.dead else self.server.fileno()


@dataclass
class Launcher:
    """Starts a replay's workers: forked from a server per (environment, modules), or new."""

    python: str
    logs_dir: Path
    preexec: Callable[[], None] | None = None
    servers: dict[tuple[Any, ...], ForkServer] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what did not go as planned
    forked: int = 0
    fresh: int = 0
    used: bool = False  # a replay ran with it (its logs directory is the replay's)

    def prepare(self, env: Mapping[str, str], warm: Sequence[str]) -> ForkServer | None:
        """The server for workers with this environment and these modules (started once)."""
        if not warm:
            return None
        key = (tuple(sorted(env.items())), tuple(warm))
        server = self.servers.get(key)
        if server is None:
            log_path = self.logs_dir / f"forkserver-{len(self.servers)}.log"
            try:
                server = ForkServer(
                    python=self.python, env=env, warm=warm, log_path=log_path,
                    preexec=self.preexec,
                )  # fmt: skip
            except OSError as exc:
                self.notes.append(f"the fork server did not start ({exc}): new interpreters")
                return None
            self.servers[key] = server
        return server

    def launch(
        self, *, argv: Sequence[str], cwd: Path, env: Mapping[str, str], log_path: Path,
        server_env: Mapping[str, str], warm: Sequence[str],
    ) -> ForkedProcess | None:  # fmt: skip
        """A forked worker, or None: the caller starts a new interpreter (a note says why)."""
        server = self.prepare(server_env, warm)
        if server is None:
            self.fresh += 1
            return None
        process = server.launch(argv=argv, cwd=cwd, env=env, log_path=log_path)
        if process is None:
            self.fresh += 1
            why = server.unsafe or f"it exited (see {server.log_path})"
            note = f"the fork server could not be used: {why}; workers started as new interpreters"
            if note not in self.notes:
                self.notes.append(note)
            return None
        self.forked += 1
        return process

    def retain(self, needed: Sequence[ForkServer]) -> None:
        """Stop the servers not in ``needed`` (started on a guess the plan did not confirm)."""
        keep = {id(server) for server in needed}
        for key, server in list(self.servers.items()):
            if id(server) not in keep:
                server.close()
                del self.servers[key]

    def summary(self) -> str:
        """What the replay's workers started from, for its report."""
        if not self.forked:
            return ""
        ready = [s.ready for s in self.servers.values() if s.ready is not None]
        seconds = sum(float(r.get("ready", 0.0)) for r in ready)
        modules = sum(int(r.get("imported", 0)) for r in ready)
        text = (
            f"start-up: {self.forked} worker(s) forked from {len(ready)} fork server(s) that "
            f"imported {modules} module(s) once in {seconds:.1f}s"
        )
        if self.fresh:
            text += f"; {self.fresh} started as new interpreters"
        return text

    def close(self) -> None:
        for server in self.servers.values():
            if server.process.returncode is None:
                server.close()
