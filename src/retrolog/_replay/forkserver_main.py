"""The fork server's own program: imports a script's heavy modules once, then forks workers.

This file runs as a module of its own in a process started by
_replay/forkserver.py (``python -c BOOT <this file> <fd>``), never as part of
the retrolog package: a worker must import retrolog itself, after it knows
its spec, so nothing here imports retrolog, and only the standard library is
used before the modules to pre-import are.

Protocol, one JSON object per line on the socket ``fd``:

- coordinator -> server: ``{"warm": [names], "spawned": t, "probe": [names]}`` once,
  then ``{"run": {...}}`` per worker: argv (argv[0] the script), cwd, env, log (a
  file for stdout and stderr), key;
- server -> coordinator: ``{"ready": seconds, "boot": seconds, "imported": n,
  "failed": [...], "forked_start": seconds}`` (``boot``: from the coordinator's
  ``spawned``, a ``time.monotonic()`` sent with ``warm``, to the imports' start;
  ``forked_start``: see :func:`time_a_start`, None when not measured)
  or ``{"unsafe": reason}`` (then it exits), ``{"started": pid, "key": k}`` per
  worker, ``{"exited": pid, "returncode": rc}`` (negative: killed by that
  signal, as subprocess reports it).

A forked worker becomes what ``python script argv...`` would have been: its
own session, stdin from /dev/null, stdout and stderr to its log, the job's cwd,
environment, argv and ``sys.path[0]``, a fresh ``__main__``, numpy's and
torch's default generators reseeded from the OS as a new interpreter's are
(Python's ``random`` reseeds itself after a fork), and it dies with the
server, which dies with the coordinator.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib
import importlib.machinery
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Any

_PR_SET_PDEATHSIG = 1


def serve(fd: int) -> dict[str, Any]:
    """Serve until the coordinator hangs up; returns (in a forked child) the job to run."""
    sock = socket.socket(fileno=fd)
    lines = _Lines(sock)
    first = json.loads(lines.next(block=True) or b"{}")
    started = time.perf_counter()
    boot = _since(first.get("spawned"))
    failed = _warm(first.get("warm") or [])
    reason = _unsafe()
    if reason:
        _send(sock, {"unsafe": reason})
        os._exit(0)
    imports = time.perf_counter() - started
    server_pid = os.getpid()
    _send(
        sock,
        {
            "ready": imports,
            "boot": boot,
            "imported": len(first.get("warm") or []) - len(failed),
            "failed": failed[:20],
            "forked_start": time_a_start(first.get("probe") or [], server_pid),
        },
    )
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    while True:
        _reap(sock)
        line = lines.next(block=False)
        if line is None:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [], 1.0)
            if wake_r in ready:
                os.read(wake_r, 4096)
            if sock.fileno() in ready:
                lines.fill()
            continue
        if not line:  # the coordinator is done (or gone): workers die with this process
            os._exit(0)
        job = json.loads(line)["run"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 3.12's multi-threaded fork warning: see _unsafe
            pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
            sock.close()
            _become(job, server_pid)
            return job
        _send(sock, {"started": pid, "key": job.get("key")})


# The longest a probe child may take to import (it is killed after; nothing is measured).
PROBE_TIMEOUT_SECONDS = 20.0


def time_a_start(modules: list[str], server_pid: int) -> float | None:
    """Seconds from a fork to a child set up as a worker is that has imported ``modules``.

    What every forked worker spends before the script's own code: the fork, becoming
    the job's process (:func:`_become`) and importing retrolog and its replay runtime,
    which the server itself never imports (a worker imports retrolog after it knows
    its spec). Measured here, on this machine under its current load, once per server,
    before it serves: the plan's estimate of each forked worker's start uses it
    instead of a constant measured on another day. The child exits at once, without
    writing anything. None when there is nothing to import, or the child failed.
    """
    if not modules:
        return None
    read_end, write_end = os.pipe()
    began = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3.12's multi-threaded fork warning: see _unsafe
        pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            job = {"log": os.devnull, "cwd": os.getcwd(), "env": dict(os.environ),
                   "argv": [os.devnull]}  # fmt: skip
            _become(job, server_pid)
            for name in modules:
                importlib.import_module(name)
            os.write(write_end, repr(time.monotonic()).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    data = b""
    try:
        ready, _, _ = select.select([read_end], [], [], PROBE_TIMEOUT_SECONDS)
        if ready:
            data = os.read(read_end, 64)
    finally:
        os.close(read_end)
        if not data:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        seconds = float(data) - began
    except ValueError:
        return None
    return seconds if 0.0 <= seconds < PROBE_TIMEOUT_SECONDS else None


def _since(spawned: object) -> float | None:
    """Seconds from the coordinator's ``time.monotonic()`` before it started this process
    (the clock is the machine's, shared by its processes) to now: the new interpreter's
    own start, which a forked worker does not repeat. None when not given or implausible."""
    if not isinstance(spawned, float):
        return None
    seconds = time.monotonic() - spawned
    return seconds if 0.0 <= seconds < 60.0 else None


class _Lines:
    """Lines from a socket: ``next`` gives a complete line, b"" at EOF, None for "not yet"."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.eof = False

    def fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if data:
            self.buffer += data
        else:
            self.eof = True

    def next(self, *, block: bool) -> bytes | None:
        while True:
            line, newline, rest = self.buffer.partition(b"\n")
            if newline:
                self.buffer = rest
                return line
            if self.eof:
                return b""
            if not block:
                return None
            self.fill()


def _warm(names: list[str]) -> list[str]:
    """Import ``names`` in order; the ones that failed (the worker imports what it needs)."""
    failed = []
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException as exc:  # any failure only means "not pre-imported"
            if isinstance(exc, KeyboardInterrupt):
                raise
            failed.append(f"{name}: {type(exc).__name__}")
    return failed


def _unsafe() -> str | None:
    """Why forking this process now would not give a worker a clean start (None: it would)."""
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"importing the script's modules started Python threads ({names})"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return "importing the script's modules initialised CUDA"
    except Exception:  # a torch without is_initialized: nothing was set up
        pass
    extra = _native_threads() - 1
    if extra > 0 and not (_openblas_loaded() and extra <= (os.cpu_count() or 1)):
        return f"importing the script's modules started {extra} native thread(s)"
    return None


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _openblas_loaded() -> bool:
    """OpenBLAS's pool (numpy's) stops its threads before a fork (its pthread_atfork handler)."""
    try:
        with open("/proc/self/maps", errors="replace") as maps:  # paths: any bytes
            return any("openblas" in line.lower() for line in maps)
    except OSError:
        return False


def _become(job: dict[str, Any], server_pid: int) -> None:
    """In the forked child: set the process up as ``python script argv...`` would be."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server_pid:  # the server died before the line above
        os._exit(1)
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    script = job["argv"][0]
    sys.argv = list(job["argv"])
    if not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    # Generators a new interpreter seeds from the OS at import, reseeded so: unseeded
    # randomness differs between workers as between processes. (Python's random module
    # reseeds itself after a fork; CUDA's generators are made later, in the worker.)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        generator.seed()


def main_namespace(path: str) -> dict[str, Any]:
    """The real ``__main__`` module's namespace, emptied and set up as ``python path``
    sets it up (pickling finds what the script defines there)."""
    import __main__

    namespace = __main__.__dict__
    namespace.clear()
    namespace.update(
        __name__="__main__",
        __doc__=None,
        __package__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __spec__=None,
        __annotations__={},
        __builtins__=builtins,
        __file__=path,
        __cached__=None,
    )
    return namespace


def run_script(path: str) -> None:
    """Run ``path`` as ``__main__``, in the real ``__main__`` module."""
    namespace = main_namespace(path)
    sys.modules.pop("_retrolog_zygote", None)
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, namespace)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        _send(sock, {"exited": pid, "returncode": code})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def main(fd: int) -> None:
    job = serve(fd)
    try:
        run_script(job["argv"][0])
    except SystemExit as exc:
        _leave(_exit_status(exc))
    except KeyboardInterrupt:
        raise  # the interpreter's own way out: the traceback, then death by SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the traceback, as the interpreter prints it
        _leave(1)
    _leave(0)


def _exit_status(exc: SystemExit) -> int:
    """The status ``python script`` exits with after ``exc``, printing it if it is text."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _leave(status: int) -> None:
    """End the worker as the interpreter would, but without finalizing its modules.

    The interpreter's exit joins the non-daemon threads, runs the atexit handlers
    (retrolog's writes the worker's output) and flushes stdout and stderr; then it
    tears down every module and object. That last part is what a process that
    imported torch (and scikit-learn, ...) spends most of its exit in: 0.4-0.7 s in a
    forked child, against 0.01 s for os._exit; and a forked worker's memory is mostly
    its server's pages, which need no freeing. So the worker does the first three and
    leaves by os._exit.
    """
    import atexit

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
