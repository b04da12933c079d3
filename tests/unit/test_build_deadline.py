"""A build's one deadline (``engine._left``): every wait of the lock gets what is left of it."""

from __future__ import annotations

import asyncio

from contextsvc.engine.engine import _left


async def test_what_is_left_shrinks_as_the_build_goes_on_and_never_reaches_zero() -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.3
    first = _left(deadline, loop)
    await asyncio.sleep(0.05)
    second = _left(deadline, loop)
    assert 0 < second < first <= 0.3  # not one answer kept for the whole build
    assert _left(loop.time() - 1.0, loop) == 0.001  # past it: a held lock is refused at once
