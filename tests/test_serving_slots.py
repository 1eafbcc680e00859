"""GenerationSlots and the SSE stream that holds one, without a server: capacity, queue bound, release."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest

from unimae.serving.schemas import APIError
from unimae.serving.slots import GenerationSlots
from unimae.serving.sse import sse_events


async def _until(condition) -> None:
    """Let other tasks run until ``condition()`` holds; the timeout only turns a hang into a failure."""

    async def poll():
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), 10)


async def _holder(slots: GenerationSlots, done: asyncio.Event, entered: list) -> None:
    """A generation: reserve (as the route does), then hold a slot until ``done``."""
    slots.reserve()
    async with slots.hold():
        entered.append(True)
        await done.wait()


def test_at_most_max_running_hold_a_slot_and_the_next_waits_for_one():
    async def main():
        slots, done, entered = GenerationSlots(max_running=2, max_queued=4), asyncio.Event(), []
        tasks = [asyncio.create_task(_holder(slots, done, entered)) for _ in range(3)]
        await _until(lambda: slots.running == 2 and slots.waiting == 1)
        for _ in range(10):
            await asyncio.sleep(0)  # the third has every chance to (wrongly) start
        assert len(entered) == 2 and (slots.running, slots.waiting) == (2, 1)
        done.set()
        await asyncio.gather(*tasks)
        assert len(entered) == 3 and (slots.running, slots.waiting) == (0, 0)

    asyncio.run(main())


def test_a_full_queue_is_429_and_takes_no_place():
    async def main():
        slots, done, entered = GenerationSlots(max_running=1, max_queued=2), asyncio.Event(), []
        tasks = [asyncio.create_task(_holder(slots, done, entered)) for _ in range(3)]
        await _until(lambda: slots.running == 1 and slots.waiting == 2)
        with pytest.raises(APIError) as refused:
            slots.reserve()
        assert refused.value.status == 429 and refused.value.code == "server_busy"
        assert refused.value.body()["error"]["type"] == "rate_limit_error"
        assert (slots.running, slots.waiting) == (1, 2)
        done.set()
        await asyncio.gather(*tasks)
        slots.reserve()  # room again once the queue drained
        assert slots.waiting == 1

    asyncio.run(main())


def test_without_a_queue_a_request_runs_if_a_slot_is_free_and_is_refused_if_none_is():
    async def main():
        slots, done, entered = GenerationSlots(max_running=1, max_queued=0), asyncio.Event(), []
        task = asyncio.create_task(_holder(slots, done, entered))  # reserve() passes: the slot is free
        await _until(lambda: slots.running == 1)
        with pytest.raises(APIError):
            slots.reserve()
        done.set()
        await task
        slots.reserve()  # free again
        assert slots.waiting == 1

    asyncio.run(main())


def test_an_error_while_holding_releases_the_slot():
    async def main():
        slots = GenerationSlots(max_running=1, max_queued=0)
        slots.reserve()
        with pytest.raises(RuntimeError):
            async with slots.hold():
                raise RuntimeError("generation failed")
        assert (slots.running, slots.waiting) == (0, 0)
        slots.reserve()  # the slot is free: no 429
        async with slots.hold():
            assert slots.running == 1

    asyncio.run(main())


def test_cancelled_while_waiting_gives_up_the_place_and_leaks_no_slot():
    async def main():
        slots, done, entered = GenerationSlots(max_running=1, max_queued=1), asyncio.Event(), []
        running = asyncio.create_task(_holder(slots, done, entered))
        await _until(lambda: slots.running == 1)
        waiting = asyncio.create_task(_holder(slots, done, entered))
        await _until(lambda: slots.waiting == 1)
        waiting.cancel()  # its client left while it queued
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (slots.running, slots.waiting) == (1, 0) and len(entered) == 1
        running.cancel()  # the running one is cancelled too: its slot comes back
        with pytest.raises(asyncio.CancelledError):
            await running
        assert (slots.running, slots.waiting) == (0, 0)
        slots.reserve()
        async with slots.hold():
            assert slots.running == 1

    asyncio.run(main())


def _events(frames: list[bytes]) -> list:
    text = b"".join(frames).decode()
    assert all(part.startswith("data: ") for part in text.split("\n\n") if part), text
    return [part[6:] if part[6:] == "[DONE]" else json.loads(part[6:]) for part in text.split("\n\n") if part]


def test_sse_stream_frames_items_and_releases_its_slot():
    def pieces():
        yield from ["a", "", "b"]

    async def main():
        slots, cancel = GenerationSlots(max_running=1, max_queued=0), threading.Event()
        slots.reserve()
        stream = sse_events(slots, pieces, lambda x: {"text": x} if x else None, cancel, [{"n": 0}])
        frames = [frame async for frame in stream]
        return _events(frames), slots, cancel

    events, slots, cancel = asyncio.run(main())
    assert events == [{"n": 0}, {"text": "a"}, {"text": "b"}, "[DONE]"]  # "" rendered to None: skipped
    assert cancel.is_set() and (slots.running, slots.waiting) == (0, 0)


def test_sse_stream_reports_an_error_in_the_stream_and_releases_its_slot():
    def failing():
        yield "a"
        raise RuntimeError("boom")

    async def main():
        slots, cancel = GenerationSlots(max_running=1, max_queued=0), threading.Event()
        slots.reserve()
        frames = [frame async for frame in sse_events(slots, failing, lambda x: {"text": x}, cancel)]
        return _events(frames), slots, cancel

    events, slots, cancel = asyncio.run(main())
    assert events[0] == {"text": "a"} and events[-1] == "[DONE]"
    assert (
        events[1]["error"]["message"] == "generation failed: RuntimeError"
        and events[1]["error"]["type"] == "server_error"
    )
    assert cancel.is_set() and (slots.running, slots.waiting) == (0, 0)


def test_a_client_leaving_the_stream_cancels_the_generation_and_releases_its_slot():
    def endless():
        while True:
            yield "x"

    async def main():
        slots, cancel = GenerationSlots(max_running=1, max_queued=0), threading.Event()
        slots.reserve()
        stream = sse_events(slots, endless, lambda x: {"text": x}, cancel)
        first = await stream.__anext__()
        assert slots.running == 1 and not cancel.is_set()
        await stream.aclose()  # what the server does when the client disconnects
        return first, slots, cancel

    first, slots, cancel = asyncio.run(main())
    assert _events([first]) == [{"text": "x"}]
    assert cancel.is_set() and (slots.running, slots.waiting) == (0, 0)


def _one_piece():
    yield "x"


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_client_leaving_before_the_stream_starts_gives_back_its_queue_place(spec_version):
    """The route reserved a place; the client is gone before the body runs (the first send fails, or the
    disconnect arrives first): the response gives the place back, so the queue does not shrink for ever."""
    from starlette.requests import ClientDisconnect

    from unimae.serving.sse import sse_response

    async def main():
        slots, cancel = GenerationSlots(max_running=1, max_queued=1), threading.Event()
        slots.reserve()
        response = sse_response(sse_events(slots, _one_piece, lambda x: {"text": x}, cancel), slots)

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            if spec_version == "2.4":
                raise OSError("connection reset")  # ASGI 2.4: the server raises on send to a gone client
            await asyncio.Event().wait()  # before 2.4: the send hangs until the disconnect cancels it

        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        with contextlib.suppress(ClientDisconnect):
            await response(scope, receive, send)
        return slots

    slots = asyncio.run(main())
    assert (slots.running, slots.waiting) == (0, 0)


def test_a_stream_that_ran_gives_back_its_place_once():
    """After a full stream the reservation is consumed by hold(), not given back a second time."""
    from unimae.serving.sse import sse_response

    async def main():
        slots, cancel = GenerationSlots(max_running=1, max_queued=1), threading.Event()
        slots.reserve()
        response = sse_response(sse_events(slots, _one_piece, lambda x: {"text": x}, cancel), slots)
        sent = []

        async def receive():
            await asyncio.Event().wait()  # the client never leaves

        async def send(message):
            sent.append(message)

        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return slots, sent

    slots, sent = asyncio.run(main())
    assert (slots.running, slots.waiting) == (0, 0)
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


class _Client:
    """The ASGI side of a non-streaming request whose body was read: ``receive`` returns once it leaves."""

    def __init__(self):
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}


def test_a_completion_whose_client_leaves_ends_its_generation_and_frees_its_slot():
    from types import SimpleNamespace

    from unimae.generation.sampling import GenerationParams
    from unimae.serving.routes.completions import _generate

    ended, client, loops = threading.Event(), _Client(), []

    def generate(ids, params, cancel):  # an engine's generation: one piece, then nothing until cancelled
        try:
            yield "a"
            loops[0].call_soon_threadsafe(client.leave.set)  # the client leaves once the generation runs
            cancel.wait()
        finally:  # run out or closed: the generation has ended either way
            ended.set()

    params = GenerationParams(max_new_tokens=64)

    async def scenario():
        loops.append(asyncio.get_running_loop())
        state = SimpleNamespace(slots=GenerationSlots(1, 0), engine=SimpleNamespace(generate=generate))
        with pytest.raises(APIError) as err:
            await _generate(state, [([1, 5], params)], client)
        assert err.value.status == 499 and ended.is_set()
        assert (state.slots.running, state.slots.waiting) == (0, 0)  # the slot is free for the next request

    asyncio.run(scenario())
