"""``core.codec.copy_plain``: the stores' deep copy of session state and metadata (issue #15)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime

from contextsvc.core.codec import copy_plain


def test_a_json_like_value_is_copied_deeply_and_equals_what_deepcopy_gives() -> None:
    value = {
        "epoch": 3,
        "baseline": {"tokens": 1200, "last_sequence": 41, "view_id": "ab"},
        "tags": ["a", {"nested": [1, 2.5, None, True]}],
        "empty": {},
    }
    copied = copy_plain(value)
    assert copied == value == copy.deepcopy(value)
    # Nothing is shared: changing the copy at any depth leaves the original as it was.
    copied["baseline"]["tokens"] = 0
    copied["tags"][1]["nested"].append(9)
    copied["empty"]["x"] = 1
    assert value["baseline"]["tokens"] == 1200
    assert value["tags"][1]["nested"] == [1, 2.5, None, True]
    assert value["empty"] == {}


def test_values_outside_json_still_get_a_deep_copy() -> None:
    when = datetime(2026, 1, 2, tzinfo=UTC)
    inner = {"k": [1]}
    value = {"pair": (inner, 2), "when": when, "items": {1, 2}}
    copied = copy_plain(value)
    assert copied == value
    assert copied["pair"][0] is not inner  # a tuple holding a dict: deepcopy's copy of it
    copied["items"].add(3)
    assert value["items"] == {1, 2}
