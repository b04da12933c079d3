"""Token accounting through the engine: BuildContext estimates, RecordBaseline, EstimateTokens."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from contextsvc.config import ProfileConfig, Settings
from contextsvc.core.messages import Flags, Message, Role, ToolCall
from contextsvc.core.priors import MESSAGE, family_for, prior_for
from contextsvc.core.profile import CompressionOverrides, ProfileOverrides
from contextsvc.core.session import ANONYMOUS
from contextsvc.core.tokens import EstimateMethod
from contextsvc.engine.engine import Engine
from contextsvc.engine.remembered_profile import session_profile
from contextsvc.engine.validation import IncomingImage, IncomingMessage
from contextsvc.errors import ContextTooLarge, InvalidArgument, NotFound
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.stores.files import FilesStore
from contextsvc.stores.memory import MemoryData, MemoryStore
from tests.support.engines import make_engine


def _settings(**profile: Any) -> Settings:
    return Settings(profiles={"default": ProfileConfig(**profile)}, store="memory")


async def _engine(settings: Settings, data: MemoryData | None = None) -> tuple[Engine, MemoryEventBus]:
    store = MemoryStore(settings, data=data)
    await store.open()
    bus = MemoryEventBus(retention=100)
    return make_engine(store, settings, bus=bus), bus


def _msg(role: Role, content: str = "", **kw: Any) -> IncomingMessage:
    images = kw.pop("images", ())
    return IncomingMessage(Message(role=role, content=content, **kw), images=tuple(images))


async def _session_with(engine: Engine, *messages: IncomingMessage) -> str:
    s = await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})
    await engine.append(ANONYMOUS, s.id, list(messages), request_id="", turn_complete=False)
    return s.id


async def _build(engine: Engine, sid: str, incoming: IncomingMessage | None = None, **profile: Any) -> Any:
    return await engine.build_context(
        ANONYMOUS,
        sid,
        profile=ProfileOverrides(**profile),
        incoming=incoming,
        mid_turn=False,
        auto_compress=True,
    )


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


async def test_build_injects_profile_prompt_fresh_and_allow_listed_records_only() -> None:
    engine, _ = await _engine(_settings(system_prompt="You are v1."))
    sid = await _session_with(
        engine,
        _msg(Role.SYSTEM, "note for the model", metadata={"source": "task_note"}),
        _msg(Role.SYSTEM, "audit record", metadata={"source": "audit"}),
        _msg(Role.USER, "hello"),
    )
    view = await _build(engine, sid)
    contents = [(vm.message.role, vm.message.content) for vm in view.messages]
    assert contents == [(Role.SYSTEM, "You are v1."), (Role.SYSTEM, "note for the model"), (Role.USER, "hello")]
    # A profile change applies at once: the prompt is never stored.
    view2 = await _build(engine, sid, system_prompt="You are v2.")
    assert view2.messages[0].message.content == "You are v2."
    assert view2.estimate.segments.system > 0 and view2.estimate.segments.records > 0


async def test_view_is_repaired_into_a_legal_sequence() -> None:
    engine, _ = await _engine(_settings())
    call = ToolCall(id="c1", name="ls", arguments_json="{}")
    sid = await _session_with(
        engine,
        _msg(Role.TOOL, "orphan result", tool_call_id="zz"),
        _msg(Role.USER, "list files"),
        _msg(Role.ASSISTANT, "", tool_calls=(call,)),
        _msg(Role.TOOL, "a.txt", tool_call_id="c1"),
        _msg(Role.ASSISTANT, "one file"),
    )
    view = await _build(engine, sid)
    roles = [vm.message.role for vm in view.messages]
    assert roles == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]


async def test_one_megabyte_tool_result_is_cut_in_the_view_only() -> None:
    engine, _ = await _engine(_settings(context_window=32768))
    call = ToolCall(id="c1", name="dump", arguments_json="{}")
    huge = "x" * (1024 * 1024)
    sid = await _session_with(
        engine,
        _msg(Role.USER, "dump it"),
        _msg(Role.ASSISTANT, "", tool_calls=(call,)),
        _msg(Role.TOOL, huge, tool_call_id="c1"),
    )
    view = await _build(engine, sid)
    cut = view.messages[-1]
    assert cut.truncated and "chars cut" in cut.message.content
    assert len(cut.message.content) < 200_000
    # The estimate counts the cut view, so the session is not "too large" for a prompt never sent.
    assert view.estimate.total < 32768 // 6 + 1000
    assert any("cut to fit" in n for n in view.notices)
    stored = await engine.store.get_messages(sid, caller=ANONYMOUS, first=3, last=3)
    assert stored[0].content == huge


async def test_baseline_truncated_refused_previous_survives_and_session_flagged() -> None:
    engine, bus = await _engine(_settings(context_window=32768))
    sid = await _session_with(engine, _msg(Role.USER, "a" * 18_000))
    first = await _build(engine, sid)
    ok = await engine.record_baseline(ANONYMOUS, sid, view_id=first.view_id, prompt_tokens=first.estimate.total)
    assert ok.recorded and not ok.truncated
    session = await engine.store.get_session(sid, caller=ANONYMOUS)
    baseline_before = session.state["baseline"]

    # A view estimated at ~10,000 tokens, reported as 6,000: a silently truncated prompt.
    second = await _build(engine, sid)
    assert second.estimate.method is EstimateMethod.BASELINE_DELTA
    reported = int(second.estimate.total * 0.6)
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=second.view_id, prompt_tokens=reported)
    assert result.truncated and not result.recorded
    session = await engine.store.get_session(sid, caller=ANONYMOUS)
    assert session.context_truncated  # the post-turn check compresses regardless of the threshold
    assert session.state["baseline"] == baseline_before
    kinds = [e.kind for e in list(bus._log)]
    assert kinds.count("baseline_recorded") == 1 and "context_truncated" in kinds


async def test_an_honest_count_of_filler_text_is_recorded_not_taken_for_truncation() -> None:
    # "x" * 4000 is 500 tokens in o200k (counted with bench/tokens/count.mjs); the view adds the
    # chat template's frame (~4 a message, 3 for the reply primer). Priced per letter like a rare
    # word, it was estimated at ~1,290 tokens and this honest count refused as a truncated prompt.
    engine, _ = await _engine(_settings(context_window=32768, model="gpt-4o"))
    sid = await _session_with(engine, _msg(Role.USER, "x" * 4000))
    view = await _build(engine, sid)
    assert view.estimate.total < 600
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=500 + 7)
    assert result.recorded and not result.truncated
    session = await engine.store.get_session(sid, caller=ANONYMOUS)
    assert not session.context_truncated


@pytest.mark.parametrize("reported", [100_000_000, 2**62])
async def test_a_count_no_tokenizer_could_make_is_refused_and_changes_nothing(reported: int) -> None:
    """A count past a token a byte of the view plus ``baseline_unseen_tokens`` (a client summing
    usage, or a garbage number) is INVALID_ARGUMENT: it neither anchors the session nor joins the
    model's fit, which prices every other session of the model."""
    settings = _settings(context_window=32768, model="m-ceiling")
    engine, bus = await _engine(settings)
    sid = await _session_with(engine, _msg(Role.USER, "hello there"))
    other = await _session_with(engine, _msg(Role.USER, "w " * 300))
    view = await _build(engine, sid)
    ok = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
    assert ok.recorded
    before = await engine.store.get_session(sid, caller=ANONYMOUS)
    observations = len(await engine.store.list_calibration_observations("m-ceiling", limit=100))
    other_before = (await _build(engine, other)).estimate
    again = await _build(engine, sid)
    with pytest.raises(InvalidArgument) as refused:
        await engine.record_baseline(ANONYMOUS, sid, view_id=again.view_id, prompt_tokens=reported)
    assert [v.field for v in refused.value.violations] == ["prompt_tokens"]
    after = await engine.store.get_session(sid, caller=ANONYMOUS)
    assert after.state["baseline"] == before.state["baseline"]
    assert len(await engine.store.list_calibration_observations("m-ceiling", limit=100)) == observations
    assert (await _build(engine, other)).estimate == other_before
    assert [e.kind for e in list(bus._log)].count("baseline_recorded") == 1
    # Right at the ceiling is still a count (tool definitions can be large): recorded.
    record = await engine.store.get_view(sid, again.view_id)
    assert record is not None and record.chars > 0
    ceiling = 4 * record.chars + settings.tokens.baseline_unseen_tokens
    with pytest.raises(InvalidArgument):
        await engine.record_baseline(ANONYMOUS, sid, view_id=again.view_id, prompt_tokens=ceiling + 1)
    assert (await engine.record_baseline(ANONYMOUS, sid, view_id=again.view_id, prompt_tokens=ceiling)).recorded


async def test_a_baseline_anchors_only_views_of_its_shape_model_and_system_prompt() -> None:
    """A real count of a view with one model and system prompt says nothing of a view sent with
    another: a build after such a change is priced afresh (as a new session of the same rows
    would be), and a build back in the baseline's shape uses it again."""
    engine, _ = await _engine(_settings(context_window=32768))
    rows = [_msg(Role.USER, "w " * 200), _msg(Role.ASSISTANT, "noted, " * 50)]
    sid = await _session_with(engine, *rows)
    long_prompt = "You review deploys carefully and cite the log lines you rely on. " * 90
    first = await _build(engine, sid, model="pc", system_prompt=long_prompt)
    ok = await engine.record_baseline(ANONYMOUS, sid, view_id=first.view_id, prompt_tokens=first.estimate.total)
    assert ok.recorded
    anchored = await _build(engine, sid, model="pc", system_prompt=long_prompt)
    assert anchored.estimate.method is EstimateMethod.BASELINE_DELTA

    fresh_sid = await _session_with(engine, *rows)
    for change in (
        {"model": "pd", "context_window": 1024, "system_prompt": "Be terse."},
        {"model": "pc", "system_prompt": "Be terse."},  # the system prompt alone
        {"model": "pd", "system_prompt": long_prompt},  # the model alone
    ):
        other = await _build(engine, sid, **change)
        assert other.estimate.method is not EstimateMethod.BASELINE_DELTA, change
        assert other.estimate == (await _build(engine, fresh_sid, **change)).estimate, change
    # The long prompt's count no longer prices a nine-character one.
    terse = await _build(engine, sid, model="pc", system_prompt="Be terse.")
    assert terse.estimate.segments.system < 20
    again = await _build(engine, sid, model="pc", system_prompt=long_prompt)
    assert again.estimate.method is EstimateMethod.BASELINE_DELTA
    assert again.estimate.total == anchored.estimate.total


async def test_a_baseline_keeps_its_shape_through_a_restart(tmp_path: Path) -> None:
    settings = Settings(profiles={"default": ProfileConfig(context_window=32768)}, store=f"files:{tmp_path}")
    store = FilesStore(tmp_path, settings=settings)
    await store.open()
    engine = make_engine(store, settings, retention=10)
    sid = await _session_with(engine, _msg(Role.USER, "w " * 300))
    view = await _build(engine, sid, model="pc", system_prompt="Cite log lines.")
    await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
    await store.close()

    store = FilesStore(tmp_path, settings=settings)
    await store.open()
    engine = make_engine(store, settings, retention=10)
    same = await _build(engine, sid, model="pc", system_prompt="Cite log lines.")
    assert same.estimate.method is EstimateMethod.BASELINE_DELTA
    changed = await _build(engine, sid, model="pc", system_prompt="Be terse.")
    assert changed.estimate.method is not EstimateMethod.BASELINE_DELTA
    await store.close()


async def test_baseline_refusal_uses_seventy_percent_of_the_view_estimate() -> None:
    engine, _ = await _engine(_settings())
    sid = await _session_with(engine, _msg(Role.USER, "b" * 18_000))
    view = await _build(engine, sid)
    est = view.estimate.total
    edge = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=int(est * 0.7) + 1)
    assert edge.recorded
    below = await _build(engine, sid)
    refused = await engine.record_baseline(
        ANONYMOUS, sid, view_id=below.view_id, prompt_tokens=int(below.estimate.total * 0.69)
    )
    assert refused.truncated


async def test_baselines_calibrate_the_model_and_estimates_follow_them() -> None:
    engine, _ = await _engine(_settings(model="m1"))
    sid = await _session_with(engine, _msg(Role.USER, "w " * 2000))
    v1 = await _build(engine, sid)
    assert v1.estimate.method is EstimateMethod.FALLBACK
    await engine.record_baseline(ANONYMOUS, sid, view_id=v1.view_id, prompt_tokens=v1.estimate.total)
    await engine.append(ANONYMOUS, sid, [_msg(Role.USER, "w " * 3000)], request_id="", turn_complete=False)
    v2 = await _build(engine, sid)
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=v2.view_id, prompt_tokens=v2.estimate.total)
    assert result.recorded and result.calibration.observations == 2
    # The estimate of a fresh message list for the same model now uses the calibrated line.
    est = await engine.estimate_tokens(
        ANONYMOUS, model="m1", messages=[_msg(Role.USER, "hello there")], session_id="", profile=ProfileOverrides()
    )
    assert est.method in (EstimateMethod.CALIBRATED, EstimateMethod.FALLBACK)
    other = await engine.estimate_tokens(
        ANONYMOUS, model="m2", messages=[_msg(Role.USER, "hello there")], session_id="", profile=ProfileOverrides()
    )
    assert other.method is EstimateMethod.FALLBACK  # model m1's observations never price m2


async def test_estimate_after_restart_is_the_same(tmp_path: Path) -> None:
    settings = Settings(profiles={"default": ProfileConfig(model="m")}, store=f"files:{tmp_path}")
    store = FilesStore(tmp_path, settings=settings)
    await store.open()
    engine = make_engine(store, settings, retention=10)
    sid = await _session_with(engine, _msg(Role.USER, "z" * 4000))
    for extra in (0, 3000, 9000):
        if extra:
            await engine.append(ANONYMOUS, sid, [_msg(Role.USER, "y" * extra)], request_id="", turn_complete=False)
        v = await _build(engine, sid)
        # A line with slope 0.4 and overhead 50, so a fit is accepted.
        await engine.record_baseline(
            ANONYMOUS,
            sid,
            view_id=v.view_id,
            prompt_tokens=int(50 + 0.4 * sum(len(m.message.content) for m in v.messages)),
        )
    before = await engine.estimate_tokens(ANONYMOUS, model="", messages=[], session_id=sid, profile=ProfileOverrides())
    fresh = await engine.estimate_tokens(
        ANONYMOUS, model="m", messages=[_msg(Role.USER, "q" * 5000)], session_id="", profile=ProfileOverrides()
    )
    await store.close()

    store2 = FilesStore(tmp_path, settings=settings)
    await store2.open()
    engine2 = make_engine(store2, settings, retention=10)
    after = await engine2.estimate_tokens(ANONYMOUS, model="", messages=[], session_id=sid, profile=ProfileOverrides())
    fresh2 = await engine2.estimate_tokens(
        ANONYMOUS, model="m", messages=[_msg(Role.USER, "q" * 5000)], session_id="", profile=ProfileOverrides()
    )
    await store2.close()
    assert (after.total, after.method) == (before.total, before.method)
    assert fresh2.total == fresh.total and fresh.method is EstimateMethod.CALIBRATED


async def test_view_too_large_fails_with_the_numbers_it_compared() -> None:
    engine, _ = await _engine(_settings(context_window=1024, output_reserve_tokens=100))
    pinned = Flags(is_pinned=True)
    sid = await _session_with(engine, _msg(Role.USER, "hi"))
    with pytest.raises(ContextTooLarge) as err:
        await _build(engine, sid, incoming=_msg(Role.USER, "p" * 5000, flags=pinned))
    meta = err.value.metadata
    assert int(meta["estimate"]) > int(meta["budget"]) == 1024 - 100
    assert meta["estimate"] in err.value.message and meta["budget"] in err.value.message


async def test_view_too_large_says_when_the_build_did_not_compress() -> None:
    """A build that could not compress (the profile disables it, or ``auto_compress`` is false)
    must not say "even after compression": its caller can enable compression or call Compress."""
    engine, _ = await _engine(_settings(context_window=1024, output_reserve_tokens=100))
    turns = [_msg(Role.USER if i % 2 == 0 else Role.ASSISTANT, f"turn {i} " + "word " * 120) for i in range(12)]
    sid = await _session_with(engine, *turns)
    off = ProfileOverrides(compression=CompressionOverrides(enabled=False))
    with pytest.raises(ContextTooLarge) as disabled:
        await engine.build_context(ANONYMOUS, sid, profile=off, incoming=None, mid_turn=False, auto_compress=True)
    assert "compression is disabled" in disabled.value.message
    assert "even after compression" not in disabled.value.message
    with pytest.raises(ContextTooLarge) as manual:
        await engine.build_context(
            ANONYMOUS, sid, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=False
        )
    assert "auto_compress = false" in manual.value.message
    assert "even after compression" not in manual.value.message
    # The same session builds once the build may compress.
    assert (await _build(engine, sid)).estimate.total <= 1024 - 100


async def test_a_build_with_another_model_reprices_the_session_context_tokens() -> None:
    """The context tokens appends report (and the session shows) are the rows priced for the model
    the session's builds use. A message appended before the first build was priced for the
    session's named profile; once a build names another model, the running count must not keep
    that price (a Russian message priced for the default family stayed ~50% over gpt-4o's price
    in every later append's ``context_tokens`` and ``window_fraction``)."""
    engine, _ = await _engine(_settings())
    russian = "Привет, как дела? Развертывание сервера прошло успешно, миграция завершена. " * 30
    sid = await _session_with(engine, _msg(Role.USER, russian))
    await _build(engine, sid, model="gpt-4o")
    outcome = await engine.append(ANONYMOUS, sid, [_msg(Role.ASSISTANT, russian)], request_id="", turn_complete=False)
    pair = [_msg(Role.USER, russian), _msg(Role.ASSISTANT, russian)]

    async def priced(model: str) -> int:
        found = await engine.estimate_tokens(
            ANONYMOUS, model=model, messages=pair, session_id="", profile=ProfileOverrides()
        )
        return found.total

    assert abs(outcome.context_tokens - await priced("gpt-4o")) <= 2
    # and back: the default model's price again
    await _build(engine, sid)
    session = await engine.sessions.get(ANONYMOUS, sid)
    assert abs(session.context_tokens - await priced("")) <= 2


async def test_a_model_switch_reprices_the_rows_and_keeps_what_the_count_holds_beside_them() -> None:
    """An anchored count holds what the client sent beside the rows (its tool definitions, the
    system prompt, the framing): a build with another model swaps the rows' price only."""
    engine, _ = await _engine(_settings())
    russian = "Привет, как дела? Развертывание сервера прошло успешно, миграция завершена. " * 30
    sid = await _session_with(engine, _msg(Role.USER, russian), _msg(Role.ASSISTANT, russian))
    view = await _build(engine, sid)
    await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total + 500)
    assert await engine.anchors_applied(5)
    anchored = (await engine.sessions.get(ANONYMOUS, sid)).context_tokens
    context = await engine.store.load_context(sid, caller=ANONYMOUS)
    # The rows as views send them (each cut to the per-message budget, were it over it).
    budget = session_profile(engine.settings, await engine.sessions.get(ANONYMOUS, sid)).per_message_budget
    default_rows = engine.accounting.context_tokens(ProfileConfig().model, context, budget)
    assert anchored == view.estimate.total + 500  # the real count, the tools' share in it
    await _build(engine, sid, model="gpt-4o")
    await engine.accounting.ensure_loaded("gpt-4o")
    gpt_rows = engine.accounting.context_tokens("gpt-4o", context, budget)
    assert gpt_rows != default_rows
    assert (await engine.sessions.get(ANONYMOUS, sid)).context_tokens == anchored - default_rows + gpt_rows


async def test_a_retried_baseline_teaches_the_calibration_once() -> None:
    """A client that retries RecordBaseline (it is not idempotent in the clients) sends the same
    view's count again: recorded each time, but one view weighs as one observation in the fit
    (four copies filled half of the model's eight-observation window)."""
    engine, _ = await _engine(_settings())
    sid = await _session_with(engine, _msg(Role.USER, "deploy the payments service " * 20))
    view = await _build(engine, sid)
    model = ProfileConfig().model
    for _ in range(4):
        result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
        assert result.recorded
    observations = await engine.store.list_calibration_observations(model, limit=100)
    assert sum(o.usable for o in observations) == 1
    # Another view of the session is a new observation.
    await engine.append(ANONYMOUS, sid, [_msg(Role.ASSISTANT, "done " * 40)], request_id="", turn_complete=False)
    again = await _build(engine, sid)
    await engine.record_baseline(ANONYMOUS, sid, view_id=again.view_id, prompt_tokens=again.estimate.total)
    observations = await engine.store.list_calibration_observations(model, limit=100)
    assert sum(o.usable for o in observations) == 2


async def test_images_are_priced_by_size_and_left_out_over_budget_with_a_notice() -> None:
    engine, _ = await _engine(_settings(context_window=8192, vision=True))
    big = IncomingImage(data=_png(2048, 2048))  # 4098 tokens each
    sid = await _session_with(
        engine,
        _msg(Role.USER, "first screenshot", images=[big]),
        _msg(Role.USER, "second screenshot", images=[IncomingImage(data=_png(2048, 1024))]),
    )
    view = await _build(engine, sid)
    first, second = view.messages[0], view.messages[1]
    assert len(second.message.images) == 1 and second.image_data[0][:4] == b"\x89PNG"
    assert second.message.images[0].token_count == 2050
    assert not first.message.images and "not in this view" in first.message.content
    assert view.estimate.images == 2050
    assert view.notices and "blob" in view.notices[0]
    # A vision-less profile gets notices only.
    blind = await _build(engine, sid, vision=False)
    assert all(not vm.message.images for vm in blind.messages) and blind.estimate.images == 0


async def test_notices_of_left_out_images_come_out_of_the_image_budget() -> None:
    """An agent that sent 60 screenshots, building without compression: the images that do not fit
    are left out with a notice each, and those notices' tokens are room the images cannot also
    take. Counted after the fact, they made the view ~2,200 tokens over and CONTEXT_TOO_LARGE."""
    engine, _ = await _engine(_settings(context_window=8192, vision=True))
    shots = [_msg(Role.USER, f"screenshot {i}", images=[IncomingImage(data=_png(300, 300))]) for i in range(60)]
    sid = await _session_with(engine, *shots)
    view = await engine.build_context(
        ANONYMOUS, sid, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=False
    )
    assert view.estimate.total <= view.estimate.budget == 8192 - 2048
    assert len(view.notices) > 40 and view.estimate.images > 0
    kept = [vm for vm in view.messages if vm.message.images]
    assert kept and all(vm.message.sequence_number > 40 for vm in kept)  # the newest kept


async def test_compress_without_a_profile_uses_the_one_the_sessions_builds_use() -> None:
    """An agent builds with its model's window as an override; a Compress without a profile (the
    inspector's button, the gateway's ``compact``) aims at that window, as the post-turn check
    does, not at the named profile's 8x larger one."""
    engine, _ = await _engine(_settings(context_window=65536))
    turns = []
    for i in range(14):
        turns.append(_msg(Role.USER, f"question {i}: " + "what does this module do? " * 24))
        turns.append(_msg(Role.ASSISTANT, f"answer {i}: " + "it parses the configuration. " * 24))
    sid = await _session_with(engine, *turns)
    await _build(engine, sid, context_window=8192)
    report = await engine.compress(ANONYMOUS, sid, profile=ProfileOverrides(), note="", dry_run=True)
    assert report.plan is not None and report.plan.budget < 8192
    named = await engine.compress(ANONYMOUS, sid, profile=ProfileOverrides(context_window=65536), note="", dry_run=True)
    assert named.plan is not None and named.plan.budget > 8192


async def test_image_type_comes_from_the_bytes_and_repeats_are_stored_once() -> None:
    settings = _settings()
    data = MemoryData()
    engine, _ = await _engine(settings, data)
    png = _png(100, 100)
    sid = await _session_with(
        engine,
        _msg(Role.USER, "a", images=[IncomingImage(data=png)]),
        _msg(Role.USER, "b", images=[IncomingImage(data=png)]),
    )
    rows = await engine.store.get_messages(sid, caller=ANONYMOUS, first=1, last=2)
    assert rows[0].images[0].mime_type == "image/png" and rows[0].images[0].token_count == 258
    assert rows[0].images[0].blob_id == rows[1].images[0].blob_id and len(data.blobs) == 1
    # A reference to the stored blob works; an unknown one is a clear error.
    await engine.append(
        ANONYMOUS,
        sid,
        [_msg(Role.USER, "c", images=[IncomingImage(blob_id=rows[0].images[0].blob_id)])],
        request_id="",
        turn_complete=False,
    )
    with pytest.raises(InvalidArgument) as err:
        await engine.append(
            ANONYMOUS,
            sid,
            [_msg(Role.USER, "d", images=[IncomingImage(blob_id="0" * 64)])],
            request_id="",
            turn_complete=False,
        )
    assert err.value.violations[0].field == "messages[0].images[0].blob_id"


async def test_record_baseline_for_unknown_view_is_not_found_and_bad_counts_are_invalid() -> None:
    engine, _ = await _engine(_settings())
    sid = await _session_with(engine, _msg(Role.USER, "x"))
    with pytest.raises(NotFound):
        await engine.record_baseline(ANONYMOUS, sid, view_id="nope", prompt_tokens=10)
    view = await _build(engine, sid)
    with pytest.raises(InvalidArgument) as err:
        await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=0)
    assert err.value.violations[0].field == "prompt_tokens"


async def test_exact_tokenizer_counts_with_a_configured_tokenizer_file(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    json.loads(path.read_text())  # a real tokenizer.json
    settings = _settings(model="exact-model")
    settings.tokens.tokenizer_files["exact-model"] = str(path)
    engine, _ = await _engine(settings)
    est = await engine.estimate_tokens(
        ANONYMOUS,
        model="",
        messages=[_msg(Role.USER, "hello world hello"), _msg(Role.USER, "world")],
        session_id="",
        profile=ProfileOverrides(),
    )
    # The text exactly (4 tokens), plus the chat template's framing of the two messages, which no
    # tokenizer file holds: priced as the model's calibration prices it.
    per_message = prior_for(family_for("exact-model", settings.tokens.model_families)).weights[MESSAGE]
    assert est.method is EstimateMethod.EXACT and est.total == 4 + round(2 * per_message)


async def test_exact_tokenizer_views_count_the_framing_of_every_message(tmp_path: Path) -> None:
    """A view of many short messages with a tokenizer file: the framing of each message is part of
    the prompt. Counted as nothing (the text alone, margin 0), 300 two-token messages on a
    1,024-token window looked like ~600 tokens and were served with no compaction, while the
    prompt sent was about three times that, well past the window."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "ok": 1, "done": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    settings = _settings(model="exact-model", context_window=1024, output_reserve_tokens=256)
    settings.tokens.tokenizer_files["exact-model"] = str(path)
    engine, _ = await _engine(settings)
    turns = [_msg(Role.USER if i % 2 == 0 else Role.ASSISTANT, "ok done") for i in range(300)]
    sid = await _session_with(engine, *turns)
    view = await _build(engine, sid)
    per_message = prior_for(family_for("exact-model", settings.tokens.model_families)).weights[MESSAGE]
    # what the provider counts: the text (2 tokens a message) and the template's framing
    sent = sum(2 + per_message for _ in view.messages)
    assert view.estimate.method is EstimateMethod.EXACT
    assert view.estimate.total >= sent - 1
    assert sent <= view.estimate.budget + view.estimate.margin  # compacted to fit, framing included


@pytest.mark.parametrize(
    ("incoming", "says"),
    [
        (_msg(Role.TOOL, "42 rows", tool_call_id="c9"), "answers no tool call the view holds (tool_call_id 'c9')"),
        (_msg(Role.SYSTEM, "be brief"), "a system message is never sent as one"),
    ],
)
async def test_an_incoming_message_the_view_leaves_out_is_named_in_a_notice(
    incoming: IncomingMessage, says: str
) -> None:
    engine, _ = await _engine(_settings())
    sid = await _session_with(engine, _msg(Role.USER, "count the rows"), _msg(Role.ASSISTANT, "on it"))
    built = await _build(engine, sid, incoming=incoming)
    assert [vm.message.content for vm in built.messages] == ["count the rows", "on it"]  # left out
    assert any("incoming message was left out" in n and says in n for n in built.notices), built.notices
    # A message the view keeps carries no such notice.
    kept = await _build(engine, sid, incoming=_msg(Role.USER, "thanks"))
    assert not any("left out" in n for n in kept.notices)


async def _session_with_a_long_tool_result(engine: Engine) -> tuple[str, Any]:
    """A session whose tool call got a 36,000-character log back, and that append's outcome."""
    sid = await _session_with(engine, _msg(Role.USER, "Read the build log and tell me what failed."))
    calls = (ToolCall(id="c1", name="read_log", arguments_json="{}"),)
    log = "".join(f"[{i:05d}] step {i} compiled module_{i % 97}.o in {i % 13} ms, cache miss\n" for i in range(640))
    assert len(log) > 36_000
    rows = [_msg(Role.ASSISTANT, "", tool_calls=calls), _msg(Role.TOOL, log, tool_call_id="c1")]
    return sid, await engine.append(ANONYMOUS, sid, rows, request_id="", turn_complete=False)


async def test_a_long_message_counts_in_the_context_as_the_view_sends_it() -> None:
    """A view cuts a message over the per-message budget to that budget, so the session's count
    holds it at that size: a 36,000-character tool result on an 8k window made an append's
    ``window_fraction`` 1.94 while the next view's was 0.17 (and 5.82 against 0.50 after three),
    and a fork's and a model switch's counts the same."""
    engine, _ = await _engine(_settings(context_window=8192))
    sid, outcome = await _session_with_a_long_tool_result(engine)
    view = await _build(engine, sid)
    assert any(vm.truncated for vm in view.messages)  # the log went out cut
    budget = session_profile(engine.settings, await engine.sessions.get(ANONYMOUS, sid)).per_message_budget
    assert outcome.context_tokens <= view.estimate.total + budget // 4
    assert outcome.window_fraction < 0.5
    # A fork counts its rows the same way.
    fork = await engine.sessions.fork(ANONYMOUS, sid, at_sequence=0)
    assert fork.context_tokens == outcome.context_tokens


async def test_what_a_view_cannot_cut_counts_whole() -> None:
    """A view never cuts tool-call arguments (the runtime parses them), so a message carrying long
    ones counts at its full price: counted at the budget, the session looked at a sixth of its
    window while its next build could not fit."""
    engine, _ = await _engine(_settings(context_window=32768))
    sid = await _session_with(engine, _msg(Role.USER, "Write the generated fixtures to disk."))
    body = json.dumps(
        {"path": "fixtures.json", "content": "".join(f"row {i}: {i * 7919 % 10007}\n" for i in range(9000))}
    )
    calls = (ToolCall(id="w1", name="write_file", arguments_json=body),)
    outcome = await engine.append(
        ANONYMOUS, sid, [_msg(Role.ASSISTANT, "", tool_calls=calls)], request_id="", turn_complete=False
    )
    rows = await engine.store.load_context(sid, caller=ANONYMOUS)
    assert rows[-1].token_count > 32768 // 6  # over the per-message budget
    assert outcome.context_tokens >= sum(m.token_count for m in rows)


async def test_a_build_with_another_window_counts_long_rows_at_its_budget() -> None:
    """The same model with a larger window (a larger per-message budget): the rows counted at the
    old budget are counted again at the new one, or the count stayed a tenth of the view's."""
    engine, _ = await _engine(_settings(context_window=8192))
    sid, _ = await _session_with_a_long_tool_result(engine)
    view = await _build(engine, sid, context_window=131072)
    assert not any(vm.truncated for vm in view.messages)  # the new budget holds the whole log
    outcome = await engine.append(ANONYMOUS, sid, [_msg(Role.USER, "and?")], request_id="", turn_complete=False)
    assert abs(outcome.context_tokens - view.estimate.total) <= view.estimate.total // 10
