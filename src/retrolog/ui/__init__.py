"""``retrolog ui``: a local web dashboard over the project's store (docs/ui.md).

Needs the ``ui`` extra (starlette, uvicorn); the chart library's files ship in the
package (retrolog.ui.assets). The core never imports this package.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sys
import threading
import webbrowser
from collections.abc import Callable
from typing import TYPE_CHECKING

from retrolog.errors import UsageError

if TYPE_CHECKING:
    from retrolog._project import Project
    from retrolog.ui.server import Settings

DEFAULT_PORT = 7431


def serve(
    project: Project,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    open_browser: bool = True,
    index: bool = True,
    echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> None:
    """Serve the dashboard for ``project`` until interrupted (Ctrl-C). With ``index``, long
    series are read ahead into the series cache by an idle-priority child process
    (retrolog.ui.indexer), where the store can be written."""
    try:
        import uvicorn

        from retrolog.ui import assets
        from retrolog.ui.indexer import Indexer
        from retrolog.ui.server import Settings, create_app
    except ImportError as exc:
        raise UsageError(
            f"`retrolog ui` needs the dashboard's dependencies ({exc.name} is not installed): "
            "pip install 'retrolog[ui]'."
        ) from exc
    if assets.missing():
        raise UsageError(
            "The dashboard's chart library is not installed "
            f"({', '.join(assets.missing())} missing from {assets.VENDOR}): the package is "
            "incomplete. Reinstall retrolog, or run `python -m retrolog.ui.assets` once, with "
            "access to registry.npmjs.org."
        )
    project.check_readable()  # a clear error now, when there is no store, not in the browser
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    settings = Settings(host=host, port=bound)
    if settings.everywhere:
        settings.machine_names = _machine_names()
    url = f"http://{_shown_host(settings)}:{bound}/?token={settings.token}"
    if not settings.loopback:
        echo(
            f"Warning: the dashboard listens on {host}, so other machines can reach it; every "
            "request needs the token in the address below, and the traffic is not encrypted."
        )
    echo(f"retrolog dashboard for {project.root}: {url}")
    echo("Press Ctrl-C to stop it.")
    indexer = Indexer(project.root) if index and project.indexable else None
    app = create_app(project, settings, indexer)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    if open_browser:
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    try:
        server.run(sockets=[sock])
    finally:
        if indexer is not None:
            indexer.stop()
        # A replay started from the page stops with the dashboard, as on Ctrl-C: its
        # workers are stopped and what it backfilled is kept.
        for job in app.state.jobs.values():
            if job.returncode is None:
                echo(f"Stopping the replay started from the dashboard ({job.job_id}).")
                job.cancel()
                if job.wait(60) is None:
                    echo(f"The replay {job.job_id} did not stop within 60 s; it goes on alone.")


def _shown_host(settings: Settings) -> str:
    """The host part of an address that reaches the server: bound to every interface,
    this machine's address on its default route (what another machine uses too)."""
    if settings.host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    if settings.everywhere:
        address = _outward_address(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
        if address is None:
            return "127.0.0.1"
        return f"[{address}]" if ":" in address else address
    return f"[{settings.host}]" if ":" in settings.host else settings.host


def _outward_address(family: socket.AddressFamily) -> str | None:
    """The local address the system would send from to a documentation address (no packet
    is sent: connecting a UDP socket only chooses the route), or None without a route."""
    targets = [(socket.AF_INET, "192.0.2.1")]
    if family == socket.AF_INET6:
        targets.insert(0, (socket.AF_INET6, "2001:db8::1"))
    for kind, target in targets:
        try:
            with socket.socket(kind, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))
                address: str = probe.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(address).is_unspecified:
            return address
    return None


def _machine_names() -> frozenset[str]:
    """This machine's hostname and fully qualified name, as a Host header gives them."""
    names = {socket.gethostname()}
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn())
    return frozenset(name.lower() for name in names if name)


def _bind(host: str, port: int | None) -> socket.socket:
    """A listening socket on ``port``; without one, on DEFAULT_PORT or else any free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in ([port] if port is not None else [DEFAULT_PORT]) + [0]:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
        except OSError as exc:
            sock.close()
            if port is not None:
                raise UsageError(
                    f"Cannot listen on {host}:{port} ({exc.strerror}); pick another --port, or "
                    "leave it out to take a free one."
                ) from exc
            continue
        sock.listen(128)
        sock.set_inheritable(True)
        return sock
    raise UsageError(f"Cannot listen on {host}: no free port.")
