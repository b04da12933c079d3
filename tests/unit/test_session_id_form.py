"""``require_session_id``: the canonical form passes as is, every other form ``uuid.UUID`` reads is
normalized to it, anything else is INVALID_ARGUMENT."""

from __future__ import annotations

import uuid

import pytest

from contextsvc.engine.validation import require_session_id
from contextsvc.errors import InvalidArgument

SID = "0f8e4c2a-9b1d-4e3f-8a7b-6c5d4e3f2a1b"


def test_the_canonical_form_is_given_back() -> None:
    assert require_session_id(SID) == SID
    for _ in range(50):
        sid = str(uuid.uuid4())
        assert require_session_id(sid) == sid


@pytest.mark.parametrize(
    "other", [SID.upper(), "{" + SID + "}", "urn:uuid:" + SID, SID.replace("-", ""), SID.upper().replace("-", "")]
)
def test_other_forms_are_normalized(other: str) -> None:
    assert require_session_id(other) == SID


@pytest.mark.parametrize(
    "bad", ["x", SID[:-1], SID + "0", SID + "\n", " " + SID, "g" * 32, SID.replace("-", "_"), "z" + SID[1:]]
)
def test_anything_else_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="must be a UUID"):
        require_session_id(bad, "session_id")


def test_an_empty_id_is_required() -> None:
    with pytest.raises(InvalidArgument, match="is required"):
        require_session_id("")
