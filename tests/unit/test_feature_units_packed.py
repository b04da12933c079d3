"""``sizing.feature_units`` sums a text's pieces packed into integers; the loop over the pieces
(``_looped_units``, which long texts take) must give the same columns for every script."""

from __future__ import annotations

import random

import pytest

from contextsvc.core import sizing

SAMPLES = (
    "the build failed on the parser module because a token was missing",
    "def _private(self): return self.attr.value  # HTTPServer, snake_case, camelCase",
    "Привет, мир! Это проверка: как считаются слова в русском тексте?",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. 2026 год",
    "日本語のテキストと漢字、ひらがな、カタカナが混ざった文です。",
    "中文文本的长度按汉字计算\uff0c标点符号也算。",  # (a full-width comma)
    "한국어 텍스트는 한글 음절로 셉니다.",
    "mixed: English, русский, 日本語, 한국어, emoji \U0001f600\U0001f680 and numbers 1234567",
    "   \n\n\t  spaces, tabs\tand\r\nnewlines   ",
    '{\'json\': [1, 2, 3], "nested": {"k": null}} <tag attr="x"/>',
    "",
    "a",
)


def _columns_by_loop(text: str) -> tuple[int, ...]:
    found = sizing._PIECE.findall(text)
    return tuple(sizing._looped_units(found)) if found else sizing._NO_UNITS


def _texts() -> list[str]:
    rng = random.Random(3)
    out = list(SAMPLES)
    for _ in range(300):  # random mixtures of the samples' pieces
        pieces = sizing._PIECE.findall(" ".join(SAMPLES))
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 80))))
    return out


@pytest.mark.parametrize("cold", [False, True])
def test_packed_sums_equal_the_loop_over_the_pieces(cold: bool) -> None:
    if cold:
        sizing.clear_caches()
    for text in _texts():
        assert sizing.feature_units(text) == _columns_by_loop(text), text
        assert sum(sizing.class_units(text)) == sizing.text_size(text)


def test_cyrillic_texts_fill_every_familys_column_and_others_leave_them_empty() -> None:
    families = slice(sizing.N_CLASSES, sizing.IDENT_PREFIXED)
    russian = sizing.feature_units("Это проверка русского текста")
    assert all(u > 0 for u in russian[families])
    assert not any(sizing.feature_units("plain English words only")[families])
    assert not any(sizing.feature_units("日本語のテキスト")[families])


def test_a_text_past_the_packed_bound_takes_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "Привет _name 日本 word 123"
    packed = sizing.feature_units(text)
    sizing.clear_caches()
    monkeypatch.setattr(sizing, "_PACKED_MAX_CHARS", 4)
    calls: list[int] = []
    looped = sizing._looped_units
    monkeypatch.setattr(sizing, "_looped_units", lambda found: calls.append(len(found)) or looped(found))
    assert sizing.feature_units(text) == packed
    assert calls, "the loop was not taken"


def test_the_fields_hold_far_more_than_a_text_can_carry() -> None:
    # A piece is at least one character and costs at most 8 units a character; a field holds 2**40 - 1.
    chars = ("a", "\u4e00", "\U0001f600", "\u2705", "\u200d", "!", " ", "7", "\u0416")
    per_char = max(sizing.piece_units(ch * n) / n for ch in chars for n in (1, 2, 32))
    assert per_char <= 8
    assert sizing._PACKED_MAX_CHARS * 8 < 1 << sizing._FIELD_BITS
