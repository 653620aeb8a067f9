"""Replay segments as Ray tasks: ``retrolog replay ... --executor ray`` (docs/replay-on-ray.md).

coordinator                                   a Ray node (any machine of the cluster)
-----------                                   ---------------------------------------
jobs ──SegmentTask + the run's loop rows──>   run_segment: the code (its manifest in the
  (num_cpus = the worker's threads,             object store, else the recorded git dir),
   num_gpus = 1 for a run that used one)        a private worker store, ``python script``
<── output, log, seconds ──────────────────   <── the worker (a subprocess, as locally)
job.output / job.error -> _collect -> backfill into the metadata store, as for local workers

The worker is the same program as a local one; only where it starts differs. The
metadata store never leaves the coordinator: a task gets the rows its worker reads
(the run's loop contexts and checkpoint frame locals) and returns what it computed,
which the coordinator writes, so backfill stays idempotent and in one writer. Nothing
here imports ray at module import: only :func:`connect` does, when Ray is chosen.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrolog._config import lookup, mask
from retrolog.errors import RayUnavailableError, RetrologError

ADDRESS_ENV = "RAY_ADDRESS"  # Ray's own variable, honoured as Ray itself does
_LOG_BYTES = 1 << 20  # of a worker's log a task returns, from its end
_NOT_INSTALLED = (
    "--executor ray needs Ray, which is not installed in this environment "
    "({python}); install retrolog's ray extra: pip install 'retrolog[ray]' (the same Ray "
    "version as the cluster's)."
)


def cluster_address(given: str | None) -> str:
    """The Ray cluster's address: ``given`` (--ray-address), else the ``ray_address``
    setting (``RAY_ADDRESS``); a RayUnavailableError saying how to give one when none is."""
    address = (given if given is not None else lookup(ADDRESS_ENV) or "").strip()
    if not address:
        raise RayUnavailableError(
            "--executor ray needs the address of a Ray cluster: pass --ray-address HOST:PORT "
            f"(what `ray start --head` prints), or set {ADDRESS_ENV} or the ray_address setting; "
            "'auto' finds a cluster started on this machine."
        )
    return address


def check_installed() -> None:
    """Raise RayUnavailableError, saying what to install, when Ray cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise RayUnavailableError(_NOT_INSTALLED.format(python=sys.executable))


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail at once, with a clear message, when nothing answers at ``address``.

    ray.init itself waits for a missing cluster for minutes. ``auto`` (a cluster of
    this machine, found by Ray) is left to Ray.
    """
    host_port = address.removeprefix("ray://").rstrip("/")
    if address == "auto" or ":" not in host_port:
        return
    host, _, port_text = host_port.rpartition(":")
    host = host.strip("[]")
    if not port_text.isdigit():
        raise RayUnavailableError(
            f"The Ray address {address!r} has no port; give it as HOST:PORT, as "
            "`ray start --head` prints it.",
            address=address,
        )
    try:
        with socket.create_connection((host, int(port_text)), timeout=timeout):
            pass
    except OSError as exc:
        raise RayUnavailableError(
            f"No Ray cluster answers at {address} ({exc.strerror or exc}): start one with "
            "`ray start --head`, or give the address its head node printed with --ray-address "
            f"or {ADDRESS_ENV}.",
            address=address,
        ) from exc


@dataclass
class RayCluster:
    """A connection to a Ray cluster, and what it has."""

    ray: Any = field(repr=False)  # the ray module
    address: str
    cpus: float
    gpus: float
    nodes: int
    largest_node_cpus: float  # no task asks for more, or it would never be scheduled
    owned: bool  # this replay connected (and so disconnects); False: the caller had

    def describe(self) -> str:
        """One line for the plan."""
        gpus = f", {self.gpus:g} GPU(s)" if self.gpus else ""
        return (
            f"workers run as Ray tasks on the cluster at {self.address} ({self.nodes} node(s), "
            f"{self.cpus:g} CPU(s){gpus})"
        )

    def default_workers(self, threads: int | None) -> int:
        """Segments in flight at once: as many as the cluster's CPUs hold at ``threads``
        each (or one per GPU when it has GPUs), at least one."""
        if self.gpus:
            return max(1, int(self.gpus))
        return max(1, int(self.cpus // max(threads or 1, 1)))

    def close(self) -> None:
        if self.owned:
            with contextlib.suppress(Exception):
                self.ray.shutdown()


def connect(address: str) -> RayCluster:
    """Connect to the Ray cluster at ``address`` (a connection this process already has
    is used as it is). Raises RayUnavailableError when Ray is missing or the cluster
    cannot be reached."""
    check_installed()
    owned = False
    try:
        import ray
    except ImportError as exc:  # installed but broken (a missing shared library)
        raise RayUnavailableError(
            _NOT_INSTALLED.format(python=sys.executable) + f" Importing it failed: {exc}"
        ) from exc
    if not ray.is_initialized():
        check_reachable(address)
        import logging

        try:
            ray.init(
                address=address, logging_level=logging.ERROR, log_to_driver=False,
                configure_logging=True,
            )  # fmt: skip
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
            said = " ".join(str(exc).split())[:400]
            raise RayUnavailableError(
                f"Cannot connect to the Ray cluster at {address}: {said}. Check that it is "
                "running (`ray status`) and that this machine runs the same Python and Ray "
                "versions as the cluster.",
                address=address,
            ) from exc
        owned = True
    try:
        total = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    except Exception as exc:  # a Ray error type we cannot name without importing more of it
        if owned:
            ray.shutdown()
        raise RayUnavailableError(
            f"The Ray cluster at {address} does not answer: {exc}", address=address
        ) from exc
    largest = max((float(n.get("Resources", {}).get("CPU", 0)) for n in nodes), default=0.0)
    return RayCluster(
        ray=ray, address=address, cpus=float(total.get("CPU", 0)),
        gpus=float(total.get("GPU", 0)), nodes=len(nodes), largest_node_cpus=largest,
        owned=owned,
    )  # fmt: skip


# -- what a task carries -----------------------------------------------------------------


@dataclass
class SegmentTask:
    """Everything a Ray node needs to run one segment's worker, but the run's loop rows."""

    key: str
    spec: dict[str, Any]  # the WorkerSpec, as data; paths on the node are filled in there
    argv: list[str]
    filename: str
    cwd: str
    source: str
    skipped: list[str]
    numerics: dict[str, Any] | None
    # The run's code: its manifest in the object store (read from anywhere) ...
    code: dict[str, Any]  # run_id, code_commit, code_tree, code_manifest
    # ... else the coordinator's git directory, when the node has it (one machine, shared FS).
    git_dir: str
    commit: str
    project: str  # the coordinator's project root: linked in when the node has it
    store: str  # the coordinator's store directory (never linked into a checkout)
    log_path: str  # the coordinator's log file: written directly when the node has its folder
    # Modules a fork server of the Ray worker process imports once, its workers forked from
    # it (_replay/forkserver.py); empty: the worker is a new interpreter.
    warm: list[str] = field(default_factory=list)
    # The script's early environment writes, made in that fork server before its imports
    # (forkserver.StartPlan.environ).
    environ: list[list[str]] = field(default_factory=list)


@dataclass
class WorkerRows:
    """What a worker reads of the metadata store: the run's loop contexts and the frame
    locals kept with its checkpoints (runtime/replay_worker.py, _load_contexts and
    _load_frame_locals)."""

    loops: list[tuple[Any, ...]]  # (ctx_id, parent_ctx, name, iteration)
    checkpoints: list[tuple[Any, ...]]  # (kind, ctx_id, frame_locals)


def worker_rows(conn: sqlite3.Connection, run_id: str) -> WorkerRows:
    """The rows of ``run_id`` that its replay workers read."""
    loops = conn.execute(
        "SELECT ctx_id, parent_ctx, name, iteration FROM loops WHERE run_id = ? ORDER BY ctx_id",
        (run_id,),
    ).fetchall()
    checkpoints = conn.execute(
        "SELECT kind, ctx_id, frame_locals FROM checkpoints"
        " WHERE run_id = ? AND frame_locals IS NOT NULL",
        (run_id,),
    ).fetchall()
    return WorkerRows([tuple(r) for r in loops], [tuple(r) for r in checkpoints])


def _write_worker_store(store: Path, run_id: str, rows: WorkerRows) -> None:
    """A worker's private store on the node: a database with just ``rows``."""
    store.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(store / "retrolog.db")
    try:
        with conn:
            conn.execute(
                "CREATE TABLE loops(run_id TEXT, ctx_id INTEGER, parent_ctx INTEGER, "
                "name TEXT, iteration INTEGER)"
            )
            conn.execute(
                "CREATE TABLE checkpoints(run_id TEXT, kind TEXT, ctx_id INTEGER, "
                "frame_locals BLOB)"
            )
            conn.executemany(
                "INSERT INTO loops VALUES (?, ?, ?, ?, ?)", [(run_id, *r) for r in rows.loops]
            )
            conn.executemany(
                "INSERT INTO checkpoints VALUES (?, ?, ?, ?)",
                [(run_id, *r) for r in rows.checkpoints],
            )
    finally:
        conn.close()


# -- on the node ---------------------------------------------------------------------------


# Said when a node cannot reach the object store: its client reads the node's own settings.
NODE_STORE_HINT = (
    "Every node reads the object store with its own settings, as any program reading it "
    "does: give the nodes its address and credentials (for S3: AWS_ENDPOINT_URL, "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment `ray start` runs in, or "
    "~/.aws on each node). retrolog does not send the coordinator's credentials to the "
    "cluster."
)


def run_segment(task: SegmentTask, rows: WorkerRows) -> dict[str, Any]:
    """Run one segment's worker on this node (the body of the Ray task).

    Returns {"returncode", "output" (the worker's JSON or None), "error" (why it could
    not start, or None), "seconds", "log" (its tail, when the coordinator cannot read
    the log file), "node", "forked"}. The temporary directory is removed when it
    returns; a task whose process is killed leaves it to the next task's sweep on that
    node (its name carries this process's pid). With ``task.warm``, the worker is forked
    from a fork server this Ray worker process keeps for its later tasks, so a node
    imports torch once per Ray worker, not once per segment.
    """
    from retrolog._replay.checkout import checkout_prefix, sweep_checkouts
    from retrolog._replay.execute import worker_diagnosis, worker_output

    started = time.perf_counter()
    sweep_checkouts()  # what killed Ray workers of this node left (no coordinator runs here)
    node = socket.gethostname()
    base = Path(tempfile.mkdtemp(prefix=checkout_prefix(f"ray-{task.spec['run_id']}")))
    shared_log = Path(task.log_path)
    log_path = shared_log if shared_log.parent.is_dir() else base / "worker.log"
    result: dict[str, Any] = {
        "returncode": None, "output": None, "error": None, "node": node, "forked": False,
    }  # fmt: skip
    try:
        made = _checkout_here(task, node)
        if isinstance(made, str):
            result["error"] = made
            return result
        checkout, root = made
        try:
            output = base / "out.json"
            process, result["forked"] = _start_worker(
                task, rows, base, output, checkout, root, log_path
            )
            result["returncode"] = _wait(process)
            result["output"] = worker_output(output, result["returncode"])
            if result["output"] is None:
                result["diagnosis"] = worker_diagnosis(output)
        finally:
            shutil.rmtree(checkout, ignore_errors=True)
        if log_path != shared_log:
            with log_path.open("rb") as log:
                log.seek(max(0, log_path.stat().st_size - _LOG_BYTES))
                result["log"] = log.read()
        return result
    finally:
        result["seconds"] = time.perf_counter() - started
        shutil.rmtree(base, ignore_errors=True)


def _checkout_here(task: SegmentTask, node: str) -> tuple[Path, Path | None] | str:
    """The run's code checked out on this node, with the project's directory when this
    node has it; or why it cannot be."""
    from retrolog._replay.checkout import make_checkout

    try:
        git_dir, rev = _code_here(task)
        project = Path(task.project)
        root = project if project.is_dir() else None
        checkout = make_checkout(
            root=root, store=Path(task.store), git_dir=git_dir, commit=rev,
            filename=task.filename, script_source=task.source, skipped=task.skipped,
            prefix=f"ray-{task.spec['run_id']}",
        )  # fmt: skip
    except RetrologError as exc:
        return f"the Ray task on {node} cannot set up the run's code: {exc}"
    except Exception as exc:  # the object store's client: credentials, network, access
        where = mask(str(task.spec.get("objects")))
        text = " ".join(str(exc).split())[:300]
        return (
            f"the Ray task on {node} cannot read the run's code from the object store at "
            f"{where}: {type(exc).__name__}: {text}. {NODE_STORE_HINT}"
        )
    return checkout, root


def _start_worker(
    task: SegmentTask,
    rows: WorkerRows,
    base: Path,
    output: Path,
    checkout: Path,
    root: Path | None,
    log_path: Path,
) -> tuple[Any, bool]:
    """The segment's worker started in ``checkout``, reading the run's rows from a store
    of its own under ``base`` and writing its output to ``output``; and whether it was
    forked from this Ray worker's fork server (a warm task) rather than a new interpreter."""
    from retrolog._replay.execute import die_with, run_worker_env
    from retrolog.runtime.replay_worker import SPEC_ENV, WorkerSpec

    store = base / "store"
    _write_worker_store(store, task.spec["run_id"], rows)
    spec = WorkerSpec(**task.spec)
    spec.store = str(store)
    spec.database = None  # the node's own store, just written
    spec.output = str(output)
    spec.checkout = str(checkout)
    spec.project = str(root) if root is not None else None
    spec_path = base / "spec.json"
    spec.save(spec_path)
    run_env = run_worker_env(task.numerics)
    env = {**run_env, SPEC_ENV: str(spec_path)}
    cwd = checkout / task.cwd
    if not cwd.is_dir():
        cwd = checkout
    argv = [str(checkout / task.filename), *task.argv[1:]]
    if task.warm:
        from retrolog._replay.forkserver import with_writes

        log_path.write_bytes(b"")
        process = _launcher_here().launch(
            argv=argv, cwd=cwd, env=env, log_path=log_path,
            server_env=with_writes(run_env, task.environ), warm=task.warm,
        )  # fmt: skip
        if process is not None:
            return process, True
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with(os.getpid()),
        )  # fmt: skip
    return process, False


def _wait(process: Any) -> Any:
    """The worker's exit status; a cancelled task (Ray raises in it) kills the worker."""
    try:
        return process.wait()
    except BaseException:  # the task was cancelled: its worker goes with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            process.wait(timeout=5)
        raise


_LAUNCHER: Any = None  # this Ray worker process's fork servers, kept across its tasks


def _launcher_here() -> Any:
    """The fork-server launcher of this Ray worker process (made at its first task).

    Its servers die with the process (a parent-death signal), and their directory is
    then swept as a dead process's checkout.
    """
    global _LAUNCHER
    if _LAUNCHER is None:
        from retrolog._replay.checkout import checkout_prefix
        from retrolog._replay.execute import die_with
        from retrolog._replay.forkserver import Launcher

        logs = Path(tempfile.mkdtemp(prefix=checkout_prefix("ray-forkservers")))
        _LAUNCHER = Launcher(python=sys.executable, logs_dir=logs, preexec=die_with(os.getpid()))
    return _LAUNCHER


def _code_here(task: SegmentTask) -> tuple[Path, str]:
    """Where this node reads the run's code: the store's copy (its code manifest in the
    object store, imported into a cache repository of this node), else the recorded git
    directory when this node has it."""
    from retrolog.store.backends import open_object_store
    from retrolog.versions.portable import readable_version

    location = task.spec.get("objects")
    if task.code.get("code_manifest") and task.code.get("code_tree") and location:
        digest = hashlib.sha256(str(location).encode()).hexdigest()[:16]
        cache = Path(tempfile.gettempdir()) / f"retrolog-ray-code-{os.getuid()}" / digest
        cache.mkdir(parents=True, exist_ok=True)
        version = readable_version(
            task.code, store_dir=cache, objects=open_object_store(location), from_store=True
        )
        return version.git_dir, version.rev
    git_dir = Path(task.git_dir)
    if not git_dir.is_dir():
        raise RetrologError(
            f"run {task.code.get('run_id')} has no copy of its code in the object store "
            f"(it was recorded before retrolog kept one), and its git directory {git_dir} is "
            "not on this node; replay it with the local executor."
        )
    return git_dir, task.commit


# -- on the coordinator ---------------------------------------------------------------------


def segment_task(job: Any, row: Mapping[str, Any], root: Path, store: Path) -> SegmentTask:
    """The task for ``job`` (an execute.Job) of the run whose ``runs`` row is ``row``."""
    return SegmentTask(
        key=job.key, spec=asdict(job.spec), argv=list(job.argv), filename=job.filename,
        cwd=job.cwd, source=job.source, skipped=list(job.skipped), numerics=job.numerics,
        code={k: row.get(k) for k in ("run_id", "code_commit", "code_tree", "code_manifest")},
        git_dir=str(job.git_dir), commit=job.commit, project=str(root), store=str(store),
        log_path=str(job.log_path),
        warm=list(job.start.warm) if job.start is not None and job.start.forked else [],
        environ=[list(w) for w in job.start.environ] if job.start is not None else [],
    )  # fmt: skip


def _uses_gpu(numerics: Mapping[str, Any] | None) -> bool:
    """Whether the run trained with CUDA devices (its recorded torch state)."""
    if not numerics:
        return False
    torch = numerics.get("torch") or numerics.get("torch_at_start") or {}
    return bool(torch.get("cuda_devices"))


def run_jobs_on_ray(
    jobs: Sequence[Any],
    tasks: Mapping[str, SegmentTask],
    rows: Mapping[str, WorkerRows],
    *,
    cluster: RayCluster,
    workers: int,
    on_done: Callable[[Any], None] | None = None,
) -> list[str]:
    """Run ``jobs`` (execute.Job, longest first) as Ray tasks, at most ``workers`` at once.

    Each job gets ``output`` or ``error`` (and ``seconds``) as a local worker's does; a
    task whose Ray worker died is a failed job, and the others go on. On an interrupt
    (Ctrl-C, SIGTERM) the tasks still running are cancelled (their workers killed) and
    the jobs that had finished keep their output. Returns lines for the report: the
    nodes the tasks ran on, and how their workers started.
    """
    ray = cluster.ray
    remote = ray.remote(run_segment)
    row_refs = {run_id: ray.put(r) for run_id, r in rows.items()}
    pending = list(jobs)
    running: dict[Any, Any] = {}
    nodes: dict[str, int] = {}
    forked: list[bool] = []
    try:
        while pending or running:
            while pending and len(running) < workers:
                job = pending.pop(0)
                task = tasks[job.key]
                threads = int(job.spec.torch_state.get("intra_op_threads") or 1)
                cpus = min(float(threads), cluster.largest_node_cpus or 1.0)
                gpus = 1 if cluster.gpus and _uses_gpu(job.numerics) else 0
                ref = remote.options(
                    num_cpus=cpus, num_gpus=gpus, max_retries=0, retry_exceptions=False,
                    name=f"retrolog-replay:{job.key}",
                ).remote(task, row_refs[job.run_id])  # fmt: skip
                job.started = time.perf_counter()
                running[ref] = job
            ready, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            for ref in ready:
                job = running.pop(ref)
                forked.append(_finish(ray, job, ref, nodes))
                if on_done is not None:
                    on_done(job)
    except BaseException:
        # Those that finished before the interrupt keep their values (the run is partial,
        # not interrupted with its finished work thrown away); the rest are cancelled.
        with contextlib.suppress(Exception):
            ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
            for ref in ready:
                job = running.pop(ref)
                _finish(ray, job, ref, nodes)
                if job.output is None:
                    job.error = None  # stopped, as the others are
        for ref in running:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        raise
    lines = []
    if nodes:
        shown = "; ".join(f"{node}: {count} segment(s)" for node, count in sorted(nodes.items()))
        lines.append(f"Ray tasks ran on {shown}")
    if any(forked):
        lines.append(
            f"start-up on Ray: {sum(forked)} worker(s) forked from fork servers kept by the "
            f"Ray worker processes; {len(forked) - sum(forked)} started as new interpreters"
        )
    return lines


def _finish(ray: Any, job: Any, ref: Any, nodes: dict[str, int]) -> bool:
    """Fill in ``job`` from its finished task, as execute._finish does from a process;
    whether its worker was forked from a fork server."""
    job.seconds = time.perf_counter() - job.started
    try:
        result = ray.get(ref)
    except ray.exceptions.RayError as exc:
        job.error = f"its Ray task failed: {_ray_failure(ray, exc)}"
        return False
    nodes[result["node"]] = nodes.get(result["node"], 0) + 1
    if result.get("log") is not None:
        Path(job.log_path).write_bytes(result["log"])
    job.returncode = result["returncode"]
    if result.get("error"):
        job.error = result["error"]
    elif result["output"] is not None:
        job.output = result["output"]
    elif result.get("diagnosis"):
        job.error = f"{result['diagnosis']} (on Ray node {result['node']})"
        job.diagnosed = True
    else:
        code = job.returncode
        job.error = (
            f"worker exited with code {code} (on Ray node {result['node']})"
            if code
            else f"worker wrote no output (did the script reach retrolog?) (on Ray node "
            f"{result['node']})"
        )
    return bool(result.get("forked"))


def _ray_failure(ray: Any, exc: BaseException) -> str:
    """One line for a task that raised or whose Ray worker died."""
    exceptions = ray.exceptions
    if isinstance(exc, exceptions.WorkerCrashedError):
        return (
            "the Ray worker process running it died (killed, or out of memory), and its "
            "worker with it"
        )
    if isinstance(exc, exceptions.TaskCancelledError):
        return "it was cancelled"
    cause = getattr(exc, "cause", None)
    if isinstance(exc, exceptions.RayTaskError) and cause is not None:
        return f"{type(cause).__name__}: {cause}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


class RayExecutor:
    """A Ray task per segment (``--executor ray``); the coordinator keeps the store.

    It connects at the plan (:meth:`capacity`: the cluster's CPUs size it) and
    disconnects at :meth:`close` when it connected.
    """

    name = "ray"

    def __init__(self, coordinator: Any, address: str | None) -> None:
        assert address is not None
        self.coordinator = coordinator
        self.address: str | None = address
        self.cluster: RayCluster | None = None

    @staticmethod
    def resolve_address(given: str | None) -> str | None:
        """The cluster's address (:func:`cluster_address`), once Ray is known installed."""
        address = cluster_address(given)
        check_installed()
        return address

    def _connected(self) -> RayCluster:
        if self.cluster is None:
            assert self.address is not None
            self.cluster = connect(self.address)
        return self.cluster

    def warm_up(self, env: Mapping[str, str], warm: Sequence[str]) -> None:
        """Nothing: each Ray worker process keeps its own fork servers (run_segment)."""

    def capacity(self, threads: int) -> Any:
        from retrolog._replay.executor import Capacity

        cluster = self._connected()
        return Capacity(
            workers=cluster.default_workers(threads), cores=max(1, int(cluster.cpus)),
            notes=(cluster.describe(),),
        )  # fmt: skip

    def prepare(
        self,
        runs: Mapping[str, Mapping[str, Any]],
        starts: Mapping[str, Any],
        echo: Callable[[str], None],
    ) -> dict[str, Any]:
        """The start plans as they are: the nodes' fork servers start at their first task."""
        return dict(starts)

    def run(
        self,
        jobs: Sequence[Any],
        *,
        workers: int,
        on_done: Callable[[Any], None],
        echo: Callable[[str], None],
    ) -> None:
        from retrolog._replay.execute import terminate_as_interrupt

        cluster = self._connected()
        conn, paths = self.coordinator.conn, self.coordinator.paths
        tasks = {j.key: segment_task(j, _code_row(conn, j.run_id), paths.root, paths.store)
                 for j in jobs}  # fmt: skip
        rows = {run_id: worker_rows(conn, run_id) for run_id in {j.run_id for j in jobs}}
        lines: list[str] = []
        try:
            with terminate_as_interrupt():
                lines = run_jobs_on_ray(
                    jobs, tasks, rows, cluster=cluster, workers=workers, on_done=on_done
                )
        except KeyboardInterrupt:
            echo(f"Interrupted: the replay's Ray tasks still running on {cluster.address} were "
                 "cancelled.")  # fmt: skip
            raise
        finally:
            for line in lines:
                echo(line)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()


def _code_row(conn: sqlite3.Connection, run_id: str) -> dict[str, Any]:
    """What a node reads the run's code from (segment_task's ``row``)."""
    columns = ("run_id", "code_commit", "code_tree", "code_manifest")
    found = conn.execute(f"SELECT {', '.join(columns)} FROM runs WHERE run_id = ?", (run_id,))
    return dict(zip(columns, found.fetchone() or (), strict=False))


if TYPE_CHECKING:  # mypy holds the class to the seam's protocol
    from retrolog._replay.executor import ExecutorClass

    _CONFORMS: ExecutorClass = RayExecutor
