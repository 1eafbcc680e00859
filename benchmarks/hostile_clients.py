"""The hostile clients of ``load_test.py --mix hostile``: what a hostile but fair user sends beside the normal load.

Each kind runs from the start of the load to its end and records every request or connection as an
:class:`Outcome`: what the server did, against what it should do.

- ``long``: texts near and over the server's limits, one request at a time (``pause`` s apart): one string of
  nearly ``max_body_bytes`` to /v1/embeddings (200: truncated to ``--max-length`` tokens), the same string as
  a completion prompt and as a chat message (400: longer than the context), a body just over ``max_body_bytes``
  (413) and one input more than ``--max-inputs`` (400).
- ``malformed``: bodies that are no request (cut JSON, not an object, a wrong type, bytes that are not UTF-8,
  100k nested brackets, a lone surrogate, an infinite max_tokens): a 4xx each.
- ``half_sent``: headers announcing a body, half of it, then nothing: 408 within ``body_timeout_s``.
- ``idle``: a connection that makes one request (200), then stays idle: closed by the server within
  ``keep_alive_s``; then a new one.
- ``silent``: a connection that never sends a byte: closed by the server within ``header_timeout_s`` (a server
  without that timeout holds it until the run ends: ``held``, or ``closed_late``).
- ``leave``: a streamed completion read to its first event, then closed (a client that leaves mid-stream; the
  server's /health ``generations.cancelled`` counts them).

A server that is late by more than ``margin`` seconds counts as holding the connection. What an outcome is:
``expected`` (the status or event it should get), ``got`` (a status, ``closed``, ``held``, ``dropped`` for a
connection the server cut without an answer, or an error name) and whether it is ``ok``. Any 5xx or dropped
request is an error of the run (:func:`summarize`'s ``errors``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

MALFORMED = [  # (case, route, body): none is a request the server can serve
    ("cut_json", "embeddings", b'{"input": "the cat'),
    ("not_an_object", "embeddings", b"[1, 2, 3]"),
    ("input_a_number", "embeddings", b'{"input": 5}'),
    ("not_utf8", "embeddings", b'\xff\xfe{"input": "x"}'),
    ("nested_100k_deep", "embeddings", b"[" * 100_000),
    ("lone_surrogate", "embeddings", b'{"input": "\\ud800"}'),
    ("infinite_max_tokens", "completions", b'{"prompt": "x", "max_tokens": 1e309}'),
    ("nan_temperature", "completions", b'{"prompt": "x", "temperature": NaN}'),
    ("messages_a_string", "chat/completions", b'{"messages": "hello"}'),
]


@dataclass
class Outcome:
    kind: str  # the hostile client: long, malformed, half_sent, idle, silent, leave
    label: str  # the case, e.g. embeddings_near_body_limit
    expected: str
    got: str
    seconds: float

    @property
    def ok(self) -> bool:
        return as_expected(self.expected, self.got)

    @property
    def error(self) -> bool:
        """A 5xx, or a request the server cut without an answer."""
        return self.got.startswith("5") or self.got == "dropped"


def as_expected(expected: str, got: str) -> bool:
    return got == expected or (expected == "4xx" and got.startswith("4"))


@dataclass
class Limits:
    """The server's limits the hostile clients probe (``load_test.py`` starts the server with them)."""

    max_body_bytes: int
    max_inputs: int
    body_timeout_s: float
    keep_alive_s: float
    header_timeout_s: float
    margin_s: float = 5.0  # lateness tolerated before a connection counts as held


class HostileClients:
    """The hostile kinds against ``host:port`` until ``deadline`` (``time.monotonic()``); ``outcomes`` fills."""

    def __init__(
        self, host: str, port: int, limits: Limits, texts: list[str], deadline: float, counts: dict, pause: float
    ):
        self.host, self.port, self.limits, self.deadline = host, port, limits, deadline
        self.counts = counts  # {"idle": n, "silent": n, "half_sent": n}: connections of each kind at a time
        self.pause = pause  # seconds between two requests of the long, malformed and leave clients
        self.outcomes: list[Outcome] = []
        rng = random.Random(2)
        prose = " ".join(rng.choice(texts) for _ in range(200)).encode("ascii", "ignore").decode()
        prose = prose.replace('"', "").replace("\\", "")  # one byte a character in the JSON body
        self.long_text = (prose * (limits.max_body_bytes // len(prose) + 2))[: limits.max_body_bytes - 1024]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def coroutines(self, http: httpx.AsyncClient) -> list:
        out = [self.long(http), self.malformed(http), self.leave(http)]
        out += [self.half_sent() for _ in range(self.counts.get("half_sent", 0))]
        out += [self.idle() for _ in range(self.counts.get("idle", 0))]
        out += [self.silent() for _ in range(self.counts.get("silent", 0))]
        return out

    def _record(self, kind: str, label: str, expected: str, got: str, start: float) -> None:
        self.outcomes.append(Outcome(kind, label, expected, got, round(time.perf_counter() - start, 3)))

    async def _post(self, http: httpx.AsyncClient, kind: str, label: str, route: str, body: bytes, expected: str):
        start = time.perf_counter()
        try:
            response = await http.post(
                f"/v1/{route}", content=body, headers={"content-type": "application/json"}, timeout=300
            )
            got = str(response.status_code)
        except httpx.RemoteProtocolError:
            got = "dropped"
        except httpx.HTTPError as err:
            got = type(err).__name__
        self._record(kind, label, expected, got, start)

    async def long(self, http: httpx.AsyncClient) -> None:
        text, limits = self.long_text, self.limits
        over = json.dumps({"input": text + "x" * 2048}).encode()  # just over max_body_bytes
        cases = [
            ("embeddings_near_body_limit", "embeddings", {"input": text}, "200"),
            ("completion_near_body_limit", "completions", {"prompt": text, "max_tokens": 4}, "400"),
            ("chat_near_body_limit", "chat/completions", {"messages": [{"role": "user", "content": text}]}, "400"),
            ("embeddings_one_input_too_many", "embeddings", {"input": ["the cat"] * (limits.max_inputs + 1)}, "400"),
        ]
        bodies = [(label, route, json.dumps(body).encode(), want) for label, route, body, want in cases]
        bodies.append(("embeddings_over_body_limit", "embeddings", over, "413"))
        while self.left() > 0:
            for label, route, body, want in bodies:
                if self.left() <= 0:
                    return
                await self._post(http, "long", label, route, body, want)
                await asyncio.sleep(self.pause)

    async def malformed(self, http: httpx.AsyncClient) -> None:
        while self.left() > 0:
            for label, route, body in MALFORMED:
                if self.left() <= 0:
                    return
                await self._post(http, "malformed", label, route, body, "4xx")
                await asyncio.sleep(self.pause)

    async def leave(self, http: httpx.AsyncClient) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 256, "temperature": 0, "stream": True}
        while self.left() > 0:
            start = time.perf_counter()
            try:
                async with http.stream("POST", "/v1/completions", json=body, timeout=300) as response:
                    got = str(response.status_code)
                    if response.status_code == 200:
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                got = "first_event"
                                break  # and leave: the context manager closes the connection
            except httpx.RemoteProtocolError:
                got = "dropped"
            except httpx.HTTPError as err:
                got = type(err).__name__
            self._record("leave", "stream_left_after_first_event", "first_event", got, start)
            await asyncio.sleep(self.pause)

    async def _connect(self, kind: str, label: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A new connection, or None (recorded, after a pause) when the server refuses it."""
        start = time.perf_counter()
        try:
            return await asyncio.open_connection(self.host, self.port)
        except OSError as err:
            self._record(kind, label, "connected", type(err).__name__, start)
            await asyncio.sleep(self.pause)
            return None

    async def _closed_within(self, reader: asyncio.StreamReader, limit: float) -> str | None:
        """``closed`` once the server closes the connection, ``held`` after ``limit`` s, None if the run ends
        first (not recorded)."""
        wait = min(limit, self.left())
        try:
            data = await asyncio.wait_for(reader.read(1), wait)
        except asyncio.TimeoutError:
            return "held" if wait == limit else None
        except ConnectionError:
            return "closed"
        return "closed" if data == b"" else "data"

    async def idle(self) -> None:
        limit = self.limits.keep_alive_s + self.limits.margin_s
        head = f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()
        while self.left() > 0:
            if (connection := await self._connect("idle", "request_before_idling")) is None:
                continue
            reader, writer = connection
            try:
                start = time.perf_counter()
                writer.write(head)
                status = await _read_status(reader, limit)
                self._record("idle", "request_before_idling", "200", status, start)
                start = time.perf_counter()
                if status == "200" and (got := await self._closed_within(reader, limit)) is not None:
                    self._record("idle", "idle_after_a_request", "closed", got, start)
            finally:
                writer.close()

    async def silent(self) -> None:
        while self.left() > 0:
            if (connection := await self._connect("silent", "connected_sending_nothing")) is None:
                continue
            reader, writer = connection
            start = time.perf_counter()
            got = await self._closed_within(reader, self.limits.header_timeout_s + self.limits.margin_s)
            if got == "held":  # and for how long: up to the end of the run
                got = "closed_late" if await self._closed_within(reader, self.left()) == "closed" else "held"
            if got is not None:  # None: the run ended before the header timeout could show (not recorded)
                self._record("silent", "connected_sending_nothing", "closed", got, start)
            writer.close()

    async def half_sent(self) -> None:
        body = json.dumps({"input": ["the cat sat on the mat"] * 8}).encode()
        head = (
            f"POST /v1/embeddings HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        limit = self.limits.body_timeout_s + self.limits.margin_s
        while self.left() > 0:
            if (connection := await self._connect("half_sent", "body_stalled_after_half")) is None:
                continue
            reader, writer = connection
            start = time.perf_counter()
            try:
                writer.write(head + body[: len(body) // 2])
                status = await _read_status(reader, min(limit, self.left()))
                if status != "TimeoutError":
                    self._record("half_sent", "body_stalled_after_half", "408", status, start)
                elif self.left() > 0:  # no answer in time, and not because the run ended
                    self._record("half_sent", "body_stalled_after_half", "408", "held", start)
            finally:
                writer.close()


async def _read_status(reader: asyncio.StreamReader, limit: float) -> str:
    """The status of the next response (its head and Content-Length body read within ``limit`` s), ``dropped``
    if the server closes the connection first, ``TimeoutError`` if it does not answer in time."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), limit)
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:")), 0)
        await asyncio.wait_for(reader.readexactly(length), limit)
    except (asyncio.IncompleteReadError, ConnectionError):
        return "dropped"
    except asyncio.TimeoutError:
        return "TimeoutError"
    return lines[0].split(" ")[1]


def summarize(outcomes: list[Outcome]) -> dict:
    """Per kind and case: how many, what the server did (counted by ``got``), how many were not as expected,
    the median and longest seconds; and ``errors``: 5xx or dropped requests, with samples."""
    cases: dict[str, dict] = {}
    for o in outcomes:
        case = cases.setdefault(f"{o.kind}/{o.label}", {"expected": o.expected, "got": {}, "seconds": []})
        case["got"][o.got] = case["got"].get(o.got, 0) + 1
        case["seconds"].append(o.seconds)
    for case in cases.values():
        seconds = sorted(case.pop("seconds"))
        case["count"] = len(seconds)
        case["unexpected"] = sum(n for got, n in case["got"].items() if not as_expected(case["expected"], got))
        case["p50_s"], case["max_s"] = seconds[len(seconds) // 2], seconds[-1]
    errors = [o for o in outcomes if o.error]
    return {
        "cases": cases,
        "unexpected": sum(c["unexpected"] for c in cases.values()),
        "errors": len(errors),
        "error_samples": [f"{o.kind}/{o.label}: {o.got} after {o.seconds} s" for o in errors[:5]],
    }
