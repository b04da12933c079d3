"""The profile a session remembers: the inline overrides of its newest BuildContext, kept in its
engine state, so work without a request of its own (the post-turn check, an append's pinned cap and
window share) judges the session by the window and model its runtime actually uses."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, cast

from contextsvc.config import Settings
from contextsvc.core.profile import (
    NO_OVERRIDES,
    CompressionOverrides,
    EffectiveProfile,
    ProfileOverrides,
    RecallOverrides,
    resolve_profile,
)
from contextsvc.core.session import SessionInfo
from contextsvc.errors import ContextError

#: engine-state key of the remembered overrides
PROFILE_KEY = "profile"


def session_profile(settings: Settings, session: SessionInfo) -> EffectiveProfile:
    """The profile the session's appends price with: the one its builds use (its named profile
    with the overrides it remembers), else the named one alone (remembered overrides the settings
    no longer accept must not fail an append), else the default profile: a session whose named
    profile left the settings still stores what its agent appends (its builds say what is wrong,
    ``resolve_profile``); an append refused for it lost the agent's turn."""
    try:
        return resolve_profile(settings, session.profile_id, remembered_overrides(session))
    except ContextError:
        pass
    try:
        return resolve_profile(settings, session.profile_id, None)
    except ContextError:
        return resolve_profile(settings, "", None)


def counted_budget(settings: Settings, session: SessionInfo) -> int:
    """The per-message budget the session's appends count long rows at (``context_share``)."""
    return session_profile(settings, session).per_message_budget


def remembered_stored(session: SessionInfo) -> Any:
    """The overrides ``session`` remembers, as its state stores them (None: none). Read from the
    state mapping itself: an append compares it on every call, without parsing the state."""
    return session.state.get(PROFILE_KEY)


def remembered_overrides(session: SessionInfo) -> ProfileOverrides | None:
    """The overrides ``session`` remembers, or None (none remembered, or unreadable)."""
    saved = remembered_stored(session)
    return overrides_from_dict(saved) if isinstance(saved, dict) else None


@functools.cache
def stored_none() -> dict[str, Any]:
    """``as_stored(NO_OVERRIDES)``, without hashing the overrides on every build."""
    return as_stored(NO_OVERRIDES)


@functools.lru_cache(maxsize=256)
def as_stored(overrides: ProfileOverrides) -> dict[str, Any]:
    """``overrides`` as the engine state stores them (JSON: tuples come back as lists), computed
    once per distinct overrides (they are frozen). Shared: compare it, copy it before storing it.

    Fields left unset (None, empty lists) are left out, as ``overrides_from_dict`` reads a missing
    field as unset: the profile a session remembers costs a few bytes instead of ~25 nulls in every
    session's state, its log and the files store's start-up index (issue #9's resident memory)."""
    return cast(dict[str, Any], _without_unset(json.loads(json.dumps(dataclasses.asdict(overrides)))))


def _without_unset(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    kept = {k: _without_unset(v) for k, v in value.items()}
    return {k: v for k, v in kept.items() if v is not None and v != [] and v != {}}


def overrides_from_dict(d: dict[str, Any]) -> ProfileOverrides | None:
    try:
        c = d.get("compression") or {}
        recall = RecallOverrides(**(d.get("recall") or {}))
        compression = CompressionOverrides(
            **{
                **c,
                "strategies": tuple(c.get("strategies") or ()),
                "critical_tool_names": tuple(c.get("critical_tool_names") or ()),
            }
        )
        return ProfileOverrides(**{**d, "compression": compression, "recall": recall})
    except TypeError:
        return None
