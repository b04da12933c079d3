"""A turn resolves its session's profile several times; the engine checks a resolved profile's
summarizer and strategies once, and the compactor computes its bounds once, for the last profile
object they saw. Another profile is checked and bounded again."""

from __future__ import annotations

import dataclasses

import pytest

from contextsvc.config import ProfileConfig, Settings
from contextsvc.core.profile import CompressionOverrides, ProfileOverrides, resolve_profile
from contextsvc.core.session import ANONYMOUS
from contextsvc.errors import InvalidArgument
from contextsvc.stores.memory import MemoryStore
from tests.support.engines import make_engine


def _settings() -> Settings:
    return Settings(
        store="memory",
        profiles={"default": ProfileConfig(context_window=100_000), "small": ProfileConfig(context_window=8_192)},
    )


async def test_bounds_are_those_of_the_profile_asked_about() -> None:
    settings = _settings()
    engine = make_engine(MemoryStore(settings), settings)
    big, small = resolve_profile(settings, "default", None), resolve_profile(settings, "small", None)
    fresh = make_engine(MemoryStore(settings), settings).compactor
    first = engine.compactor.bounds(big)
    assert engine.compactor.bounds(big) is first  # the same profile object: not computed again
    assert engine.compactor.bounds(small) == fresh.bounds(small) != first
    assert engine.compactor.bounds(big) == first
    # An equal profile that is another object is computed, not taken for the last one.
    copy = dataclasses.replace(small, context_window=50_000)
    assert engine.compactor.bounds(copy) == fresh.bounds(copy) != fresh.bounds(small)


async def test_a_profile_with_an_unknown_strategy_or_summarizer_is_refused_after_a_good_one() -> None:
    settings = _settings()
    engine = make_engine(MemoryStore(settings), settings)
    session = await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})
    good = await engine._profile_for(session, None)
    assert await engine._profile_for(session, None) is good
    with pytest.raises(InvalidArgument, match="unknown strategy 'summarise'"):
        await engine._profile_for(
            session, ProfileOverrides(compression=CompressionOverrides(strategies=("summarise",)))
        )
    with pytest.raises(InvalidArgument):
        await engine._profile_for(session, ProfileOverrides(compression=CompressionOverrides(summarizer="nope")))
    assert await engine._profile_for(session, None) is good  # still served after the refusals
