"""The request guard in front of every route: API key (all routes but /health), request-body size limit and
body-read timeout (a client that sends part of a body and then nothing is answered 408, not held for ever).

A pure ASGI middleware rather than FastAPI dependencies (``HTTPBearer``) or ``BaseHTTPMiddleware``:
it rejects before routing (a request without the key gets 401 on any path, unknown ones included), it
enforces the body limit while the body streams in without reading it itself, and an error raised while
a route reads the body reaches the route's error handler unwrapped.
"""

from __future__ import annotations

import asyncio
import secrets

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unimae.serving.schemas import APIError


class RequestGuard:
    """401 without ``Authorization: Bearer <api_key>`` (when a key is set); 413 for a body over ``limit``.

    A body over ``limit`` bytes gets 413 before it is read into memory, whether it announces its length
    (checked here) or streams in chunks (counted as the route reads them). A body whose next part takes more
    than ``body_timeout`` seconds to come gets 408.
    """

    def __init__(self, app: ASGIApp, limit: int, api_key: str | None, body_timeout: float = 30.0):
        self.app, self.limit, self.api_key, self.body_timeout = app, limit, api_key, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if self.api_key and scope.get("path") != "/health" and not self._authorized(headers):
            err = APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")
            return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
        length = headers.get(b"content-length")
        too_long = APIError(413, f"request body is larger than the server's limit of {self.limit} bytes")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await JSONResponse(too_long.body(), status_code=413)(scope, receive, send)
        seen, body_done = 0, False
        too_slow = APIError(408, f"the request body did not arrive within {self.body_timeout:g} s; send it whole")

        async def counted() -> Message:
            nonlocal seen, body_done
            if body_done:  # after the body only a disconnect is left to receive: wait for it as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                raise too_slow from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise too_long
            return message

        return await self.app(scope, counted, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        header = headers.get(b"authorization", b"").decode("latin-1")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        return secrets.compare_digest(token.encode(), self.api_key.encode())
