"""Ctrl-C in `run` stops where nothing is being written, never inside a database write.

Python raises KeyboardInterrupt at whatever line runs when the signal comes. Inside a
write to SQLite that can leave the interrupted connection holding the write lock (its
statement is still referenced by the exception's frames), and the write that puts the
interrupted shard back to 'queued' then waits on it until "database is locked": the job
ends with an error instead of the resume message. So while `run` works on a job, Ctrl-C
raises at once only inside blocks that write nothing (loading the model, a decoding
step); anywhere else it says so and waits for the next such block (one that comes while
the job's last rows are stored lets the job finish). A second Ctrl-C raises wherever it
lands, for a user who will not wait (a long job creation, a stuck database).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any, TypeVar

T = TypeVar("T")


class CtrlC:
    """While the `with` block runs, SIGINT raises KeyboardInterrupt only inside
    `allowed()` blocks and `decoding(...)` steps, or on a second press."""

    def __init__(self) -> None:
        self.pending = False
        self._allowed = False
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        # Python runs signal handlers in the main thread only; elsewhere (a library user's
        # thread) Ctrl-C is not this code's to handle.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, _signum: int, _frame: FrameType | None) -> None:
        if self._allowed or self.pending:
            raise KeyboardInterrupt
        self.pending = True
        print(
            "\nCtrl-C: stopping as soon as nothing is being written (Ctrl-C again: at once)",
            file=sys.stderr,
            flush=True,
        )

    @contextmanager
    def allowed(self) -> Iterator[None]:
        """A block that writes nothing: Ctrl-C raises in it at once, a pending one as it
        starts."""
        self._allowed = True
        try:
            if self.pending:
                raise KeyboardInterrupt
            yield
        finally:
            self._allowed = False

    def decoding(self, steps: Iterable[T]) -> Iterator[T]:
        """`steps`, each advanced inside `allowed()`."""
        iterator = iter(steps)
        while True:
            with self.allowed():
                step = next(iterator, _END)
            if step is _END:
                return
            yield step  # type: ignore[misc]


_END: Any = object()
