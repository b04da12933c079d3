"""Truncation detection on views made mostly of images (engine/views.py ``_truncation``).

A view's images are priced by the image pricing rule (DESIGN §5.3), not by a vocabulary, so
their share of an honest count is known: the truncation floor holds ``truncation_image_ratio``
of it on top of the text's floor. Before, a small view made mostly of images was judged by its
few text tokens alone, and a prompt cut to half of it was recorded as honest (bench/compression:
13 truncated counts sent, 12 caught).
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from contextsvc.config import ProfileConfig, Settings, TokenSettings
from contextsvc.core.calibration import lower_bound
from contextsvc.core.images import image_tokens
from contextsvc.core.messages import Message, Role
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import ANONYMOUS
from contextsvc.engine.engine import Engine
from contextsvc.engine.validation import IncomingImage, IncomingMessage
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.stores.memory import MemoryStore
from tests.support.engines import make_engine


def _settings(**tokens: Any) -> Settings:
    return Settings(
        profiles={"default": ProfileConfig(context_window=32768, vision=True, model="img-model")},
        store="memory",
        tokens=TokenSettings(**tokens),
    )


async def _engine(settings: Settings) -> tuple[Engine, MemoryEventBus]:
    store = MemoryStore(settings)
    await store.open()
    bus = MemoryEventBus(retention=100)
    return make_engine(store, settings, bus=bus), bus


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (20, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


async def _image_view(engine: Engine, text: str = "what is on this screenshot?", images: int = 2) -> Any:
    s = await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})
    ask = IncomingMessage(
        Message(role=Role.USER, content=text),
        images=tuple(IncomingImage(data=_png(1024, 1024)) for _ in range(images)),
    )
    await engine.append(ANONYMOUS, s.id, [ask], request_id="", turn_complete=False)
    view = await engine.build_context(
        ANONYMOUS, s.id, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=True
    )
    return s.id, view


async def test_a_small_image_heavy_view_cut_to_half_is_caught() -> None:
    engine, bus = await _engine(_settings())
    sid, view = await _image_view(engine)
    assert view.estimate.images == 2 * image_tokens(1024, 1024)  # 2,052 of a ~2,070-token view
    assert view.estimate.images > 0.95 * view.estimate.total
    cut = int(view.estimate.total * 0.5)  # the bench's truncated counts: 40-65 % of the estimate
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=cut)
    assert result.truncated and not result.recorded
    assert result.lower_bound >= int(0.7 * view.estimate.images)
    assert "image pricing rule" in result.truncation_reason
    session = await engine.store.get_session(sid, caller=ANONYMOUS)
    assert session.context_truncated
    (event,) = [e for e in list(bus._log) if e.kind == "context_truncated"]
    assert event.payload["lower_bound"] == result.lower_bound


async def test_an_honest_count_of_an_image_heavy_view_is_never_refused() -> None:
    engine, _ = await _engine(_settings())
    sid, view = await _image_view(engine, text="x " * 400)
    # The cheapest honest count: the image rule's price and the text at the cheapest vocabulary.
    record = await engine.store.get_view(sid, view.view_id)
    assert record is not None and record.image_tokens == view.estimate.images
    cheapest = lower_bound(record.features) + view.estimate.images
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=cheapest)
    assert result.recorded and not result.truncated


async def test_the_image_part_holds_only_its_ratio_of_the_rule() -> None:
    # A provider whose images cost 75 % of our rule, its text as cheap as any vocabulary: honest.
    engine, _ = await _engine(_settings())
    sid, view = await _image_view(engine, images=3)
    record = await engine.store.get_view(sid, view.view_id)
    assert record is not None
    count = lower_bound(record.features) + int(0.75 * view.estimate.images)
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=count)
    assert result.recorded


async def test_a_ratio_of_zero_leaves_images_out_of_the_floor() -> None:
    # The setting's escape hatch (a provider with a far cheaper image rule): the text floor alone,
    # so the same cut count is taken as honest, as before this rule.
    engine, _ = await _engine(_settings(truncation_image_ratio=0.0))
    sid, view = await _image_view(engine)
    cut = int(view.estimate.total * 0.5)
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=cut)
    assert result.recorded and not result.truncated
    assert result.lower_bound < cut


async def test_a_view_without_images_has_the_text_floor_alone() -> None:
    engine, _ = await _engine(_settings())
    sid, view = await _image_view(engine, text="plain words " * 300, images=0)
    record = await engine.store.get_view(sid, view.view_id)
    assert record is not None and record.image_tokens == 0 and not record.had_images
    result = await engine.record_baseline(
        ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=lower_bound(record.features)
    )
    assert result.recorded
