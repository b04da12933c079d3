"""Emoji and pictographs priced near their real tokens, cold.

The counts below were taken once with the bench's four tokenizers (``bench/tokens/count.mjs``:
o200k, cl100k, Llama 3 and the old Claude vocabulary); the unit tests do not need node. Before
these prices, an emoji cost 1.5 extra tokens, and a BMP pictograph (``✅ ☕``) and the emoji
joiner 0.5: the cold estimate of these texts was 13-49 % under each count.
"""

from __future__ import annotations

import pytest

from contextsvc.config import TokenSettings
from contextsvc.core import sizing
from contextsvc.core.calibration import fallback
from contextsvc.core.tokens import CalibratedCounter

#: (text, real tokens in o200k, cl100k, Llama 3, Claude)
_MEASURED = (
    (
        "shipped the fix 🎉🎉 thanks everyone 🙏 next up: the docs 📝✨ then lunch 🍕🍔 "
        "👩\u200d💻👨\u200d💻 ✅ done ❤\ufe0f",
        (39, 51, 49, 54),
    ),
    ("🇺🇸🇬🇧🇯🇵 flags and 👍🏽👍🏿 tones ⚠\ufe0f careful ☕☕☕ 🚀🚀🚀🚀", (39, 55, 55, 52)),
)
_FAMILIES = ("o200k", "cl100k", "llama3", "claude")


@pytest.mark.parametrize(("text", "counts"), _MEASURED)
def test_a_cold_estimate_is_within_a_quarter_of_every_vocabulary(text: str, counts: tuple[int, ...]) -> None:
    for family, real in zip(_FAMILIES, counts, strict=True):
        estimate = CalibratedCounter(fallback(TokenSettings(), family=family)).count_text(text)
        assert abs(estimate - real) <= 0.25 * real, (family, estimate, real)


def test_pictographs_cost_more_than_typographic_marks() -> None:
    # One token each in every vocabulary measured: dashes, quotes, arrows, the ellipsis.
    marks = [sizing.piece_units(" " + ch) for ch in "\u2014\u2019\u201c\u2026\u2192\u2022"]
    # Two or three: an emoji, a BMP pictograph.
    pictographs = [sizing.piece_units(" " + ch) for ch in ("🚀", "✅", "☕", "⚠")]
    assert max(marks) < min(pictographs)


def test_a_run_of_emoji_grows_with_each_emoji() -> None:
    one, three = sizing.text_size("🚀"), sizing.text_size("🚀🚀🚀")
    # Each emoji past the first is ~2 tokens (four UTF-8 bytes), not the run's share of one.
    assert three - one >= 2 * 2 * sizing.WEIGHTS.units_per_token


def test_the_joiner_of_an_emoji_sequence_is_priced() -> None:
    assert sizing.text_size("👩\u200d💻") > sizing.text_size("👩💻")
    assert sizing.text_size("❤\ufe0f") > sizing.text_size("❤")
