"""``CallLock``: an ``LLM``'s calls one at a time (``generate``, ``chat``, ``beam_search``,
``generate_stream``), for an engine that is not thread-safe.

Threads sharing an LLM each get the results they would get alone, one call at a time. A
``generate_stream`` holds the lock from its first item until it is exhausted or closed, so a call
made by the thread that is inside such a stream (in the loop over it) would wait for itself
forever: it raises RuntimeError at once instead. The holder is the thread that last resumed the
stream (a stream may be handed to another thread).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, TypeVar

T = TypeVar("T")


class CallLock:
    """The lock of one LLM and who holds it: (thread id, call name), or None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: Optional[tuple[int, str]] = None

    @contextlib.contextmanager
    def held(self, call: str):
        """Hold the lock for one call (``call``: the LLM method's name, for the message);
        RuntimeError at once if this thread already holds it."""
        me = threading.get_ident()
        holder = self._holder
        if holder is not None and holder[0] == me:
            raise RuntimeError(
                f"LLM.{call} called while this thread is inside LLM.{holder[1]} of the same LLM, which holds its "
                "lock until it is done (a generate_stream until it is exhausted or closed): this call would wait "
                "for itself forever. Finish or close() the stream first."
            )
        with self._lock:
            self._holder = (me, call)
            try:
                yield
            finally:
                self._holder = None

    def held_over(self, call: str, items: Iterator[T]) -> Iterator[T]:
        """``items``, yielded while the lock is held: taken at the first item, given back when
        ``items`` is exhausted, raises, or this generator is closed (``items`` is closed with it,
        so that it aborts its work before the lock is free)."""
        with self.held(call), contextlib.closing(items):
            for item in items:
                yield item
                self._holder = (threading.get_ident(), call)  # resumed by this thread
