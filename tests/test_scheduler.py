"""In-flight batching of generations (unimae.serving.scheduler) on tiny models, against ``decode_tokens`` alone.

What runs when is decided by the test, never by timing: the scheduler's model lock is a :class:`GatedLock`,
which lets the scheduler's thread take the model (one prefill or one decode step) only as many times as the
test allows; every wait has a generous timeout that only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import httpx
import pytest
import torch
from conftest import SENTENCES

from unimae.encoder import Encoder
from unimae.generation.decoding import decode_tokens, eos_token_ids
from unimae.generation.fast_path import packed_supported
from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import GenerationResult, generate_stream, generate_text
from unimae.models import load_model
from unimae.serving.model_lock import THREAD_NAME as MODEL_THREAD
from unimae.serving.model_lock import ModelLock
from unimae.serving.scheduler import THREAD_NAME, GenerationScheduler

WAIT = 60  # seconds: a guard against a hang, never an ordering device


class GatedLock(ModelLock):
    """The model lock with a gate for the scheduler's thread only (embedding threads pass freely): closed, the
    scheduler takes the model only as many times as :meth:`allow` says; :meth:`open` lets it go on freely."""

    def __init__(self):
        super().__init__()
        self._permits = threading.Semaphore(0)
        self._open = False
        self.blocked = threading.Event()  # the scheduler has waited at the gate

    def allow(self, times: int) -> None:
        self._permits.release(times)

    def open(self) -> None:
        self._open = True
        self._permits.release()  # the one waiting now, if any

    def close(self) -> None:
        """Closed again, no permits left (call it while the scheduler is idle)."""
        self._open = False
        while self._permits.acquire(blocking=False):
            pass
        self.blocked.clear()

    def acquire(self) -> None:
        if threading.current_thread().name == THREAD_NAME and not self._open:
            if not self._permits.acquire(blocking=False):
                self.blocked.set()
                assert self._permits.acquire(timeout=WAIT), "the test never let the scheduler go on"
        super().acquire()


@pytest.fixture
def gated():
    """``gated(model, max_batch)`` -> (a started scheduler whose lock is closed, its lock); stopped afterwards."""
    made = []

    def make(model, max_batch: int = 8, precision: str = "fp32") -> tuple[GenerationScheduler, GatedLock]:
        lock = GatedLock()
        scheduler = GenerationScheduler(model, precision, max_batch, lock)
        scheduler.start()
        made.append((scheduler, lock))
        return scheduler, lock

    yield make
    for scheduler, lock in made:
        lock.open()
        scheduler.stop()


def _load(tiny_dir, lora: bool = False):
    model, tokenizer, _ = load_model(str(tiny_dir))
    model = model.float()
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    return model, tokenizer


def _alone(model, ids: list[int], params: GenerationParams, eos: set[int], precision="fp32", **kwargs) -> list[int]:
    return list(decode_tokens(model, ids, params, eos, precision, **kwargs))


def _take(tokens, count: int) -> list[int]:
    return [next(tokens) for _ in range(count)]


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_concurrent_greedy_generations_equal_each_decoded_alone(tiny_dir, lora, gated):
    model, tokenizer = _load(tiny_dir, lora)
    eos = eos_token_ids(model, tokenizer)
    prompts = [tokenizer(s)["input_ids"] for s in SENTENCES[:4]]
    with torch.inference_mode():  # the last one reuses a prefix cache, as RAG does
        prefix = model.get_decoder()(input_ids=torch.tensor([prompts[3][:5]]), use_cache=True).past_key_values
    budgets, extra = [40, 12, 25, 40], [{}, {}, {}, {"past_key_values": prefix}]
    params = [GenerationParams(max_new_tokens=n) for n in budgets]
    expected = [_alone(model, ids, p, eos, **kw) for ids, p, kw in zip(prompts, params, extra, strict=True)]
    assert min(map(len, expected)) > 2, "every row should still run when the others join"
    scheduler, lock = gated(model)
    streams = [scheduler.submit(ids, p, eos, **kw) for ids, p, kw in zip(prompts, params, extra, strict=True)]
    lock.open()
    assert [list(tokens) for tokens in streams] == expected
    stats = scheduler.snapshot()
    assert stats["peak_batch"] == 4 and stats["finished"] == 4 and stats["running"] == stats["waiting"] == 0
    assert stats["tokens"] == sum(map(len, expected))
    assert prefix.get_seq_length() == 5, "the prefix cache is not modified"


@pytest.mark.skipif(not packed_supported(torch.device("cpu")), reason="no oneDNN bf16 on this CPU")
def test_bf16_rows_on_packed_weights_equal_each_decoded_alone(tiny_model_dirs, gated):
    model, tokenizer = _load(tiny_model_dirs["llama"])
    model = model.to(torch.bfloat16)
    prompts, params = [tokenizer(s)["input_ids"] for s in SENTENCES[6:9]], GenerationParams(max_new_tokens=24)
    expected = [_alone(model, ids, params, set(), "bf16") for ids in prompts]
    scheduler, lock = gated(model, precision="bf16")
    streams = [scheduler.submit(ids, params, set()) for ids in prompts]
    lock.open()
    assert [list(tokens) for tokens in streams] == expected
    assert scheduler.stats.peak_batch == 3


def test_a_request_joining_mid_flight_gets_the_same_tokens(tiny_dir, gated):
    model, tokenizer = _load(tiny_dir)
    first, second = (tokenizer(s)["input_ids"] for s in SENTENCES[4:6])
    params = GenerationParams(max_new_tokens=30)
    scheduler, lock = gated(model)
    running = scheduler.submit(first, params, set())
    lock.allow(5)  # the prefill and 4 steps: 5 of its 30 tokens
    head = _take(running, 5)
    joining = scheduler.submit(second, params, set())  # joins while the first is at token 5 of 30
    lock.open()
    assert head + list(running) == _alone(model, first, params, set())
    assert list(joining) == _alone(model, second, params, set())
    assert scheduler.stats.peak_batch == 2


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_dir, gated):
    model, tokenizer = _load(tiny_dir)
    ids, others = tokenizer(SENTENCES[0])["input_ids"], [tokenizer(s)["input_ids"] for s in SENTENCES[1:3]]
    sampled = [GenerationParams(max_new_tokens=20, temperature=1.5, top_p=0.9, seed=seed) for seed in (7, 8)]
    expected = [_alone(model, ids, p, set()) for p in sampled]
    assert expected[0] != expected[1], "another seed samples other tokens"
    scheduler, lock = gated(model)
    alone = scheduler.submit(ids, sampled[0], set())  # in a batch of its own
    lock.allow(1)
    assert next(alone) == expected[0][0]
    greedy = [scheduler.submit(other, GenerationParams(max_new_tokens=20), set()) for other in others]
    second = scheduler.submit(ids, sampled[1], set())  # batched with greedy rows and the other seed
    lock.open()
    assert [expected[0][0], *alone] == expected[0] and list(second) == expected[1]
    assert [list(tokens) for tokens in greedy] == [_alone(model, o, GenerationParams(20), set()) for o in others]


def test_cancelling_or_closing_a_generation_frees_its_row(tiny_model_dirs, gated):
    model, tokenizer = _load(tiny_model_dirs["llama"])
    ids = tokenizer(SENTENCES[0])["input_ids"]
    long, short = GenerationParams(max_new_tokens=50), GenerationParams(max_new_tokens=8)
    scheduler, lock = gated(model, max_batch=1)  # one row: the next request runs only once it is free
    cancel = threading.Event()
    cancelled = scheduler.submit(ids, long, set(), cancel=cancel)
    behind = scheduler.submit(ids, short, set())
    never_cancel = threading.Event()
    never = scheduler.submit(ids, short, set(), cancel=never_cancel)
    never_cancel.set()  # cancelled while it waits for the row: it leaves the queue, never prefilled
    lock.allow(3)
    assert len(_take(cancelled, 3)) == 3
    cancel.set()
    lock.allow(2)  # the next step finds it cancelled (no 4th token); the waiting request's prefill takes the row
    assert list(cancelled) == [] and list(never) == []
    assert _take(behind, 1) == _alone(model, ids, short, set())[:1]
    closed = scheduler.submit(ids, long, set())  # waits for `behind`, which has 7 tokens to go
    lock.allow(8)
    assert len(list(behind)) == 7
    assert len(_take(closed, 1)) == 1
    closed.close()  # its consumer stops reading
    last = scheduler.submit(ids, short, set())
    lock.open()
    assert list(last) == _alone(model, ids, short, set())
    stats = scheduler.snapshot()
    assert (stats["cancelled"], stats["finished"], stats["running"], stats["waiting"]) == (3, 2, 0, 0)


def test_a_request_cancelled_while_its_prefill_waits_for_the_model_is_never_prefilled(tiny_model_dirs, gated):
    model, tokenizer = _load(tiny_model_dirs["llama"])
    scheduler, lock = gated(model)
    cancel = threading.Event()
    stream = scheduler.submit(tokenizer(SENTENCES[0])["input_ids"], GenerationParams(8), set(), cancel=cancel)
    assert lock.blocked.wait(WAIT)  # taken from the queue; its prefill waits for the model
    cancel.set()
    lock.allow(1)
    assert list(stream) == []
    stats = scheduler.snapshot()
    assert (stats["cancelled"], stats["tokens"], stats["running"]) == (1, 0, 0)


def test_a_stream_closed_or_dropped_before_its_first_token_is_cancelled(tiny_model_dirs, gated):
    model, tokenizer = _load(tiny_model_dirs["llama"])
    ids, short = tokenizer(SENTENCES[0])["input_ids"], GenerationParams(max_new_tokens=3)
    scheduler, lock = gated(model, max_batch=1)
    closed = scheduler.submit(ids, GenerationParams(max_new_tokens=50), set())
    closed.close()  # never read
    scheduler.submit(ids, GenerationParams(max_new_tokens=50), set())  # never read, dropped at once
    after = scheduler.submit(ids, short, set())
    lock.open()
    assert list(after) == _alone(model, ids, short, set())  # one row: it ran only once both others had left
    stats = scheduler.snapshot()
    assert (stats["cancelled"], stats["finished"]) == (2, 1) and stats["tokens"] <= 2 + 3


def test_a_failing_prefill_fails_only_its_request_and_stop_ends_the_rest(tiny_model_dirs, gated):
    model, tokenizer = _load(tiny_model_dirs["llama"])
    ids, params = tokenizer(SENTENCES[0])["input_ids"], GenerationParams(max_new_tokens=10)
    scheduler, lock = gated(model, max_batch=2)
    good = scheduler.submit(ids, params, set())
    bad = scheduler.submit([10**6], params, set())  # no such token: the embedding lookup fails
    lock.open()
    with pytest.raises(IndexError):
        next(bad)
    assert list(good) == _alone(model, ids, params, set())
    lock.close()  # the scheduler is idle
    running = scheduler.submit(ids, GenerationParams(max_new_tokens=50), set())
    waiting = scheduler.submit(ids, params, set())
    lock.allow(1)
    assert len(_take(running, 1)) == 1  # the scheduler waits at the gate for its next prefill or step
    scheduler.stop(wait=False)
    lock.open()
    scheduler.stop()
    for tokens in (running, waiting):
        with pytest.raises(RuntimeError, match="shutting down"):
            list(tokens)
    with pytest.raises(RuntimeError, match="not running"):
        scheduler.submit(ids, params, set())
    assert scheduler.stats.failed == 3


def test_generate_stream_takes_its_tokens_from_the_scheduler(tiny_model_dirs, gated):
    model, tokenizer = _load(tiny_model_dirs["qwen2"])
    ids = tokenizer("the river")["input_ids"]
    full = generate_text(model, tokenizer, ids, GenerationParams(max_new_tokens=24))
    stop = full.text[3:6]
    scheduler, lock = gated(model)
    lock.open()
    batched = generate_text(model, tokenizer, ids, GenerationParams(max_new_tokens=24), decode=scheduler.decode)
    assert batched == full
    items = list(generate_stream(model, tokenizer, ids, GenerationParams(24, stop=[stop]), decode=scheduler.decode))
    pieces, result = items[:-1], items[-1]
    assert isinstance(result, GenerationResult) and result.finish_reason == "stop"
    assert result.text == full.text[: full.text.find(stop)] == "".join(pieces)
    other, _ = _load(tiny_model_dirs["qwen2"])
    with pytest.raises(ValueError, match="its own model"):
        scheduler.decode(other, ids, GenerationParams(), set())
    with pytest.raises(ValueError, match="its own model"):
        scheduler.decode(model, ids, GenerationParams(), set(), precision="bf16")


def test_model_lock_runs_every_call_on_one_thread_of_its_own():
    lock = ModelLock()
    names = [lock.run(lambda: threading.current_thread().name) for _ in range(3)]
    idents = {lock.run(threading.get_ident) for _ in range(3)} | {lock.call(threading.get_ident)}
    assert len(set(names)) == 1 and names[0].startswith(MODEL_THREAD) and len(idents) == 1
    assert threading.get_ident() not in idents
    assert lock.run(lambda: lock.run(lambda: 7)) == 7  # a call from the model's thread runs in place, no deadlock
    with pytest.raises(ValueError, match="bad chunk"):
        lock.run(_fail, "bad chunk")  # the error comes back to the caller
    assert lock.run(lambda: 1) == 1  # and the lock was released


def _fail(message: str):
    raise ValueError(message)


def test_scheduler_decodes_on_the_model_lock_thread(tiny_model_dirs):
    model, _ = _load(tiny_model_dirs["llama"])
    lock = ModelLock()
    seen = set()
    original = GenerationScheduler._step_rows

    def observed(self, decoder):
        seen.add(threading.current_thread().name)
        return original(self, decoder)

    scheduler = GenerationScheduler(model, "fp32", 2, lock)
    scheduler._step_rows = observed.__get__(scheduler)
    scheduler.start()
    try:
        params = GenerationParams(max_new_tokens=4, ignore_eos=True)
        assert len(list(scheduler.submit([1, 2, 3], params, set()))) == 4
    finally:
        scheduler.stop()
    assert len(seen) == 1 and next(iter(seen)).startswith(MODEL_THREAD)


def test_model_lock_serves_callers_in_the_order_they_asked():
    class Observed(ModelLock):
        def __init__(self):
            super().__init__()
            self.asked = queue.SimpleQueue()  # thread names, as they take a ticket

        def _ticket(self) -> int:
            ticket = super()._ticket()
            self.asked.put(threading.current_thread().name)
            return ticket

    lock, held = Observed(), []

    def hold(times: int) -> None:
        for _ in range(times):
            with lock:
                held.append(threading.current_thread().name)

    lock.acquire()
    assert lock.asked.get(timeout=WAIT) == "MainThread"
    steps = threading.Thread(target=hold, args=(3,), name="steps")  # as the scheduler: again and again
    chunk = threading.Thread(target=hold, args=(1,), name="chunk")  # as the embedding batcher: once
    steps.start()
    assert lock.asked.get(timeout=WAIT) == "steps"
    chunk.start()
    assert lock.asked.get(timeout=WAIT) == "chunk"
    lock.release()
    steps.join(WAIT), chunk.join(WAIT)
    assert held == ["steps", "chunk", "steps", "steps"]  # the chunk's turn came after one step


def _app(tiny_model_dirs, **config):
    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=32)
    return encoder, create_app(encoder, ServerConfig(model_name="tiny", **config))


def test_an_embedding_request_completes_while_a_generation_runs(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr("unimae.serving.torch_engine.ModelLock", GatedLock)  # shared by the batcher and the scheduler
    encoder, app = _app(tiny_model_dirs)
    state = app.state.server
    lock = state.scheduler.lock
    assert lock is state.lock
    body = {"prompt": "the cat", "max_tokens": 20, "temperature": 0}

    async def main():
        state.batcher.start()
        state.scheduler.start()
        loop = asyncio.get_running_loop()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=WAIT) as http:
            try:
                lock.allow(3)  # the prefill and two steps, then the generation waits at the gate
                generation = asyncio.create_task(http.post("/v1/completions", json=body))
                assert await loop.run_in_executor(None, lock.blocked.wait, WAIT)
                embedded = await http.post("/v1/embeddings", json={"input": SENTENCES[:3], "encoding_format": "float"})
                during = (generation.done(), state.scheduler.snapshot())
            finally:
                lock.open()
            completed = await generation
        await state.batcher.stop()
        await loop.run_in_executor(None, state.scheduler.stop)
        return embedded, during, completed

    embedded, (finished_before, stats), completed = asyncio.run(main())
    assert embedded.status_code == 200 and len(embedded.json()["data"]) == 3
    assert not finished_before and stats["running"] == 1 and stats["tokens"] == 3
    assert completed.status_code == 200
    assert completed.json()["choices"][0]["text"] == encoder.generate("the cat", max_new_tokens=20)


@pytest.mark.parametrize(("budget", "groups"), [(10_000, [3]), (1, [1, 1, 1])])
def test_requests_arriving_together_are_prefilled_together_within_the_token_budget(
    tiny_model_dirs, monkeypatch, budget, groups
):
    """One turn on the model lock prefills at most ``prefill_tokens`` padded tokens (a longer prompt alone), so an
    embedding chunk waits for at most about that; within it, one forward for all (Decoder.prefill_many). The
    scheduler's thread builds its Decoder through the closed lock, so all three are waiting when it opens."""
    from unimae.generation.decoding import Decoder

    model, tokenizer = _load(tiny_model_dirs["llama"])
    prompts, params = [tokenizer(s)["input_ids"] for s in SENTENCES[:3]], GenerationParams(max_new_tokens=5)
    expected = [_alone(model, ids, params, set()) for ids in prompts]
    seen, prefill_many = [], Decoder.prefill_many

    def spy(self, states, budget=None):
        seen.append(len(states))
        return prefill_many(self, states, budget)

    monkeypatch.setattr(Decoder, "prefill_many", spy)
    lock = GatedLock()
    scheduler = GenerationScheduler(model, "fp32", 8, lock, prefill_tokens=budget)
    scheduler.start()
    try:
        streams = [scheduler.submit(ids, params, set()) for ids in prompts]
        lock.open()
        assert [list(tokens) for tokens in streams] == expected
    finally:
        scheduler.stop()
    assert seen == groups
