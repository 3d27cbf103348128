"""Ctrl-C in `run` lands in decoding, never in a database write (producer/interrupts.py).
Real SIGINTs sent to this process."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, event, text

from producer.interrupts import CtrlC
from workers.db import make_engine


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_outside_decoding_waits_for_the_next_step() -> None:
    advanced: list[int] = []

    def steps() -> Iterator[int]:
        for i in range(3):
            advanced.append(i)
            yield i

    with CtrlC() as guard:
        decoding = guard.decoding(steps())
        assert next(decoding) == 0
        ctrl_c()  # between steps: a database write would be running here
        assert guard.pending
        with pytest.raises(KeyboardInterrupt):
            next(decoding)
    assert advanced == [0]  # raised before the next step started


def test_ctrl_c_outside_an_allowed_block_says_it_waits(capfd: pytest.CaptureFixture[str]) -> None:
    with CtrlC() as guard:
        ctrl_c()  # a database write would be running here
        assert "Ctrl-C: stopping as soon as nothing is being written" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt), guard.allowed():
            raise AssertionError("a pending Ctrl-C raises as the block starts")


def test_ctrl_c_inside_an_allowed_block_raises_at_once() -> None:
    with CtrlC() as guard:
        with pytest.raises(KeyboardInterrupt), guard.allowed():  # loading a model, say
            ctrl_c()
            while True:
                pass
        assert not guard.pending
        ctrl_c()  # after the block: waits again
        assert guard.pending


def test_ctrl_c_during_a_step_stops_it_at_once() -> None:
    def steps() -> Iterator[int]:
        ctrl_c()
        while True:  # a long decoding step
            pass
        yield 0

    with CtrlC() as guard, pytest.raises(KeyboardInterrupt):
        next(guard.decoding(steps()))


def test_a_second_ctrl_c_does_not_wait() -> None:
    with CtrlC() as guard:
        ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
    assert guard.pending


def test_the_previous_handler_is_back_afterwards() -> None:
    before = signal.getsignal(signal.SIGINT)
    with CtrlC():
        assert signal.getsignal(signal.SIGINT) != before
    assert signal.getsignal(signal.SIGINT) == before


def test_outside_the_main_thread_it_leaves_signals_alone() -> None:
    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def in_a_thread() -> None:
        with CtrlC() as guard, guard.allowed():
            seen.extend(guard.decoding([1, 2]))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [1, 2]
    assert signal.getsignal(signal.SIGINT) == before


def short_busy_timeout(engine: Engine) -> None:
    # make_engine's pragmas run first (30 s); a lock left behind then fails in 1 s.
    event.listen(engine, "connect", lambda conn, _record: conn.execute("PRAGMA busy_timeout=1000"))


def test_ctrl_c_at_any_moment_leaves_the_database_writable(tmp_path: Path) -> None:
    """The failure this guards against: SQLite writes alternating with decoding steps and
    Ctrl-C at a random moment; the write that puts the work back must go through.
    Unguarded (the default handler), 300 trials leave the lock held in most runs."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    short_busy_timeout(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE rows (n INTEGER)"))
    rng = random.Random(0)

    def steps() -> Iterator[int]:
        while True:
            yield rng.randrange(1, 1000)  # a (short) decoding step: most time goes to writes

    for _ in range(300):
        previous_alarm = signal.signal(signal.SIGALRM, lambda *_: ctrl_c())
        try:
            with CtrlC() as guard, pytest.raises(KeyboardInterrupt):
                # armed inside the guard: on a loaded machine an alarm armed before it could
                # fire before it was entered, a Ctrl-C outside the test's reach
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0005, 0.01))
                for n in guard.decoding(steps()):
                    with engine.begin() as conn:
                        conn.execute(text("INSERT INTO rows VALUES (:n)"), {"n": n})
                        conn.execute(text("INSERT INTO rows VALUES (:n)"), {"n": -n})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_alarm)
        with engine.begin() as conn:  # what run does after Ctrl-C: put the shard back
            conn.execute(text("INSERT INTO rows VALUES (0)"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT sum(n) FROM rows")).scalar() == 0  # pairs whole
    engine.dispose()
