"""``tokens._scaled``: a baseline-anchored estimate's breakdown scaled to its total."""

from __future__ import annotations

import random

from contextsvc.core.tokens import TokenSegments, _scaled

NAMES = ("system", "records", "summaries", "pinned", "messages", "images", "incoming")


def _by_names(raw: TokenSegments, total: int) -> TokenSegments:
    """The rule written out by field name: each segment's exact share, floored, and the units
    left handed to the largest remainders (the first of equal remainders first)."""
    values = [getattr(raw, n) for n in NAMES]
    base = sum(values)
    if base <= 0:
        return TokenSegments(messages=total)
    exact = [v * total / base for v in values]
    floors = [int(x) for x in exact]
    for i in sorted(range(len(NAMES)), key=lambda i: exact[i] - floors[i], reverse=True)[: total - sum(floors)]:
        floors[i] += 1
    return TokenSegments(**dict(zip(NAMES, floors, strict=True)))


def test_scaled_segments_sum_to_the_total_and_keep_each_segment_in_its_field() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        raw = TokenSegments(*(rng.choice([0, 0, rng.randint(1, 5000)]) for _ in NAMES))
        total = rng.randint(0, 20000)
        scaled = _scaled(raw, total)
        assert scaled == _by_names(raw, total)
        assert scaled.total == total and scaled.recall == 0
        for name in NAMES:  # a segment that was empty stays empty
            if getattr(raw, name) == 0 and raw.total > 0:
                assert getattr(scaled, name) == 0


def test_an_empty_breakdown_puts_the_total_in_messages() -> None:
    assert _scaled(TokenSegments(), 120) == TokenSegments(messages=120)


def test_one_segment_takes_the_whole_total() -> None:
    assert _scaled(TokenSegments(incoming=30), 75) == TokenSegments(incoming=75)
