"""``retrolog ui``: a local web dashboard over the project's store (docs/ui.md).

Needs the ``ui`` extra (starlette, uvicorn) and the chart library fetched at
build time (``python -m retrolog.ui.assets``); the core never imports this package.
"""

from __future__ import annotations

import socket
import sys
import threading
import webbrowser
from collections.abc import Callable
from typing import TYPE_CHECKING

from retrolog.errors import UsageError

if TYPE_CHECKING:
    from retrolog._project import Project

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
            f"({', '.join(assets.missing())} missing from {assets.VENDOR}); run "
            "`python -m retrolog.ui.assets` once, with access to registry.npmjs.org."
        )
    project.check_readable()  # a clear error now, when there is no store, not in the browser
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    settings = Settings(host=host, port=bound)
    shown = "127.0.0.1" if settings.loopback else host
    url = f"http://{shown}:{bound}/?token={settings.token}"
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
