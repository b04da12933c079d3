"""BuildContext, EstimateTokens and RecordBaseline: the view a model is sent, and what it cost."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from contextsvc.config import Settings
from contextsvc.core.calibration import Calibration, Observation, lower_bound, margin_base
from contextsvc.core.messages import Message, Role, text_bytes
from contextsvc.core.priors import N_FEATURES, VIEW
from contextsvc.core.profile import EffectiveProfile, view_shape
from contextsvc.core.session import Principal, SessionInfo
from contextsvc.core.tokens import (
    Baseline,
    CalibratedCounter,
    TextCounter,
    TokenEstimate,
    each_message_features,
    estimate,
    estimate_segments,
    features_size,
    image_tokens_of,
    message_features,
    messages_chars,
    messages_features,
)
from contextsvc.core.view import Segment, View, build_view
from contextsvc.core.view_budget import (
    AFTER_COMPRESSION,
    additive,
    budget_images,
    column_max,
    none_cut,
    too_large,
    truncate_for_view,
)
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.engine.attachments import describe_images
from contextsvc.engine.remembered_profile import counted_budget
from contextsvc.engine.state import BaselineState, EngineState
from contextsvc.engine.validation import IncomingMessage, check_messages, require_session_id
from contextsvc.engine.view_memo import ViewMemo
from contextsvc.errors import InvalidArgument, NotFound, quoted
from contextsvc.ports import BaselineWrite, Clock, EventBus, SessionStore, ViewRecord, statement_publisher

_SEQUENCE = operator.attrgetter("sequence_number")

#: Room a view's response keeps for its message framing, ids, notices and estimate, besides its text
#: and images (``_image_bytes_budget``).
_VIEW_FRAMING_BYTES = 1024 * 1024


class ViewMessage(NamedTuple):
    """One message of a built view; images carry their bytes so the runtime can send them.

    ``stored`` says the message is the stored row itself, unchanged by the view (not cut, no
    image left out, not the prompt or the incoming message): the API adapter may then send the
    encoding it keeps for that row instead of encoding it again. A named tuple, not a frozen
    dataclass: a view makes one per row, and a tuple is made several times faster.
    """

    message: Message
    image_data: tuple[bytes, ...]
    truncated: bool
    stored: bool = False


#: ``ViewMessage._make`` without its Python frame (the tuples come from a ``zip`` of the four
#: fields): a from-scratch view makes one per row, ~0.2 µs each through ``_make``.
_view_message_of = functools.partial(tuple.__new__, ViewMessage)


@dataclass(slots=True, frozen=True)
class BuiltView:
    messages: list[ViewMessage]
    view_id: str
    estimate: TokenEstimate
    notices: list[str]
    compression: Any = None
    #: content hashes of the history chunks recalled into this view (``engine/recall.py``).
    injected_chunk_ids: tuple[str, ...] = ()
    #: the messages of the view this one extends (``Assembled.extends``): its first rows, the
    #: same objects, so the API adapter finds that view's encoding without comparing them.
    extends: list[ViewMessage] | None = None


@dataclass(slots=True, frozen=True)
class BaselineResult:
    recorded: bool
    truncated: bool
    model: str
    calibration: Calibration
    #: why the count was taken as truncated (empty when it was not).
    truncation_reason: str = ""
    #: the fewest tokens any vocabulary could count for the view (what the count was held against).
    lower_bound: int = 0


@dataclass(slots=True, frozen=True)
class PendingAnchor:
    """A baseline to make the session's anchor: the provider's count of ``view``'s stored part."""

    view_id: str
    view: ViewRecord
    tokens: int
    #: the session as the baseline read it (``try_anchor`` writes only if it is still so)
    read: SessionInfo | None = None
    #: tokens the count holds beside the view (``ViewService._beside``); None leaves the state's
    beside: int | None = None

    def applied_to(self, state: EngineState) -> EngineState:
        """``state`` anchored on this baseline."""
        view = self.view
        anchored = state.with_baseline(self.tokens, view.last_sequence, self.view_id, view.shape, view.cuts)
        return anchored if self.beside is None else anchored.with_beside(self.beside)


def _anchorable(view: ViewRecord, session: SessionInfo) -> bool:
    """Whether a baseline of ``view`` may become ``session``'s anchor. A view that carried images
    is none: the provider's count holds those images, and a later view may leave some out (image
    budget), so baseline + delta would count them twice; such views are priced fresh every time,
    by the same rules the view's budget used. A view of an older compaction cycle is none either."""
    return not view.had_images and view.epoch == EngineState.of(session).epoch


def _pending(
    view_id: str, view: ViewRecord, prompt_tokens: int, read: SessionInfo, beside: int | None = None
) -> PendingAnchor:
    # The incoming message the view carried is appended later, newer than the view's last
    # sequence: the anchor holds the stored part only, or baseline + delta counts it twice.
    return PendingAnchor(view_id, view, max(1, prompt_tokens - view.incoming_tokens), read, beside)


@dataclass(slots=True)
class _SavedView:
    """The last view this process saved for a session: what a rebuild compares to reuse it, the
    record a baseline of it reads instead of the store's, the session as its build read it (the
    baseline's unlocked anchor writes only on that), and how many other views of the session this
    process saved since (the store keeps the newest ``views_kept_per_session``)."""

    built: Assembled
    epoch: int
    view_id: str
    #: the session's create time: a session deleted and created again under the same id (by
    #: another replica) lost the record with the old one, even when its rows look the same.
    created: datetime | None
    #: the record saved under ``view_id``: a baseline of this view reads it here, not from the store
    record: ViewRecord
    #: the session as the build that served the view last read it (``_record_on_saved``)
    session: SessionInfo
    others: int = 0
    #: the service's count of builds and baselines (``ViewService._calls``) once this view was last
    #: served: a baseline of it that finds the count higher was recorded while other requests ran.
    calls: int = 0


#: A view segment's place among ``estimate_segments``' parts.
_SEGMENT_PARTS = {
    Segment.SYSTEM: 0,
    Segment.RECORDS: 1,
    Segment.SUMMARIES: 2,
    Segment.PINNED: 3,
    Segment.MESSAGES: 4,
    Segment.INCOMING: 5,
}


def _column_sums(features: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """``messages_features`` of messages whose own features are ``features`` (a message's own
    count of whole views is 0, so the sum's is too)."""
    if len(features) == 1:
        return features[0]
    return tuple(map(sum, zip(*features, strict=True))) if features else (0,) * N_FEATURES


def _cap_of(
    messages: Sequence[Message],
    segments: Sequence[Segment],
    features: Sequence[tuple[int, ...]],
    skip: Collection[int] = (),
) -> tuple[int, ...]:
    """``column_max`` of the rows ``truncate_for_view`` may cut: not the system prompt, not a
    pinned row (both are sent whole), not a row whose index is in ``skip`` (priced on its own)."""
    system = Segment.SYSTEM
    rows = zip(messages, segments, features, strict=True)
    if skip:
        cuttable = (
            f for i, (m, seg, f) in enumerate(rows) if seg is not system and not m.flags.is_pinned and i not in skip
        )
        return column_max(list(cuttable))
    return column_max([f for m, seg, f in rows if seg is not system and not m.flags.is_pinned])


def _over_of(
    messages: Sequence[Message],
    segments: Sequence[Segment],
    features: Sequence[tuple[int, ...]],
    truncated: Sequence[bool],
    counter: TextCounter,
    budget: int,
) -> tuple[tuple[tuple[int, Message], ...], tuple[int, ...] | None]:
    """For a view some of whose ``messages`` were cut (``truncated``): ``Assembled.over`` and
    ``cap`` when the rows cut are the only ones over the budget (the others' cap fits it: each
    later counter prices that cap once and cuts only those rows again), else ``((), None)``.
    A row cut must be a stored one (numbered), as ``_since`` finds the rows a baseline missed
    by number."""
    cut_at = [i for i, t in enumerate(truncated) if t]
    if not cut_at or not all(messages[i].sequence_number for i in cut_at):
        return (), None
    cap = _cap_of(messages, segments, features, skip=set(cut_at))
    if not none_cut(counter, cap, budget):
        return (), None
    return tuple((i, messages[i]) for i in cut_at), cap


def _cut_notice(m: Message, budget: int) -> str:
    """The notice of a view whose row ``m`` was cut to one message's ``budget``."""
    where = f"message #{m.sequence_number}" if m.sequence_number else "the incoming message"
    return f"{where} was cut to fit the per-message budget of {budget} tokens"


def _left_out_notice(incoming: Message) -> str:
    """The notice of a view that left the incoming message out (a stored row the repair drops is
    the history's own shape; the caller's new message vanishing silently is not)."""
    if incoming.role is Role.SYSTEM:
        why = (
            "a system message is never sent as one (the profile's system prompt is; a stored record "
            "with an allowed metadata.source reaches the view)"
        )
    elif incoming.role is Role.TOOL:
        why = f"it answers no tool call the view holds (tool_call_id {quoted(incoming.tool_call_id)})"
    else:
        why = "the view must stay a legal chat sequence"
    return f"the incoming message was left out of the view: {why}"


def _parts_of(
    rows: list[Message], segments: Sequence[Segment]
) -> tuple[str, list[Message], list[Message], list[Message]]:
    """The view's rows as ``estimate``'s parts: the system prompt's text, the records, the
    conversation, the incoming message. ``build_view`` orders them so: the prompt first, then
    the records, the conversation, and the incoming message last."""
    n = len(rows)
    first = 1 if n and segments[0] is Segment.SYSTEM else 0
    lead = first
    while lead < n and segments[lead] is Segment.RECORDS:
        lead += 1
    tail = n - 1 if n > lead and segments[-1] is Segment.INCOMING else n
    return (rows[0].content if first else "", rows[first:lead], rows[lead:tail], rows[tail:])


def _as_view(rows: Sequence[int]) -> tuple[float, ...]:
    """``messages_features(rows, views=1)`` as floats, from the rows' ``messages_features``."""
    return tuple(float(x) for x in (*rows[:VIEW], 1, *rows[VIEW + 1 :]))


def _since(state: EngineState, kept: Assembled, added: Sequence[Message]) -> list[Message] | None:
    """The rows of ``kept``'s records and conversation, then of ``added`` (appended after them),
    that the session's baseline did not count, in that order: what ``estimate`` finds by a pass
    over every row, found without one. None when there is no baseline, or when it is older than
    rows of ``kept`` (its numbered rows are at most ``kept.last_sequence``) and ``kept`` did not
    keep the rows it left uncounted (``Assembled.since``)."""
    baseline = state.baseline
    if baseline is None:
        return None
    last = baseline.last_sequence
    if last >= kept.last_sequence:
        held: Sequence[Message] = kept.unnumbered
    else:
        # The baseline's view is older than ``kept``: ``kept`` may have found the rows when it
        # was made by extending a view that baseline had counted (the build of an incoming
        # message right after its session's appended rows), for those very parts.
        found = kept.since
        if found is None or found[0] != last or found[1] is not kept.parts:
            return None
        held = found[2]
    return [*held, *(m for m in added if not m.sequence_number or m.sequence_number > last)]


#: the event a recorded baseline publishes
BASELINE_RECORDED = "baseline_recorded"

#: ``quick_anchor(pending, write)`` of ``ViewService.record_baseline``: True once written, False
#: when refused, None when not tried because a compaction of the session runs here (the anchor
#: must wait for it).
QuickAnchor = Callable[[PendingAnchor, BaselineWrite | None], Awaitable[bool | None]]


def _recorded_payload(view_id: str, view: ViewRecord, prompt_tokens: int) -> dict[str, Any]:
    """The payload of ``BASELINE_RECORDED``."""
    return {
        "view_id": view_id,
        "prompt_tokens": prompt_tokens,
        "estimated_tokens": view.estimated_tokens,
        "model": view.model,
    }


#: longer than any view id ``_new_id`` makes, with room for other forms a store may have kept
MAX_VIEW_ID_CHARS = 128


def _new_id() -> str:
    """A fresh view id: 128 random bits as 32 hex digits (the form ``uuid4().hex`` had)."""
    return os.urandom(16).hex()


@dataclass(slots=True, frozen=True)
class Assembled:
    rows: list[Message]
    segments: list[Segment]
    truncated: list[bool]
    estimate: TokenEstimate
    notices: list[str]
    #: size units of ``rows`` (what a baseline of this view is fitted on)
    chars: int = 0
    #: calibration features of ``rows`` as one prompt (what a baseline of this view is fitted on)
    features: tuple[float, ...] = ()
    #: newest sequence number of the context the view was built from
    last_sequence: int = 0
    had_images: bool = False
    #: tokens of the images in ``rows`` by the image pricing rule (unscaled; 0 without images)
    image_tokens: int = 0
    #: the view's messages ready to send, when none carries an image (no bytes to load per build);
    #: the same list object for every build that reuses this view, so the API adapter can reuse
    #: its encoding too.
    plain: list[ViewMessage] | None = None
    #: what the estimate priced (system prompt, records, conversation, incoming), kept when the
    #: view may be re-priced with another calibration or baseline without being assembled again.
    parts: tuple[str, list[Message], list[Message], list[Message]] | None = None
    #: with ``parts`` and a calibrated counter: the feature sums the view is priced from, so a
    #: re-pricing or an extension reads only the rows it adds
    sums: _Sums | None = None
    #: with ``parts``: the rows of its records and conversation without a sequence number, in their
    #: order (what every baseline counts as new: ``_since``)
    unnumbered: tuple[Message, ...] = ()
    #: ``plain`` of the view this one extended (``_extended``): the first rows of ``plain``
    #: (never changed; one list of references more per session)
    extends: list[ViewMessage] | None = None
    #: with ``sums``: a bound, feature by feature, of the rows the view could cut but ``over``'s:
    #: their largest values (``_cap_of``), or the view's total while the whole fits one message's
    #: budget; any calibration can tell in one price that it cuts none of them (``none_cut``)
    cap: tuple[int, ...] | None = None
    #: with ``sums``: the rows priced one by one, each over one message's budget when it joined the
    #: view, as (row index, the stored message) in row order: the row is ``truncate_for_view`` of
    #: the message by ``cut_by``, and another counter cuts it again (``_recut``)
    over: tuple[tuple[int, Message], ...] = ()
    #: with ``over``: the counter its rows were cut by
    cut_by: TextCounter | None = None
    #: ``_since`` of this view for a baseline older than its last rows, when the view found them
    #: (``_extended``): (that baseline's ``last_sequence``, the ``parts`` they are of, the rows)
    since: tuple[int, object, tuple[Message, ...]] | None = None
    #: the distinct sequence numbers of the stored rows in ``rows``, ascending (``stored_sequences``):
    #: which messages the view holds, kept as rows are added so that recall, which asks on every
    #: build with a user's message, does not read a view of a thousand rows each time (None: not kept)
    sequences: tuple[int, ...] | None = None


@dataclass(slots=True, frozen=True)
class _Sums:
    """Integer ``messages_features`` of a view's rows, and of each of ``estimate_segments`` of
    its ``parts`` (None: empty). Sums of integers, so kept by adding what is appended they are
    exactly what a pass over the rows gives, and the prices are the same to the bit."""

    rows: tuple[int, ...]
    segments: tuple[tuple[int, ...] | None, ...]

    @staticmethod
    def of_rows(features: Sequence[tuple[int, ...]], segments: Sequence[Segment], total: tuple[int, ...]) -> _Sums:
        """``of`` for rows that are a view's messages, from each row's ``message_features`` and
        their sum ``total``: a row's view segment is the part ``estimate_segments`` prices it in."""
        parts: list[list[tuple[int, ...]]] = [[] for _ in _SEGMENT_PARTS]
        # Only the few rows outside the plain conversation (the prompt, records, summaries,
        # pinned rows, the incoming message) are summed one by one; the conversation's plain
        # rows are what is left of the total (integers: exactly their sum).
        plain = Segment.MESSAGES  # bound once: an enum member lookup costs more than the comparison
        for i in [i for i, seg in enumerate(segments) if seg is not plain]:
            parts[_SEGMENT_PARTS[segments[i]]].append(features[i])
        sums = [_column_sums(part) if part else None for part in parts]
        if len(segments) > sum(map(len, parts)):
            rest = list(total)
            for x in sums:
                if x is not None:
                    rest = [a - b for a, b in zip(rest, x, strict=True)]
            sums[_SEGMENT_PARTS[Segment.MESSAGES]] = tuple(rest)
        return _Sums(rows=total, segments=tuple(sums))

    def extended(self, added: Sequence[Message], features: tuple[int, ...]) -> _Sums:
        """The sums once ``added`` (whose ``messages_features`` are ``features``) join the
        conversation: each into the segment ``estimate_segments`` puts it in."""
        segments = list(self.segments)
        for k, part in enumerate(estimate_segments("", (), added, ()), start=0):
            if part and k in (2, 3, 4):  # summaries, pinned, others
                x = features if len(part) == len(added) else messages_features(part)
                held = segments[k]
                segments[k] = x if held is None else tuple(map(operator.add, held, x))  # (same widths)
        return _Sums(rows=tuple(map(operator.add, self.rows, features)), segments=tuple(segments))


def stored_sequences(rows: Iterable[Message]) -> tuple[int, ...]:
    """The distinct sequence numbers of the stored messages in ``rows`` (0: unstored), ascending."""
    return tuple(sorted(set(filter((0).__lt__, map(_SEQUENCE, rows)))))


def _sequences_after(held: tuple[int, ...] | None, added: Sequence[Message]) -> tuple[int, ...] | None:
    """``stored_sequences`` of a view's rows ``held`` and ``added`` after them: appended rows are
    newer than every stored row, so their numbers only extend the tuple (else it is sorted again)."""
    if held is None:
        return None
    new = [n for n in map(_SEQUENCE, added) if n > 0]
    if not new:
        return held
    if (not held or new[0] > held[-1]) and all(a < b for a, b in itertools.pairwise(new)):
        return (*held, *new)
    return tuple(sorted({*held, *new}))


def _legal_tail(before: Sequence[Message], added: Sequence[Message]) -> View | None:
    """The view of ``added`` alone when the legal view of ``before`` followed by ``added`` is the
    legal view of ``before`` followed by ``added`` unchanged, else None (``core.legal``): a user
    message ends every tool-call run, so added rows that start with one, are no records, carry no
    image and are legal on their own, after rows whose last conversation row leaves no call
    unanswered, change nothing before them and are kept as they are."""
    if not added or added[0].role is not Role.USER:
        return None
    last = next((m for m in reversed(before) if m.role is not Role.SYSTEM), None)
    if last is not None and last.tool_calls:
        return None
    if any(m.role is Role.SYSTEM or m.images for m in added):
        return None
    tail = build_view("", (), added)
    if len(tail.messages) != len(added) or not all(map(operator.is_, tail.messages, added)):
        return None
    return tail


def _recut(kept: Assembled, counter: CalibratedCounter, budget: int) -> Assembled:
    """``kept`` (with ``sums``) with each row of ``kept.over`` cut by ``counter``, as a build from
    scratch cuts it (a new fit moves where a cut falls): O(rows cut), not O(rows). A cut that comes
    out the same keeps its object (its features and its encoding are reused)."""
    before = kept.cut_by
    # A cut depends on the counter only through its prices (a baseline that refits nothing makes
    # a new counter with the same weights).
    if not kept.over or (
        isinstance(before, CalibratedCounter) and before.calibration.weights == counter.calibration.weights
    ):
        return kept
    assert kept.sums is not None and kept.plain is not None
    rows = list(kept.rows)
    changed = []
    for i, m in kept.over:
        old = rows[i]
        new = truncate_for_view(m, budget, counter)
        if new is old or (
            new is not m and old is not m and new.content == old.content and new.thinking == old.thinking
        ):
            continue
        rows[i] = new
        changed.append((i, m, old, new))
    if not changed:
        return dataclasses.replace(kept, cut_by=counter)
    segments = kept.segments
    total = kept.sums.rows
    parts = list(kept.sums.segments)
    truncated = list(kept.truncated)
    plain = list(kept.plain)
    for i, m, old, new in changed:
        gone, came = message_features(old), message_features(new)
        k = _SEGMENT_PARTS[segments[i]]
        held = parts[k]
        assert held is not None  # it holds ``old``
        parts[k] = tuple(a - b + c for a, b, c in zip(held, gone, came, strict=True))
        total = tuple(a - b + c for a, b, c in zip(total, gone, came, strict=True))
        truncated[i] = new is not m
        plain[i] = ViewMessage(message=new, image_data=(), truncated=new is not m, stored=new is m)
    sums = _Sums(rows=total, segments=tuple(parts))
    return dataclasses.replace(
        kept,
        rows=rows,
        truncated=truncated,
        notices=[_cut_notice(m, budget) for i, m in kept.over if rows[i] is not m],
        chars=features_size(sums.rows),
        features=_as_view(sums.rows),
        plain=plain,
        parts=_parts_of(rows, segments),
        sums=sums,
        extends=None,
        cut_by=counter,
    )


def _cut_pairs(rows: Sequence[Message], over: Iterable[tuple[int, Message]]) -> list[tuple[Message, Message]]:
    """(the stored message, the row sent) of each row of ``over`` (``Assembled.over``) the view
    sends cut."""
    return [(m, rows[i]) for i, m in over if rows[i] is not m]


def _view_cuts(
    rows: Sequence[Message], truncated: Sequence[bool], most: int
) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """``ViewRecord.cuts`` of a view's ``rows``: each stored row it sends cut, with the features of
    the cut it sends; None (not known) past ``most`` of them (``tokens.anchor_cuts_max``)."""
    if not any(truncated):
        return ()
    cuts = tuple(
        (r.sequence_number, message_features(r)) for r in itertools.compress(rows, truncated) if r.sequence_number
    )
    return cuts if len(cuts) <= most else None


def _recut_tokens(
    baseline: BaselineState,
    counter: TextCounter,
    cut: Sequence[tuple[Message, Message]],
    rows: Iterable[Message],
) -> int:
    """Tokens the rows ``baseline`` counted are sent with more (or fewer, negative) in a view that
    cuts them as ``cut`` says ((stored message, row sent) pairs; ``rows``: the view's stored rows):
    a fit after the baseline moves where a long row is cut (``_recut``), and the baseline's count
    holds the cut its own view sent (``BaselineState.cuts``), so each row cut otherwise is priced
    twice, as sent now and as sent then, and the difference added. A row the count held whole
    and now cut, or cut then and whole now, likewise. Without that, one 36,000-character tool
    result on an 8k window, re-cut after the first baseline, read 954 tokens for a prompt of
    1,400. Features price only with a calibrated counter (an exact one moves a cut by its framing
    alone: 0). An anchor whose cuts are not known (``BaselineState.cuts`` None) gets 0: every row
    priced as its count held it."""
    if baseline.cuts is None or not isinstance(counter, CalibratedCounter):
        return 0
    last = baseline.last_sequence
    then = dict(baseline.cuts)
    if not then and not cut:
        return 0
    sent: list[tuple[int, ...]] = []
    counted: list[tuple[int, ...]] = []
    for m, r in cut:
        seq = m.sequence_number
        if not 0 < seq <= last:
            continue  # newer than the baseline's view: priced with the rows since
        now = message_features(r)
        was = then.pop(seq, None)
        if was is None:
            was = message_features(m)  # the baseline's view sent it whole
        if now != was:
            sent.append(now)
            counted.append(was)
    if then:  # cut in the baseline's view, sent whole now (a fit that prices it lower)
        for m in rows:
            was = then.pop(m.sequence_number, None)
            if was is not None:
                sent.append(message_features(m))
                counted.append(was)
    if not sent:
        return 0
    price = counter.calibration.price
    return round(price(_column_sums(sent)) - price(_column_sums(counted)))


class ViewService:
    def __init__(
        self,
        *,
        store: SessionStore,
        bus: EventBus,
        settings: Settings,
        clock: Clock,
        accounting: TokenAccounting,
    ):
        self._store = store
        self._bus = bus
        self._settings = settings
        self._clock = clock
        self._accounting = accounting
        #: the store, when it writes a baseline's observation and event with its anchor in one
        #: statement (``ports.EventPublishingStore``: PostgreSQL with its own bus).
        self._publisher = statement_publisher(store, bus)
        self._memo: ViewMemo[Assembled] = ViewMemo(settings.hot_path.view_cache_sessions)
        #: session id -> the view record saved for its reused view (``_SavedView``), so a build that
        #: reuses the assembled view also reuses its record instead of writing a new one.
        self._saved: OrderedDict[str, _SavedView] = OrderedDict()
        #: per session, the last view made of its reusable one for one build (the user's incoming
        #: message added, recalled excerpts): a baseline of it reads the record here too
        self._single: OrderedDict[str, _SavedView] = OrderedDict()
        #: builds and baselines this process served, of every session: a baseline that finds its
        #: view's count (``_SavedView.calls``) behind it was not the only request under way.
        self._calls = 0
        #: (session, view) pairs whose baseline this process gave the calibration, newest last
        #: (as many as the sessions whose views are kept): a client that retries a RecordBaseline
        #: must not weigh one view as several in the model's fit.
        self._observed: OrderedDict[tuple[str, str], None] = OrderedDict()

    async def prepare_incoming(
        self, incoming: IncomingMessage | None, field: str
    ) -> tuple[Message | None, dict[str, bytes]]:
        """Validate the not-yet-stored message and price its images from their bytes (nothing stored)."""
        if incoming is None:
            return None, {}
        check_messages([incoming], self._settings.limits, field=field, repeated=False)
        refs, data = await describe_images(
            self._store, incoming.images, self._settings.tokens, f"{field}.images", persist=False
        )
        return dataclasses.replace(incoming.message, images=refs), data

    def assemble(
        self,
        profile: EffectiveProfile,
        context: Sequence[Message],
        incoming: Message | None,
        state: EngineState,
        *,
        session_id: str = "",
    ) -> Assembled:
        """The view of ``context`` for ``profile``: ordered, legal, cut per message, images budgeted,
        estimated. Pure given its inputs; shared by BuildContext and EstimateTokens.

        With ``session_id``, the session's last view is reused when every input is the same
        (``engine.view_memo``); an incoming message is added to the view of the stored rows
        (``_with_incoming``), which stays the session's reusable view."""
        counter = self._accounting.counter(profile.model)
        # A baseline counted a view of one shape (model, system prompt, ...): not of this one.
        state = state.for_shape(view_shape(profile))
        if not session_id:
            return self._assemble(profile, context, incoming, state, counter)
        if incoming is not None:
            stored = self.assemble(profile, context, None, state, session_id=session_id)
            joined = self._with_incoming(profile, stored, context, incoming, state, counter)
            return joined if joined is not None else self._assemble(profile, context, incoming, state, counter)
        baseline = state.baseline
        # Every input of ``_assemble``: the profile fields it reads (not compression settings).
        key = (
            profile.model,
            profile.context_window,
            profile.system_prompt,
            profile.vision,
            profile.output_reserve_tokens,
            profile.message_token_budget,
            counter,
            (baseline.tokens, baseline.last_sequence, baseline.view_id) if baseline is not None else None,
        )
        try:
            hash(key)
        except TypeError:  # a counter that cannot be compared by value (never cached)
            return self._assemble(profile, context, incoming, state, counter)
        built = self._memo.get(session_id, key, context)
        if built is None:
            kept = self._memo.prefix_of(session_id, context)
            # Same profile fields: only the calibration or the baseline (the last two fields of the
            # key) may have changed, and rows may have been appended.
            if kept is not None and isinstance(kept[0], tuple) and kept[0][:-2] == key[:-2]:
                _, n, view = kept
                if n == len(context):
                    built = self._repriced(profile, view, state, counter)
                else:
                    built = self._extended(profile, view, context[:n], context[n:], state, counter)
            if built is None:
                built = self._assemble(profile, context, incoming, state, counter)
            self._memo.put(session_id, key, context, built)
        return built

    def _repriced(
        self, profile: EffectiveProfile, kept: Assembled, state: EngineState, counter: TextCounter
    ) -> Assembled | None:
        """``kept`` (assembled from the same rows and profile) priced with another counter or
        baseline, or None when the new price could change which rows the view holds.

        When no message carries an image, the rows depend on the counter only through one check
        and the rows it cut: no other row alone exceeds one message's budget (``none_cut``;
        without the features of a calibrated counter, nothing was cut and the whole view fits
        it), and the cut rows (``Assembled.over``) are cut again by the new counter (``_recut``).
        If the check still holds, the other rows, segments, sizes and messages to send are
        ``kept``'s, and only the estimate is priced again: a baseline refits the calibration, and
        the post-turn check (or the next build) need not assemble the view again (issue #15)."""
        parts = kept.parts
        if parts is None or not additive(counter):
            return None
        sums = None
        budget = profile.per_message_budget
        if isinstance(counter, CalibratedCounter) and kept.sums is not None:
            if not none_cut(counter, kept.cap, budget):
                return None
            kept = _recut(kept, counter, budget)
            parts = kept.parts
            sums = kept.sums
        elif kept.over or counter.count_messages(kept.rows) > budget:
            return None
        assert parts is not None
        since = _since(state, kept, ())
        # Kept parts hold no image (``_assemble``).
        cut = _cut_pairs(kept.rows, kept.over)
        estimate = self._estimate(profile, parts, state, counter, sums, since, image_free=True, cut=cut)
        return dataclasses.replace(kept, estimate=estimate)

    def _extended(
        self,
        profile: EffectiveProfile,
        kept: Assembled,
        before: Sequence[Message],
        added: Sequence[Message],
        state: EngineState,
        counter: TextCounter,
    ) -> Assembled | None:
        """``kept`` (the view of ``before``) with the rows ``added`` to its context since, or None
        when they could change what the view holds of the rows before them.

        When the added rows follow the kept ones legally as they are (``_legal_tail``), the legal
        view of the whole is the kept view followed by them. No kept row is cut anew when none alone
        exceeds one message's budget (``none_cut``: the largest features of the kept rows and the
        added ones priced once; else the added ones priced one by one, and those over the budget
        cut as ``_assemble`` cuts them: a long tool result). Without a calibrated counter, nothing
        is cut and the whole fits it. Then only the added rows (and the rows cut before, when the
        counter changed: ``_recut``) are measured, and the view is priced again."""
        if kept.parts is None or not additive(counter):
            return None
        tail = _legal_tail(before, added)
        if tail is None:
            return None
        budget = profile.per_message_budget
        sums = None
        cap = None
        over = kept.over
        shown: Sequence[Message] = added  # the added rows as the view shows them (a copy when one is cut)
        if isinstance(counter, CalibratedCounter) and kept.sums is not None and kept.cap is not None:
            each = each_message_features(added)
            cuttable = [(j, f) for j, (m, f) in enumerate(zip(added, each, strict=True)) if not m.flags.is_pinned]
            cap = column_max([kept.cap, *(f for _, f in cuttable)])
            if not none_cut(counter, cap, budget):
                # An added row may be over the budget (a long tool result): the kept rows by
                # their cap, the added ones priced one by one; those over it are cut and join
                # ``over``, so later builds cut them again only when the counter changes.
                long = {j for j, f in cuttable if counter.count_features(f) > budget}
                cap = column_max([kept.cap, *(f for j, f in cuttable if j not in long)])
                if not none_cut(counter, cap, budget) or any(not added[j].sequence_number for j in long):
                    return None
                each = list(each)
                shown = list(added)
                for j in sorted(long):
                    shown[j] = truncate_for_view(added[j], budget, counter)
                    each[j] = message_features(shown[j])
                    over = (*over, (len(kept.rows) + j, added[j]))
            kept = _recut(kept, counter, budget)
            features = _column_sums(each)
            assert kept.sums is not None
            sums = kept.sums.extended(shown, features)
        else:
            features = messages_features(added)
            if kept.over or counter.count_messages([*kept.rows, *added]) > budget:
                return None
        assert kept.parts is not None
        system, records, conversation, incoming = kept.parts
        new_parts = (system, records, [*conversation, *shown], incoming)
        unnumbered = (*kept.unnumbered, *(m for m in shown if not m.sequence_number))
        since = _since(state, kept, shown)
        plain = kept.plain
        cut = [r is not m for m, r in zip(added, shown, strict=True)]
        rows = [*kept.rows, *shown]
        return Assembled(
            rows=rows,
            segments=[*kept.segments, *tail.segments],
            truncated=[*kept.truncated, *cut],
            estimate=self._estimate(
                profile, new_parts, state, counter, sums, since, image_free=True, cut=_cut_pairs(rows, over)
            ),
            notices=[*kept.notices, *(_cut_notice(m, budget) for m, c in zip(added, cut, strict=True) if c)],
            chars=kept.chars + messages_chars(shown),
            features=tuple(map(operator.add, kept.features, map(float, features))),  # a + float(b), as _as_view
            last_sequence=max(kept.last_sequence, *(m.sequence_number for m in added)),
            had_images=False,
            plain=None
            if plain is None
            else [
                *plain,
                *(
                    ViewMessage(message=r, image_data=(), truncated=c, stored=not c)
                    for r, c in zip(shown, cut, strict=True)
                ),
            ],
            parts=new_parts,
            sums=sums,
            unnumbered=unnumbered,
            extends=plain,
            cap=cap,
            over=over,
            cut_by=counter,
            since=None
            if since is None or state.baseline is None
            else (state.baseline.last_sequence, new_parts, tuple(since)),
            sequences=_sequences_after(kept.sequences, shown),
        )

    def _with_incoming(
        self,
        profile: EffectiveProfile,
        kept: Assembled,
        context: Sequence[Message],
        incoming: Message,
        state: EngineState,
        counter: TextCounter,
    ) -> Assembled | None:
        """``kept`` (the view of ``context``) with ``incoming`` as its last row, or None when the
        message could change what the view holds (then it is assembled whole).

        An agent that sends its user's new message with BuildContext (appending it with the
        answer) had every such build assembled from scratch: ~15x a build of the stored rows alone
        for 200 of them. As for rows appended (``_extended``, ``_legal_tail``): a message that
        follows the stored rows legally as it is leaves their view as it is. It is priced in the
        incoming segment, and must fit one message's budget alone (a longer one is cut by the whole
        assembly)."""
        if kept.parts is None or kept.sums is None or not isinstance(counter, CalibratedCounter):
            return None
        if _legal_tail(context, (incoming,)) is None:
            return None
        features = message_features(incoming)
        if counter.count_features(features) > profile.per_message_budget:
            return None
        system, records, conversation, _ = kept.parts
        parts = (system, records, conversation, [incoming])
        held = kept.sums.segments[_SEGMENT_PARTS[Segment.INCOMING]]
        assert held is None  # the stored rows' view has no incoming message
        segments = list(kept.sums.segments)
        segments[_SEGMENT_PARTS[Segment.INCOMING]] = features
        sums = _Sums(rows=tuple(map(operator.add, kept.sums.rows, features)), segments=tuple(segments))
        cap = kept.cap
        if cap is not None and not incoming.flags.is_pinned:
            cap = column_max([cap, features])
        plain = kept.plain
        return dataclasses.replace(
            kept,
            rows=[*kept.rows, incoming],
            segments=[*kept.segments, Segment.INCOMING],
            truncated=[*kept.truncated, False],
            estimate=self._estimate(
                profile,
                parts,
                state,
                counter,
                sums,
                _since(state, kept, ()),
                image_free=True,
                cut=_cut_pairs(kept.rows, kept.over),
            ),
            notices=list(kept.notices),
            chars=kept.chars + messages_chars([incoming]),
            features=tuple(map(operator.add, kept.features, map(float, features))),  # a + float(b), as _as_view
            plain=None
            if plain is None
            else [*plain, ViewMessage(message=incoming, image_data=(), truncated=False, stored=False)],
            parts=parts,
            sums=sums,
            extends=plain,
            cap=cap,
        )

    def _estimate(
        self,
        profile: EffectiveProfile,
        parts: tuple[str, list[Message], list[Message], list[Message]],
        state: EngineState,
        counter: TextCounter,
        sums: _Sums | None = None,
        since: Sequence[Message] | None = None,
        *,
        image_free: bool,
        cut: Sequence[tuple[Message, Message]] = (),
    ) -> TokenEstimate:
        """``parts`` priced; ``sums``, ``since`` (``_since``) and ``image_free`` as ``estimate``'s
        ``segment_features``, ``since`` and ``image_free``; ``cut``: the (stored message, row sent)
        pairs of the rows the view sends cut (``_recut_tokens``)."""
        system, records, context, incoming = parts
        baseline = state.baseline
        anchor = None
        if baseline is not None:
            tokens = baseline.tokens + _recut_tokens(baseline, counter, cut, itertools.chain(records, context))
            # (an anchor a re-cut would take to nothing says nothing of this view: priced fresh)
            anchor = Baseline(tokens, baseline.last_sequence) if tokens > 0 else None
        return estimate(
            counter=counter,
            window=profile.context_window,
            reserve=profile.output_reserve_tokens,
            system=system,
            records=records,
            context=context,
            incoming=incoming,
            baseline=anchor,
            image_fallback=self._settings.tokens.image_tokens_fallback,
            segment_features=sums.segments if sums is not None else None,
            since=since,
            image_free=image_free,
            margin_share=self._settings.tokens.margin_view_share,
            beside=state.beside,
        )

    def forget(self, session_id: str) -> None:
        """Drop the session's reused view (and the rows it holds): the files store calls this
        when it drops the session's rows to stay within ``files.cache_mb``. The saved view record
        holds the assembled rows too: without dropping it, up to ``view_cache_sessions`` evicted
        sessions' rows stayed alive."""
        self._memo.forget(session_id)
        self._saved.pop(session_id, None)
        self._single.pop(session_id, None)

    def _image_bytes_budget(self, rows: Sequence[Message]) -> int:
        """Bytes the images of a view may take so that it stays one response the server can send
        (``limits.grpc_max_send_bytes``): what its text and 1 MiB of framing leave."""
        return self._settings.limits.grpc_max_send_bytes - sum(map(text_bytes, rows)) - _VIEW_FRAMING_BYTES

    def _assemble(
        self,
        profile: EffectiveProfile,
        context: Sequence[Message],
        incoming: Message | None,
        state: EngineState,
        counter: TextCounter,
    ) -> Assembled:
        tokens = self._settings.tokens
        view = build_view(profile.system_prompt, self._settings.llm_system_sources, context, incoming)
        budget = profile.per_message_budget
        rows: list[Message] = []
        truncated: list[bool] = []
        notices: list[str] = []
        if incoming is not None and any(m is incoming for m in view.dropped):
            notices.append(_left_out_notice(incoming))
        # A calibrated counter prices features: each row's are read once here, and the whole
        # count, the segment sums and the size all come from them (sums of integers: the same
        # figures as a pass over the rows for each).
        # When no message alone can exceed one message's budget, none is cut: with a calibrated
        # counter, when the largest features of the rows it may cut fit (``none_cut``); else when
        # the whole view fits (counts are sums of non-negative per-message parts). One count
        # instead of one per message.
        features: list[tuple[int, ...]] | None = None
        total: tuple[int, ...] = ()
        cap = None
        whole = None
        if isinstance(counter, CalibratedCounter):
            features = each_message_features(view.messages)
            total = _column_sums(features)
            if additive(counter):
                whole = counter.count_features(total)
                # While the whole view fits one message's budget, its total bounds every row's
                # features (non-negative counts), so it serves as the cap: the rows' own column
                # maxima (~60 µs for 200 rows) are taken only once the whole no longer fits.
                cap = total if whole <= budget else _cap_of(view.messages, view.segments, features)
        elif additive(counter):
            whole = counter.count_messages(view.messages)
        uncut = whole is not None and (whole <= budget or none_cut(counter, cap, budget))
        any_images = any(m.images for m in view.messages)
        over: tuple[tuple[int, Message], ...] = ()
        cut_pairs: list[tuple[Message, Message]] = []
        if uncut:
            rows = list(view.messages)
            truncated = [False] * len(rows)
        else:
            for m, seg in zip(view.messages, view.segments, strict=True):
                cut = m if seg is Segment.SYSTEM else truncate_for_view(m, budget, counter)
                rows.append(cut)
                truncated.append(cut is not m)
                if cut is not m:
                    notices.append(_cut_notice(m, budget))
            if features is not None and whole is not None and not any_images:
                over, cap = _over_of(view.messages, view.segments, features, truncated, counter, budget)
                if over:  # the sums and the size are the rows', cut ones included
                    features = list(features)
                    for i, _ in over:
                        features[i] = message_features(rows[i])
                    total = _column_sums(features)
        # Nothing was cut: the rows are the view's messages, already counted.
        text_tokens = (whole if uncut and whole is not None else counter.count_messages(rows)) + counter.overhead
        plan = budget_images(
            rows,
            window=profile.context_window,
            text_tokens=text_tokens,
            vision=profile.vision,
            # Images are the part of a view that can be left out, so they never push it past the size
            # guard: their share is capped by what the reply reserve leaves, not only by 0.8 x window.
            fraction=min(tokens.view_image_budget_fraction, 1 - profile.output_reserve / profile.context_window),
            image_fallback=tokens.image_tokens_fallback,
            notice_tokens=counter.count_text,
            max_bytes=self._image_bytes_budget(rows) if any_images else None,
        )
        rows = plan.messages
        notices.extend(plan.notices)
        if not uncut and any(truncated):
            # The rows as sent (a cut row that lost an image carries its notice too), as the view's
            # record keeps them (``_view_cuts``).
            cut_pairs = [(view.messages[i], rows[i]) for i in itertools.compress(range(len(rows)), truncated)]
        segments = list(view.segments)
        parts = _parts_of(rows, segments)
        # Re-priceable (``_repriced``): no row was cut to the per-message budget but ``over``'s,
        # and no message carries an image (the image budget changed nothing). Its rows are the
        # view's messages themselves, the cut ones excepted (their features are the cuts').
        repriceable = (uncut or bool(over)) and not any_images
        sums = None
        if repriceable and features is not None:
            sums = _Sums.of_rows(features, view.segments, total)
        est = self._estimate(profile, parts, state, counter, sums, image_free=not any_images, cut=cut_pairs)
        had_images = any_images and any(m.images for m in rows)
        plain = None
        if not had_images:
            # A row is the stored one when it is the very object the store gave (a cut, a
            # repaired copy, the prompt and the incoming message are new objects).
            stored_rows = {id(m) for m in context}
            stored = map(stored_rows.__contains__, map(id, rows))
            plain = list(
                map(_view_message_of, zip(rows, itertools.repeat((), len(rows)), truncated, stored, strict=True))
            )
        return Assembled(
            rows=rows,
            segments=segments,
            truncated=truncated,
            estimate=est,
            notices=notices,
            chars=features_size(sums.rows) if sums is not None else messages_chars(rows),
            features=_as_view(sums.rows)
            if sums is not None
            else tuple(float(x) for x in messages_features(rows, views=1)),
            last_sequence=max((m.sequence_number for m in context), default=0),
            had_images=had_images,
            image_tokens=image_tokens_of(rows, fallback_tokens=tokens.image_tokens_fallback) if had_images else 0,
            plain=plain,
            parts=parts if repriceable else None,
            sums=sums,
            unnumbered=tuple(m for m in (*parts[1], *parts[2]) if not m.sequence_number) if repriceable else (),
            cap=cap if sums is not None else None,
            over=over if sums is not None else (),
            cut_by=counter,
            sequences=stored_sequences(rows),
        )

    async def finish(
        self,
        caller: Principal,
        session: SessionInfo,
        profile: EffectiveProfile,
        context: Sequence[Message],
        built: Assembled,
        incoming_data: dict[str, bytes],
        compression: Any = None,
        *,
        anchor: bool = True,
        after: str = AFTER_COMPRESSION,
    ) -> BuiltView:
        """Size-check and remember an assembled view; load the bytes of the images it carries.

        ``anchor=False`` marks a view that is not the session's committed context (a fallback
        served while a compaction runs): its baseline still calibrates the model, but is never
        kept as the session's anchor (it would price a context the session does not hold).
        ``after`` ends a CONTEXT_TOO_LARGE message with what the build did (``too_large``)."""
        # The compression trigger fires on estimate + margin, so a view reaches here over the budget
        # by its margin only when compression could not shrink it further. The turn fails only when
        # the estimate itself does not fit: a margin is a doubt, and a turn must never fail on one.
        error = too_large(built.estimate.total, profile.context_window, profile.output_reserve_tokens, after=after)
        if error is not None:
            raise error
        # A copy: ``built`` may be the session's reused view (engine.view_memo), shared by builds.
        notices = list(built.notices)
        if built.estimate.guarded > built.estimate.budget:
            notices.append(
                f"the view's estimate {built.estimate.total} is within the budget of {built.estimate.budget} tokens "
                f"but its margin of {built.estimate.margin} is not: the real count may exceed it"
            )
        view_id = await self._remember(session, profile, built, anchor)
        if built.plain is not None:
            return BuiltView(
                messages=built.plain,
                view_id=view_id,
                estimate=built.estimate,
                notices=notices,
                compression=compression,
                extends=built.extends,
            )
        messages = []
        stored_rows = {id(m) for m in context}
        for m, cut in zip(built.rows, built.truncated, strict=True):
            data = []
            for ref in m.images:
                raw = incoming_data.get(ref.blob_id)
                if raw is None:
                    raw = await self._store.get_blob(ref.blob_id) or b""
                data.append(raw)
            messages.append(
                ViewMessage(message=m, image_data=tuple(data), truncated=cut, stored=not cut and id(m) in stored_rows)
            )
        return BuiltView(
            messages=messages,
            view_id=view_id,
            estimate=built.estimate,
            notices=notices,
            compression=compression,
        )

    async def _remember(self, session: SessionInfo, profile: EffectiveProfile, built: Assembled, anchor: bool) -> str:
        """The id of ``built``'s view record, saved for RecordBaseline.

        A view names what was sent (its size, estimate, images, context boundary, compaction cycle),
        so a build that reuses the session's assembled view (``view_memo``: same rows, profile,
        calibration and baseline) in the same cycle is the same view, and gets the same id without a
        store write. The record is written again before the store could have let it go: after
        ``views_kept_per_session - 1`` other views of the session were saved by this process.
        """
        epoch = EngineState.of(session).epoch if anchor else -1
        keep = self._settings.tokens.views_kept_per_session
        saved = self._saved.get(session.id)
        if saved is not None and saved.created != session.create_time:
            saved = None
        self._calls += 1
        if saved is not None and saved.built is built and saved.epoch == epoch and saved.others < keep - 1:
            self._saved.move_to_end(session.id)
            saved.calls = self._calls
            saved.session = session
            return saved.view_id
        view_id = saved.view_id if saved is not None and saved.built is built and saved.epoch == epoch else _new_id()
        record = ViewRecord(
            view_id=view_id,
            model=profile.model,
            chars=built.chars,
            estimated_tokens=built.estimate.total,
            had_images=built.had_images,
            last_sequence=built.last_sequence,
            create_time=self._clock.now(),
            epoch=epoch,
            features=built.features,
            # Not in the stored context: the incoming message and recalled excerpts.
            incoming_tokens=built.estimate.segments.incoming + built.estimate.segments.recall,
            priced_tokens=built.estimate.priced,
            image_tokens=built.image_tokens,
            shape=view_shape(profile),
            cuts=_view_cuts(built.rows, built.truncated, self._settings.tokens.anchor_cuts_max),
        )
        await self._store.save_view(session.id, record, keep=keep)
        # A view made for one build (not the session's reusable one) is kept apart, so the reusable
        # one keeps its id for the builds that reuse it. Both count the views saved after them.
        reusable = self._memo.holds(session.id, built)
        slot, other = (self._saved, self._single) if reusable else (self._single, self._saved)
        previous = other.get(session.id)
        if previous is not None:
            previous.others += 1
        if anchor:
            kept = _SavedView(built, epoch, view_id, session.create_time, record, session, calls=self._calls)
            slot[session.id] = kept
            slot.move_to_end(session.id)
            while len(slot) > max(1, self._settings.hot_path.view_cache_sessions):
                slot.popitem(last=False)
        elif slot.get(session.id) is not None:
            slot[session.id].others += 1
        return view_id

    async def estimate_messages(
        self, *, model: str, profile: EffectiveProfile, messages: Sequence[IncomingMessage]
    ) -> TokenEstimate:
        """An arbitrary message list priced for ``model`` (no session, nothing stored)."""
        if not messages:
            raise InvalidArgument.field("messages", "give messages or a session_id")
        check_messages(messages, self._settings.limits)
        rows = []
        for i, item in enumerate(messages):
            m, _ = await self.prepare_incoming(item, f"messages[{i}]")
            assert m is not None
            rows.append(m)
        profile = dataclasses.replace(profile, model=model or profile.model)
        await self._accounting.ensure_loaded(profile.model)
        counter = self._accounting.counter(profile.model)
        return estimate(
            counter=counter,
            window=profile.context_window,
            reserve=profile.output_reserve_tokens,
            context=rows,
            image_fallback=self._settings.tokens.image_tokens_fallback,
            view=False,
        )

    async def estimate_session(
        self, session: SessionInfo, context: list[Message], *, model: str, profile: EffectiveProfile
    ) -> TokenEstimate:
        """What ``BuildContext`` with ``profile`` would send now, priced the same way (no
        compression). ``context``: the session's context buffer, read with ``session`` at one
        moment (``context_and_session``)."""
        profile = dataclasses.replace(profile, model=model or profile.model)
        await self._accounting.ensure_loaded(profile.model)
        return self.assemble(profile, context, None, EngineState.of(session)).estimate

    async def record_baseline(
        self,
        caller: Principal,
        session_id: str,
        *,
        view_id: str,
        prompt_tokens: int,
        anchor: Callable[[PendingAnchor], Awaitable[None]],
        quick_anchor: QuickAnchor | None = None,
    ) -> BaselineResult:
        """Record the provider's count of a view: a calibration observation for the view's model,
        and (unless it looks truncated) the session's new anchor, handed to ``anchor``, which
        applies it under the compaction lock (``apply_anchor``), now or once a compaction ends.

        ``quick_anchor`` (``try_anchor`` when no compaction of the session runs here; True once
        written): for the view this process saved last, tried first on the session as that build
        read it, before anything else is read or written. Written, the session exists, is the
        caller's and is in the view's cycle, so the baseline needs no read of its own. A store
        that publishes the events writes the observation and the event with that anchor."""
        sid = require_session_id(session_id)
        if not view_id:
            raise InvalidArgument.field("view_id", "is required")
        if len(view_id) > MAX_VIEW_ID_CHARS:  # no view has one: not looked up, not repeated whole
            raise InvalidArgument.field(
                "view_id", f"is no view id BuildContext gave (over {MAX_VIEW_ID_CHARS} characters)"
            )
        if prompt_tokens <= 0:
            raise InvalidArgument.field("prompt_tokens", "must be positive")
        saved = self._saved.get(sid)
        if saved is None or saved.view_id != view_id:
            saved = self._single.get(sid) or saved  # a view made for one build (an incoming message)
        if saved is not None and (
            saved.view_id != view_id
            # The store let it go. Counted by this process's saves alone: when other replicas
            # build the session too, the one that built the view may accept it a little longer
            # than the store holds it (the record is immutable, the anchor checks the same).
            or saved.others >= self._settings.tokens.views_kept_per_session
        ):
            saved = None
        # Other builds or baselines served since this view was (a fleet of agents, not one client
        # going through its sessions one call at a time): only then may its refit wait for others.
        concurrent = saved is not None and self._calls > saved.calls
        self._calls += 1
        if saved is not None and quick_anchor is not None:
            done = await self._record_on_saved(caller, sid, saved, prompt_tokens, concurrent, quick_anchor, anchor)
            if done is not None:
                return done
        session = await self._store.get_session(sid, caller=caller)
        if saved is not None and saved.created != session.create_time:
            saved, concurrent = None, False
        # The view this process saved last for the session is the record the store holds under
        # its id (records are never changed): read here, it costs no store read.
        view = saved.record if saved is not None else await self._store.get_view(sid, view_id)
        if view is None:
            raise NotFound(
                f"view {view_id} of session {sid} is unknown or too old; build a new one",
                reason="VIEW_NOT_FOUND",
                metadata={"view_id": view_id},
            )
        self._refuse_impossible(prompt_tokens, view)
        calibration = await self._accounting.ensure_loaded(view.model)
        reason, bound = self._truncation(prompt_tokens, view, calibration)
        if reason:
            # The provider silently cut the prompt's head: keep the previous honest baseline and
            # make the post-turn check compress regardless of the threshold.
            await self._store.update_state(sid, caller=caller, context_truncated=True)
            await self._bus.publish(
                session_id=sid,
                user_id=session.user_id,
                kind="context_truncated",
                payload={
                    "view_id": view_id,
                    "prompt_tokens": prompt_tokens,
                    "estimated_tokens": view.estimated_tokens,
                    "lower_bound": bound,
                    "reason": reason,
                },
            )
            return BaselineResult(
                recorded=False,
                truncated=True,
                model=view.model,
                calibration=calibration,
                truncation_reason=reason,
                lower_bound=bound,
            )
        beside, observation = self._judged(sid, view_id, view, prompt_tokens, calibration, session)
        if self._publisher is not None:
            # The observation and the event in one statement, after the anchor (applied, or
            # deferred behind a compaction), as the quick way orders them.
            if _anchorable(view, session):
                await anchor(_pending(view_id, view, prompt_tokens, session, beside))
            write = self._baseline_write(view_id, view, prompt_tokens, observation)
            if not await self._publisher.observe_baseline(sid, caller=caller, write=write):
                # Deleted since it was read: the answer of an unknown session (stores' too).
                raise NotFound("session not found", metadata={"session_id": sid})
            calibration = await self._accounting.observe(
                view.model, write.observation, source=sid, concurrent=concurrent, written=True
            )
            self._mark_observed(sid, view_id)
            return BaselineResult(
                recorded=True, truncated=False, model=view.model, calibration=calibration, lower_bound=bound
            )
        calibration = await self._accounting.observe(view.model, observation, source=sid, concurrent=concurrent)
        self._mark_observed(sid, view_id)
        if _anchorable(view, session):  # the cycle is checked again where the anchor is applied
            await anchor(_pending(view_id, view, prompt_tokens, session, beside))
        await self._recorded(sid, session.user_id, view_id, view, prompt_tokens)
        return BaselineResult(
            recorded=True, truncated=False, model=view.model, calibration=calibration, lower_bound=bound
        )

    async def _record_on_saved(
        self,
        caller: Principal,
        sid: str,
        saved: _SavedView,
        prompt_tokens: int,
        concurrent: bool,
        quick_anchor: QuickAnchor,
        anchor: Callable[[PendingAnchor], Awaitable[None]],
    ) -> BaselineResult | None:
        """``record_baseline`` of the view this process saved last, anchored first on the session
        as its build read it; None (nothing done) when that is not how it ends: a count that looks
        truncated, a view that is no anchor, or a session that changed since (the caller then
        reads the session and goes the usual way).

        The anchor is written before the observation, so that a refused anchor costs no second
        observation on the usual way. An observation that then fails leaves the anchor (a correct
        one) and no event; the caller gets the error, and its retry anchors on a fresh read and
        observes. A store that publishes the events (``_publisher``) writes the observation and
        the event in the anchor's own statement instead: all three, or none when refused. While a
        compaction of the session runs here, the anchor waits for it (``anchor``), and that store
        writes the other two in one statement at once, checked against the session as the build
        read it (its owner, its creation): the baseline reads nothing."""
        view, read = saved.record, saved.session
        if not _anchorable(view, read) or prompt_tokens > self._ceiling(view):
            return None  # (an impossible count is refused on the usual way)
        calibration = await self._accounting.ensure_loaded(view.model)
        reason, bound = self._truncation(prompt_tokens, view, calibration)
        if reason:
            return None
        beside, observation = self._judged(sid, saved.view_id, view, prompt_tokens, calibration, read)
        write = None
        if self._publisher is not None:
            write = self._baseline_write(saved.view_id, view, prompt_tokens, observation)
        pending = _pending(saved.view_id, view, prompt_tokens, read, beside)
        written = await quick_anchor(pending, write)
        if written is None and write is not None and self._publisher is not None:
            if not await self._publisher.observe_baseline(sid, caller=caller, write=write, created=read.create_time):
                return None
            await anchor(pending)
        elif not written:
            return None
        calibration = await self._accounting.observe(
            view.model, observation, source=sid, concurrent=concurrent, written=write is not None
        )
        self._mark_observed(sid, saved.view_id)
        if write is None:
            await self._recorded(sid, read.user_id, saved.view_id, view, prompt_tokens)
        return BaselineResult(
            recorded=True, truncated=False, model=view.model, calibration=calibration, lower_bound=bound
        )

    @staticmethod
    def _baseline_write(view_id: str, view: ViewRecord, prompt_tokens: int, observation: Observation) -> BaselineWrite:
        """What a store that publishes the events writes for a recorded baseline besides its
        anchor: its ``observation`` and the ``BASELINE_RECORDED`` event."""
        payload = _recorded_payload(view_id, view, prompt_tokens)
        return BaselineWrite(view.model, observation, BASELINE_RECORDED, payload)

    def _judged(
        self,
        sid: str,
        view_id: str,
        view: ViewRecord,
        prompt_tokens: int,
        calibration: Calibration,
        session: SessionInfo,
    ) -> tuple[int, Observation]:
        """What a baseline's count holds beside its view (``_beside``, for the anchor) and its
        observation for the calibration: inert when it is the first to show tokens sent beside
        the view, or when this process already observed the view (a retried RecordBaseline)."""
        known = EngineState.of(session).beside
        beside = self._beside(view, prompt_tokens, calibration, known)
        inert = bool(beside and not known) or (sid, view_id) in self._observed
        return beside, self._observation(view, prompt_tokens, beside=known, inert=inert)

    def _observation(
        self, view: ViewRecord, prompt_tokens: int, *, beside: int = 0, inert: bool = False
    ) -> Observation:
        """The calibration's observation of a baseline: of the count less ``beside``, what the
        session was known to send beside its views when the view was built (``_beside``; the
        view's estimate held it too). ``inert``: the count holds tokens sent beside the view
        that were not known yet: kept without features or residual, so neither the fit nor the
        margin reads it."""
        if inert:
            return Observation(chars=view.chars, tokens=prompt_tokens, had_images=view.had_images)
        tokens = max(1, prompt_tokens - beside)
        return Observation(
            chars=view.chars,
            tokens=tokens,
            had_images=view.had_images,
            features=view.features,
            residual=_residual(prompt_tokens, view, self._settings.tokens.margin_view_share),
        )

    def _mark_observed(self, sid: str, view_id: str) -> None:
        key = (sid, view_id)
        self._observed[key] = None
        self._observed.move_to_end(key)
        while len(self._observed) > max(1, self._settings.hot_path.view_cache_sessions):
            self._observed.popitem(last=False)

    def _beside(self, view: ViewRecord, prompt_tokens: int, calibration: Calibration, known: int) -> int:
        """Tokens a count of ``view`` holds beside the view (tool definitions): its excess over
        the view's price, when that is more than a calibration misses by (``tokens.beside_share``
        of the price, and at least ``beside_min_tokens``); for a session already known to send
        some (``known``), any excess past ``beside_min_tokens`` (their price moves with the
        calibration). 0 when the count is the view's.

        Judged on views priced whole only (a session's first, the first after a compaction):
        those are small, and a calibration misses a small view by little; an anchored view is
        as large as the session has grown, and its excess would carry the calibration's miss on
        all of it. ``known`` stays for the others, and for a view the price cannot judge
        (images, no features)."""
        tokens = self._settings.tokens
        if view.had_images or not view.features:
            return known
        # Priced whole: all of its estimate but what is known to be sent beside was priced.
        if view.priced_tokens + view.image_tokens + known < view.estimated_tokens:
            return known
        price = calibration.price(view.features)
        excess = prompt_tokens - math.ceil(price)
        least = tokens.beside_min_tokens
        if excess > max(least, tokens.beside_share * price) or (known and excess > least):
            return excess
        return 0

    async def _recorded(self, sid: str, user_id: str, view_id: str, view: ViewRecord, prompt_tokens: int) -> None:
        await self._bus.publish(
            session_id=sid,
            user_id=user_id,
            kind=BASELINE_RECORDED,
            payload=_recorded_payload(view_id, view, prompt_tokens),
        )

    async def try_anchor(
        self, caller: Principal, session_id: str, pending: PendingAnchor, write: BaselineWrite | None = None
    ) -> SessionInfo | None:
        """``apply_anchor`` without the store's compaction lock, for the common case: nothing was
        appended since the view, and the session is still as the baseline read it (the store
        checks that, and that no compaction holds the lock elsewhere). None when not written:
        the caller then takes the locked way (``apply_anchor``), which decides on a fresh read.
        With ``write`` (a store that publishes the events) its observation and event are written
        with the anchor, or neither."""
        read, view = pending.read, pending.view
        if read is None or read.last_sequence != view.last_sequence or not _anchorable(view, read):
            return None
        state = pending.applied_to(EngineState.of(read)).to_dict()
        if write is not None and self._publisher is not None:
            return await self._publisher.anchor_baseline(
                session_id, caller=caller, read=read, context_tokens=pending.tokens, state=state, write=write
            )
        return await self._store.update_state_if_unchanged(
            session_id, caller=caller, read=read, context_tokens=pending.tokens, state=state
        )

    async def apply_anchor(self, caller: Principal, session_id: str, pending: PendingAnchor) -> SessionInfo | None:
        """Make ``pending`` the session's baseline if its view is of the session's current
        compaction cycle (a compaction committed since the view was built makes it stale: it is
        dropped). A read-modify-write of the engine state: call it under the compaction lock.
        The session as written when applied; None when dropped."""
        session = await self._store.get_session(session_id, caller=caller)
        state = EngineState.of(session)
        view = pending.view
        if view.epoch != state.epoch:
            return None
        # Nothing was appended since the view (its newest row is the session's): no context to read.
        newer: list[Message] = []
        if session.last_sequence != view.last_sequence:
            # Read again with its context, at one moment: the count written below is of that
            # context, and the session's context tokens then are what later appends count from.
            session, context = await self._store.context_and_session(session_id, caller=caller)
            state = EngineState.of(session)
            if state.epoch != view.epoch:
                return None
            newer = [m for m in context if m.sequence_number > view.last_sequence]
        if newer:  # priced as the next view sends them (a long row cut to the per-message budget)
            budget = counted_budget(self._settings, session)
            context_tokens = pending.tokens + self._accounting.context_tokens(view.model, newer, budget)
        else:
            context_tokens = pending.tokens
        # Not durable on its own: a crash that loses the anchor leaves the previous one (or none),
        # and the next baseline anchors again; a files store in fsync mode answers without an
        # fsync of its own (issue #15: the second fsync of every turn).
        return await self._store.update_state(
            session_id,
            caller=caller,
            context_tokens=context_tokens,
            context_truncated=False,
            state=pending.applied_to(state).to_dict(),
            durable=False,
            # Appends take no compaction lock: one committed since the read keeps what it added
            # (an absolute write would lose it, and the session's count would stay short).
            context_tokens_as_of=session.context_tokens,
        )

    def _ceiling(self, view: ViewRecord) -> int:
        """The most tokens a provider's count of ``view`` can hold: a token for each byte of its
        text (at most four a character), four times its images' price by the image pricing rule,
        and ``tokens.baseline_unseen_tokens`` for what a request carries beside the view."""
        return 4 * (view.chars + max(0, view.image_tokens)) + self._settings.tokens.baseline_unseen_tokens

    def _refuse_impossible(self, prompt_tokens: int, view: ViewRecord) -> None:
        """Raise INVALID_ARGUMENT for a count no tokenizer could make of ``view`` (a client's bug:
        a sum of several calls' usage, a count of another request): recorded, it would become the
        session's anchor and a residual in the model's fit priced for every session."""
        ceiling = self._ceiling(view)
        if prompt_tokens > ceiling:
            raise InvalidArgument.field(
                "prompt_tokens",
                f"{prompt_tokens} is more than any tokenizer can count for this view ({view.chars:,} characters, "
                f"estimate {view.estimated_tokens:,}): at most {ceiling:,} with what a request carries beside it",
            )

    def _truncation(self, prompt_tokens: int, view: ViewRecord, calibration: Calibration) -> tuple[str, int]:
        """Why ``prompt_tokens`` looks silently truncated ("" when it does not), and the lower bound.

        The count is held against the smaller of ``truncation_ratio`` x the view's estimate and the
        view's floor. The floor's text part (``Calibration.floor``) is ``truncation_ratio`` x the
        fitted price of the features the model's baselines have shown, and for the rest the fewest
        tokens any vocabulary could have counted (``calibration.lower_bound``): before any
        calibration it is that bound alone, so an inflated cold estimate never refuses an honest
        count; once baselines back the weights, a prompt cut to well under its calibrated price is
        caught even where the bare bound is loose (framing, whitespace). Its image part is
        ``truncation_image_ratio`` x the view's images by the image pricing rule: an image's count
        is the rule's, not a vocabulary's guess, so a small view made mostly of images is not
        judged by its few text tokens alone. A view recorded without features (or with another
        feature layout) falls back to the estimate alone.
        """
        tokens = self._settings.tokens
        ratio = tokens.truncation_ratio
        by_estimate = ratio * view.estimated_tokens
        if len(view.features) != N_FEATURES:
            if view.estimated_tokens > 0 and prompt_tokens < by_estimate:
                return (
                    f"prompt_tokens {prompt_tokens} is below {ratio:.0%} of the view's estimate "
                    f"{view.estimated_tokens}",
                    0,
                )
            return "", 0
        text = max(lower_bound(view.features), calibration.floor(view.features, ratio))
        images = math.floor(tokens.truncation_image_ratio * max(0, view.image_tokens))
        bound = text + images
        if bound > 0 and prompt_tokens < min(by_estimate, bound):
            of_images = (
                f" and {images} for its images ({view.image_tokens} by the image pricing rule)" if images else ""
            )
            return (
                f"prompt_tokens {prompt_tokens} is below {bound}, the fewest tokens an honest count of this "
                f"view can have: {text} for its text (the model's calibrated price where its baselines back "
                f"it, the cheapest known vocabulary elsewhere){of_images}; estimate {view.estimated_tokens}: "
                "the provider most likely dropped the head of the prompt",
                bound,
            )
        return "", bound


def _residual(prompt_tokens: int, view: ViewRecord, share: float) -> float | None:
    """How far the real count was above the view's estimate, relative to what its margin
    protects (``margin_base``: what the estimate priced, at least ``share`` of the view's text;
    the calibration's margin is a quantile of these). None when nothing was priced or the view
    carried images (their price is not the text calibration's error)."""
    if view.priced_tokens <= 0 or view.had_images:
        return None
    return (prompt_tokens - view.estimated_tokens) / margin_base(view.priced_tokens, view.estimated_tokens, share)
