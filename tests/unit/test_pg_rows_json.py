"""The PostgreSQL store's JSON encoder (``rows.dumps``, also asyncpg's json/jsonb codec) writes
exactly what ``json.dumps`` with the same options writes, whatever the value."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from contextsvc.stores.postgres.rows import dumps

_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text()
_VALUES = st.recursive(
    _LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
)


def _reference(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@given(_VALUES)
def test_the_cached_encoder_writes_what_json_dumps_writes(value: Any) -> None:
    assert dumps(value) == _reference(value)


def test_known_values() -> None:
    value = {"é": "日本\u2028", "n": [1, 2.5, None, True], "nan": math.nan, "inf": -math.inf, "nested": {"a": []}}
    assert dumps(value) == _reference(value)
    assert dumps(value).startswith('{"é":"日本\u2028","n":[1,2.5,null,true],"nan":NaN,')
    assert dumps({}) == "{}" and dumps([]) == "[]"
