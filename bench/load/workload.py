"""What the load suite sends: deterministic agent-like messages, and seeding through the public API.

Messages follow an agent's rhythm (a user ask, an assistant tool call, its result, an answer),
about 375 bytes each on average, so a 200-message session carries a view of ~75 KB, the size the
issue measured. Everything is generated from a seed: two runs send the same bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator

import grpc

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import context_service_pb2_grpc as pb_grpc
from contextsvc._gen.v1 import resources_pb2 as r

_SENTENCES = (
    "the build failed on the parser module because a token was missing after the import list and "
    "we need to check the fixture paths config values retry budget cache window latency service "
    "request handler session compaction summary baseline estimate profile calibration store append"
)
WORDS = tuple(_SENTENCES.split())
#: Messages per AppendMessages while seeding (the server allows 500).
SEED_BATCH = 250
#: Words of a long tool result (``messages(long_every=)``): ~8,000 tokens, past one message's
#: budget on ``serve``'s default profile (32,768 ÷ 6 = 5,461), so the view cuts it.
LONG_TOOL_WORDS = 6_000


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def messages(count: int, *, seed: int = 7, start: int = 0, long_every: int = 0, salt: str = "") -> list[r.Message]:
    """``count`` messages of an agent loop; ``start`` continues a loop already that long (legal order).
    ``long_every``: every that many tool results, one is ``LONG_TOOL_WORDS`` long (a file read),
    which a view with a smaller per-message budget cuts; ``salt`` starts each long one, so two
    sessions' long results are different texts (as two agents' file reads are: the service
    measures a text it saw before for free)."""
    rng = random.Random(seed * 1_000_003 + start)
    out: list[r.Message] = []
    for i in range(start, start + count):
        step = i % 4
        if step == 0:
            out.append(r.Message(role=r.ROLE_USER, content=_text(rng, 30)))
        elif step == 1:
            args = json.dumps({"path": f"src/mod_{i}.py", "query": _text(rng, 4)})
            out.append(
                r.Message(
                    role=r.ROLE_ASSISTANT,
                    content=_text(rng, 8),
                    tool_calls=[r.ToolCall(id=f"call_{i}", name="read_file", arguments_json=args)],
                )
            )
        elif step == 2:
            long = long_every and (i // 4) % long_every == long_every - 1
            content = f"{salt} {_text(rng, LONG_TOOL_WORDS)}" if long else _text(rng, 90)
            m = r.Message(role=r.ROLE_TOOL, tool_call_id=f"call_{i - 1}", content=content)
            m.metadata.update({"source": "tool", "bytes": 540})
            out.append(m)
        else:
            out.append(r.Message(role=r.ROLE_ASSISTANT, content=_text(rng, 40)))
    return out


def turn_messages(turn: int, *, seed: int = 11) -> list[r.Message]:
    """The two messages one agent turn appends (a user ask and the answer)."""
    rng = random.Random(seed * 1_000_003 + turn)
    return [
        r.Message(role=r.ROLE_USER, content=_text(rng, 30)),
        r.Message(role=r.ROLE_ASSISTANT, content=_text(rng, 40)),
    ]


def provider_tokens(messages: Iterable[r.Message]) -> int:
    """What a provider's tokenizer counts for a view: a fixed function of its text (a token per 4
    bytes, 4 per message of framing, 3 for the reply's priming), as turndriver's providerTokens.
    The turn loop records it as each view's baseline. A count derived from the service's own
    estimate (5 % above it, say) would compound through baseline + delta: the estimate grows 5 % a
    turn until the session compacts in the middle of the run."""
    return 3 + sum(len(m.content.encode()) // 4 + 4 for m in messages)


def batches(items: list[r.Message], size: int = SEED_BATCH) -> Iterator[list[r.Message]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def fresh_copy(rows: list[r.Message]) -> list[r.Message]:
    """Context rows as plain messages to append to a new session: what the service assigned
    (numbers, times, flags, counts, what a summary replaced) cleared, a stored record made a
    user message."""
    fresh = []
    for m in rows:
        c = r.Message()
        c.CopyFrom(m)
        for field in ("sequence_number", "create_time", "flags", "token_count", "replaces"):
            c.ClearField(field)
        if c.role == r.ROLE_SYSTEM:
            c.role = r.ROLE_USER
        fresh.append(c)
    return fresh


class Seeder:
    """Creates and fills sessions on a running server (blocking stubs; seeding is not measured)."""

    def __init__(self, address: str, profile: str) -> None:
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        )
        self.stub = pb_grpc.ContextServiceStub(self.channel)
        self.profile = profile

    def close(self) -> None:
        self.channel.close()

    def session(self, count: int, *, profile: str = "", name: str = "bench", long_every: int = 0) -> str:
        sid = self.stub.CreateSession(pb.CreateSessionRequest(profile_id=profile or self.profile, name=name)).id
        for batch in batches(messages(count, long_every=long_every, salt=sid)):
            self.stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch))
        return sid

    def compressed(self, count: int, *, profile: str) -> str:
        """A session of ``count`` display messages whose context was compressed (by ``profile``'s
        small window: forced compressions until the context stops shrinking)."""
        sid = self.stub.CreateSession(pb.CreateSessionRequest(profile_id=profile, name="long")).id
        for batch in batches(messages(count)):
            self.stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch))
            self.stub.Compress(pb.CompressRequest(session_id=sid, reason="bench seed"))
        return sid

    def copy_context(self, source: str, *, profile: str = "") -> str:
        """A fresh session holding the context rows of ``source`` (appended as plain messages)."""
        rows: list[r.Message] = []
        token = ""
        for _ in range(1000):  # bounded paging; the context buffer pages by token
            page = self.stub.ListMessages(
                pb.ListMessagesRequest(session_id=source, buffer=pb.BUFFER_CONTEXT, page_size=1000, page_token=token)
            )
            rows[:0] = list(page.messages)
            if not page.next_page_token:
                break
            token = page.next_page_token
        sid = self.stub.CreateSession(pb.CreateSessionRequest(profile_id=profile or self.profile, name="copy")).id
        for batch in batches(fresh_copy(rows)):
            self.stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch))
        return sid

    def warm(self, sessions: list[str]) -> None:
        for sid in sessions:
            self.stub.BuildContext(pb.BuildContextRequest(session_id=sid))

    def context_count(self, sid: str) -> int:
        return self.stub.GetSession(pb.GetSessionRequest(session_id=sid)).context_message_count

    def display_count(self, sid: str) -> int:
        return self.stub.GetSession(pb.GetSessionRequest(session_id=sid)).display_message_count
