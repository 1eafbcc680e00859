"""In-flight (continuous) batching of the server's generations: one thread decodes every running generation
together, one new token each per step; a request joins the batch at the next step and leaves when it is done.

Why: a 135M model's decode step on a CPU is bound by reading its weights, so one step over B rows costs about
what one row costs, while B generations decoded separately on 2 cores each read the weights themselves.

How (the arithmetic is :class:`unimae.generation.decoding.Decoder`'s):

- :meth:`GenerationScheduler.submit` queues a request (prompt ids, :class:`GenerationParams` with its own
  temperature / top_p / seed / max_new_tokens, EOS ids, an optional prefix KV cache, a cancel event) and
  returns an iterator of its new token ids as they come. :meth:`GenerationScheduler.decode` is the same with
  :func:`~unimae.generation.decoding.decode_tokens`'s signature: the token source that
  ``generate_stream(..., decode=scheduler.decode)`` runs, so turning ids into text, stop strings, streaming
  and cancellation stay in :mod:`unimae.generation.stream`, one code path for the server, ``unimae ask`` and
  ``Encoder.generate``.
- The scheduler's thread loops: take waiting requests while the batch has room (``max_batch`` rows); prefill
  them (:meth:`Decoder.prefill_many`: prompts with nothing cached in one right-padded forward, the others
  alone, each with its own cache and the reusable part of its prefix copied in, as ``decode_tokens`` does)
  -> their first tokens; then one :meth:`Decoder.step` over every row -> one token each. Each row keeps its
  own KV cache, no padding; for Llama-family models the caches are slots of one
  :class:`~unimae.generation.kv_cache.KVPool` and the step stacks the rows for the projections and attends over all of
  them in one call per layer; other models (Gemma3) step each row with the model's own forward (correct,
  not faster). Greedy tokens equal those of the request decoded alone (fp32 tests).
- A row leaves at an EOS id, at ``max_new_tokens``, or once its cancel event is set (the routes set it when
  the client leaves or a stop string ends the text; closing the iterator does the same), checked when the
  step has the model, so a cancelled row costs at most the step it is in and frees its place for the next one.
- Sharing the model: a prefill or a step holds the server's :class:`ModelLock`, which the embedding batcher
  holds for one chunk; the lock is FIFO, so embedding chunks run between decode steps: a chunk waits for at
  most one step (or prefill), a step for at most one chunk. Both run on the lock's one thread
  (:meth:`ModelLock.run`), not on this scheduler's: see :mod:`unimae.runtime.threads`.
- Bounds: at most ``max_batch`` rows; what is submitted is bounded by the routes' ``GenerationSlots`` (sized
  ``max_batch`` running + ``--max-queued-generations`` waiting, then 429 before the stream's 200).
- Errors: a prefill that fails ends its request with the error; a step that fails ends the rows in it; the
  scheduler goes on. Stopping ends every generation left with an error.

Deviation from an ``asyncio.Queue`` per request: tokens go into a thread-safe queue read by the thread that
runs ``generate_stream`` (the route's worker thread, as with ``decode_tokens``), so the routes and the text
logic are unchanged; that costs one thread hand-off per token, small next to a decode step.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from queue import SimpleQueue
from typing import Protocol

from unimae.generation.decoding import Decoder, DecodeState, padded_groups
from unimae.generation.sampling import GenerationParams
from unimae.serving.model_lock import ModelLock

logger = logging.getLogger(__name__)


class TokenSource(Protocol):
    """``generate_stream``'s ``decode``: new token ids after ``input_ids``, ending after an EOS id (yielded too),
    ``params.max_new_tokens``, or once ``cancel`` is set. :func:`~unimae.generation.decoding.decode_tokens` is one
    for any ``model`` and ``precision``; :meth:`GenerationScheduler.decode` is one BOUND to the scheduler's model
    and precision: ``generate_stream`` passes them (it knows no other signature), and the scheduler checks them,
    a ValueError for any other model or precision (a caller's mistake, never a request's)."""

    def __call__(
        self,
        model,
        input_ids: list[int],
        params: GenerationParams,
        eos_ids: set[int],
        precision: str = "fp32",
        past_key_values=None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]: ...


_DONE = object()  # the last item of a request's queue
THREAD_NAME = "unimae-generation-scheduler"


@dataclass
class SchedulerStats:
    """Counters since start (``/health`` reports them)."""

    requests: int = 0  # submitted
    finished: int = 0  # ended at an EOS id or max_new_tokens
    cancelled: int = 0  # left early: cancel set, or its consumer closed the stream
    failed: int = 0  # ended by an error
    steps: int = 0  # batched one-token forwards
    tokens: int = 0  # new tokens produced (the prefill's first tokens included)
    peak_batch: int = 0  # most rows in one step


@dataclass(eq=False)
class _Request:
    input_ids: list[int]
    params: GenerationParams
    eos_ids: set[int]
    prefix: object | None  # KV cache of a prefix of input_ids (not modified); let go after the prefill
    cancel: threading.Event
    out: SimpleQueue = field(default_factory=SimpleQueue)  # token ids, then an error or _DONE
    state: DecodeState | None = None  # from the prefill on
    closed: bool = False  # the consumer closed its token iterator

    def gone(self) -> bool:
        return self.closed or self.cancel.is_set()

    def begin(self, decoder: Decoder) -> None:
        """A fresh decode state (cache with the prefix copied in), giving back a previous one's pool slot."""
        if self.state is not None:
            self.state.close()
        self.state = decoder.start(self.input_ids, self.params, self.eos_ids, self.prefix)


class GenerationScheduler:
    """Decodes the submitted generations of ``model`` together, at most ``max_batch`` at a time.

    ``lock``: the model lock shared with the embedding batcher (a fresh one if not given). ``prefill_tokens``: the
    most padded prompt tokens prefilled in one turn on the lock (a longer prompt alone), so that, like an
    embedding chunk, a prefill keeps the others waiting for a bounded time (the server passes
    ``--embed-chunk-tokens``). :meth:`start` starts the thread, :meth:`stop` ends it; :meth:`submit` is refused
    before and after.
    """

    def __init__(
        self,
        model,
        precision: str = "fp32",
        max_batch: int = 8,
        lock: ModelLock | None = None,
        prefill_tokens: int = 512,
    ):
        if max_batch < 1 or prefill_tokens < 1:
            raise ValueError(f"max_batch and prefill_tokens must be >= 1, got {max_batch} and {prefill_tokens}")
        self.model, self.precision, self.max_batch = model, precision, max_batch
        self.prefill_tokens = prefill_tokens
        self.lock = lock or ModelLock()
        self.stats = SchedulerStats()
        self._waiting: collections.deque[_Request] = collections.deque()
        # The running batch: changed only while the scheduler thread runs or waits for a step or prefill (on
        # the model's thread, during lock.run), never by two threads at once; snapshot() reads its length.
        self._rows: list[_Request] = []
        self._wake = threading.Condition()  # guards _waiting, _running, _stopping
        self._running = self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the decoding thread (it packs bf16 decode weights first, once)."""
        with self._wake:
            if self._thread is not None:
                raise RuntimeError("the generation scheduler was already started")
            self._running = True
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop after the step under way; generations still running or waiting end with an error. New ones are
        refused from now on. ``wait``: block until the thread has ended."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if wait and self._thread is not None:
            self._thread.join()

    def snapshot(self) -> dict:
        """The counters, plus the rows decoding now and the requests waiting for a place."""
        return {**asdict(self.stats), "running": len(self._rows), "waiting": len(self._waiting)}

    def submit(
        self,
        input_ids: list[int],
        params: GenerationParams,
        eos_ids: set[int],
        past_key_values=None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Queue a generation -> its new token ids as they come, ending after an EOS id (yielded too),
        ``params.max_new_tokens``, or early once ``cancel`` is set or the iterator is closed.

        ``past_key_values``: the KV cache of a prefix of ``input_ids`` (not modified). The iterator blocks
        while it waits for the next token; read it from a worker thread.
        """
        if not input_ids:
            raise ValueError("the prompt is empty")
        request = _Request(list(input_ids), params, set(eos_ids), past_key_values, cancel or threading.Event())
        with self._wake:
            if not self._running or self._stopping:
                raise RuntimeError("the generation scheduler is not running")
            self._waiting.append(request)
            self.stats.requests += 1
            self._wake.notify()
        return _TokenStream(request)

    def decode(
        self,
        model,
        input_ids: list[int],
        params: GenerationParams,
        eos_ids: set[int],
        precision: str = "fp32",
        past_key_values=None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """A :class:`TokenSource` bound to this scheduler's model and precision: :meth:`submit`, decoded in the batch;
        pass it as ``generate_stream``'s ``decode``. ``model`` and ``precision`` must be the scheduler's own."""
        if model is not self.model or precision != self.precision:
            raise ValueError(
                f"this scheduler decodes its own model in {self.precision}; "
                "call decode_tokens for another model or precision"
            )
        return self.submit(input_ids, params, eos_ids, past_key_values, cancel)

    def _run(self) -> None:
        error: Exception = RuntimeError("the server is shutting down")
        arrivals: list[_Request] | None = []  # taken from the queue, not yet prefilled
        try:
            decoder = self.lock.call(Decoder, self.model, self.precision)  # packs bf16 weights on the model's thread
            while (arrivals := self._arrivals()) is not None:
                groups = padded_groups([len(r.input_ids) for r in arrivals], self.prefill_tokens)
                for group in [[arrivals[i] for i in g] for g in groups]:
                    self._prefill(decoder, group)  # one turn on the model lock each
                    arrivals = [r for r in arrivals if r not in group]
                self._step(decoder)
        except Exception as err:  # a bug: end every generation with it rather than leave them waiting
            logger.exception("the generation scheduler stopped on an error")
            error = err
        with self._wake:
            self._running = False
            left = [*(arrivals or []), *self._rows, *self._waiting]
            self._rows, self._waiting = [], collections.deque()
        for request in left:
            self._end(request, error)

    def _arrivals(self) -> list[_Request] | None:
        """The waiting requests that fit in the batch now, oldest first; blocks while there is nothing to do.
        None once the scheduler is stopping. Waiting requests that were cancelled leave the queue here."""
        with self._wake:
            while not (self._stopping or self._waiting or self._rows):
                self._wake.wait()
            if self._stopping:
                return None
            self._drop_gone(self._waiting)
            room = self.max_batch - len(self._rows)
            return [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]

    def _prefill(self, decoder: Decoder, requests: list[_Request]) -> None:
        """Feed the prompts of ``requests`` (together: :meth:`Decoder.prefill_many`) -> their first tokens; each
        joins the batch unless it is done. A request whose prefill fails ends with its error; the others go on."""
        outcomes = self.lock.run(self._start, decoder, requests)
        for request, outcome in zip(requests, outcomes, strict=True):
            if isinstance(outcome, Exception):
                self._end(request, outcome)
            elif outcome is None:
                self._end(request, cancelled=True)
            else:
                request.prefix = None
                self._deliver(request, outcome)
                if request.state.finished:
                    self._end(request)
                else:
                    self._rows.append(request)

    def _start(self, decoder: Decoder, requests: list[_Request]) -> list[int | None | Exception]:
        """On the model's thread: each request's cache (its prefix copied in), then their prefills -> each one's
        first token, None (cancelled while it waited for the model: no prefill) or the error that ended it.
        If the prefills together fail, each is retried alone, so only the request at fault fails."""
        outcomes: list[int | None | Exception] = [None] * len(requests)
        started = []
        for i, request in enumerate(requests):
            if request.gone():
                continue
            try:
                request.begin(decoder)
                started.append(i)
            except Exception as err:  # this request's fault (or its prompt's)
                outcomes[i] = err
        try:
            tokens = decoder.prefill_many([requests[i].state for i in started], self.prefill_tokens)
        except Exception as err:
            if len(started) == 1:
                outcomes[started[0]] = err
                return outcomes
            tokens = [self._prefill_alone(decoder, requests[i]) for i in started]
        for i, token in zip(started, tokens, strict=True):
            outcomes[i] = token
        return outcomes

    @staticmethod
    def _prefill_alone(decoder: Decoder, request: _Request) -> int | Exception:
        """``request``'s prefill on its own, from a fresh cache -> its first token or its error."""
        try:
            request.begin(decoder)
            return decoder.prefill(request.state)
        except Exception as err:
            return err

    def _step(self, decoder: Decoder) -> None:
        """One token for every row; rows that are done (or gone) leave the batch."""
        rows = self.lock.run(self._step_rows, decoder)
        if not rows:
            return
        self.stats.steps += 1
        self.stats.peak_batch = max(self.stats.peak_batch, len(rows))
        for request, token in rows:
            self._deliver(request, token)
        self._rows = [r for r, _ in rows if not r.state.finished]
        for request, _ in rows:
            if request.state.finished:
                self._end(request)

    def _step_rows(self, decoder: Decoder) -> list[tuple[_Request, int]]:
        """On the model's thread, lock held: drop the rows that are gone (checked once the model is ours), then
        one decode step -> (row, token) pairs; a step that fails ends its rows ([])."""
        self._drop_gone(self._rows)
        rows = list(self._rows)
        if not rows:
            return []
        try:
            tokens = decoder.step([r.state for r in rows])
        except Exception as err:  # every row of this step fails; later requests go on
            self._rows = []
            for request in rows:
                self._end(request, err)
            return []
        return list(zip(rows, tokens, strict=True))

    def _drop_gone(self, requests: list[_Request] | collections.deque[_Request]) -> None:
        """Remove the cancelled or closed requests from ``requests`` (in place) and end them."""
        for request in [r for r in requests if r.gone()]:
            requests.remove(request)
            self._end(request, cancelled=True)

    def _deliver(self, request: _Request, token: int) -> None:
        self.stats.tokens += 1
        request.out.put(token)

    def _end(self, request: _Request, error: Exception | None = None, cancelled: bool = False) -> None:
        if request.state is not None:
            request.state.close()  # its pool slot is free for the next request
        if error is not None:
            self.stats.failed += 1
            request.out.put(error)
        elif cancelled:
            self.stats.cancelled += 1
        else:
            self.stats.finished += 1
        request.out.put(_DONE)


class _TokenStream:
    """The consumer's side of a request: its token ids as the scheduler delivers them, or its error.

    Closing it (or dropping it), even before the first token, marks the request closed: its row leaves
    the batch at the next step (a generator's ``finally`` would not run if it was never started).
    An error shared by several requests (a failed step, the shutdown) is raised as a copy per consumer,
    chained to the original, so their tracebacks do not mix across threads.
    """

    def __init__(self, request: _Request):
        self._request = request
        self._ended = False

    def __iter__(self) -> _TokenStream:
        return self

    def __next__(self) -> int:
        if self._ended:
            raise StopIteration
        item = self._request.out.get()
        if item is _DONE or isinstance(item, Exception):
            self.close()
            if item is _DONE:
                raise StopIteration
            raise _copy_error(item) from item
        return item

    def close(self) -> None:
        self._ended = True
        self._request.closed = True

    def __del__(self) -> None:
        self._request.closed = True


def _copy_error(error: Exception) -> Exception:
    """A fresh exception of ``error``'s type and arguments (a RuntimeError naming it where it cannot be copied)."""
    try:
        return copy.copy(error)
    except Exception:  # an exception class whose constructor does not take its own args back
        return RuntimeError(f"{type(error).__name__}: {error}")
