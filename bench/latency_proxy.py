"""A TCP proxy that delays every byte by a fixed time each way: a server farther away.

    python bench/latency_proxy.py --to 127.0.0.1:PORT --one-way-ms 5   # prints its address

moto's S3 server on loopback answers in well under a millisecond, so a benchmark
against it measures the client's CPU, not what a real object store costs: a round
trip per request (same-region S3: roughly 10-30 ms for a small request). Point the
client at this proxy instead (``RETROLOG_TEST_S3_ENDPOINT`` for bench_objects.py,
``AWS_ENDPOINT_URL`` for bench_code_export.py) and each request and each response
arrives ``--one-way-ms`` later, in order; bandwidth is not limited. Only data is
delayed: the TCP handshake with the proxy is local, so opening a connection costs
no round trip here (a real store's does, once per pooled connection).

Netem (``tc qdisc ... netem delay``) would do this in the kernel; this machine's
kernel has no netem, hence the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(1 << 16)
            await queue.put((time.monotonic() + delay, data))
            if not data:
                break
    except ConnectionError:
        await queue.put((0.0, b""))
    await sender


async def _serve(host: str, port: int, target: tuple[str, int], delay: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(
            _pipe(client_r, server_w, delay), _pipe(server_r, client_w, delay),
            return_exceptions=True,
        )  # fmt: skip

    server = await asyncio.start_server(handle, host, port)
    bound = server.sockets[0].getsockname()
    print(f"http://{bound[0]}:{bound[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", required=True, help="HOST:PORT of the real server")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (0: any free port)")
    parser.add_argument("--one-way-ms", type=float, default=5.0)
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    to_host, _, to_port = args.to.rpartition(":")
    asyncio.run(_serve(host, int(port), (to_host, int(to_port)), args.one_way_ms / 1000))


if __name__ == "__main__":
    main()
