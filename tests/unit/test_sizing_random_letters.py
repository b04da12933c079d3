"""Letters with no word in them (random ids, keys, base64) priced near their real tokens, cold.

The counts below were taken once with the bench's four tokenizers (``bench/tokens/count.mjs``:
o200k, cl100k, Llama 3 and the old Claude vocabulary); the unit tests do not need node. Priced
by their case humps (one token a hump), these texts were estimated 38-62 % under each count:
a view of random text that the estimate said fits could be twice the model's window.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from contextsvc.config import TokenSettings
from contextsvc.core import sizing
from contextsvc.core.calibration import fallback
from contextsvc.core.tokens import CalibratedCounter

_FAMILIES = ("o200k", "cl100k", "llama3", "claude")
#: (text, real tokens in o200k, cl100k, Llama 3, Claude)
_RANDOM = (
    (  # random.choices(ascii_letters, k=240)
        "AlKorSTKsuxiLIwjFbDvIYDPizVxtLBTQGhDWxetdNQgvAPebNtHUfKVOjMsPNPhmgqoczWynQhdznIwaFFrkAzQzZpCHddJWIQTK"
        "cajrJeozaCGprlwMrtmtSJihIRcLZnHUwpMnQGPJsdkHxLFtUlHAfzEcMKBTnBSZMkKTWnQJoePvcvDQVrvGVEaBfEtUuOmNAqNGyx"
        "dTDvmVwqVRKCJoLALULHVVwevMegjYUFNrdtp",
        (146, 157, 157, 148),
    ),
    (  # 40 "words" of 3-9 random lower-case letters
        "bmhm tupm uzdavtil zxtchcwzl gve gtgm cmpgkx mghsziui ocljnrigq wzi euriwkk iqkugidxh eimgnm lqeb gujf "
        "hdztbxj cji lyylozn xikvt ata yijmpwdn afxdikpm xcl pay jcscicu krvr vqmhobtf lsebve jyevwx rmgpsutzx "
        "jnioh nujkqms smeq ggo tdx fkmfwgyh yvx elpzyqaln ctv kba",
        (123, 132, 131, 128),
    ),
    (  # random.choices(ascii_letters + digits, k=240)
        "6aqUZD8yjwp8sPvX3M9s8VevXMvf4MeS4cdfGBr2P8cRBH5CQXDsMOZhdSBX6xkb9DetvzYZpNEeSfutR28VXqa1XCiCR8Nz9diHMr"
        "UvQ1Wj3U52isCfVv6IXGDgHDXwqvk7jBOpO7M5movIwD1Jci3vvNgXiaDdEOdutjCF9l2RG9ClZqR8KameGp56rvRVdr8Iehk6XhJw"
        "YT9dvH4zdk0lB2E9PwDUlF20Rk3zQ3QYhgcs",
        (167, 182, 181, 170),
    ),
)


@pytest.mark.parametrize(("text", "counts"), _RANDOM)
def test_random_letters_are_not_priced_as_words(text: str, counts: tuple[int, ...]) -> None:
    for family, real in zip(_FAMILIES, counts, strict=True):
        estimate = CalibratedCounter(fallback(TokenSettings(), family=family)).count_text(text)
        # Under is what overflows a window; Claude's old vocabulary holds fewer of these pieces.
        assert 0.8 * real <= estimate <= 1.3 * real, (family, estimate, real)


@pytest.mark.parametrize(
    "word",
    ["configuration", "getValueFromCache", "DescribeInstances", "the", "quick", "Python", "HTTPServer"],
)
def test_words_keep_the_hump_price(word: str) -> None:
    humps = sizing._HUMP.findall(word)
    w = sizing.WEIGHTS
    by_humps = sum(
        1.0
        + w.per_long_letter * max(0, min(len(h), w.word_letters) - w.free_letters)
        + w.per_odd_letter * max(0, len(h) - w.word_letters)
        for h in humps
    )
    assert sizing.piece_tokens(word) == pytest.approx(by_humps)


def test_a_run_cut_into_short_pieces_costs_a_token_a_piece() -> None:
    assert sizing._latin_pieces("configuration") <= 2
    assert sizing._latin_pieces("xqzvkjw") >= 3
    assert sizing.piece_tokens("xqzvkjw") == sizing._latin_pieces("xqzvkjw")


def test_text_without_letters_never_unpacks_the_token_list() -> None:
    code = (
        "import sys\n"
        "from contextsvc.core import sizing\n"
        "sizing.feature_units('12 + 345 = 357; 数据')\n"
        "assert not sizing._LATIN_TOKENS and 'contextsvc.core._latin_tokens' not in sys.modules\n"
        "sizing.feature_units('configuration')\n"
        "assert len(sizing._LATIN_TOKENS[0]) > 40_000\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
