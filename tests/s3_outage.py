"""An S3-compatible server of the test's own that it can stop, pause and restart.

moto's server keeps its objects in memory, so stopping its process loses them, which a
real object store's restart does not. So the server is reached through a small TCP
proxy of the test's own: stopping and restarting the *endpoint* (the proxy) is what a
client sees of a server stopped and started again (connections reset, then refused,
then accepted), with the objects kept; pausing is SIGSTOP on moto itself (connections
accepted by the kernel, never answered). The shared test server is never touched.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BUCKET = "outage"

# A byte pipe between a client and moto, one connection each way; nothing else.
PROXY = """\
import asyncio, sys

LISTEN, TARGET = int(sys.argv[1]), int(sys.argv[2])

async def pipe(reader, writer):
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()

async def serve(reader, writer):
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", TARGET)
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", LISTEN, reuse_address=True)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
            return True
    except OSError:
        return False


class OwnS3:
    """moto on a free port behind a proxy on another; ``endpoint`` is the proxy's URL."""

    def __init__(self, workdir: Path) -> None:
        from conftest import require_services_marker

        require_services_marker("an S3-compatible server of its own")
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.moto_port = free_port()
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        moto = Path(sys.executable).with_name("moto_server")
        self.moto = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.moto_port)],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not _answers(self.moto_port):
            assert self.moto.poll() is None and time.monotonic() < deadline, "moto did not start"
            time.sleep(0.1)
        self.proxy: subprocess.Popen[str] | None = None
        self.start()
        self.paused = False

    def env(self) -> dict[str, str]:
        """The variables a user of an S3-compatible server sets."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "retrolog-tests",
            "AWS_SECRET_ACCESS_KEY": "retrolog-tests",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def make_bucket(self) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.moto_port}",
            aws_access_key_id="retrolog-tests",
            aws_secret_access_key="retrolog-tests",
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)

    def start(self) -> None:
        """The endpoint answers (again)."""
        assert self.proxy is None
        self.proxy = subprocess.Popen(
            [sys.executable, "-c", PROXY, str(self.port), str(self.moto_port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proxy.stdout is not None
        assert self.proxy.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        """The endpoint is gone: open connections reset, new ones refused."""
        assert self.proxy is not None
        self.proxy.kill()
        self.proxy.wait()
        if self.proxy.stdout is not None:
            self.proxy.stdout.close()
        self.proxy = None

    def pause(self) -> None:
        os.kill(self.moto.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.kill(self.moto.pid, signal.SIGCONT)
        self.paused = False

    def close(self) -> None:
        if self.paused:
            self.resume()
        if self.proxy is not None:
            self.stop()
        self.moto.terminate()
        try:
            self.moto.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.moto.kill()
            self.moto.wait()
