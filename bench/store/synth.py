"""The benchmark's data: sessions and messages generated from a fixed seed, one session at a time.

Synthetic chat text (pseudo-words from syllables), alternating user/assistant rows of 5-45 words
(~170 characters on average). Session 0 has exactly ``BUILD_MESSAGES`` rows: the session
BuildContext is measured on. One session in ``NEEDLE_EVERY`` carries the rare word ``NEEDLE`` in
one of its rows, so the content search matches ~0.1% of the sessions (what a trigram index is for);
``MISSING`` occurs nowhere (a search that must look at everything to say so).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import _checkout  # noqa: F401 - this checkout's contextsvc, see _checkout.py

from contextsvc.core.messages import Message, Role
from contextsvc.core.session import SessionInfo

NEEDLE = "quartzwyvern"
MISSING = "xylophonequasar"
NEEDLE_EVERY = 1000
BUILD_MESSAGES = 200
USER = "bench"
BASE_TIME = datetime(2026, 1, 1, tzinfo=UTC)

_ONSETS = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "br", "st", "tr", "pl", "gr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]


def _vocabulary(seed: int, size: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3))))
    # Sorted before use: set order differs between interpreter runs.
    return sorted(words)


@dataclass(frozen=True, slots=True)
class Plan:
    sessions: int
    messages: int
    seed: int = 7

    def __post_init__(self) -> None:
        if self.sessions < 2:
            raise ValueError(f"need at least 2 sessions, got {self.sessions}")
        if self.messages < BUILD_MESSAGES + self.sessions - 1:
            raise ValueError(
                f"{self.messages} messages cannot give session 0 {BUILD_MESSAGES} rows and every other one at least 1"
            )

    def sizes(self) -> list[int]:
        """Rows per session: ``BUILD_MESSAGES`` for session 0, the rest shared evenly."""
        rest, extra = divmod(self.messages - BUILD_MESSAGES, self.sessions - 1)
        return [BUILD_MESSAGES] + [rest + (1 if i < extra else 0) for i in range(self.sessions - 1)]

    def session_id(self, index: int) -> str:
        return str(uuid.UUID(int=random.Random(f"{self.seed}:id:{index}").getrandbits(128), version=4))

    def needle_sessions(self) -> int:
        return len(range(NEEDLE_EVERY // 2, self.sessions, NEEDLE_EVERY))


@dataclass(frozen=True, slots=True)
class SessionData:
    info: SessionInfo
    rows: list[Message]  # numbered from 1, create times set


class Generator:
    """Sessions of a ``Plan``, deterministic whatever order they are asked for in."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.words = _vocabulary(plan.seed)
        self.sizes = plan.sizes()

    def session(self, index: int) -> SessionData:
        rng = random.Random(f"{self.plan.seed}:rows:{index}")
        count = self.sizes[index]
        created = BASE_TIME + timedelta(minutes=index)
        needle_at = rng.randrange(count) if index % NEEDLE_EVERY == NEEDLE_EVERY // 2 else -1
        rows = []
        for i in range(count):
            words = rng.choices(self.words, k=rng.randint(5, 45))
            if i == needle_at:
                words[rng.randrange(len(words))] = NEEDLE
            content = " ".join(words)
            rows.append(
                Message(
                    Role.USER if i % 2 == 0 else Role.ASSISTANT,
                    content,
                    sequence_number=i + 1,
                    create_time=created + timedelta(seconds=i),
                    token_count=max(1, len(content) // 4),
                )
            )
        info = SessionInfo(
            id=self.plan.session_id(index),
            user_id=USER,
            profile_id="default",
            name=f"session {index}",
            create_time=created,
            update_time=rows[-1].create_time,
        )
        return SessionData(info, rows)

    def __iter__(self) -> Iterator[SessionData]:
        for index in range(self.plan.sessions):
            yield self.session(index)
