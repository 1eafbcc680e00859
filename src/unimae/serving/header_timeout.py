"""A deadline for a request's headers: the HTTP protocol uvicorn would pick, with one more timer.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``), but it starts that timer only after a
response and cancels it at the next byte: a connection that never sends a request, or sends its headers a
byte at a time (slowloris), is held for ever, and no ASGI middleware sees it (the app runs once the headers
are parsed). :func:`header_timeout_protocol` adds the timer nginx calls ``client_header_timeout`` and Node
``headersTimeout``: it starts when the connection opens, and at the first byte of each later request, and
further bytes do not reset it. Headers not complete when it fires: the connection is closed, after a 408 if
part of a request came. Once a request's headers are in, its body has the guard's ``--body-timeout-s``
(:mod:`unimae.serving.guard`) and its answer no limit.

Works over both of uvicorn's HTTP/1.1 protocols (h11, httptools): it reads only what they share, the
connection's transport and its current request cycle (``cycle``, ``cycle.response_complete``).
"""

from __future__ import annotations

import asyncio
import json
import logging

from unimae.serving.schemas import APIError

logger = logging.getLogger(__name__)


class _HeaderDeadline:
    """Mixed in before a uvicorn HTTP protocol class (see :func:`header_timeout_protocol`).

    A wait for headers is keyed by the request cycle before it (None on a new connection): it is over once the
    protocol has started another cycle, that is, once the next request's headers were parsed.
    """

    header_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_wait: tuple[asyncio.TimerHandle, object] | None = None
        self._header_bytes = 0  # bytes received during the current wait
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # between requests: these bytes start (or continue) a head
            if self._header_wait is None or self._header_wait[1] is not cycle:
                self._await_headers()
            self._header_bytes += len(data)
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_waiting()
        timer = asyncio.get_running_loop().call_later(self.header_timeout, self._headers_late)
        self._header_wait, self._header_bytes = (timer, self.cycle), 0

    def _stop_waiting(self) -> None:
        if self._header_wait is not None:
            self._header_wait[0].cancel()
            self._header_wait = None

    def _headers_late(self) -> None:
        awaited = self._header_wait[1]
        self._header_wait = None
        transport = self.transport
        if self.cycle is not awaited or transport.is_closing() or transport.get_protocol() is not self:
            return  # the headers came (or the connection is closing, or was handed to another protocol)
        if self._header_bytes:
            message = f"the request headers did not arrive within {self.header_timeout:g} s; send them whole"
            body = json.dumps(APIError(408, message).body()).encode()
            head = "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            transport.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        logger.info(
            "closed a connection from %s: no complete request headers within %g s (%d bytes of them came)",
            self.client[0] if self.client else "?",
            self.header_timeout,
            self._header_bytes,
        )
        transport.close()


def header_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class (httptools if installed, else h11) with a ``seconds`` deadline for each
    request's headers; pass it as ``uvicorn.run(..., http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    if not seconds > 0:
        raise ValueError(f"the header timeout must be > 0 seconds, got {seconds}")
    name = f"HeaderTimeout{AutoHTTPProtocol.__name__}"
    return type(name, (_HeaderDeadline, AutoHTTPProtocol), {"header_timeout": float(seconds)})
