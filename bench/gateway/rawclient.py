"""A minimal WebSocket client as an asyncio Protocol, for the fan-out bench.

Browsers parse frames in their own processes, natively; 200 ``websockets`` clients in one Python
process would make the bench client the bottleneck (a task wake-up per frame per client). This
one parses frames inside ``data_received`` and only records what the bench needs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import time
from collections.abc import Callable
from typing import Any


class RawClient(asyncio.Protocol):
    def __init__(self, host: str, port: int, path: str, on_frame: Callable[[dict[str, Any], float], None]):
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
        self._on_frame = on_frame
        self._buf = b""
        self._open = False
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self._buf += data
        if not self._open:
            head, sep, rest = self._buf.partition(b"\r\n\r\n")
            if not sep:
                return
            if not head.startswith(b"HTTP/1.1 101"):
                self.opened.set_exception(ConnectionError(head.decode(errors="replace")))
                return
            self._open, self._buf = True, rest
            self.opened.set_result(None)
        buf = self._buf
        pos = 0
        while len(buf) - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            n, head = b1 & 0x7F, 2
            if n == 126:
                if len(buf) - pos < 4:
                    break
                (n,) = struct.unpack_from("!H", buf, pos + 2)
                head = 4
            elif n == 127:
                if len(buf) - pos < 10:
                    break
                (n,) = struct.unpack_from("!Q", buf, pos + 2)
                head = 10
            if len(buf) - pos < head + n:
                break
            payload = buf[pos + head : pos + head + n]
            pos += head + n
            opcode = b0 & 0x0F
            if opcode == 0x1:
                self._on_frame(json.loads(payload), now)
            elif opcode == 0x9:  # ping: answer with a masked pong
                self._send(0xA, payload)
            elif opcode == 0x8 and self.transport is not None:
                self.transport.close()
        self._buf = buf[pos:]

    def _send(self, opcode: int, payload: bytes) -> None:
        if self.transport is None or len(payload) > 125:
            return
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.transport.write(bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_client(host: str, port: int, path: str, on_frame: Callable[[dict[str, Any], float], None]) -> RawClient:
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(lambda: RawClient(host, port, path, on_frame), host, port)
    await client.opened
    return client
