"""Many replicas on one PostgreSQL database (DESIGN §5.8), end to end.

Real ``contextsvc serve --store postgres://…`` processes on loopback, generated sync stubs in
threads, a fresh database per test. What the tests check, each against the database itself where
it can: sequence numbers from 30 clients through 3 replicas; StreamEvents on one replica seeing
what the others cause, and resuming without gaps or duplicates; PostgreSQL stopped under load
(UNAVAILABLE, then recovery, nothing acknowledged lost); the schema created once and left alone;
one compaction per crossing when replicas race for it, and no reader ever seeing half of one.

Every wait is bounded; every process started here is stopped by its pid.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import events_pb2
from contextsvc._gen.v1 import resources_pb2 as r
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from contextsvc.stores.postgres.schema import MIGRATIONS
from tests.support.fake_llm import FakeLLM
from tests.support.postgres import PgCluster, create_database, drop_database, postgres_dsn, query
from tests.support.rpc import all_messages, assistant, tool, user
from tests.support.server import ServerProcess

__all__ = ["postgres_dsn"]  # the session-scoped cluster fixture

pytestmark = pytest.mark.e2e

CALL_S = 30.0  # deadline of one RPC
WAIT_S = 30.0  # bound on any wait for something to happen
WINDOW = 8192

#: Quick reconnects and polls, so outages and notifications settle in well under a second.
PG_ENV = {
    "CONTEXTSVC_POSTGRES__CONNECT_TIMEOUT_SECONDS": "2",
    "CONTEXTSVC_POSTGRES__ACQUIRE_TIMEOUT_SECONDS": "5",
    "CONTEXTSVC_POSTGRES__EVENT_POLL_SECONDS": "0.5",
    "CONTEXTSVC_POSTGRES__RECONNECT_MAX_SECONDS": "0.5",
}


# -- fixtures and helpers ---------------------------------------------------------------------


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def database(postgres_dsn: str) -> Iterator[str]:
    """A DSN of a new, empty database, dropped after the test."""
    dsn = run(create_database(postgres_dsn))
    try:
        yield dsn
    finally:
        run(drop_database(postgres_dsn, dsn))


@dataclass
class Replicas:
    procs: list[ServerProcess]
    channels: list[grpc.Channel] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.channels = [grpc.insecure_channel(p.address) for p in self.procs]
        self.stubs = [ContextServiceStub(ch) for ch in self.channels]

    def stop(self) -> None:
        for ch in self.channels:
            ch.close()
        for proc in self.procs:
            proc.kill()


def start_replicas(dsn: str, count: int, env: dict[str, str] | None = None) -> Replicas:
    """``count`` servers started at once on the same database (they migrate it concurrently)."""
    procs = [ServerProcess(dsn, env={**PG_ENV, **(env or {})}) for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(p.start) for p in procs]
        errors = [f.exception() for f in futures]
    if any(errors):
        for p in procs:
            p.kill()
        raise RuntimeError(f"a replica did not start: {next(e for e in errors if e)}")
    return Replicas(procs)


@pytest.fixture
def three(database: str) -> Iterator[Replicas]:
    replicas = start_replicas(database, 3)
    try:
        yield replicas
    finally:
        replicas.stop()


def _profile(summarizer: str = "extractive", **compression: Any) -> r.Profile:
    compression.setdefault("strategies", ["summarize"])
    return r.Profile(
        model="m",
        context_window=WINDOW,
        system_prompt="You are a coding agent.",
        compression=r.CompressionSettings(summarizer=summarizer, **compression),
    )


def _turns(first: int, count: int) -> list[r.Message]:
    """Agent turns with a tool-call group and a sizeable result each."""
    batch: list[r.Message] = []
    for t in range(first, first + count):
        batch += [
            user(f"turn {t}: inspect module_{t}.py"),
            assistant("", [(f"c{t}", "read_file")]),
            tool(f"c{t}", f"def handler_{t}():\n    return {t}\n" * 20),
            assistant(f"module_{t}.py defines handler_{t}"),
        ]
    return batch


def append(stub: ContextServiceStub, sid: str, messages: list[r.Message], **kw: Any) -> list[int]:
    resp = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=messages, **kw), timeout=CALL_S)
    return list(resp.sequence_numbers)


def eventually(check: Callable[[], Any], what: str, within: float = WAIT_S) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {within:g} s waiting for {what}")


class Watcher:
    """A StreamEvents call read by a thread into a queue; the stream's deadline bounds it."""

    def __init__(self, stub: ContextServiceStub, *, after_event_id: int = 0, session_id: str = "") -> None:
        self.queue: queue.Queue[events_pb2.Event] = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.stream = stub.StreamEvents(
            pb.StreamEventsRequest(session_id=session_id, after_event_id=after_event_id), timeout=120
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for event in self.stream:
                self.queue.put(event)
        except grpc.RpcError as exc:
            self.error = exc

    def take(self, count: int, within: float = WAIT_S) -> list[events_pb2.Event]:
        deadline = time.monotonic() + within
        out: list[events_pb2.Event] = []
        while len(out) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"got {len(out)} of {count} events (stream error: {self.error})")
            try:
                out.append(self.queue.get(timeout=remaining))
            except queue.Empty:
                continue
        return out

    def poll(self, within: float) -> events_pb2.Event | None:
        try:
            return self.queue.get(timeout=within)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(10)
        assert not self.thread.is_alive()


def stored_events(dsn: str, after: int = 0) -> list[tuple[int, str, str]]:
    rows = query(dsn, "SELECT event_id, kind, session_id FROM events WHERE event_id > $1 ORDER BY event_id", after)
    return [(row[0], row[1], row[2]) for row in rows]


def delivered(events: list[events_pb2.Event]) -> list[tuple[int, str, str]]:
    return [(e.event_id, e.WhichOneof("payload") or "", e.session_id) for e in events]


# -- 1. sequence numbers ------------------------------------------------------------------------

CLIENTS = 30
APPENDS_EACH = 4
BATCH = 2


def test_thirty_clients_through_three_replicas_get_unique_contiguous_numbers(three: Replicas) -> None:
    sid = three.stubs[0].CreateSession(pb.CreateSessionRequest(name="shared"), timeout=CALL_S).id
    start = threading.Barrier(CLIENTS, timeout=WAIT_S)

    def client(n: int) -> list[tuple[list[int], list[str]]]:
        proc = three.procs[n % 3]
        done = []
        with grpc.insecure_channel(proc.address) as ch:  # a client of its own, as a runtime has
            stub = ContextServiceStub(ch)
            start.wait()
            for k in range(APPENDS_EACH):
                contents = [f"client {n} append {k} row {i}" for i in range(BATCH)]
                done.append((append(stub, sid, [user(c) for c in contents]), contents))
        return done

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [item for batch in pool.map(client, range(CLIENTS)) for item in batch]

    total = CLIENTS * APPENDS_EACH * BATCH
    numbers = [seq for seqs, _ in results for seq in seqs]
    assert sorted(numbers) == list(range(1, total + 1))  # unique and gap-free
    for seqs, _ in results:  # one append's rows are consecutive
        assert seqs == list(range(seqs[0], seqs[0] + BATCH))
    expected = {seq: text for seqs, texts in results for seq, text in zip(seqs, texts, strict=True)}
    for stub in three.stubs:  # every replica reads the same history
        listed = all_messages(stub, sid, page_size=97)
        assert {m.sequence_number: m.content for m in listed} == expected
        assert [m.sequence_number for m in listed] == list(range(1, total + 1))
        session = stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=CALL_S)
        assert (session.display_message_count, session.context_message_count) == (total, total)


def _pinned(text: str) -> r.Message:
    return r.Message(role=r.ROLE_USER, content=text, flags=r.MessageFlags(is_pinned=True))


def test_pinned_appends_racing_through_replicas_stay_within_the_pinned_cap(three: Replicas) -> None:
    """Pinned rows may take at most ``pinned_max_fraction`` of the window. Each append checks the
    cap against the context it reads: appends racing through replicas (or within one) must not
    each pass the check on a context without the others' rows (all three got in, 3x the cap)."""
    window = 4096
    cap = window // 4  # pinned_max_fraction 0.25
    text = " ".join(f"note{i}" for i in range(300))  # more than half the cap, within it
    for attempt in range(3):
        sid = three.stubs[0].CreateSession(pb.CreateSessionRequest(name=f"pinned {attempt}"), timeout=CALL_S).id
        # The session's window: a build remembers the profile its appends are capped by.
        three.stubs[0].BuildContext(
            pb.BuildContextRequest(session_id=sid, profile=r.Profile(context_window=window)), timeout=CALL_S
        )
        start = threading.Barrier(3, timeout=WAIT_S)

        def pin(n: int, sid: str = sid, start: threading.Barrier = start) -> str:
            start.wait()
            try:
                append(three.stubs[n], sid, [_pinned(text)])
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
                return "refused"
            return "appended"

        with ThreadPoolExecutor(3) as pool:
            outcomes = sorted(pool.map(pin, range(3)))
        pinned = [m for m in all_messages(three.stubs[1], sid, pb.BUFFER_CONTEXT) if m.flags.is_pinned]
        assert cap / 2 < pinned[0].token_count <= cap  # so one fits and no two do
        assert outcomes == ["appended", "refused", "refused"]
        assert len(pinned) == 1


# -- 2. events across replicas --------------------------------------------------------------------


def _go_live(watcher: Watcher, stub: ContextServiceStub, sid: str) -> events_pb2.Event:
    """Append probes until the (live-from-now) stream delivers one; returns that first event."""
    for n in range(40):
        append(stub, sid, [user(f"probe {n}")])
        event = watcher.poll(0.5)
        if event is not None:
            return event
    raise AssertionError("the stream never went live")


def test_stream_on_one_replica_sees_the_others_and_resumes_without_gaps(three: Replicas, database: str) -> None:
    a, b, c = three.stubs
    first_session = b.CreateSession(pb.CreateSessionRequest(name="first"), timeout=CALL_S).id
    keeper = c.CreateSession(pb.CreateSessionRequest(name="keeper"), timeout=CALL_S).id

    watcher = Watcher(a)
    try:
        first = _go_live(watcher, b, keeper)
        # Appends through B and C, a forced compression through C, a deletion through B.
        batch = _turns(0, 30)
        for i in range(0, len(batch), 20):
            append(b if i % 40 == 0 else c, first_session, batch[i : i + 20])
        done = c.Compress(pb.CompressRequest(session_id=first_session, profile=_profile()), timeout=CALL_S)
        assert done.compressed
        b.DeleteSession(pb.DeleteSessionRequest(session_id=first_session), timeout=CALL_S)

        expected = stored_events(database, first.event_id - 1)
        got = delivered([first, *watcher.take(len(expected) - 1)])
        assert got == expected  # every event, in order, each once
        kinds = [kind for _, kind, sid in got if sid == first_session]
        assert kinds.count("messages_appended") == 6
        assert kinds.index("compression_started") < kinds.index("context_compressed") < kinds.index("session_deleted")
        assert kinds[-1] == "session_deleted"
    finally:
        watcher.close()
    last_seen = got[-1][0]

    # While nobody watches: a second session lives and dies through C and B.
    second = c.CreateSession(pb.CreateSessionRequest(name="second"), timeout=CALL_S).id
    for i, rows in enumerate((_turns(100, 5), _turns(105, 5), _turns(110, 5))):
        append((b, c)[i % 2], second, rows)
    append(b, keeper, [user("meanwhile")])
    c.DeleteSession(pb.DeleteSessionRequest(session_id=second), timeout=CALL_S)
    missed = stored_events(database, last_seen)
    assert len(missed) == 5

    resumed = Watcher(a, after_event_id=last_seen)
    try:
        assert delivered(resumed.take(len(missed))) == missed  # exactly the missed ones
        append(c, keeper, [user("marker")])
        marker = stored_events(database, missed[-1][0])
        assert len(marker) == 1
        # The next thing on the resumed stream is the marker: no duplicate or stray event before it.
        assert delivered(resumed.take(1)) == marker
        assert resumed.poll(0.5) is None
    finally:
        resumed.close()

    # A watcher of the second session alone resumes on A, though C deleted it meanwhile: what it
    # missed, then the deletion, and its stream ends (OK).
    own = a.StreamEvents(pb.StreamEventsRequest(session_id=second, after_event_id=last_seen), timeout=CALL_S)
    assert delivered(list(own)) == [e for e in missed if e[2] == second]
    assert own.code() == grpc.StatusCode.OK and missed[-1][1] == "session_deleted"


# -- 3. PostgreSQL stopped under load -------------------------------------------------------------


@pytest.fixture
def own_cluster() -> Iterator[PgCluster]:
    """A cluster of this test's own: stopping it disturbs no other test."""
    cluster = PgCluster.create()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


@dataclass
class Outcome:
    started: float
    ended: float
    seq: int = 0
    content: str = ""
    code: grpc.StatusCode | None = None


OUTAGE_S = 5.0
LOADERS = 6


def test_postgres_stopped_under_load_is_unavailable_then_recovers_losing_nothing(own_cluster: PgCluster) -> None:
    dsn = run(create_database(own_cluster.url))
    replicas = start_replicas(dsn, 1)
    stop_load = threading.Event()
    outcomes: list[list[Outcome]] = [[] for _ in range(LOADERS)]
    try:
        stub = replicas.stubs[0]
        sid = stub.CreateSession(pb.CreateSessionRequest(name="under load"), timeout=CALL_S).id

        def load(n: int) -> None:
            # Bounded in count and time; a short pause between calls keeps the load modest.
            for k in range(5000):
                if stop_load.is_set():
                    return
                content = f"loader {n} call {k}"
                began = time.monotonic()
                try:
                    seqs = append(stub, sid, [user(content)])
                    outcomes[n].append(Outcome(began, time.monotonic(), seq=seqs[0], content=content))
                except grpc.RpcError as exc:
                    outcomes[n].append(Outcome(began, time.monotonic(), code=exc.code()))
                time.sleep(0.02)

        threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(LOADERS)]
        for t in threads:
            t.start()
        eventually(lambda: all(any(o.seq for o in out) for out in outcomes), "appends before the outage")

        own_cluster.stop()
        down_at = time.monotonic()
        time.sleep(OUTAGE_S)
        up_from = time.monotonic()
        own_cluster.start()  # same port, so the service's DSN is valid again

        def recovered() -> bool:
            return all(any(o.seq and o.started > up_from for o in out) for out in outcomes)

        eventually(recovered, "every loader to succeed again after the restart")
        stop_load.set()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads)

        every = [o for out in outcomes for o in out]
        failures = [o for o in every if o.code is not None]
        # Failures are UNAVAILABLE only (never INTERNAL or UNKNOWN), and the outage produced some.
        assert {o.code for o in failures} == {grpc.StatusCode.UNAVAILABLE}
        inside = [o for o in every if o.started >= down_at and o.ended <= up_from]
        assert inside and all(o.code == grpc.StatusCode.UNAVAILABLE for o in inside)

        # Nothing acknowledged is lost; numbers stay gap-free (a failed append may have committed
        # before its connection died: such a row is there without having been acknowledged).
        acknowledged = {o.seq: o.content for o in every if o.seq}
        listed = {m.sequence_number: m.content for m in all_messages(stub, sid, page_size=500)}
        assert set(listed) == set(range(1, max(listed) + 1))
        assert {seq: listed.get(seq) for seq in acknowledged} == acknowledged
        assert len(set(acknowledged.values())) == len(acknowledged)
        session = stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=CALL_S)
        assert session.display_message_count == len(listed)
    finally:
        stop_load.set()
        replicas.stop()


def test_a_read_only_postgres_makes_writes_unavailable_until_it_takes_writes_again(own_cluster: PgCluster) -> None:
    """A primary demoted to a standby, or a database switched read-only: writes are UNAVAILABLE
    (a client retries; they were INTERNAL, which it does not) and work again once it takes writes."""
    dsn = run(create_database(own_cluster.url))
    replicas = start_replicas(dsn, 1)
    try:
        stub = replicas.stubs[0]
        sid = stub.CreateSession(pb.CreateSessionRequest(), timeout=CALL_S).id
        append(stub, sid, [user("before")])
        query(own_cluster.url, "ALTER SYSTEM SET default_transaction_read_only = on")
        query(own_cluster.url, "SELECT pg_reload_conf()")

        def refused() -> grpc.StatusCode | None:
            try:
                append(stub, sid, [user("while read-only")])
            except grpc.RpcError as exc:
                return exc.code()
            return None

        assert eventually(refused, "an append refused while read-only") == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateSession(pb.CreateSessionRequest(), timeout=CALL_S)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        query(own_cluster.url, "ALTER SYSTEM RESET default_transaction_read_only")
        query(own_cluster.url, "SELECT pg_reload_conf()")
        eventually(lambda: refused() is None, "appends taken again")
        listed = [m.content for m in all_messages(stub, sid)]
        assert listed[0] == "before" and "while read-only" in listed
    finally:
        replicas.stop()


# -- 4. the schema --------------------------------------------------------------------------------

_FINGERPRINT = {
    "relations": """SELECT c.relname, c.relkind::text, c.oid::bigint, c.relfilenode::bigint FROM pg_class c
                      JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = 'public' ORDER BY c.relname""",
    "columns": """SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                         pg_get_expr(d.adbin, d.adrelid)
                    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                    JOIN pg_namespace n ON n.oid = c.relnamespace
                    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                   WHERE n.nspname = 'public' AND a.attnum > 0 AND NOT a.attisdropped
                   ORDER BY c.relname, a.attnum""",
    "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY indexname",
    "constraints": """SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint
                       WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2""",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = 'public' ORDER BY viewname",
    "extensions": "SELECT extname, extversion FROM pg_extension ORDER BY extname",
    "migrations": "SELECT version, name, applied_at FROM schema_migrations ORDER BY version",
}


def fingerprint(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    """The schema as the catalog describes it, oids included (a drop + re-create shows)."""
    has_migrations = query(dsn, "SELECT to_regclass('public.schema_migrations') IS NOT NULL")[0][0]
    return {
        name: [tuple(row) for row in query(dsn, sql)]
        for name, sql in _FINGERPRINT.items()
        if name != "migrations" or has_migrations
    }


def test_serve_creates_the_schema_once_and_a_second_start_changes_nothing(database: str) -> None:
    empty = fingerprint(database)
    assert empty["relations"] == [] and "migrations" not in empty

    first = ServerProcess(database, env=PG_ENV).start()
    try:
        with first.channel() as ch:
            sid = first.stub(ch).CreateSession(pb.CreateSessionRequest(name="s"), timeout=CALL_S).id
    finally:
        assert first.terminate() == 0
    created = fingerprint(database)
    tables = {name for name, kind, *_ in created["relations"] if kind == "r"}
    assert {"sessions", "messages", "messages_archive", "events", "history_chunks", "schema_migrations"} <= tables
    assert [v for v, *_ in created["migrations"]] == [m.version for m in MIGRATIONS]  # every one, once
    assert any(name == "pg_trgm" for name, _ in created["extensions"])
    assert any(name == "messages_content_trgm" for name, _ in created["indexes"])

    second = ServerProcess(database, env=PG_ENV).start()
    try:
        with second.channel() as ch:
            assert second.stub(ch).GetSession(pb.GetSessionRequest(session_id=sid), timeout=CALL_S).name == "s"
    finally:
        assert second.terminate() == 0
    assert fingerprint(database) == created


# -- 5. compaction across replicas ----------------------------------------------------------------


@pytest.fixture
def slow_summarizer_replicas(database: str, llm: FakeLLM) -> Iterator[Replicas]:
    llm.reset()
    env = {
        "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": llm.base_url,
        "CONTEXTSVC_SUMMARIZER__OPENAI__TIMEOUT_SECONDS": "10",
        "CONTEXTSVC_SUMMARIZER__OPENAI__TOTAL_TIMEOUT_SECONDS": "20",
        "CONTEXTSVC_SUMMARIZER__OPENAI__MAX_RETRIES": "0",
        # Longer than a summary (SUMMARY_S): B must wait for A's commit, not take the bounded
        # fallback a build serves when a compaction runs too long (hot_path.build_wait_seconds).
        "CONTEXTSVC_HOT_PATH__BUILD_WAIT_SECONDS": "15",
    }
    replicas = start_replicas(database, 3, env)
    try:
        yield replicas
    finally:
        replicas.stop()


SUMMARY_S = 2.0  # how long each summarizer call takes: the window in which the replicas race


def _context(stub: ContextServiceStub, sid: str) -> tuple[int, ...]:
    """The whole context buffer in one call (one statement in the store, so one snapshot)."""
    resp = stub.ListMessages(
        pb.ListMessagesRequest(session_id=sid, buffer=pb.BUFFER_CONTEXT, page_size=1000), timeout=CALL_S
    )
    assert not resp.next_before_sequence
    return tuple(m.sequence_number for m in resp.messages)


def _view(resp: pb.BuildContextResponse) -> tuple[int, ...]:
    """The stored messages a view carries (the system prompt and the incoming one have none)."""
    return tuple(m.sequence_number for m in resp.messages if m.sequence_number)


@pytest.mark.parametrize("trigger", ["post_turn", "pre_turn"])
def test_replicas_racing_to_compact_run_one_compaction_and_readers_never_see_half(
    slow_summarizer_replicas: Replicas, database: str, llm: FakeLLM, trigger: str
) -> None:
    a, b, c = slow_summarizer_replicas.stubs
    # A low threshold, so the full context is over it yet still fits the window: a reader's
    # BuildContext without compression succeeds before and after the compaction.
    profile = _profile("openai", threshold=0.5, target=0.3)
    sid = a.CreateSession(pb.CreateSessionRequest(name="race"), timeout=CALL_S).id
    quiet = pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False)
    a.BuildContext(quiet, timeout=CALL_S)  # remembers the profile for the post-turn check
    turn = 0
    while a.BuildContext(quiet, timeout=CALL_S).estimate.total < 0.6 * WINDOW:
        append(a, sid, _turns(turn, 2))
        turn += 2
        assert turn < 200
    llm.control(mode="hang", hang_seconds=SUMMARY_S)  # every summary now takes SUMMARY_S
    initial = _context(c, sid)

    # Readers on C, all through the race: snapshots of the context buffer and uncompressed views.
    seen_contexts: list[tuple[int, ...]] = []
    seen_views: list[tuple[int, ...]] = []
    reading = threading.Event()
    stop = threading.Event()

    # The second reader alternates two system prompts: each of its builds rewrites the profile the
    # session remembers, a read-modify-write of the engine state racing the compaction's commit.
    other = r.Profile()
    other.CopyFrom(profile)
    other.system_prompt = "You are a careful coding agent."
    builds = ([quiet], [quiet, pb.BuildContextRequest(session_id=sid, profile=other, auto_compress=False)])

    def reader(requests: list[pb.BuildContextRequest]) -> None:
        for i in range(2000):  # bounded
            if stop.is_set():
                return
            seen_contexts.append(_context(c, sid))
            seen_views.append(_view(c.BuildContext(requests[i % len(requests)], timeout=CALL_S)))
            reading.set()

    readers = [threading.Thread(target=reader, args=(b,), daemon=True) for b in builds]
    for t in readers:
        t.start()
    try:
        eventually(reading.is_set, "the readers to start")
        pre_turn = pb.BuildContextRequest(session_id=sid, profile=profile, incoming=user("next step?"))
        first: list[pb.BuildContextResponse] = []
        before = initial
        if trigger == "post_turn":
            added = append(a, sid, [user("wrap up"), assistant("turn done")], turn_complete=True)
            before = (*initial, *added)
        else:
            racer = threading.Thread(target=lambda: first.append(a.BuildContext(pre_turn, timeout=CALL_S)))
            racer.start()

        def started() -> bool:
            return any(kind == "compression_started" for _, kind, _ in stored_events(database))

        eventually(started, f"the {trigger} compaction on replica A to start")
        # B crosses the same threshold while A's compaction is in its summarizer call.
        second = b.BuildContext(pre_turn, timeout=CALL_S)
        if trigger == "pre_turn":
            racer.join(CALL_S)
            assert first and first[0].compression.compressed

        def compressed() -> bool:
            return any(kind == "context_compressed" for _, kind, _ in stored_events(database))

        eventually(compressed, "the compaction to commit")
        time.sleep(0.3)  # a few more reads after the commit
    finally:
        stop.set()
        for t in readers:
            t.join(CALL_S)
    assert not any(t.is_alive() for t in readers)

    after = _context(c, sid)
    assert after != before and len(after) < len(before)
    # One compaction for the crossing: one start, one commit, one summarizer call, one record.
    kinds = [kind for _, kind, _ in stored_events(database)]
    assert kinds.count("compression_started") == 1
    assert kinds.count("context_compressed") == 1
    assert len(llm.requests()) == 1
    assert sum(m.flags.is_compression for m in all_messages(a, sid)) == 1
    # B waited for A's compaction instead of running its own, and built a whole view.
    assert not second.compression.compressed
    assert _view(second) in (before, after)
    # Every snapshot and every view was the context before or after: never half of it.
    whole = {initial, before, after}
    assert set(seen_contexts) <= whole and set(seen_views) <= whole
    assert after in seen_contexts  # the readers did see the commit (and so read across it)
    # The next turn on any replica starts from the compacted context.
    assert _view(b.BuildContext(pre_turn, timeout=CALL_S)) == after
