"""Emoji priced nearer their real tokens, cold, and never so high that an honest count is refused.

The counts below were taken once with the bench's four tokenizers (``bench/tokens/count.mjs``:
o200k, cl100k, Llama 3 and the old Claude vocabulary); the unit tests do not need node. The
vocabularies disagree on emoji (the same text is 32 tokens in o200k and 51 in cl100k), so no one
price is close to all of them; the prices are held between two limits instead: the estimate may
not fall below the cheapest vocabulary's honest count's floor (``calibration.lower_bound``: a count
under it is taken for a truncated prompt), and should not be far under the dearest. Before (an
emoji 1.5 extra tokens, the joiner 0.5), these texts were up to 49 % under a vocabulary's count.
"""

from __future__ import annotations

import pytest

from contextsvc.config import TokenSettings
from contextsvc.core import sizing
from contextsvc.core.calibration import fallback, lower_bound
from contextsvc.core.priors import N_FEATURES
from contextsvc.core.tokens import CalibratedCounter

#: (text, real tokens in o200k, cl100k, Llama 3, Claude)
_MEASURED = (
    (
        "shipped the fix 🎉🎉 thanks everyone 🙏 next up: the docs 📝✨ then lunch 🍕🍔 "
        "👩\u200d💻👨\u200d💻 ✅ done ❤\ufe0f",
        (39, 51, 49, 54),
    ),
    ("🇺🇸🇬🇧🇯🇵 flags and 👍🏽👍🏿 tones ⚠\ufe0f careful ☕☕☕ 🚀🚀🚀🚀", (39, 55, 55, 52)),
    ("great job 🚀🚀🚀🚀 party 🎉🎉🎉 lol 😂😂😂😂😂 ok 🔥🔥 thanks 🙏🙏🙏", (32, 51, 51, 49)),
)
_FAMILIES = ("o200k", "cl100k", "llama3", "claude")


@pytest.mark.parametrize(("text", "counts"), _MEASURED)
def test_a_cold_estimate_of_emoji_chat_sits_between_the_vocabularies(text: str, counts: tuple[int, ...]) -> None:
    for family, real in zip(_FAMILIES, counts, strict=True):
        estimate = CalibratedCounter(fallback(TokenSettings(), family=family)).count_text(text)
        assert 0.6 * real <= estimate <= 1.25 * real, (family, estimate, real)


#: (a character, real tokens of ``(" " + it) * 50`` in o200k, cl100k, Llama 3, Claude)
_FLOORED = (
    ("🚀", (100, 150, 150, 150)),
    ("✅", (50, 100, 100, 150)),
    ("⭐", (50, 100, 100, 150)),
    ("★", (50, 50, 50, 100)),
    ("✓", (50, 50, 50, 150)),
    ("👩\u200d💻", (250, 300, 250, 350)),
    ("🇩🇪", (200, 300, 300, 300)),
    ("👍🏽", (150, 250, 250, 300)),
)


@pytest.mark.parametrize(("char", "counts"), _FLOORED)
def test_an_honest_count_of_emoji_clears_the_floor(char: str, counts: tuple[int, ...]) -> None:
    features = list(sizing.feature_units((" " + char) * 50)) + [0] * (N_FEATURES - sizing.N_UNIT_COLUMNS)
    assert min(counts) >= lower_bound(features)


def test_emoji_cost_more_than_typographic_marks() -> None:
    # One token each in every vocabulary measured: dashes, quotes, arrows, the ellipsis.
    marks = [sizing.piece_units(" " + ch) for ch in "\u2014\u2019\u201c\u2026\u2192\u2022"]
    assert max(marks) < min(sizing.piece_units(" " + ch) for ch in ("🚀", "😂", "🎉"))


def test_a_run_of_emoji_grows_with_each_emoji() -> None:
    one, three = sizing.text_size("🚀"), sizing.text_size("🚀🚀🚀")
    # Each emoji past the first is ~2 tokens (four UTF-8 bytes), not the run's share of one.
    assert three - one >= 2 * 2 * sizing.WEIGHTS.units_per_token


def test_the_joiner_of_an_emoji_sequence_is_priced() -> None:
    assert sizing.text_size("👩\u200d💻") > sizing.text_size("👩💻")
    assert sizing.text_size("❤\ufe0f") > sizing.text_size("❤")
