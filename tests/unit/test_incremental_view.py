"""The reused view (engine.view_memo) and the reused encodings (api.wire) give exactly what a build
from scratch gives, through random sequences of appends, flag changes, compactions, baselines,
profile changes and restarts (issue #15, item 2)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc.api.views import build_response, response_fields
from contextsvc.api.wire import WireCache, encode_build_response
from contextsvc.config import ProfileConfig, Settings
from contextsvc.core.messages import Message, Role, ToolCall
from contextsvc.core.profile import ProfileOverrides, view_shape
from contextsvc.core.session import ANONYMOUS
from contextsvc.core.tokens import CalibratedCounter
from contextsvc.engine import views as views_module
from contextsvc.engine.engine import Engine
from contextsvc.engine.state import EngineState
from contextsvc.engine.validation import IncomingMessage
from contextsvc.engine.views import BuiltView, stored_sequences
from contextsvc.errors import ContextError
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.stores.files import FilesStore
from contextsvc.summarizers.registry import build_summarizers
from tests.support.stores import TickingClock

#: what an assembled view says of itself, compared field by field with one built from scratch
_FIELDS = (
    "segments",
    "truncated",
    "estimate",
    "notices",
    "chars",
    "features",
    "last_sequence",
    "had_images",
    "sequences",
)

PROFILES = [
    ProfileOverrides(),
    ProfileOverrides(system_prompt="You are terse.", message_token_budget=60),
    ProfileOverrides(system_prompt="Другой промпт", context_window=4096),
    # Views far larger than one message's budget, most rows within it and long ones cut.
    ProfileOverrides(message_token_budget=300),
]

ops = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 6), st.integers(0, 400)),
    st.tuples(st.just("flags"), st.integers(0, 1 << 30), st.booleans()),
    st.tuples(st.just("compress"), st.just(0), st.just(0)),
    st.tuples(st.just("baseline"), st.integers(95, 130), st.just(0)),
    st.tuples(st.just("replica_baseline"), st.integers(95, 130), st.just(0)),
    st.tuples(st.just("profile"), st.integers(0, len(PROFILES) - 1), st.just(0)),
    st.tuples(st.just("restart"), st.just(0), st.just(0)),
)


def _turn(n: int, k: int, words: int) -> list[IncomingMessage]:
    text = " ".join(f"w{(k * 7 + i) % 97}" for i in range(words))
    out: list[Message] = []
    for i in range(n):
        step = (k + i) % 4
        if step == 0:
            out.append(Message(role=Role.USER, content=f"ask {k}.{i} {text}"))
        elif step == 1:
            out.append(
                Message(
                    role=Role.ASSISTANT,
                    content="calling",
                    tool_calls=(ToolCall(id=f"c{k}_{i}", name="read", arguments_json='{"p": 1}'),),
                    metadata={"step": i},
                )
            )
        elif step == 2:
            out.append(Message(role=Role.TOOL, tool_call_id=f"c{k}_{i - 1}", content=f"result {text}"))
        else:
            out.append(Message(role=Role.ASSISTANT, content=f"answer {k}.{i}"))
    return [IncomingMessage(m) for m in out]


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.settings = Settings(
            store="memory", profiles={"default": ProfileConfig(context_window=16384, output_reserve_tokens=512)}
        )
        self.wire = WireCache(1 << 20)
        self.profile = PROFILES[0]
        self.engine: Engine | None = None
        self.sid = ""

    async def open(self) -> Engine:
        store = FilesStore(self.root, self.settings, clock=TickingClock())
        await store.open()
        self.engine = Engine(
            store=store,
            bus=MemoryEventBus(retention=100),
            settings=self.settings,
            clock=TickingClock(),
            summarizers=build_summarizers(self.settings),
        )
        return self.engine

    async def close(self) -> None:
        assert self.engine is not None
        await self.engine.close()
        await self.engine.store.close()

    async def build(self) -> BuiltView:
        assert self.engine is not None
        return await self.engine.build_context(
            ANONYMOUS, self.sid, profile=self.profile, incoming=None, mid_turn=False, auto_compress=False
        )

    async def check(self) -> None:
        """The build through the memo and the caches equals a build from scratch."""
        engine = self.engine
        assert engine is not None
        try:
            built = await self.build()
        except ContextError:
            return  # too large for this profile: nothing is served, nothing to compare
        session = await engine.store.get_session(self.sid, caller=ANONYMOUS)
        effective = await engine._profile_for(session, self.profile)
        context = await engine.store.load_context(self.sid, caller=ANONYMOUS)
        counter = engine.accounting.counter(effective.model)
        # From scratch, as a build sees the state: a baseline of another shape is not used.
        state = EngineState.of(session).for_shape(view_shape(effective))
        fresh = engine.views._assemble(effective, context, None, state, counter)
        again = engine.views.assemble(effective, context, None, EngineState.of(session), session_id=self.sid)
        for field in _FIELDS:
            assert getattr(again, field) == getattr(fresh, field), field
        assert [m for m in again.rows] == [m for m in fresh.rows]
        # Which stored messages the view holds (recall's question), kept as rows were added.
        assert again.sequences == stored_sequences(again.rows)
        # What the wire cache may reuse of the view it extends is its first rows, the very objects.
        assert again.extends is None or all(map(operator.is_, again.extends, again.plain or []))
        assert built.estimate == fresh.estimate
        expected = build_response(dataclasses.replace(built, messages=fresh.plain or []))
        encoded = encode_build_response(built, self.sid, self.wire, response_fields(built))
        assert pb.BuildContextResponse.FromString(encoded.data) == expected
        # And a second encoding of the very same view (the whole-view hit) is the same bytes.
        assert encode_build_response(built, self.sid, self.wire, response_fields(built)).data == encoded.data
        await self.check_incoming(effective, context, state, counter)

    async def check_incoming(self, effective: Any, context: list[Message], state: EngineState, counter: Any) -> None:
        """A build with the user's next message (added to the stored rows' view) equals one from
        scratch; some of those messages exceed one message's budget (assembled whole, cut)."""
        engine = self.engine
        assert engine is not None
        words = (len(context) * 37) % 300
        text = " ".join(f"q{i % 89}" for i in range(words))
        incoming = Message(role=Role.USER, content=f"next {len(context)} {text}")
        fresh = engine.views._assemble(effective, context, incoming, state, counter)
        again = engine.views.assemble(effective, context, incoming, state, session_id=self.sid)
        for field in _FIELDS:
            assert getattr(again, field) == getattr(fresh, field), field
        assert again.rows == fresh.rows
        assert again.extends is None or all(map(operator.is_, again.extends, again.plain or []))
        try:
            built = await engine.build_context(
                ANONYMOUS,
                self.sid,
                profile=self.profile,
                incoming=IncomingMessage(incoming),
                mid_turn=False,
                auto_compress=False,
            )
        except ContextError:
            return
        assert built.estimate == fresh.estimate
        expected = build_response(dataclasses.replace(built, messages=fresh.plain or []))
        encoded = encode_build_response(built, self.sid, self.wire, response_fields(built))
        assert pb.BuildContextResponse.FromString(encoded.data) == expected

    async def step(self, op: tuple[str, int, Any], k: int) -> None:
        engine = self.engine
        assert engine is not None
        kind, a, b = op
        if kind == "append":
            await engine.append(ANONYMOUS, self.sid, _turn(a, k, b), request_id="", turn_complete=False)
        elif kind == "flags":
            rows = await engine.store.load_context(self.sid, caller=ANONYMOUS)
            if rows:
                pick = rows[a % len(rows)].sequence_number
                await engine.store.set_context_flags(self.sid, [pick], caller=ANONYMOUS, is_context=b)
        elif kind == "compress":
            with contextlib.suppress(ContextError):
                await engine.compress(ANONYMOUS, self.sid, profile=self.profile, note="test", dry_run=False)
        elif kind == "baseline":
            try:
                built = await self.build()
            except ContextError:
                return
            await engine.record_baseline(
                ANONYMOUS, self.sid, view_id=built.view_id, prompt_tokens=max(1, built.estimate.total * a // 100)
            )
        elif kind == "replica_baseline":
            # Another replica recorded a baseline: the state changes, this process's calibration
            # does not (it refreshes on its own clock), so only the baseline tells the views apart.
            try:
                built = await self.build()
            except ContextError:
                return
            session = await engine.store.get_session(self.sid, caller=ANONYMOUS)
            state = EngineState.of(session).with_baseline(
                max(1, built.estimate.total * a // 100),
                max((m.sequence_number for m in built_rows(built)), default=0),
                built.view_id,
            )
            await engine.store.update_state(self.sid, caller=ANONYMOUS, state=state.to_dict())
        elif kind == "profile":
            self.profile = PROFILES[a]
        elif kind == "restart":
            await self.close()
            await self.open()


async def _one_session(root: Path, overrides: ProfileOverrides) -> tuple[World, Any, Any]:
    """An open world with one empty session; its effective profile for ``overrides`` and counter."""
    world = World(root)
    engine = await world.open()
    world.sid = (await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})).id
    session = await engine.store.get_session(world.sid, caller=ANONYMOUS)
    effective = await engine._profile_for(session, overrides)
    return world, effective, engine.accounting.counter(effective.model)


async def _budgeted_session(root: Path) -> tuple[World, Engine, Any, CalibratedCounter]:
    """``_one_session`` on a profile whose one message's budget is 200 tokens."""
    world, effective, counter = await _one_session(root, ProfileOverrides(message_token_budget=200))
    assert world.engine is not None and isinstance(counter, CalibratedCounter)
    return world, world.engine, effective, counter


@contextlib.contextmanager
def _extensions() -> Any:
    """Each ``ViewService._extended`` call meanwhile, as whether it extended the kept view."""
    extended: list[bool] = []
    original = views_module.ViewService._extended

    def counting(self: Any, *args: Any) -> Any:
        out = original(self, *args)
        extended.append(out is not None)
        return out

    views_module.ViewService._extended = counting  # type: ignore[method-assign]
    try:
        yield extended
    finally:
        views_module.ViewService._extended = original  # type: ignore[method-assign]


def built_rows(built: BuiltView) -> list[Message]:
    return [vm.message for vm in built.messages]


async def _run(steps: list[tuple[str, int, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        world = World(Path(tmp))
        engine = await world.open()
        world.sid = (await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})).id
        await engine.append(ANONYMOUS, world.sid, _turn(8, 0, 20), request_id="", turn_complete=False)
        try:
            await world.check()
            for k, op in enumerate(steps, start=1):
                await world.step(op, k)
                await world.check()
        finally:
            await world.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=14))
def test_reused_views_equal_views_built_from_scratch(steps: list[tuple[str, int, Any]]) -> None:
    asyncio.run(_run(steps))


def test_a_steady_session_reuses_its_view_and_its_encoding() -> None:
    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            world = World(Path(tmp))
            engine = await world.open()
            world.sid = (await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})).id
            await engine.append(ANONYMOUS, world.sid, _turn(40, 0, 20), request_id="", turn_complete=False)
            first = await world.build()
            second = await world.build()
            assert second.messages is first.messages  # the reused view: no per-message work
            encode_build_response(first, world.sid, world.wire, response_fields(first))
            hits = world.wire.stats()["hits"]
            encode_build_response(second, world.sid, world.wire, response_fields(second))
            assert world.wire.stats()["hits"] == hits + 1  # one whole-view hit, not 40 row hits
            await engine.append(ANONYMOUS, world.sid, _turn(2, 40, 5), request_id="", turn_complete=False)
            third = await world.build()
            assert third.messages is not first.messages
            assert len(third.messages) == len(first.messages) + 2
            await world.close()

    asyncio.run(run())


def test_an_extended_view_prices_the_rows_its_baseline_did_not_count_as_a_full_pass_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An extended view finds the rows newer than the baseline without a pass over the view
    (``engine.views._since``): a row without a sequence number counts as new, rows the baseline
    counted do not, and a baseline older than the kept view falls back to the pass."""

    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            world, effective, counter = await _one_session(Path(tmp), ProfileOverrides())
            engine = world.engine
            assert engine is not None
            numbered = [
                Message(role=Role.USER if i % 2 else Role.ASSISTANT, content=f"turn {i} " * 9, sequence_number=i)
                for i in range(1, 9)
            ]
            loose = Message(role=Role.USER, content="a row the store did not number " * 3)  # sequence 0
            before = [*numbered[:4], loose, numbered[4]]  # no call left open at its end
            added = [numbered[6], numbered[7]]  # a user message, then a reply
            found: list[list[Message] | None] = []
            since = views_module._since
            monkeypatch.setattr(views_module, "_since", lambda *a: found.append(since(*a)) or found[-1])
            for last in (5, 3):  # the kept view's newest row, then a baseline older than it
                sid = f"{world.sid}-{last}"
                state = EngineState().with_baseline(400, last, "v")
                kept = engine.views.assemble(effective, before, None, state, session_id=sid)
                assert kept.parts is not None and kept.unnumbered == (loose,)
                grown = engine.views.assemble(effective, [*before, *added], None, state, session_id=sid)
                fresh = engine.views._assemble(effective, [*before, *added], None, state, counter)
                assert grown.rows == fresh.rows and grown.parts is not None  # extended, not rebuilt
                assert grown.estimate == fresh.estimate
                assert grown.unnumbered == (loose,)
            # The newest-row baseline's new rows found without a pass; the older one's by the pass.
            assert found == [[loose, *added], None]
            await world.close()

    asyncio.run(run())


def test_a_view_larger_than_one_message_budget_is_extended_while_no_row_exceeds_it() -> None:
    """A session's view is many times one message's budget (the default profile's budget is a
    sixth of the window), yet no row alone exceeds it: builds after an append extend the kept
    view instead of assembling it again, and give what a build from scratch gives. A row over
    the budget (a long tool result) is cut as from scratch, and the view still grows by extension;
    another calibration cuts it again where a build from scratch would."""

    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            world, engine, effective, counter = await _budgeted_session(Path(tmp))
            short = [Message(role=Role.USER if i % 2 else Role.ASSISTANT, content=f"turn {i} " * 20) for i in range(45)]
            rows = [dataclasses.replace(m, sequence_number=i + 1) for i, m in enumerate(short)]
            state = EngineState()

            def same(got: Any, want: Any) -> None:
                for field in ("rows", "truncated", "notices", "estimate", "chars", "features", "segments"):
                    assert getattr(got, field) == getattr(want, field), field
                assert [vm.message for vm in got.plain] == [vm.message for vm in want.plain]
                assert [(vm.truncated, vm.stored) for vm in got.plain] == [
                    (vm.truncated, vm.stored) for vm in want.plain
                ]
                assert got.extends is None or all(map(operator.is_, got.extends, got.plain))

            with _extensions() as extensions:
                kept = engine.views.assemble(effective, rows[:39], None, state, session_id=world.sid)
                assert counter.count_messages(kept.rows) > 5 * effective.per_message_budget
                assert not any(kept.truncated) and kept.parts is not None
                grown = engine.views.assemble(effective, rows[:41], None, state, session_id=world.sid)
                assert sum(extensions) == 1  # the two rows appended (a question, its answer) were measured alone
                same(grown, engine.views._assemble(effective, rows[:41], None, state, counter))
                assert not any(grown.truncated) and len(grown.rows) == len(kept.rows) + 2

                long = Message(role=Role.USER, content="a long tool output line " * 200, sequence_number=42)
                with_long = [*rows[:41], long]
                cut = engine.views.assemble(effective, with_long, None, state, session_id=world.sid)
                assert sum(extensions) == 2  # extended: the new row alone was priced, and cut
                fresh = engine.views._assemble(effective, with_long, None, state, counter)
                assert cut.truncated == fresh.truncated == [False] * len(grown.rows) + [True]
                same(cut, fresh)
                after = [
                    *with_long,
                    *(dataclasses.replace(m, sequence_number=43 + i) for i, m in enumerate(short[1:3])),
                ]
                later = engine.views.assemble(effective, after, None, state, session_id=world.sid)
                assert sum(extensions) == 3 and later.rows[len(cut.rows) - 1] is cut.rows[-1]  # the cut kept as it was
                same(later, engine.views._assemble(effective, after, None, state, counter))

                # A new fit (dearer text) moves where the long row's cut falls: an extension or a
                # re-pricing under it cuts that row again, exactly as a build from scratch does.
                calibration = counter.calibration
                dearer = CalibratedCounter(
                    dataclasses.replace(calibration, weights=tuple(w * 1.3 for w in calibration.weights))
                )
                again = engine.views._repriced(effective, later, state, dearer)
                assert again is not None
                want = engine.views._assemble(effective, after, None, state, dearer)
                same(again, want)
                assert again.rows[len(cut.rows) - 1] != later.rows[len(cut.rows) - 1]
                more = [*after, *(dataclasses.replace(m, sequence_number=45 + i) for i, m in enumerate(short[3:5]))]
                grown_again = engine.views._extended(effective, later, after, more[len(after) :], state, dearer)
                assert grown_again is not None
                same(grown_again, engine.views._assemble(effective, more, None, state, dearer))
            await world.close()

    asyncio.run(run())


def test_a_view_growing_past_one_message_budget_is_extended_all_the_way() -> None:
    """While the whole view fits one message's budget, a build takes the view's total as the bound
    of every row's features (no per-column maxima); extensions carry that bound on with the rows
    they add, so the view is extended on every append, also past the point where the whole no
    longer fits. Every build gives what a build from scratch gives."""

    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            world, engine, effective, counter = await _budgeted_session(Path(tmp))
            rows = [
                Message(
                    role=Role.USER if i % 2 == 0 else Role.ASSISTANT,
                    content=f"step {i} of the plan " * (8 if i < 2 else 1),  # the first two rows longest
                    sequence_number=i + 1,
                )
                for i in range(40)
            ]
            state = EngineState()
            with _extensions() as extended:
                fits: list[bool] = []
                for n in range(2, len(rows) + 1, 2):  # a question and its answer at a time
                    got = engine.views.assemble(effective, rows[:n], None, state, session_id=world.sid)
                    want = engine.views._assemble(effective, rows[:n], None, state, counter)
                    for field in ("rows", "truncated", "notices", "estimate", "chars", "features", "segments"):
                        assert getattr(got, field) == getattr(want, field), (n, field)
                    assert not any(got.truncated)
                    fits.append(counter.count_messages(got.rows) <= effective.per_message_budget)
                # The bound covers the first rows too, for any later calibration: one that prices
                # them (not the later, shorter ones) over the budget re-prices nothing as it was.
                calibration = counter.calibration
                dearer = CalibratedCounter(
                    dataclasses.replace(calibration, weights=tuple(w * 6 for w in calibration.weights))
                )
                want = engine.views._assemble(effective, rows, None, state, dearer)
                assert want.truncated[:2] == [True, True] and not any(want.truncated[2:])
                again = engine.views._repriced(effective, got, state, dearer)
                assert again is None or again.rows == want.rows
            crossed = fits.index(False)  # the first build whose whole no longer fits
            assert crossed >= 2 and not any(fits[crossed:])
            # The first build has nothing to extend; every later one extends, across the crossing.
            assert len(extended) == len(fits) - 1 and all(extended)
            await world.close()

    asyncio.run(run())
