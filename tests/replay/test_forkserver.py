"""Fork servers: a forked worker is the process ``python script argv...`` would have been.

The server is the real one (_replay/forkserver_main.py in its own process, with numpy and
torch imported); each test compares what a forked worker sees with what a new
interpreter running the same script sees.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from retrolog._replay.execute import _wait_any, die_with
from retrolog._replay.forkserver import ForkServer, Launcher, describe, start_plan

PROBE = """\
import json, os, pickle, random, sys, threading

import numpy as np
import torch


class Point:
    def __init__(self, x):
        self.x = x


already = sorted(m for m in ("numpy", "torch", "retrolog") if m in sys.modules)
print(json.dumps({
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "name": __name__,
    "file": __file__,
    "spec": __spec__ is None,
    "package": __package__,
    "main_is_module": sys.modules["__main__"].__dict__ is globals(),
    "pickled": pickle.loads(pickle.dumps(Point(3))).x,
    "env": os.environ.get("PROBE_VALUE"),
    "secret": os.environ.get("PROBE_ONLY_IN_SERVER"),
    "session_leader": os.getsid(0) == os.getpid(),
    "stdin": sys.stdin.read(),
    "threads": threading.active_count(),
    "torch_seed": torch.initial_seed(),
    "torch_rand": torch.rand(3).tolist(),
    "random": random.random(),
    "numpy": float(np.random.random()),
    "torch_threads": torch.get_num_threads(),
    "retrolog_loaded": "retrolog" in sys.modules,
}))
sys.stdout.flush()
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    env["PROBE_ONLY_IN_SERVER"] = "server"
    forks = ForkServer(
        python=sys.executable, env=env, warm=["numpy", "torch", "torch.optim"],
        log_path=tmp_path / "server.log", preexec=die_with(os.getpid()),
    )  # fmt: skip
    yield forks
    forks.close()


def _script(tmp_path: Path, text: str = PROBE) -> Path:
    folder = tmp_path / "checkout" / "sub"
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "probe.py"
    script.write_text(text)
    return script


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    env.update(extra)
    return env


def _fresh(script: Path, *args: str, **extra: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=script.parent.parent, env=_env(**extra),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
        start_new_session=True,  # as replay starts a new-interpreter worker
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def _forked(
    server: ForkServer, script: Path, *args: str, log: Path, **extra: str
) -> tuple[int, str]:
    log.write_bytes(b"")
    process = server.launch(
        argv=[str(script), *args], cwd=script.parent.parent, env=_env(**extra), log_path=log
    )
    assert process is not None, server.unsafe
    code = process.wait(timeout=120)
    return code, log.read_text()


def test_a_forked_worker_sees_what_a_new_interpreter_sees(
    server: ForkServer, tmp_path: Path
) -> None:
    script = _script(tmp_path)
    code, out = _fresh(script, "--lr", "0.1", PROBE_VALUE="job")
    assert code == 0, out
    fresh = json.loads(out)
    first = second = None
    for i in range(2):
        code, out = _forked(
            server, script, "--lr", "0.1", log=tmp_path / f"w{i}.log", PROBE_VALUE="job"
        )
        assert code == 0, out
        if i == 0:
            first = json.loads(out)
        else:
            second = json.loads(out)
    assert first is not None and second is not None
    assert server.ready is not None and server.ready["imported"] >= 3
    same = (
        "argv", "cwd", "path0", "name", "file", "spec", "package", "main_is_module",
        "pickled", "env", "secret", "session_leader", "stdin", "threads", "torch_threads",
        "retrolog_loaded",
    )  # fmt: skip
    assert {k: first[k] for k in same} == {k: fresh[k] for k in same}
    assert first["secret"] is None  # the job's environment, not the server's
    assert fresh["argv"] == [str(script), "--lr", "0.1"]
    assert fresh["path0"] == str(script.parent)
    # Unseeded generators differ between workers, as between new interpreters.
    for key in ("random", "numpy", "torch_seed", "torch_rand"):
        assert first[key] != second[key], key


def test_what_a_forked_worker_saves_is_the_interpreters_start_and_the_imports(
    server: ForkServer, tmp_path: Path
) -> None:
    """The plan subtracts it from the recorded prefix; a new interpreter's start is part of
    that prefix, so it is measured too: from before the server process was started (the
    coordinator's monotonic clock, which the machine's processes share) to its imports."""
    assert server.wait_ready() and server.ready is not None
    imports, boot = server.ready["ready"], server.ready["boot"]
    # Starting python and reading the server's program: more than nothing, less than the
    # imports of numpy and torch, far less than a minute.
    assert 0.0 < boot < 10.0 and boot < imports, server.ready
    assert server.saved_seconds == pytest.approx(imports + boot)
    started = time.monotonic()
    code, out = _forked(server, _script(tmp_path), log=tmp_path / "w.log", PROBE_VALUE="job")
    assert code == 0, out
    # A forked worker runs in far less than what it saved (the imports are done).
    assert time.monotonic() - started < server.saved_seconds


def test_a_forked_start_is_timed_in_a_child_and_leaves_the_server_untouched(
    tmp_path: Path,
) -> None:
    # What every forked worker spends before the script's own code (the fork, becoming the
    # job's process, importing retrolog's worker modules) is measured by the server on
    # this machine before it serves. A module that takes 0.3 s to import stands in for a
    # slow machine's retrolog: the figure must include it, the server must not import it
    # (a worker imports retrolog itself, after it knows its spec), and the child must
    # leave no trace.
    library = tmp_path / "site"
    library.mkdir()
    (library / "slowstart.py").write_text(
        "import os, time\n"
        "time.sleep(0.3)\n"
        "open(os.environ['MARKS'] + '/' + str(os.getpid()), 'w').close()\n"
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    env = _env(PYTHONPATH=str(library), MARKS=str(marks))
    forks = ForkServer(
        python=sys.executable, env=env, warm=["json"], log_path=tmp_path / "server.log",
        preexec=die_with(os.getpid()), probe=["json", "slowstart"],
    )  # fmt: skip
    try:
        assert forks.wait_ready(), forks.unsafe
        assert forks.forked_start is not None and 0.3 <= forks.forked_start < 5.0
        (child,) = [int(p.name) for p in marks.iterdir()]
        assert child != forks.process.pid
        script = _script(tmp_path, "import sys\nprint('slowstart' in sys.modules)\n")
        code, out = _forked(forks, script, log=tmp_path / "w.log")
        assert (code, out) == (0, "False\n")  # the server never imported it
        assert forks.ready is not None and forks.ready["ready"] < 0.3  # nor counted it
    finally:
        forks.close()
    # A module that does not import: nothing measured, and the server serves all the same.
    broken = ForkServer(
        python=sys.executable, env=_env(), warm=["json"], log_path=tmp_path / "broken.log",
        preexec=die_with(os.getpid()), probe=["no_such_module_here"],
    )  # fmt: skip
    try:
        assert broken.wait_ready() and broken.forked_start is None
        code, out = _forked(broken, _script(tmp_path, "print('ran')\n"), log=tmp_path / "b.log")
        assert (code, out) == (0, "ran\n")
    finally:
        broken.close()


def test_the_real_server_times_retrologs_own_worker_start(server: ForkServer) -> None:
    assert server.wait_ready()
    # Importing retrolog's worker modules in a forked child: more than nothing, far less
    # than the server's imports of numpy and torch.
    assert server.forked_start is not None and 0.0 < server.forked_start < server.saved_seconds


def test_exit_codes_errors_and_signals_are_reported_as_for_a_process(
    server: ForkServer, tmp_path: Path
) -> None:
    script = _script(tmp_path)
    code, _ = _forked(server, script, log=tmp_path / "a.log", PROBE_EXIT="3")
    assert code == 3
    failing = _script(tmp_path, "import torch\nraise ValueError('bad batch')\n")
    code, out = _forked(server, failing, log=tmp_path / "b.log")
    assert code == 1
    assert "ValueError: bad batch" in out and "Traceback" in out
    killed = _script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    code, _ = _forked(server, killed, log=tmp_path / "c.log")
    assert code == -signal.SIGKILL


LEAVING = """\
import atexit
import sys
import threading
import time
import torch

class Noisy:
    def __del__(self):
        print("finalized", flush=True)

keep = Noisy()
atexit.register(lambda: print("atexit ran", end=""))  # flushed although no newline ends it
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined"))).start()
sys.exit(sys.argv[1] if sys.argv[1:] else None)
"""


def test_a_forked_worker_leaves_as_the_interpreter_would_but_without_finalizing(
    server: ForkServer, tmp_path: Path
) -> None:
    """Threads joined, atexit run, output flushed, the exit status; not the modules'
    teardown, which costs a process that imported torch 0.4-0.7 s."""
    script = _script(tmp_path, LEAVING)
    code, out = _forked(server, script, log=tmp_path / "a.log")
    assert code == 0, out
    assert "thread joined" in out and out.endswith("atexit ran"), out
    assert "finalized" not in out  # the module's objects were left to the OS
    code, out = _forked(server, script, "out of memory", log=tmp_path / "b.log")
    assert code == 1 and "out of memory" in out, out
    fresh, out = _fresh(script, "out of memory")
    assert fresh == 1 and "out of memory" in out


def test_an_exit_read_while_launching_another_worker_is_seen_at_once(
    server: ForkServer, tmp_path: Path
) -> None:
    """Two workers of one server: launching the second reads the server's socket until it
    says "started", and takes the first's "exited" with it when both were sent. Waiting
    for an exit must then see it in what was read, not wait on the socket, which has
    nothing more to say (a replay with 2 workers stalled 0.5 s, its timeout, so)."""
    quick, sleeper = tmp_path / "quick.py", tmp_path / "sleeper.py"
    quick.write_text("pass\n")
    sleeper.write_text("import time\ntime.sleep(30)\n")
    for name in ("q.log", "s.log"):
        (tmp_path / name).write_bytes(b"")
    first = server.launch(
        argv=[str(quick)], cwd=quick.parent, env=_env(), log_path=tmp_path / "q.log"
    )
    assert first is not None
    deadline = time.monotonic() + 10
    while Path(f"/proc/{first.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # gone, and its server has said so on the socket, unread
    time.sleep(0.2)
    second = server.launch(
        argv=[str(sleeper)], cwd=sleeper.parent, env=_env(), log_path=tmp_path / "s.log"
    )
    assert second is not None
    assert first.pid in server.exits  # read by launch(), with "started"
    jobs = [SimpleNamespace(process=first), SimpleNamespace(process=second)]
    started = time.monotonic()
    _wait_any(jobs, timeout=5.0)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    assert first.poll() == 0 and second.poll() is None
    os.kill(second.pid, signal.SIGKILL)
    assert second.wait(timeout=10) == -signal.SIGKILL


def test_a_worker_dies_with_its_server(server: ForkServer, tmp_path: Path) -> None:
    sleeper = _script(tmp_path, "import time\ntime.sleep(120)\n")
    (tmp_path / "s.log").write_bytes(b"")
    process = server.launch(
        argv=[str(sleeper)], cwd=sleeper.parent, env=_env(), log_path=tmp_path / "s.log"
    )
    assert process is not None
    os.kill(server.process.pid, signal.SIGKILL)
    assert process.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by init once its parent is gone
    state = Path(f"/proc/{process.pid}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z"


def test_imports_that_start_a_thread_make_workers_start_as_new_interpreters(
    tmp_path: Path,
) -> None:
    library = tmp_path / "site"
    library.mkdir()
    (library / "busylib.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True, name='poller').start()\n"
    )
    launcher = Launcher(python=sys.executable, logs_dir=tmp_path)
    script = _script(tmp_path, "import busylib\nprint('ran')\n")
    env = _env(PYTHONPATH=str(library))
    try:
        process = launcher.launch(
            argv=[str(script)], cwd=script.parent, env=env, log_path=tmp_path / "w.log",
            server_env=env, warm=["busylib"],
        )  # fmt: skip
    finally:
        launcher.close()
    assert process is None
    assert launcher.fresh == 1 and launcher.forked == 0
    assert any("started Python threads (poller)" in note for note in launcher.notes)


def test_the_plan_says_why_a_script_is_not_forked(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "models.py").write_text("")
    recorded = ["numpy", "numpy.linalg", "torch", "torch._dynamo", "tqdm", "models"]

    def plan(source: str, modules: list[str] | None = recorded) -> object:
        return start_plan(source, modules, root=root, script_dir=root)

    forked = plan("import torch\nimport models\nfrom numpy import linalg\n")
    assert forked.warm == ("numpy", "numpy.linalg", "torch", "torch._dynamo")
    assert forked.packages == ("torch", "numpy")  # never the project's own models.py
    assert plan("import torch\n", None).warm == ("torch",)  # recorded before modules were kept
    for source, reason in [
        # Written after an installed package is imported, or not as a literal, or
        # anywhere but the script's top: the modules may read them in any state.
        ("import torch\nimport os\nos.environ['X'] = '1'\n", "os.environ (line 3)"),
        ("import os\nos.environ['X'] = str(1)\nimport torch\n", "os.environ (line 2)"),
        ("import os\nif True:\n    os.environ['X'] = '1'\nimport torch\n", "(line 3)"),
        ("import os\nx = 1\nos.environ['X'] = '1'\nimport torch\n", "os.environ (line 3)"),
        (
            "import os\nfrom retrolog.integrations import transformers\n"
            "os.environ['X'] = '1'\nimport torch\n",
            "os.environ (line 3)",
        ),
        ("import os\ndel os.environ['X']\nimport torch\n", "os.environ (line 2)"),
        ("import os\nos.environ.pop('X')\nimport torch\n", "os.environ (line 2)"),
        ("import os\nos.putenv('X', '1')\nimport torch\n", "the environment (line 2)"),
        ("import sys\nsys.path.insert(0, '../lib')\nimport torch\n", "sys.path (line 2)"),
        ("import json\nimport models\n", "imports no installed package"),
        ("def f(:\n", "does not parse"),
    ]:
        result = plan(source)
        assert not result.forked and reason in result.reason, (source, result)
    assert "none of the script's packages" in plan("import torch\n", ["numpy"]).reason
    # Literal writes at the top, before any installed import: the server makes them too.
    early = plan(
        '"""A script."""\nfrom __future__ import annotations\nimport os\nimport retrolog as rl\n'
        "os.environ['OMP_NUM_THREADS'] = '1'\n"
        "os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')\n"
        "os.environ.update({'A': 'a'}, )\nos.environ.update(B='b')\n"
        "os.environ.pop('C', None)\nimport torch\n"
    )
    assert early.forked and early.warm == ("torch", "torch._dynamo")
    assert early.environ == (
        ("set", "OMP_NUM_THREADS", "1"),
        ("setdefault", "TOKENIZERS_PARALLELISM", "false"),
        ("set", "A", "a"),
        ("set", "B", "b"),
        ("pop", "C", ""),
    )
    worker = {"TOKENIZERS_PARALLELISM": "true", "C": "c", "D": "d"}
    assert early.server_environment(worker) == {
        "TOKENIZERS_PARALLELISM": "true", "D": "d", "OMP_NUM_THREADS": "1", "A": "a", "B": "b",
    }  # fmt: skip
    text = describe([forked, plan("import json\n")])
    assert "workers of 1 of 2 run(s) start from a fork server that imports numpy, torch" in text
    assert "1 run(s) start as new interpreters (the script imports no installed" in text


def test_a_server_imports_after_the_scripts_early_environment_writes(tmp_path: Path) -> None:
    # transformers' scripts set TOKENIZERS_PARALLELISM, HF_HUB_OFFLINE... before importing
    # it, and a library may read them when imported: the server imports it as the script
    # would have, after the same writes.
    library = tmp_path / "site"
    library.mkdir()
    (library / "envlib.py").write_text("import os\nSEEN = os.environ.get('ENVLIB_MODE')\n")
    source = (
        "import json\nimport os\n\nos.environ.setdefault('ENVLIB_MODE', 'offline')\n\n"
        "import envlib\n\nprint(json.dumps(envlib.SEEN))\n"
    )
    script = _script(tmp_path, source)
    start = start_plan(source, ["envlib"], root=tmp_path, script_dir=script.parent)
    assert start.forked and start.environ == (("setdefault", "ENVLIB_MODE", "offline"),)
    env = _env(PYTHONPATH=str(library))
    env.pop("ENVLIB_MODE", None)
    launcher = Launcher(python=sys.executable, logs_dir=tmp_path)
    log = tmp_path / "w.log"
    log.write_bytes(b"")
    try:
        process = launcher.launch(
            argv=[str(script)], cwd=script.parent, env=env, log_path=log,
            server_env=start.server_environment(env), warm=start.warm,
        )  # fmt: skip
        assert process is not None, launcher.notes
        assert process.wait(timeout=120) == 0, log.read_text()
    finally:
        launcher.close()
    assert launcher.forked == 1
    assert json.loads(log.read_text()) == "offline"  # as a new interpreter: _fresh below
    code, out = _fresh(script, PYTHONPATH=str(library))
    assert code == 0 and json.loads(out) == "offline", out


def test_forkserver_off_by_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETROLOG_FORKSERVER", "0")
    result = start_plan("import torch\n", ["torch"], root=tmp_path, script_dir=tmp_path)
    assert not result.forked and result.reason == "RETROLOG_FORKSERVER=0"


def test_the_server_program_imports_nothing_of_retrolog() -> None:
    source = (Path(__file__).parents[2] / "src/retrolog/_replay/forkserver_main.py").read_text()
    tree = ast.parse(source)
    imported = {
        alias.name.partition(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").partition(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__", "__main__"}


def test_a_server_still_importing_is_stopped_at_once_when_no_worker_needs_it(
    tmp_path: Path,
) -> None:
    # A replay starts a fork server on a guess before its plan is made; when the plan
    # needs another (or none), the guessed one may still be importing torch. It must
    # not hold the replay up until its imports end.
    library = tmp_path / "site"
    library.mkdir()
    (library / "slowlib.py").write_text("import time\ntime.sleep(60)\n")
    env = _env(PYTHONPATH=str(library))
    launcher = Launcher(python=sys.executable, logs_dir=tmp_path)
    try:
        guessed = launcher.prepare(env, ["slowlib"])
        needed = launcher.prepare(env, ["json"])
        assert guessed is not None and needed is not None
        time.sleep(0.5)
        assert guessed.process.poll() is None  # still importing
        began = time.monotonic()
        launcher.retain([needed])
        took = time.monotonic() - began
        assert guessed.process.returncode is not None
        assert list(launcher.servers.values()) == [needed]
        # The one kept serves as before.
        script = _script(tmp_path, "print('ran')\n")
        process = launcher.launch(
            argv=[str(script)], cwd=script.parent, env=env, log_path=tmp_path / "w.log",
            server_env=env, warm=["json"],
        )  # fmt: skip
        assert process is not None and process.wait(timeout=60) == 0
    finally:
        launcher.close()
    # A hang-up is read only after the imports: closing waited 5 s, then killed.
    assert took < 2.0, took
    assert (tmp_path / "w.log").read_text() == "ran\n"
