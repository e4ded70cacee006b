"""A byte pipe between a TCP port on one network namespace's loopback and a Unix socket (Unix
sockets are files: every network namespace of this machine reaches the same one). So a "pod"
(tests/netns.py) reaches the S3 test server, which stays bound to the machine's own loopback:

    python -m tests.unixbridge serve SOCKET 127.0.0.1:PORT     # on the machine: socket -> server
    python -m tests.unixbridge listen PORT SOCKET              # in a pod: 127.0.0.1:PORT -> socket
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def _joined(connect):
    async def handle(reader, writer) -> None:
        try:
            r2, w2 = await connect()
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, w2), _pipe(r2, writer))

    return handle


async def main(argv: list[str]) -> None:
    mode, a, b = argv
    if mode == "serve":  # SOCKET -> HOST:PORT
        host, _, port = b.rpartition(":")
        with contextlib.suppress(FileNotFoundError):
            os.remove(a)
        server = await asyncio.start_unix_server(
            _joined(lambda: asyncio.open_connection(host, int(port))), path=a
        )
    else:  # listen PORT SOCKET: 127.0.0.1:PORT -> SOCKET
        server = await asyncio.start_server(
            _joined(lambda: asyncio.open_unix_connection(b)), "127.0.0.1", int(a)
        )
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
