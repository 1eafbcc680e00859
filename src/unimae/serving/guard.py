"""The request guard in front of every route: API key (all routes but /health) and request-body size limit.

A pure ASGI middleware rather than FastAPI dependencies (``HTTPBearer``) or ``BaseHTTPMiddleware``:
it rejects before routing (a request without the key gets 401 on any path, unknown ones included), it
enforces the body limit while the body streams in without reading it itself, and an error raised while
a route reads the body reaches the route's error handler unwrapped.
"""

from __future__ import annotations

import secrets

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unimae.serving.schemas import APIError


class RequestGuard:
    """401 without ``Authorization: Bearer <api_key>`` (when a key is set); 413 for a body over ``limit``.

    A body over ``limit`` bytes gets 413 before it is read into memory, whether it announces its length
    (checked here) or streams in chunks (counted as the route reads them).
    """

    def __init__(self, app: ASGIApp, limit: int, api_key: str | None):
        self.app, self.limit, self.api_key = app, limit, api_key

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
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise too_long
            return message

        return await self.app(scope, counted, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        header = headers.get(b"authorization", b"").decode("latin-1")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        return secrets.compare_digest(token.encode(), self.api_key.encode())
