"""Request bodies are bounded while they are read, on every route.

The limit is enforced on the bytes as they arrive: a body declared larger is refused before
a byte is read, and a body that grows past the limit is refused as soon as it does, so a
large upload costs at most the limit in memory, never its own size.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"request body larger than {limit} bytes (setting KMEND_MAX_BATCH_BYTES)",
                       "field": "body"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: read the body up to `max_bytes`, answer 413 past it, then hand it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _too_large(send, self.max_bytes)
            return
        chunks: list[Message] = []
        total = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                chunks.append(msg)  # the client went away: let the app see it as it would have
                break
            total += len(msg.get("body", b""))
            if total > self.max_bytes:
                await _too_large(send, self.max_bytes)
                return
            chunks.append(msg)
            if not msg.get("more_body", False):
                break
        pending = iter(chunks)

        async def replay() -> Message:
            nxt = next(pending, None)
            return nxt if nxt is not None else await receive()

        await self.app(scope, replay, send)
