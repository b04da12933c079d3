# ruff: noqa: RUF001  (Cyrillic sample text)
"""The size measure the calibration is fitted on (contextsvc.core.sizing)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.core import sizing
from contextsvc.core.sizing import WEIGHTS, SizeWeights, piece_tokens, piece_units, pieces, text_size

# Real token counts of these texts, measured with bench/tokens (gpt-tokenizer o200k and cl100k,
# llama3-tokenizer-js, @anthropic-ai/tokenizer), so the tests below can check the measure against
# real tokenizers without loading one.
SAMPLES: dict[str, tuple[str, dict[str, int]]] = {
    "prose": (
        "When the build finished, the team looked at the results together and decided that the "
        "slow test suite should run every night instead of on each change, because waiting for it "
        "made every review take longer than the work itself. Nobody liked the delay very much.",
        {"o200k": 50, "cl100k": 50, "llama3": 50, "claude": 50},
    ),
    "code": (
        "def load(path: str) -> dict[str, int]:\n    with open(path) as f:\n        data = json.load(f)\n"
        "    return {k: int(v) for k, v in data.items() if v}\n",
        {"o200k": 46, "cl100k": 46, "llama3": 46, "claude": 54},
    ),
    "json": (
        '{"id": 4471, "status": "failed", "attempts": [3, 5], "tags": ["db", "retry"], "ms": 812.5}',
        {"o200k": 40, "cl100k": 40, "llama3": 40, "claude": 37},
    ),
    "ids": (
        "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 commit 3f2a9c1e7b",
        {"o200k": 58, "cl100k": 58, "llama3": 58, "claude": 58},
    ),
    "cyrillic": (
        "Сборка завершилась с ошибкой: тесты базы данных не прошли, потому что сервер не ответил "
        "вовремя. Мы перезапустили его и попробовали ещё раз, и всё заработало.",
        {"o200k": 43, "cl100k": 67, "llama3": 48, "claude": 79},
    ),
    "cjk": (
        "ビルドは失敗しました。データベースのテストがタイムアウトしたので、サーバーを再起動してもう一度実行しました。",
        {"o200k": 37, "cl100k": 49, "llama3": 35, "claude": 47},
    ),
}
TOKENIZERS = ("o200k", "cl100k", "llama3", "claude")
LATIN = ("prose", "code", "json", "ids")


def test_the_samples_are_what_was_counted() -> None:
    assert [len(text) for text, _ in SAMPLES.values()] == [260, 146, 90, 89, 158, 54]


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_one_slope_fits_every_kind_of_text(tokenizer: str) -> None:
    per_unit = {kind: counts[tokenizer] / text_size(text) for kind, (text, counts) in SAMPLES.items()}
    per_char = {kind: counts[tokenizer] / len(text) for kind, (text, counts) in SAMPLES.items()}
    # Latin-script kinds: within 1.25x of each other per size unit, though 3x apart per char.
    latin_unit = [per_unit[k] for k in LATIN]
    latin_char = [per_char[k] for k in LATIN]
    assert max(latin_unit) / min(latin_unit) < 1.25, per_unit
    assert max(latin_char) / min(latin_char) > 3.0, per_char
    # Every kind, other scripts included, well inside the calibration's slope range [0.25, 1.0],
    # so a truncated prompt (a slope far below) still stands out.
    assert all(0.3 < r < 0.7 for r in per_unit.values()), per_unit


def test_the_fallback_is_near_the_mark_for_latin_text() -> None:
    # size / 1.8 (DESIGN's fallback) is within 20% of the real count, where chars / 1.8 was 1.4-3.8x high.
    for kind in LATIN:
        text, counts = SAMPLES[kind]
        for tokenizer in TOKENIZERS:
            assert text_size(text) / 1.8 == pytest.approx(counts[tokenizer], rel=0.2), (kind, tokenizer)


# --- pieces and their prices --------------------------------------------------------------------


def test_pieces_follow_bpe_pre_tokenization() -> None:
    assert pieces("Hello  world, x=1234;\n\n    def __init__(self):") == [
        "Hello",
        " ",
        " world",
        ",",
        " x",
        "=",
        "123",
        "4",
        ";\n\n",
        "   ",
        " def",
        " __",
        "init",
        "__(",
        "self",
        "):",
    ]
    assert pieces("привет мир") == ["привет", " мир"]


@given(st.text(max_size=300))
def test_pieces_cover_every_character_once(text: str) -> None:
    assert "".join(pieces(text)) == text


@pytest.mark.parametrize(
    ("piece", "tokens"),
    [
        (" the", 1.0),  # a common word with its space: one token
        ("123", 1.0),  # up to three digits
        ("\n\n", 1.0),
        ("    ", 1.0),
        ('":', 1.0),
        (" getValue", 2.0),  # one token per case hump
        ("_init", 1.0),  # ``_``, ``.`` and a space are cheap prefixes
        ("/src", 1.5),  # other punctuation before a word costs more
        (":aws", 2.0),  # ... a token of its own for ``:``, ``+``, ``~``, ``=`` (``:amd64``, ``+dfsg``)
        ("+dfsg", 2.0),
        ("architecture", 1.9),  # a long word: 1 + 0.15 per letter past 6
        ("configuration", 2.3),  # ... and 0.4 per letter past 12
        ("=" * 9, 1.125),  # a ruler: one repeated char, about one token whatever its length
        ("=" * 32, 1.125),
        ("{[(<", 1.45),  # mixed punctuation: 1 token for 3 chars, 0.45 per char after
    ],
)
def test_piece_prices(piece: str, tokens: float) -> None:
    assert piece_tokens(piece) == pytest.approx(tokens)
    assert piece_units(piece) == max(1, round(2 * tokens))


def test_long_letter_runs_cost_more_per_letter() -> None:
    assert text_size("deadbeefcafebabe0123") > text_size("configuration") > text_size("the")
    assert piece_tokens("qzxjkvbwplmnrtsgdfhcyxqzjkvbwplm") == pytest.approx(1 + 0.15 * 6 + 0.4 * 20)  # ~0.32/char
    assert piece_tokens("x" * 6) == piece_tokens("x") == 1.0


def test_a_run_of_a_letter_every_vocabulary_holds_long_is_priced_by_its_runs() -> None:
    # "x" * 4000 is 500 tokens in o200k, cl100k and Llama 3 (8 letters a token); "b" * 4000 1,000.
    assert piece_tokens("x" * 32) == pytest.approx(4.0)
    assert piece_tokens("b" * 32) == pytest.approx(8.0)
    # "q" runs 2 letters a token: the hump price (9.9 for 32) stays, never the lower one
    assert piece_tokens("q" * 32) == pytest.approx(1 + 0.15 * 6 + 0.4 * 20)
    assert piece_tokens("xxxxxxx") == 1.0
    assert piece_tokens("xxxxxxxxxxxxxxxq") > piece_tokens("x" * 15)  # not one letter repeated


@given(st.text(alphabet="xxxaqbX _.1", max_size=60), st.text(alphabet="xxxaqbX _.1", max_size=60))
def test_more_filler_never_costs_less(a: str, b: str) -> None:
    assert text_size(a + b) >= max(text_size(a), text_size(b))


def test_scripts_are_priced_by_their_own_rules() -> None:
    assert piece_tokens(" привет") == pytest.approx(0.7 + 0.28 * 6)
    # 日 and 本 are one token alone in every vocabulary measured; 語 1.5 on average (_cjk_costs)
    assert piece_tokens("日本語") == pytest.approx(0.9 * (1 + 1 + 1.5))
    assert piece_tokens("café") == pytest.approx(1.0 + 0.8 + 0.28)  # ASCII run + other-script run
    assert piece_tokens("→") > piece_tokens("-")  # non-ASCII symbols cost extra
    assert piece_tokens("🙂") > piece_tokens("→")


def test_cyrillic_outside_the_russian_alphabet_costs_more() -> None:
    # Ukrainian, Belarusian and Serbian letters mark words the Russian-heavy vocabularies split
    # finer (1.2x-1.6x the tokens per unit on the fit split of bench/fidelity).
    assert piece_tokens(" їжак") == pytest.approx((0.7 + 0.28 * 4) * 1.45)
    assert piece_tokens(" ежак") == pytest.approx(0.7 + 0.28 * 4)
    assert piece_tokens(" Їжак") == pytest.approx((0.7 + 0.28 * 4) * 1.45 * 1.45)  # and a capital
    for word in ("Київ", "єдиний", "ґанок", "ўсё", "љубав", "њива", "џеп", "ђак", "ћерка", "јато", "ѕвезда"):
        plain = word.translate(str.maketrans("їієґўљњџђћјѕ", "ииеоулнцдтйз"))
        assert piece_tokens(word) == pytest.approx(piece_tokens(plain) * 1.45), word
    assert piece_tokens(" привет") == pytest.approx(0.7 + 0.28 * 6)  # Russian: unchanged


def test_a_cyrillic_word_not_after_a_space_costs_more() -> None:
    # The vocabularies hold Cyrillic words mostly in lower case after a space: after a line break,
    # a digit or punctuation, or with a capital, they ran ~1.45x the tokens per unit.
    spaced = piece_tokens(" привет")
    assert piece_tokens(" Привет") == pytest.approx(spaced * 1.45)
    assert piece_tokens(" ПРИВЕТ") == pytest.approx(spaced * 1.45)
    assert piece_tokens("привет", inner=True) == pytest.approx(spaced * 1.45)
    assert piece_tokens("(привет") == pytest.approx(spaced * 1.45 + 0.5)
    assert piece_tokens("\tпривет") == pytest.approx(spaced * 1.45)
    # the first word of a text is priced as after a space: text added in front never costs less
    assert piece_tokens("привет") == pytest.approx(spaced)
    assert text_size("привет") == text_size(" привет") == 5
    assert text_size("\nпривет") == 2 + round(2 * spaced * 1.45)
    assert text_size("мир\nпривет") > text_size("мир привет")
    assert sum(sizing.class_units("мир\nпривет")) == text_size("мир\nпривет")
    assert piece_tokens(" Hello") == piece_tokens(" hello")  # Latin script: unchanged


def test_east_asian_characters_cost_what_the_vocabularies_spend_on_them_alone() -> None:
    # A common ideograph is one token in every vocabulary; a rare one two or three byte-level
    # tokens: the table read off the vocabularies (bench/tokens/cjk_costs.py) prices them apart,
    # where one price per character priced both alike.
    assert piece_tokens("的") == pytest.approx(0.9)
    assert piece_tokens("櫀") == pytest.approx(0.9 * 3)  # three byte-level tokens everywhere
    assert piece_tokens("뷁") > piece_tokens("한")  # a rare hangul syllable against a common one
    assert piece_tokens("の") == piece_tokens("ア") == pytest.approx(0.9)  # kana: one token alone
    # Outside the table's blocks (extension A, bopomofo, compatibility jamo): the flat price.
    for ch in ("㐀", "ㄅ", "ㄱ"):
        assert piece_tokens(ch) == pytest.approx(WEIGHTS.cjk_per_char)


def test_the_vocabulary_table_covers_its_blocks_one_level_per_code_point() -> None:
    from contextsvc.core import _cjk_costs

    assert len(sizing._CJK_LEVELS) == sum(end - first for first, end in _cjk_costs.BLOCKS) == 32_356
    assert max(sizing._CJK_LEVELS) <= 12  # at most 4 tokens alone on average
    # Most ideographs cost about two tokens alone; hundreds are a single token everywhere.
    han = sizing._CJK_LEVELS[: 0xA000 - 0x4E00]
    assert sorted(han)[len(han) // 2] == 4 and han.count(0) > 500


def test_weights_change_the_price() -> None:
    heavier = dataclasses.replace(WEIGHTS, cyrillic_per_letter=0.5)
    assert piece_tokens("привет", heavier) > piece_tokens("привет")
    assert piece_tokens("привет", SizeWeights()) == piece_tokens("привет")


def test_weights_are_pinned() -> None:
    w = SizeWeights()
    assert w.units_per_token == 2  # one unit ~ half a token: tokens/unit ~0.5, mid-range in [0.25, 1.0]
    assert (w.free_letters, w.per_long_letter, w.word_letters, w.per_odd_letter) == (6, 0.15, 12, 0.4)
    assert (w.cyrillic_base, w.cyrillic_per_letter, w.cjk_per_char, w.cjk_table_scale) == (0.7, 0.28, 1.0, 0.9)
    assert (w.cyrillic_rare_factor, w.cyrillic_unspaced_factor) == (1.45, 1.45)
    assert (w.separate_prefixes, w.separate_prefix, w.odd_prefix) == (":+~=", 1.0, 0.5)
    assert (w.message_frame, w.tool_call_frame) == (4.0, 8.0)


# --- text_size ----------------------------------------------------------------------------------


def test_nothing_weighs_nothing_and_every_character_weighs_something() -> None:
    assert text_size("") == 0
    assert all(text_size(ch) >= 1 for ch in ("a", " ", "\n", "1", "{", "я", "日", "🙂", "\x00"))


def test_digits_are_priced_in_groups_of_three() -> None:
    assert text_size("1234567") == 3 * 2
    assert text_size("1" * 300) == 100 * 2


text_st = st.text(alphabet=st.sampled_from([*'abcXYZ019 _.-:"{}\n\t', "я", "Ж", "日", "é", "→", "🙂"]), max_size=120)


@given(text_st, text_st)
def test_more_text_never_costs_less(a: str, b: str) -> None:
    assert text_size(a + b) >= text_size(a)
    assert text_size(a + b) >= text_size(b)


@given(st.text(max_size=200))
def test_more_of_any_text_never_costs_less(text: str) -> None:
    for cut in range(0, len(text), 7):
        assert text_size(text[:cut]) <= text_size(text)


@given(st.text(max_size=400))
def test_the_size_is_deterministic(text: str) -> None:
    first = text_size(text)
    sizing.clear_caches()
    assert text_size(text) == first == text_size(str(text))
    assert first == sum(piece_units(p) for p in pieces(text))


def test_long_texts_are_remembered_and_copies_hit() -> None:
    text = "The build failed because the database tests timed out again. " * 500
    sizing.clear_caches()
    size = text_size(text)
    copy = "".join([text[:100], text[100:]])  # an equal string, another object
    assert copy is not text and text_size(copy) == size
    assert sizing._MEMO.get(text) == size


def test_the_memo_keeps_a_bounded_number_of_characters() -> None:
    memo = sizing._TextMemo[int](max_chars=1000)
    texts = [f"{i:04d}" + "x" * 300 for i in range(5)]
    for i, text in enumerate(texts):
        memo.put(text, i)
    kept = [memo.get(t) for t in texts]
    assert kept[:3] == [None, None, None] and kept[3:] == [3, 4]  # oldest dropped first
    memo.put("y" * 5000, 9)  # larger than the whole memo: not kept, nothing evicted for it
    assert memo.get("y" * 5000) is None and memo.get(texts[4]) == 4


def test_a_megabyte_of_one_character_costs_in_proportion() -> None:
    one = text_size("x" * 32_000)
    assert text_size("x" * 1_000_000) == pytest.approx(one * 1_000_000 / 32_000, rel=0.01)


# --- content classes: Han, kana and hangul are priced apart ------------------------------------


@pytest.mark.parametrize(
    ("text", "cls"),
    [
        ("数据库连接超时", sizing.HAN),
        ("データベース", sizing.KANA),
        ("ひらがな", sizing.KANA),
        ("데이터베이스", sizing.HANGUL),
        ("Сервер", sizing.CYRILLIC),
        ("Müller", sizing.OTHER),
    ],
)
def test_each_east_asian_script_has_its_own_class(text: str, cls: int) -> None:
    units = sizing.class_units(text)
    assert units[cls] == text_size(text) > 0, units
    assert sizing.piece_class(text) == cls


def test_a_piece_mixing_kanji_and_kana_shares_its_units_by_character() -> None:
    # One letter run (a BPE piece) of kanji and kana: its units go to both classes, by count.
    piece = "設定ファイル"  # 2 kanji + 4 kana
    assert pieces(piece) == [piece]
    units = sizing.class_units(piece)
    assert units[sizing.HAN] + units[sizing.KANA] == piece_units(piece)
    assert units[sizing.KANA] == 2 * units[sizing.HAN]
    assert sizing.piece_class(piece) == sizing.KANA  # the class most of its characters are in
    assert sum(units) == text_size(piece)


@given(st.text(alphabet=st.sampled_from("数据库データ데이터 ab,1\n"), max_size=60))
def test_class_units_always_sum_to_the_size(text: str) -> None:
    assert sum(sizing.class_units(text)) == text_size(text)


def test_the_split_keeps_the_first_versions_classes_otherwise() -> None:
    # Every class of the first feature set but ``cjk`` keeps its name and order.
    legacy = [c for c in sizing.LEGACY_CLASSES if c != "cjk"]
    assert [c for c in sizing.CLASSES if c not in ("han", "kana", "hangul")] == legacy
    assert tuple(sizing.CLASSES[c] for c in sizing.CJK_CLASSES) == ("han", "kana", "hangul")


# --- round 9: camelCase is priced as words, a long Cyrillic word costs less per letter ----------


@pytest.mark.parametrize(
    ("piece", "cls"),
    [
        ("getValue", sizing.WORD),
        (" DescribeInstances", sizing.WORD),
        ("value", sizing.WORD),
        ("HTTPServer", sizing.IDENT),  # acronym humps: not words to the vocabularies
        ("_name", sizing.IDENT),  # a ``_`` or ``.`` prefix: Claude spends a token on it
        (".attr", sizing.IDENT),
        ('"userId', sizing.IDENT),  # a punctuation prefix
    ],
)
def test_camel_case_humps_are_words_and_prefixed_names_identifiers(piece: str, cls: int) -> None:
    assert pieces(piece) == [piece]
    assert sizing.piece_class(piece) == cls


def test_camel_case_costs_what_it_did() -> None:
    # Only the class moved: a hump is still one token, so the size of code and JSON is unchanged.
    assert piece_tokens("getValue") == pytest.approx(2.0)
    assert sizing.class_units('{"instanceId": "i-1", "DescribeInstances": []}')[sizing.WORD] > 0


def test_a_long_cyrillic_word_costs_less_per_letter_than_a_short_one() -> None:
    # The vocabularies hold common Russian words whole: tokens grow slower than letters.
    short, long = piece_tokens(" дом"), piece_tokens(" перезапустили")
    assert short == pytest.approx(0.7 + 0.28 * 3)
    assert long / 13 < short / 3
    # Bounded: never under one token, never more than the old per-letter rule on long words.
    assert piece_tokens(" и") == 1.0
    assert all(piece_tokens(" " + "д" * n) <= max(1.0, 0.45 + 0.33 * n) + 0.25 for n in range(1, 33))


# --- round 10: each family's own count of Cyrillic pieces -----------------------------------


@pytest.mark.parametrize(
    ("piece", "counts"),
    [
        # (o200k, cl100k, Llama 3, Claude), each counted alone by the real tokenizers
        (" слово", (1, 2, 1, 2)),
        (" достопримечательности", (5, 7, 6, 9)),
        ("выполнить", (4, 5, 4, 5)),
    ],
)
def test_a_cyrillic_piece_is_counted_in_each_familys_own_vocabulary(piece: str, counts: tuple[int, ...]) -> None:
    assert sizing.cyrillic_family_tokens(piece) == counts
    units = sizing.feature_units(piece)
    assert units[sizing.N_CLASSES : sizing.IDENT_PREFIXED] == tuple(WEIGHTS.units_per_token * c for c in counts)


def test_the_families_disagree_the_way_their_vocabularies_do() -> None:
    # o200k and Llama 3 hold far more Russian words whole than cl100k and Claude.
    text = "Служба перезапущена после обновления конфигурации, проверьте журнал событий."
    o200k, cl100k, llama3, claude = sizing.feature_units(text)[sizing.N_CLASSES : sizing.IDENT_PREFIXED]
    assert o200k < cl100k and llama3 < claude
    assert max(o200k, llama3) < min(cl100k, claude)


def test_the_class_units_still_sum_to_the_size_and_text_without_cyrillic_has_no_family_units() -> None:
    for text in ("Привет, мир! Это тест.", "def get_user_id(x): return x['id']", "数据库 データ"):
        units = sizing.feature_units(text)
        assert len(units) == sizing.N_UNIT_COLUMNS
        assert sum(units[: sizing.N_CLASSES]) == text_size(text) and units[: sizing.N_CLASSES] == sizing.class_units(
            text
        )
        assert any(units[sizing.N_CLASSES : sizing.IDENT_PREFIXED]) == bool(units[sizing.CYRILLIC])


def test_a_prefix_costs_a_token_and_latin_letters_their_shared_price() -> None:
    # A punctuation prefix stays a token of its own; a Latin run inside the piece is priced as usual.
    word = sizing.cyrillic_family_tokens("слово")
    assert sizing.cyrillic_family_tokens("(слово") == tuple(1.0 + t for t in word)
    mixed = sizing.cyrillic_family_tokens("Linuxсистема")
    alone = sizing.cyrillic_family_tokens("система")
    assert mixed == tuple(piece_tokens("Linux") + t for t in alone)


def test_a_letter_no_vocabulary_holds_costs_its_two_bytes() -> None:
    # U+0460 (Cyrillic omega) is in none of the four vocabularies as a token of its own.
    assert sizing.cyrillic_family_tokens("\u0460") == (2.0, 2.0, 2.0, 2.0)


@given(st.text(alphabet=st.sampled_from("абвгдеёжзиклмнопрстуфхцчшщъыьэюяАБВЇї a,1\n"), max_size=80))
def test_family_units_are_deterministic_and_never_below_one_a_piece(text: str) -> None:
    units = sizing.feature_units(text)
    sizing.clear_caches()
    assert sizing.feature_units(text) == units
    n = sum(1 for p in pieces(text) if sizing.piece_class(p) == sizing.CYRILLIC)
    assert all(u >= WEIGHTS.units_per_token * n for u in units[sizing.N_CLASSES : sizing.IDENT_PREFIXED])


def test_text_without_cyrillic_never_unpacks_the_vocabularies() -> None:
    # The tables are unpacked at the first Cyrillic piece, so a process that sizes none pays nothing.
    code = (
        "import sys\n"
        "from contextsvc.core import sizing\n"
        "sizing.feature_units('plain English text, code(x) and 数据')\n"
        "assert not sizing._CYRILLIC_RANKS and 'contextsvc.core._cyrillic_costs' not in sys.modules\n"
        "sizing.feature_units(' слово')\n"
        "assert len(sizing._CYRILLIC_RANKS) == len(sizing.CYRILLIC_FAMILIES)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize(
    ("text", "prefixed"),
    [
        ("self.attr", [".attr"]),
        ("get_user_id", ["_user", "_id"]),
        ('{"instance_id": "i-1", "node.name": 3}', ["_id", ".name"]),
        ("getValue HTTPServer :aws \tindent", []),  # camelCase, acronyms, other prefixes, a tab: not counted
        (".Привет _мир", []),  # Cyrillic behind the prefix is Cyrillic, not an identifier
    ],
)
def test_prefixed_identifier_pieces_are_counted_again_in_their_own_column(text: str, prefixed: list[str]) -> None:
    units = sizing.feature_units(text)
    assert len(units) == sizing.N_UNIT_COLUMNS == sizing.IDENT_PREFIXED + 1
    assert [p for p in pieces(text) if sizing._piece_split(p)[-1][0] == sizing.IDENT_PREFIXED] == prefixed
    # the column is a price on top: the same units stay in ``ident`` and the classes still sum to the size
    assert units[sizing.IDENT_PREFIXED] == sum(sizing.piece_units(p) for p in prefixed)
    assert all(sizing.piece_class(p) == sizing.IDENT for p in prefixed)
    assert units[sizing.IDENT] >= units[sizing.IDENT_PREFIXED]
    assert sum(units[: sizing.N_CLASSES]) == text_size(text)


@given(st.text(alphabet=st.sampled_from("ab_.XY :\n1й"), max_size=60))
def test_the_prefixed_column_is_the_prefixed_ident_pieces_units(text: str) -> None:
    found = pieces(text)
    expected = sum(sizing.piece_units(p) for p in found if p[0] in "_." and sizing.piece_class(p) == sizing.IDENT)
    assert sizing.feature_units(text)[sizing.IDENT_PREFIXED] == expected
