"""Ctrl-C in `run` stops decoding, never a database write.

Python raises KeyboardInterrupt at whatever line runs when the signal comes. Inside a
write to SQLite that can leave the interrupted connection holding the write lock (its
statement is still referenced by the exception's frames), and the write that puts the
interrupted shard back to 'queued' then waits on it until "database is locked": the job
ends with an error instead of the resume message. So while `run` decodes, Ctrl-C only
marks itself pending, and it is raised where the decoder computes: at once when it comes
during a decoding step, else as the next step starts (one that comes while the job's
last rows are stored lets the job finish). A second Ctrl-C raises wherever it lands, for
a user who will not wait (a long head-training round, a stuck database).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Iterator
from types import FrameType, TracebackType
from typing import Any, TypeVar

T = TypeVar("T")


class CtrlC:
    """While the `with` block runs, SIGINT raises KeyboardInterrupt only inside
    `decoding(...)` iterators, or on a second press."""

    def __init__(self) -> None:
        self.pending = False
        self._decoding = False
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, _signum: int, _frame: FrameType | None) -> None:
        if self._decoding or self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def decoding(self, steps: Iterable[T]) -> Iterator[T]:
        """`steps`, each advanced with Ctrl-C allowed; a pending one raises before the
        next step starts."""
        iterator = iter(steps)
        while True:
            self._decoding = True
            try:
                if self.pending:
                    raise KeyboardInterrupt
                step = next(iterator)
            except StopIteration:
                return
            finally:
                self._decoding = False
            yield step
