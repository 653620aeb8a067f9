"""Running replay segments as worker processes, one temporary checkout each.

Workers are real processes (``python <script> <recorded argv>``), so a crash,
a hang or a CUDA error in one cannot take the others or the coordinator down.
At most ``workers`` run at once, longest estimated segment first; with GPUs
each worker sees one device through ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import retrolog
from retrolog._config import lookup
from retrolog._replay.checkout import make_checkout, remove_checkout, sweep_checkouts
from retrolog._replay.forkserver import ForkedProcess, Launcher, StartPlan
from retrolog.runtime.numerics import worker_environment
from retrolog.runtime.replay_worker import SPEC_ENV, WorkerSpec
from retrolog.store.fsspec_objects import TIMEOUT_ENV
from retrolog.store.processes import process_alive, process_start_marker

_TAIL_LINES = 15


@dataclass
class Job:
    """One segment to run: where, how, and what came of it."""

    key: str  # "<run_id>#<segment index>"
    run_id: str
    spec: WorkerSpec
    argv: list[str]  # the run's recorded command line (argv[0] is the script)
    filename: str
    cwd: str  # relative to the checkout root
    source: str  # the propagated script
    git_dir: Path
    commit: str
    skipped: list[str]
    estimate_seconds: float
    log_path: Path
    numerics: dict[str, Any] | None = None  # the run's recorded numerical environment
    start: StartPlan | None = None  # forked from a server that imported modules, or new
    handsfree: bool = False  # recorded by `retrolog run`: the worker runs it the same way
    # filled in while it runs
    seconds: float = 0.0
    returncode: int | None = None
    output: dict[str, Any] | None = None
    error: str | None = None
    diagnosed: bool = False  # error says what the script raised, and where: no log tail needed
    checkout: Path | None = None
    process: subprocess.Popen[bytes] | ForkedProcess | None = field(default=None, repr=False)
    started: float = 0.0


def gpu_count() -> int:
    """GPUs visible on this machine, without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def cpu_cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers(threads: int | None = None) -> int:
    """Workers that fit this machine without changing a run's thread count.

    threads: the largest intra-op thread count among the runs to replay (None:
        not known, taken as 1). With GPUs, one worker per GPU; otherwise as many
        workers as the cores hold at that many threads each, at least one.
    """
    return gpu_count() or max(1, cpu_cores() // max(threads or 1, 1))


def run_jobs(
    jobs: Sequence[Job],
    *,
    root: Path,
    store: Path,
    workers: int,
    python: str = sys.executable,
    on_done: Callable[[Job], None] | None = None,
    launcher: Launcher | None = None,
) -> None:
    """Run ``jobs`` (already ordered longest first), at most ``workers`` at a time.

    Each worker gets its run's recorded numerical environment variables
    (runtime/numerics.py), whatever this shell sets; its torch threads and flags
    travel in the spec and are applied in the worker. With a ``launcher``, jobs
    whose ``start`` plan says so are forked from its fork servers
    (_replay/forkserver.py); the others start as new interpreters.
    """
    pending = list(jobs)
    running: list[Job] = []
    gpus = gpu_count()
    free_devices = list(range(gpus))
    device_of: dict[str, int] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                job = pending.pop(0)
                device = free_devices.pop(0) if free_devices else None
                if device is not None:
                    device_of[job.key] = device
                _start(job, root=root, store=store, python=python, device=device, launcher=launcher)
                running.append(job)
            _wait_any(running)
            for job in list(running):
                assert job.process is not None
                if job.process.poll() is None:
                    continue
                _finish(job)
                running.remove(job)
                if job.key in device_of:
                    free_devices.append(device_of.pop(job.key))
                if on_done is not None:
                    on_done(job)
    except BaseException:
        for job in running:
            assert job.process is not None
            if job.process.poll() == 0:
                # It finished before the interrupt was noticed: keep its values, so the run
                # is recorded partial, not interrupted with its finished work thrown away.
                _finish(job)
                if job.output is None:
                    job.error = None  # no output after all: stopped, as the others are
            else:
                _kill(job)
        raise
    finally:
        for job in jobs:
            if job.checkout is not None:
                remove_checkout(job.checkout)
                job.checkout = None


def _wait_any(running: Sequence[Job], timeout: float = 0.5) -> None:
    """Block until one of the running workers exits (or ``timeout``).

    A worker's duration is measured to when this notices its exit, so a fixed
    polling interval would add half of it to every segment on average: wait on the
    processes' pidfds where Linux has them (on their fork server's socket for
    forked workers, which is told of their exit), poll every 10 ms elsewhere.
    """
    if not running:
        return
    # A fork server's socket may have said so already: launching another worker reads it
    # until "started" and takes an earlier "exited" with it. Nothing more would come.
    if any(job.process is not None and job.process.poll() is not None for job in running):
        return
    owned: list[int] = []
    shared: set[int] = set()
    try:
        for job in running:
            process = job.process
            assert process is not None
            if isinstance(process, ForkedProcess):
                fd = process.wait_fd()
                if fd is None:  # its server is gone: poll() knows already
                    return
                shared.add(fd)
            else:
                owned.append(os.pidfd_open(process.pid))
    except (AttributeError, OSError):  # not Linux >= 5.3, or the process is already reaped
        for fd in owned:
            os.close(fd)
        time.sleep(0.01)
        return
    try:
        select.select([*owned, *shared], [], [], timeout)
    finally:
        for fd in owned:
            os.close(fd)


def worker_env(job: Job) -> dict[str, str]:
    """A worker's environment: this one without retrolog's variables, with the run's numerics.

    What a job adds to it (its spec, its GPU) is set per worker; a fork server
    starts with exactly this, so the modules it imports see what a new worker's would.
    """
    return run_worker_env(job.numerics)


def run_worker_env(numerics: dict[str, Any] | None) -> dict[str, str]:
    """:func:`worker_env` for a run with the recorded numerical environment ``numerics``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    env = worker_environment(env, numerics)
    env.update({"RETROLOG_PROGRESS": "0", "PYTHONUNBUFFERED": "1"})
    # The user's limit on an object store's silence (environment or settings file) holds
    # in the workers too: without it a worker waits the default 60 s per request.
    timeout = lookup(TIMEOUT_ENV)
    if timeout is not None:
        env[TIMEOUT_ENV] = timeout
    return env


def _start(
    job: Job,
    *,
    root: Path,
    store: Path,
    python: str,
    device: int | None,
    launcher: Launcher | None = None,
) -> None:
    job.checkout = make_checkout(
        root=root,
        store=store,
        git_dir=job.git_dir,
        commit=job.commit,
        filename=job.filename,
        script_source=job.source,
        skipped=job.skipped,
        prefix=job.run_id,
    )
    spec_path = job.log_path.with_suffix(".spec.json")
    job.spec.output = str(job.log_path.with_suffix(".out.json"))
    job.spec.checkout = str(job.checkout)
    job.spec.project = str(root)
    job.spec.save(spec_path)
    base = worker_env(job)
    env = {**base, SPEC_ENV: str(spec_path)}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    cwd = job.checkout / job.cwd
    if not cwd.is_dir():
        cwd = job.checkout
    argv = [str(job.checkout / job.filename), *job.argv[1:]]
    if job.handsfree:  # the propagated version goes through its recording's rewrite
        argv = [str(Path(retrolog.__file__).parent / "__main__.py"), "run", *argv]
    if launcher is not None and job.start is not None and job.start.forked:
        job.log_path.write_bytes(b"")
        # The fork server's own imports (once, before its first worker) are not the job's:
        # the plan counts them apart.
        forked = launcher.launch(
            argv=argv, cwd=cwd, env=env, log_path=job.log_path,
            server_env=job.start.server_environment(base), warm=job.start.warm,
        )  # fmt: skip
        if forked is not None:
            job.started = time.perf_counter()
            job.process = forked
            return
    log = job.log_path.open("wb")
    try:
        job.started = time.perf_counter()
        job.process = subprocess.Popen(
            [python, *argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the coordinator, which stops workers itself
            preexec_fn=die_with(os.getpid()),
        )
    finally:
        log.close()


def die_with(parent: int) -> Callable[[], None] | None:
    """For preexec_fn: the worker is killed when its coordinator dies, however it dies.

    Linux's parent-death signal; a coordinator killed with SIGKILL (the OOM killer, a
    batch scheduler) cannot stop its workers itself. Elsewhere, None: the coordinator's
    own handlers (Ctrl-C, SIGTERM) stop them, and the next replay sweeps what is left.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_parent_death_signal() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the coordinator died before the line above
            os._exit(1)

    return set_parent_death_signal


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP stop a replay as Ctrl-C does: workers killed, checkouts removed.

    Raised as KeyboardInterrupt in the coordinator's main thread, so the same cleanup
    runs and the replay is recorded as interrupted.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _finish(job: Job) -> None:
    assert job.process is not None
    job.seconds = time.perf_counter() - job.started
    job.returncode = job.process.returncode
    out = Path(job.spec.output)
    job.output = worker_output(out, job.returncode)
    if job.output is not None:
        return
    job.error = (
        f"worker exited with code {job.returncode}"
        if job.returncode
        else "worker wrote no output (did the script reach retrolog?)"
    )
    diagnosis = worker_diagnosis(out)
    if diagnosis:
        job.error = diagnosis
        job.diagnosed = True


def worker_diagnosis(out: Path) -> str | None:
    """What a failed worker wrote about its failure (runtime/replay_worker.py, ``failed``)."""
    try:
        found = json.loads(out.read_text()).get("diagnosis")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and found else None


def worker_output(out: Path, returncode: int | None) -> dict[str, Any] | None:
    """What a worker that exited with ``returncode`` wrote to ``out``, if it is its result.

    A worker that exits 0 has written it. One that the script's own exception ended
    exits 1 with the values it computed until then and that exception (``crash``): the
    coordinator compares it with the run's (a crashed run's replay is expected to stop
    where it did). Any other exit leaves no result.
    """
    if returncode is None or not out.exists():
        return None
    if returncode == 0:
        return dict(json.loads(out.read_text()))
    try:
        written = json.loads(out.read_text())
    except (OSError, ValueError):
        return None
    return written if isinstance(written, dict) and written.get("crash") else None


def _kill(job: Job) -> None:
    process = job.process
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def log_tail(path: Path, lines: int = _TAIL_LINES) -> str:
    """The last lines of a worker's log, for a failure report."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


COORDINATOR_FILE = "coordinator.json"


def claim(logs_dir: Path) -> None:
    """Write who coordinates this replay, so a later command can tell it was killed."""
    (logs_dir / COORDINATOR_FILE).write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "host": os.uname().nodename,
                "start": process_start_marker(os.getpid()),
            }
        )
    )


def sweep_stale(conn: Any, store: Path) -> list[str]:
    """After a coordinator was killed: remove its checkouts, mark its replay interrupted.

    A replay is stale when its row says running and its coordinator, on this machine,
    is no longer the process that wrote ``coordinator.json``. Returns their ids.
    """
    sweep_checkouts()
    stale: list[str] = []
    for (replay_id,) in conn.execute("SELECT replay_id FROM replays WHERE status = 'running'"):
        try:
            who = json.loads((store / "replays" / replay_id / COORDINATOR_FILE).read_text())
        except (OSError, ValueError):
            continue  # from before coordinators were recorded: gc's age rule applies
        if who.get("host") != os.uname().nodename:
            continue
        pid = int(who.get("pid", 0))
        if process_alive(pid, who.get("start")):  # the same process, not a reused pid
            continue
        stale.append(replay_id)
    for replay_id in stale:
        conn.execute(
            "UPDATE replays SET status = 'interrupted', ended_at = COALESCE(ended_at, ?)"
            " WHERE replay_id = ? AND status = 'running'",
            (time.time(), replay_id),
        )
    if stale:
        conn.commit()
    return stale
