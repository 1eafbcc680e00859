"""The server's model lock: embedding chunks and generation steps take turns on the one loaded model, on one thread.

The embedding batcher holds it for one chunk (one forward pass, ``--embed-chunk-tokens`` padded tokens), the
generation scheduler for one prefill or one decode step. On a 2-core CPU two forwards at once only share the
cores (each with its own OpenMP team, oversubscribed); one after the other, each runs at full speed.

:meth:`ModelLock.run` also runs the work on the lock's own thread, the same one every time: when two threads
of a process have run OpenMP work, libgomp stops spinning between parallel regions and a 135M model's decode
step gets slower even on an idle 2-core machine (see :mod:`unimae.runtime.threads`). Every forward of the
server goes through :meth:`run` (the warm-up, RAG's query pass and any other included).

The lock is FIFO (a ticket lock): the thread that asked first gets the model next. A plain ``threading.Lock``
is not: the scheduler releases and re-acquires it between steps in microseconds and could take it again and
again before a waiting embedding thread wakes. With turns, an embedding chunk waits for at most the step (or
prefill) running when it asks, and a decode step for at most one chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
THREAD_NAME = "unimae-model"


class ModelLock:
    """A first-come, first-served lock (not reentrant): ``with lock:`` around one forward pass."""

    def __init__(self):
        self._turns = threading.Condition(threading.Lock())
        self._next = 0  # the ticket the next caller gets
        self._serving = 0  # the ticket that holds the lock (or gets it next)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)  # the model's thread

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on the model's thread with the lock held (taken in the caller's turn); its
        result or exception comes back to the caller. Called on the model's thread itself (the lock is held by
        whoever sent the running task), it just calls."""
        if _on_model_thread():
            return fn(*args, **kwargs)
        with self:
            return self._thread.submit(fn, *args, **kwargs).result()

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on the model's thread without taking a turn: that thread runs one task at a
        time, so it still never overlaps a forward (the scheduler packs its decode weights with it)."""
        if _on_model_thread():
            return fn(*args, **kwargs)
        return self._thread.submit(fn, *args, **kwargs).result()

    def acquire(self) -> None:
        """Wait for every caller that asked before this one, then hold the lock."""
        ticket = self._ticket()
        with self._turns:
            while self._serving != ticket:
                self._turns.wait()

    def _ticket(self) -> int:
        """This caller's place in the line."""
        with self._turns:
            self._next += 1
            return self._next - 1

    def release(self) -> None:
        """Hand the lock to the caller that has waited longest."""
        with self._turns:
            self._serving += 1
            self._turns.notify_all()

    def __enter__(self) -> ModelLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _on_model_thread() -> bool:
    return threading.current_thread().name.startswith(THREAD_NAME)
