"""The engine: one object the API adapter talks to, composed of the use-case services."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from contextsvc.config import Settings
from contextsvc.core.messages import Message
from contextsvc.core.profile import ProfileOverrides, resolve_profile
from contextsvc.core.session import Principal
from contextsvc.core.tokens import TokenEstimate
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.engine.sessions import AppendOutcome, SessionService
from contextsvc.engine.validation import IncomingMessage, require_session_id
from contextsvc.engine.views import BaselineResult, BuiltView, ViewService
from contextsvc.errors import Unimplemented
from contextsvc.ports import Clock, EventBus, SessionStore

COMPRESSION_PENDING = (
    "arrives with the compression capability (planner, summarizers, raw history index); "
    "until then the context is never compressed"
)


@dataclass(slots=True, frozen=True)
class HistoryChunk:
    text: str
    first_sequence: int
    last_sequence: int
    start_time: datetime | None
    end_time: datetime | None
    breadcrumbs: tuple[str, ...]
    score: float


class Engine:
    def __init__(self, *, store: SessionStore, bus: EventBus, settings: Settings, clock: Clock):
        self.store = store
        self.bus = bus
        self.settings = settings
        self.accounting = TokenAccounting(store, settings)
        self.sessions = SessionService(store=store, bus=bus, settings=settings, clock=clock, accounting=self.accounting)
        self.views = ViewService(store=store, bus=bus, settings=settings, clock=clock, accounting=self.accounting)

    async def append(
        self,
        caller: Principal,
        session_id: str,
        incoming: Sequence[IncomingMessage],
        *,
        request_id: str,
        turn_complete: bool,
    ) -> AppendOutcome:
        return await self.sessions.append(
            caller, session_id, incoming, request_id=request_id, turn_complete=turn_complete
        )

    async def build_context(
        self,
        caller: Principal,
        session_id: str,
        *,
        profile: ProfileOverrides,
        incoming: IncomingMessage | None,
        mid_turn: bool,
        auto_compress: bool,
    ) -> BuiltView:
        sid = require_session_id(session_id)
        session = await self.store.get_session(sid, caller=caller)
        effective = resolve_profile(self.settings, session.profile_id, profile)
        await self.accounting.ensure_loaded(effective.model)
        message, data = await self.views.prepare_incoming(incoming, "incoming")
        return await self.views.build(caller, session, effective, message, data)

    async def estimate_tokens(
        self,
        caller: Principal,
        *,
        model: str,
        messages: Sequence[IncomingMessage],
        session_id: str,
        profile: ProfileOverrides,
    ) -> TokenEstimate:
        if session_id and messages:
            from contextsvc.errors import InvalidArgument

            raise InvalidArgument.field("messages", "give either messages or a session_id, not both")
        if session_id:
            return await self.views.estimate_session(caller, session_id, model=model, overrides=profile)
        effective = resolve_profile(self.settings, "", profile)
        return await self.views.estimate_messages(model=model, profile=effective, messages=messages)

    async def record_baseline(
        self, caller: Principal, session_id: str, *, view_id: str, prompt_tokens: int
    ) -> BaselineResult:
        return await self.views.record_baseline(caller, session_id, view_id=view_id, prompt_tokens=prompt_tokens)

    async def compress(
        self, caller: Principal, session_id: str, *, profile: ProfileOverrides, note: str, dry_run: bool
    ) -> object:
        raise Unimplemented(f"Compress {COMPRESSION_PENDING}")

    async def search_history(self, caller: Principal, session_id: str, *, query: str, limit: int) -> list[HistoryChunk]:
        raise Unimplemented(f"SearchHistory {COMPRESSION_PENDING}")

    async def expand_summary(self, caller: Principal, session_id: str, *, sequence_number: int) -> list[Message]:
        raise Unimplemented(f"ExpandSummary {COMPRESSION_PENDING}")

    async def close(self) -> None:
        """Stop background work (post-turn workers arrive with compression)."""
