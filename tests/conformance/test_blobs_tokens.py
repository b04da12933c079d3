"""Blobs (content-addressed, stored once), calibration observations and built views."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from contextsvc.core.calibration import Observation
from contextsvc.core.priors import N_FEATURES
from contextsvc.errors import InvalidArgument, NotFound
from contextsvc.ports import SessionStore
from tests.conformance.helpers import ALICE, Reopen, user, view
from tests.support.stores import Backing


async def test_a_blob_is_stored_once_under_its_sha256(store: SessionStore, backing: Backing, reopen: Reopen) -> None:
    data = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 10
    blob_id = hashlib.sha256(data).hexdigest()
    assert await store.get_blob(blob_id) is None
    await store.put_blob(data, blob_id=blob_id)
    await store.put_blob(data, blob_id=blob_id)
    other = b"another image"
    await store.put_blob(other, blob_id=hashlib.sha256(other).hexdigest())
    assert await backing.count_blobs() == 2
    assert await store.get_blob(blob_id) == data

    store = await reopen()
    assert await store.get_blob(blob_id) == data
    await store.put_blob(data, blob_id=blob_id)
    assert await backing.count_blobs() == 2


async def test_a_blob_id_must_be_the_content_address(store: SessionStore, backing: Backing) -> None:
    data = b"bytes"
    with pytest.raises(InvalidArgument):
        await store.put_blob(data, blob_id=hashlib.sha256(b"other").hexdigest())
    for bad in ("../../etc/passwd", hashlib.sha256(data).hexdigest().upper(), "", "ab"):
        with pytest.raises(InvalidArgument):
            await store.put_blob(data, blob_id=bad)
        assert await store.get_blob(bad) is None
    assert await backing.count_blobs() == 0


async def test_observations_are_per_model_newest_last(store: SessionStore, reopen: Reopen) -> None:
    gpt = [Observation(chars=1000 * k, tokens=300 * k) for k in range(1, 13)]
    for obs in gpt:
        await store.add_calibration_observation("gpt", obs)
    await store.add_calibration_observation("llama", Observation(chars=10, tokens=9, had_images=True))
    assert await store.list_calibration_observations("gpt", limit=8) == gpt[-8:]
    assert await store.list_calibration_observations("gpt", limit=100) == gpt
    assert await store.list_calibration_observations("llama", limit=8) == [Observation(10, 9, True)]
    assert await store.list_calibration_observations("unknown", limit=8) == []
    assert await store.list_calibration_observations("gpt", limit=0) == []
    store = await reopen()  # shared by every replica and restart
    assert await store.list_calibration_observations("gpt", limit=8) == gpt[-8:]


async def test_views_keep_the_newest_and_survive_a_clean_restart(store: SessionStore, reopen: Reopen) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user("a")], caller=ALICE)
    before = await store.get_session(sid, caller=ALICE)
    for i in range(5):
        await store.save_view(sid, view(f"v{i}", last_sequence=i), keep=3)
    assert [await store.get_view(sid, f"v{i}") for i in range(5)] == [
        None,
        None,
        view("v2", last_sequence=2),
        view("v3", last_sequence=3),
        view("v4", last_sequence=4),
    ]
    assert await store.get_view(sid, "nope") is None
    assert await store.get_view("00000000-0000-4000-8000-000000000000", "v4") is None
    # Views are soft state: remembering one is not a change of the session.
    assert await store.get_session(sid, caller=ALICE) == before
    with pytest.raises(NotFound):
        await store.save_view("00000000-0000-4000-8000-000000000000", view("x"), keep=3)

    store = await reopen()
    assert await store.get_view(sid, "v4") == view("v4", last_sequence=4)
    assert await store.get_view(sid, "v1") is None


async def test_a_view_saved_again_becomes_the_newest_and_exactly_keep_stay(store: SessionStore) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user("a")], caller=ALICE)
    for i in range(3):
        await store.save_view(sid, view(f"v{i}", last_sequence=i), keep=3)
    await store.save_view(sid, view("v0", last_sequence=7), keep=3)  # saved again: now the newest
    await store.save_view(sid, view("v3", last_sequence=3), keep=3)  # v1 is the oldest now, and goes
    kept = {f"v{i}": await store.get_view(sid, f"v{i}") for i in range(4)}
    assert kept == {
        "v0": view("v0", last_sequence=7),
        "v1": None,
        "v2": view("v2", last_sequence=2),
        "v3": view("v3", last_sequence=3),
    }
    await store.save_view(sid, view("v4", last_sequence=4), keep=1)
    assert [await store.get_view(sid, f"v{i}") is not None for i in range(5)] == [False, False, False, False, True]


async def test_residuals_and_priced_tokens_are_shared_through_the_store(store: SessionStore, reopen: Reopen) -> None:
    # The margin is a quantile of the residuals of recent baselines (core/calibration.py): every
    # replica must read them back, with the features, as they were written.
    features = tuple(float(k) for k in range(N_FEATURES))
    written = [
        Observation(chars=100, tokens=80, features=features, residual=0.125),
        Observation(chars=200, tokens=150, features=features, residual=-0.03125),
        Observation(chars=300, tokens=200, features=features),  # no residual known
    ]
    for obs in written:
        await store.add_calibration_observation("gpt-res", obs)
    assert await store.list_calibration_observations("gpt-res", limit=8) == written
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user("a")], caller=ALICE)
    # image_tokens: the truncation floor of a view with images (engine/views.py ``_truncation``);
    # shape: which later views its baseline may anchor (core/profile.py ``view_shape``).
    priced = dataclasses.replace(
        view("vp", last_sequence=1),
        priced_tokens=321,
        features=features,
        had_images=True,
        image_tokens=1026,
        shape="3f2a9c0d1e4b5a67",
    )
    await store.save_view(sid, priced, keep=3)
    assert await store.get_view(sid, "vp") == priced
    store = await reopen()
    assert await store.list_calibration_observations("gpt-res", limit=8) == written
    assert await store.get_view(sid, "vp") == priced


async def test_a_view_keeps_how_it_cut_its_rows_across_a_restart(store: SessionStore, reopen: Reopen) -> None:
    """A view's cuts (the rows it sent cut, with the features of each cut) come back as saved, on
    every store and after a restart: a baseline of the view carries them into the anchor."""
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user("a"), user("b"), user("c")], caller=ALICE)
    cuts = ((2, tuple(range(N_FEATURES))), (3, tuple(range(10, 10 + N_FEATURES))))
    await store.save_view(sid, dataclasses.replace(view("cut", last_sequence=3), cuts=cuts), keep=3)
    await store.save_view(sid, dataclasses.replace(view("whole", last_sequence=3), cuts=()), keep=3)
    await store.save_view(sid, view("unknown", last_sequence=3), keep=3)  # as written before cuts were kept
    for reopened in (False, True):
        if reopened:
            store = await reopen()
        assert (await store.get_view(sid, "cut")).cuts == cuts  # type: ignore[union-attr]
        assert (await store.get_view(sid, "whole")).cuts == ()  # type: ignore[union-attr]
        # Not known is not "none cut": an anchor of it prices no row anew.
        assert (await store.get_view(sid, "unknown")).cuts is None  # type: ignore[union-attr]
