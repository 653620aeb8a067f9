"""A PostgreSQL server of one test's own, which the test may crash and start again.

The shared test server (scripts/services.sh) must never be stopped; a test that
crashes a server starts this one: ``initdb`` into a temporary directory, ``pg_ctl``
on a free loopback port, a database ``retrolog`` for the role ``retrolog`` reached
with a password, as services.sh sets up its own. As root the cluster belongs to the
``postgres`` user (PostgreSQL refuses to run as root), in a directory it can reach.

It runs with ``fsync = off``: the crashes a test makes are of the server's processes,
which the operating system's page cache outlives (what PostgreSQL wrote before it
died is read back as with ``fsync`` on), and a restart on a busy machine takes a
quarter of a second instead of seconds of flushing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _bin_dir() -> Path:
    """The directory of initdb and pg_ctl: on PATH, else Debian's versioned directory."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    candidates += [Path(d) for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for d in candidates:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    raise RuntimeError("PostgreSQL is not installed (no initdb or pg_ctl); see scripts/services.sh")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PrivateServer:
    """One PostgreSQL cluster in a temporary directory; :meth:`close` removes it."""

    def __init__(self) -> None:
        from conftest import require_services_marker

        require_services_marker("a PostgreSQL server of its own")
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="retrolog-pg-own-"))
        self.data = self.root / "data"
        self.port = _free_port()
        password = secrets.token_hex(16)
        (self.root / "password").write_text(password + "\n")
        self._as_owner = os.geteuid() == 0
        if self._as_owner:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(self.root / "password", "postgres", "postgres")
        self.url = f"postgresql://retrolog:{password}@127.0.0.1:{self.port}/retrolog"
        self._run(
            "initdb", "-D", str(self.data), "-U", "retrolog",
            f"--pwfile={self.root / 'password'}", "--auth-host=scram-sha-256",
            "--auth-local=trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync",
        )  # fmt: skip
        self.start()
        self._run("createdb", "-h", str(self.root), "-p", str(self.port), "-U", "retrolog",
                  "retrolog")  # fmt: skip

    def _command(self, name: str, *args: str) -> list[str]:
        command = [str(self.bin / name), *args]
        return ["runuser", "-u", "postgres", "--", *command] if self._as_owner else command

    def _run(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self._command(name, *args), capture_output=True, text=True, timeout=120
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{name} failed: {proc.stdout}{proc.stderr}{self.log_tail()}")
        return proc

    def log_tail(self) -> str:
        log = self.root / "server.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def start(self, seconds: float = 60.0) -> None:
        """Start the server; after a crash, once the old server's processes are gone."""
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} "
            f"-c unix_socket_directories={self.root} -c fsync=off"
        )
        deadline = time.monotonic() + seconds
        while True:
            proc = self._run(
                "pg_ctl", "start", "-D", str(self.data), "-w", "-t", "60",
                "-l", str(self.root / "server.log"), "-o", options, check=False,
            )  # fmt: skip
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"pg_ctl start failed: {proc.stdout}{proc.stderr}")
            time.sleep(0.2)

    def postmaster(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _children(self, parent: int) -> list[int]:
        found = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(stat.split("/")[2]))
        return found

    def stop_immediate(self) -> None:
        """``pg_ctl stop -m immediate``: every process quits at once, no checkpoint."""
        self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w")

    def kill_postmaster(self) -> None:
        """SIGKILL to the postmaster, then to whichever of its processes outlive it."""
        pid = self.postmaster()
        if pid is None:
            return
        children = self._children(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.05)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)

    def close(self) -> None:
        self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", check=False)
        pid = self.postmaster()
        if pid is not None and _alive(pid):
            self.kill_postmaster()
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
