"""A test that must not hang: a deadline turns a call that runs on past it into a failure."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def deadline(seconds: int = 5) -> Iterator[None]:
    """Fail with ``AssertionError`` if the block runs ``seconds`` (SIGALRM: the main thread only;
    Python's ``re`` checks for signals while it searches, so a runaway pattern is stopped too)."""

    def expired(signum: int, frame: object) -> None:
        raise AssertionError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
