"""A userspace TCP delay proxy: latency and jitter where the kernel has no netem.

``python -m tests.faultlab.proxy --delay-ms 1 --jitter-ms 0.5 LISTEN_HOST:PORT=TARGET_HOST:PORT ...``

Every chunk read from one side is written to the other ``delay + uniform(0, jitter)`` later,
never before an earlier chunk (TCP keeps order, so jitter delays but does not reorder). Each
direction holds at most QUEUE chunks in flight, which keeps memory bounded on a fast sender.
Prints "ready" once every listener is bound. Stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal

CHUNK = 256 << 10
QUEUE = 64


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, jitter: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE)

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    task = asyncio.create_task(deliver())
    last = 0.0
    try:
        while True:
            data = await reader.read(CHUNK)
            last = max(last, loop.time() + delay + random.uniform(0.0, jitter))
            await queue.put((last, data))
            if not data:
                break
        await task
    except (ConnectionError, OSError):
        pass
    finally:
        task.cancel()
        writer.close()


async def _serve(listen: str, target: str, delay: float, jitter: float) -> asyncio.Server:
    thost, _, tport = target.rpartition(":")

    async def handle(r1: asyncio.StreamReader, w1: asyncio.StreamWriter) -> None:
        try:
            r2, w2 = await asyncio.open_connection(thost, int(tport))
        except OSError:
            w1.close()
            return
        await asyncio.gather(_pipe(r1, w2, delay, jitter), _pipe(r2, w1, delay, jitter))

    lhost, _, lport = listen.rpartition(":")
    return await asyncio.start_server(handle, lhost, int(lport))


async def main(args: argparse.Namespace) -> None:
    servers = []
    for spec in args.map:
        listen, _, target = spec.partition("=")
        servers.append(await _serve(listen, target, args.delay_ms / 1000, args.jitter_ms / 1000))
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("map", nargs="+", help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    asyncio.run(main(p.parse_args()))
