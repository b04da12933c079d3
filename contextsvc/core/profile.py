"""Profiles: what a request may override, and the effective profile a build uses.

Precedence: the request's inline fields, then the named server profile, then the defaults of
the settings object.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache

from contextsvc.config import CompressionDefaults, ProfileConfig, RecallDefaults, Settings
from contextsvc.errors import FailedPrecondition, InvalidArgument, quoted


@dataclass(slots=True, frozen=True)
class CompressionOverrides:
    enabled: bool | None = None
    threshold: float | None = None
    target: float | None = None
    keep_recent: int | None = None
    summary_max_tokens: int | None = None
    summary_prompt: str | None = None
    summarizer: str | None = None
    strategies: tuple[str, ...] = ()
    critical_tool_names: tuple[str, ...] = ()
    hard_truncate_fallback: bool | None = None


@dataclass(slots=True, frozen=True)
class RecallOverrides:
    enabled: bool | None = None
    max_excerpts: int | None = None
    max_tokens: int | None = None
    min_score: float | None = None


@dataclass(slots=True, frozen=True)
class ProfileOverrides:
    profile_id: str = ""
    model: str | None = None
    context_window: int | None = None
    system_prompt: str | None = None
    vision: bool | None = None
    output_reserve_tokens: int | None = None
    message_token_budget: int | None = None
    compression: CompressionOverrides = field(default_factory=CompressionOverrides)
    recall: RecallOverrides = field(default_factory=RecallOverrides)


@dataclass(slots=True, frozen=True)
class EffectiveProfile:
    profile_id: str
    model: str
    context_window: int
    system_prompt: str
    vision: bool
    output_reserve_tokens: int
    message_token_budget: int
    compression: CompressionDefaults
    recall: RecallDefaults = field(default_factory=RecallDefaults)

    @property
    def output_reserve(self) -> int:
        """The answer's headroom, capped at a quarter of the window so small windows stay usable."""
        return min(self.output_reserve_tokens, self.context_window // 4)

    @property
    def per_message_budget(self) -> int:
        return self.message_token_budget or self.context_window // 6


def view_shape(profile: EffectiveProfile) -> str:
    """What a view's count depends on besides its stored rows, as a short digest: the model that
    counts it, the system prompt sent first, whether images go with it, and the per-message
    budget rows are cut to. A baseline (a real count of one view) anchors later views of the same
    shape only: after a change of any of these, the next build is priced afresh."""
    return _shape(profile.model, profile.system_prompt, profile.vision, profile.per_message_budget)


@lru_cache(maxsize=256)
def _shape(model: str, system_prompt: str, vision: bool, budget: int) -> str:
    text = "\0".join((model, system_prompt, "v" if vision else "", str(budget)))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


#: No overrides (a request without a profile): one shared object, so the hot path recognizes it by
#: identity instead of hashing a nested frozen dataclass field by field on every call.
NO_OVERRIDES = ProfileOverrides()


def resolve_profile(
    settings: Settings, session_profile_id: str, overrides: ProfileOverrides | None, *, remembered: bool = False
) -> EffectiveProfile:
    """Merge a request's overrides onto the named profile (request's, else the session's).
    ``remembered``: the overrides are the ones the session remembers from earlier builds, not the
    request's own (an unknown name in them is the session's state, not the request's error)."""
    o = overrides or NO_OVERRIDES
    name = o.profile_id or session_profile_id or settings.default_profile
    limit = settings.limits.max_model_chars
    if o.model is not None and len(o.model) > limit:
        raise InvalidArgument.field("profile.model", f"exceeds {limit} characters")
    base = settings.profile(name)
    if base is None:
        if remembered or (not o.profile_id and session_profile_id):
            # The request named no profile: the session's own (or the one its builds named before)
            # is gone from the settings (an operator removed or renamed it). Not the request's
            # fault: the session cannot be built as it was.
            raise FailedPrecondition(
                f"the session's profile {quoted(name)} is not in this server's settings (removed or renamed since "
                "the session was created): restore it, or name a configured profile in profile.profile_id",
                reason="UNKNOWN_PROFILE",
                metadata={"profile_id": name},
            )
        raise InvalidArgument.field("profile.profile_id", f"unknown profile {quoted(name)}", reason="UNKNOWN_PROFILE")
    # Every build resolves its profile: the merge (a pydantic dump and validation) is done once per
    # (profile, overrides) and reused while the named profile is the same object.
    key = (name, None if o is NO_OVERRIDES else o)
    hit = _MERGED.get(key)
    if hit is not None and hit[0] is base:
        return hit[1]
    _check_text(o)  # once per distinct overrides: a cached merge was checked
    merged = _merge(name, base, o)
    if len(_MERGED) >= _MERGED_MAX:
        _MERGED.clear()
    _MERGED[key] = (base, merged)
    return merged


def _check_text(o: ProfileOverrides) -> None:
    """NUL is no text character, and PostgreSQL cannot store it (a build remembers its profile and
    prices its model's calibration): refused on every store alike, naming the field."""
    for name, value in (
        ("profile.model", o.model),
        ("profile.system_prompt", o.system_prompt),
        ("profile.compression.summary_prompt", o.compression.summary_prompt),
    ):
        if value is not None and "\x00" in value:
            raise InvalidArgument.field(name, "contains a NUL character")


#: (profile name, overrides) -> (the named profile it was merged onto, the effective profile).
#: Overrides are frozen and hashable; a handful of distinct ones is the common case.
_MERGED: dict[tuple[str, ProfileOverrides | None], tuple[ProfileConfig, EffectiveProfile]] = {}
_MERGED_MAX = 256


def _merge(name: str, base: ProfileConfig, o: ProfileOverrides) -> EffectiveProfile:
    c = o.compression
    updates = {
        key: value
        for key, value in (
            ("enabled", c.enabled),
            ("threshold", c.threshold),
            ("target", c.target),
            ("keep_recent", c.keep_recent),
            ("summary_max_tokens", c.summary_max_tokens),
            ("summary_prompt", c.summary_prompt),
            ("summarizer", c.summarizer),
            ("strategies", list(c.strategies) or None),
            ("critical_tool_names", list(c.critical_tool_names) or None),
            ("hard_truncate_fallback", c.hard_truncate_fallback),
        )
        if value is not None
    }
    try:
        compression = CompressionDefaults.model_validate({**base.compression.model_dump(), **updates})
    except ValueError as exc:
        raise InvalidArgument.field("profile.compression", _first_error(exc)) from None
    r = o.recall
    recall_updates = {
        key: value
        for key, value in (
            ("enabled", r.enabled),
            ("max_excerpts", r.max_excerpts),
            ("max_tokens", r.max_tokens),
            ("min_score", r.min_score),
        )
        if value is not None
    }
    try:
        recall = RecallDefaults.model_validate({**base.recall.model_dump(), **recall_updates})
    except ValueError as exc:
        raise InvalidArgument.field("profile.recall", _first_error(exc)) from None
    window = o.context_window if o.context_window is not None else base.context_window
    if window < 256:
        raise InvalidArgument.field("profile.context_window", "must be at least 256 tokens")
    reserve = o.output_reserve_tokens if o.output_reserve_tokens is not None else base.output_reserve_tokens
    budget = o.message_token_budget if o.message_token_budget is not None else base.message_token_budget
    if reserve < 0:
        raise InvalidArgument.field("profile.output_reserve_tokens", "must not be negative")
    if budget < 0:
        raise InvalidArgument.field("profile.message_token_budget", "must not be negative")
    return EffectiveProfile(
        profile_id=name,
        model=o.model or base.model,
        context_window=window,
        system_prompt=o.system_prompt if o.system_prompt is not None else base.system_prompt,
        vision=o.vision if o.vision is not None else base.vision,
        output_reserve_tokens=reserve,
        message_token_budget=budget,
        compression=compression,
        recall=recall,
    )


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return f"{loc}: {first.get('msg', exc)}" if loc else str(first.get("msg", exc))
    return str(exc)
