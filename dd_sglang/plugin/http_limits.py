"""A request-body size limit for SGLang's HTTP server (``server.max_request_bytes``).

SGLang 0.5.23 reads and tokenizes a request body of any size before it checks
the prompt against the context length: a 64 MiB completion prompt grew the HTTP
server past 6.8 GB and the kernel's OOM killer stopped it (the whole server
down, from one request); an 8 MiB one took ~10 s of CPU to be refused. This
ASGI middleware answers 413 before the body is read when its declared
``Content-Length`` exceeds the limit, and stops a body sent without a length
(chunked) as soon as it passes the limit.
"""

from __future__ import annotations

import json


class BodyTooLarge(Exception):
    """A chunked request body passed the limit while being read."""


class RequestSizeLimit:
    """ASGI middleware: HTTP 413 for request bodies over ``max_bytes`` bytes.

    Args:
        app: the ASGI app to wrap.
        max_bytes: the largest body accepted, in bytes (>= 1).
    """

    def __init__(self, app, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send, what: str) -> None:
        body = json.dumps(
            {
                "object": "error",
                "message": f"request body {what} exceeds server.max_request_bytes ({self.max_bytes} bytes)",
                "type": "RequestEntityTooLarge",
                "code": 413,
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_bytes:
                await self._reject(send, f"of {declared.decode(errors='replace')} bytes")
                return
            await self.app(scope, receive, send)
            return
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send, f"of more than {self.max_bytes} bytes (chunked)")
