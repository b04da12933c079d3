"""Sizing messages and estimating the tokens of a view (DESIGN §5.2, §5.3).

What is counted is the view the model is sent — after per-message truncation and image
budgeting — never the raw stored context: deciding on the raw size while printing the cut
size was how a session once died "too large" over a prompt the model never received.

A message's size is in *size units* (``contextsvc.core.sizing``: about half a token of any
common vocabulary, whatever the kind of text), and the calibration line maps size units to
tokens. Where the DESIGN and the persisted observations say "chars", read size units.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from contextsvc.config import TokenSettings
from contextsvc.core.calibration import Calibration, margin_base
from contextsvc.core.images import DEFAULT_FALLBACK_TOKENS, ref_tokens
from contextsvc.core.message_memo import IdentityMemo
from contextsvc.core.messages import Message, Role
from contextsvc.core.priors import MESSAGE, N_CLASSES, N_FEATURES, N_UNITS, TOOL_CALL, VIEW
from contextsvc.core.sizing import (
    MESSAGE_FRAME_UNITS,
    TOOL_CALL_FRAME_UNITS,
    CutIndex,
    cut_feature_units,
    cut_index,
    feature_units,
)

_DEFAULTS = TokenSettings()


class EstimateMethod(StrEnum):
    """How an estimate was obtained (mirrors the contract's ``EstimateMethod``)."""

    CALIBRATED = "calibrated"
    FALLBACK = "fallback"
    BASELINE_DELTA = "baseline_delta"
    EXACT = "exact"


# --- what a message weighs: its size (contextsvc.core.sizing) -------------------------------


def message_parts(m: Message) -> tuple[str, ...]:
    """The text of ``m`` that reaches the model, the only text counted.

    Counted: ``content``, ``thinking``, each tool call's ``id``, ``name`` and ``arguments_json``,
    and the message's ``tool_call_id`` and ``name``. Not counted: metadata, flags, timestamps, and
    images (priced by their pixels, never by their bytes). The chat template's framing is not in
    the text; ``message_size`` adds a fixed allowance for it per message and per tool call.
    """
    parts = [m.content, m.thinking]
    for call in m.tool_calls:
        parts += (call.id, call.name, call.arguments_json)
    parts += (m.tool_call_id, m.name)
    return tuple(p for p in parts if p)


def message_size(m: Message) -> int:
    """Size units of ``m`` (``sizing.text_size`` of its parts plus its template framing), computed
    once per message object (``core.message_memo``): a view prices the same stored rows every build."""
    return _SIZES.get(m, _measure)


def _measure(m: Message) -> int:
    # ``sizing.class_units`` of a text sum to its ``text_size``, so the size is its features'
    # class units (measured once per message, and needed to price it anyway) plus the framing:
    # one pass over the text instead of two.
    return features_size(message_features(m))


def features_size(x: Sequence[int]) -> int:
    """``messages_size`` of messages whose ``messages_features`` are ``x``: their class units
    plus the framing of each message and each tool call (both counted among the features)."""
    return sum(x[:N_CLASSES]) + MESSAGE_FRAME_UNITS * x[MESSAGE] + TOOL_CALL_FRAME_UNITS * x[TOOL_CALL]


_SIZES: IdentityMemo[int] = IdentityMemo()


def messages_size(messages: Iterable[Message]) -> int:
    """Size units of every message: the measure the calibration line is fitted on."""
    return sum(map(message_size, messages))


def message_frame_units(m: Message) -> int:
    """Size units of the framing a chat template wraps ``m`` in (role header, end marker, one
    wrapper per tool call): real prompt tokens that no text field shows."""
    return MESSAGE_FRAME_UNITS + TOOL_CALL_FRAME_UNITS * len(m.tool_calls)


def message_features(m: Message) -> tuple[int, ...]:
    """What the calibration prices in ``m`` (``priors.FEATURES`` order): size units of its parts
    per content class, 1 message, and its tool calls. Computed once per message object
    (``core.message_memo``): the fit maps these to tokens, so a new fit never invalidates them."""
    return _FEATURES.get(m, _features)


def _features(m: Message) -> tuple[int, ...]:
    parts = message_parts(m)
    if len(parts) == 1:  # most rows: the content alone
        units = feature_units(parts[0])
    else:  # column by column, in C (``map``/``zip``/``sum``)
        units = tuple(map(sum, zip(*map(feature_units, parts), strict=True))) if parts else _NO_UNITS
    # The columns after the units, in ``priors.FEATURES`` order: MESSAGE, TOOL_CALL, VIEW.
    return (*units, 1, len(m.tool_calls), 0)


_NO_UNITS = (0,) * N_UNITS
assert (MESSAGE, TOOL_CALL, VIEW, N_FEATURES) == (N_UNITS, N_UNITS + 1, N_UNITS + 2, N_UNITS + 3)


_FEATURES: IdentityMemo[tuple[int, ...]] = IdentityMemo()


def each_message_features(messages: Iterable[Message]) -> list[tuple[int, ...]]:
    """``message_features`` of each message, in order."""
    return _FEATURES.get_each(messages, _features)


def messages_features(messages: Iterable[Message], *, views: int = 0) -> tuple[int, ...]:
    """Sum of ``message_features``, plus ``views`` whole prompts (1 for a view sent as a prompt)."""
    each = list(map(message_features, messages))
    if len(each) == 1 and not views:
        return each[0]  # one message (a per-message cut check): its own features, VIEW already 0
    total = list(map(sum, zip(*each, strict=True))) or [0] * N_FEATURES
    total[VIEW] = views
    return tuple(total)


def carry_measures(src: Message, dst: Message) -> Message:
    """``dst``, given the size and features already measured for ``src`` when its measured fields
    are the very same objects (a copy that changed only numbers, times, flags or metadata, as
    ``dataclasses.replace`` makes it): the copy a store keeps is not measured again at its first
    build. Anything else is left to be measured on its own."""
    if (
        src.content is dst.content
        and src.thinking is dst.thinking
        and src.tool_calls is dst.tool_calls
        and src.tool_call_id is dst.tool_call_id
        and src.name is dst.name
    ):
        _SIZES.carry(src, dst)
        _FEATURES.carry(src, dst)
    return dst


#: The cut indexes (``sizing.cut_index``) of a message's fields that views cut, by field name (None:
#: a text the index cannot cover): made at the first cut, dropped with the message.
_CUT_INDEXES: IdentityMemo[dict[str, CutIndex | None]] = IdentityMemo()


def remember_cut(original: Message, cut: Message, spans: Sequence[tuple[str, int, int]]) -> None:
    """Give ``cut`` its ``message_features`` from ``original``'s: ``cut`` is ``original`` with
    the fields named in ``spans`` cut, each to its text's first ``head`` characters, a marker, and
    its text from ``tail`` on (``core.view_budget``). The same numbers as measuring ``cut`` whole
    (``sizing.cut_feature_units``), at the cost of the pieces around each cut: a view cuts a long
    row again whenever the calibration moves, and measuring the cut whole cost ~0.8 ms per 20 KB."""
    features = list(message_features(original))
    indexes = _CUT_INDEXES.get(original, _no_indexes)
    for name, head, tail in spans:
        text, now = getattr(original, name), getattr(cut, name)
        if name not in indexes:
            indexes[name] = cut_index(text)
        index = indexes[name]
        if index is None:
            units, whole = feature_units(now), feature_units(text)
        else:
            units, whole = cut_feature_units(text, now, head, tail, index), index.whole()
        features[:N_UNITS] = map(operator.add, features[:N_UNITS], map(operator.sub, units, whole))
    _FEATURES.put(cut, tuple(features))


def remember_features(m: Message, features: tuple[int, ...]) -> None:
    """Give ``m`` the ``message_features`` measured for a message with the same fields (a cut
    made again the same way: ``view_budget``)."""
    _FEATURES.put(m, features)


def _no_indexes(_: Message) -> dict[str, CutIndex | None]:
    return {}


def text_features(text: str) -> tuple[int, ...]:
    """Class units (and the families' Cyrillic columns) of a bare text (no message framing)."""
    return (*feature_units(text), *([0] * (N_FEATURES - N_UNITS)))


#: Kept under their historical names: the engine stores ``messages_chars`` of a built view as
#: the ``chars`` of its baseline observation, so they must return the calibration's measure —
#: size units, not characters.
message_chars = message_size
messages_chars = messages_size


def text_chars(m: Message) -> int:
    """Plain characters of ``message_parts(m)`` (for cutting text, never for pricing it)."""
    return sum(len(p) for p in message_parts(m))


def image_tokens_of(messages: Iterable[Message], *, fallback_tokens: int = DEFAULT_FALLBACK_TOKENS) -> int:
    """Tokens of every image the messages carry, each priced by its own size."""
    # Most views carry no image: one plain pass finds the few rows that do.
    carrying = [m for m in messages if m.images]
    return sum(ref_tokens(ref, fallback_tokens=fallback_tokens) for m in carrying for ref in m.images)


def cut_to_budget(m: Message) -> bool:
    """Whether a view sends ``m``'s text cut to the per-message budget when it is over it
    (``truncate_for_view``): not a pinned message, nor one with tool calls, whose arguments are
    never cut (counted whole: over, never under), nor a system row."""
    return not (m.flags.is_pinned or m.tool_calls or m.role is Role.SYSTEM)


def context_share(m: Message, budget: int, *, fallback_tokens: int = DEFAULT_FALLBACK_TOKENS) -> int:
    """What ``m`` adds to its session's context tokens, from its price as stored (``token_count``):
    a view cuts the text of a message over ``budget`` tokens to that budget (``cut_to_budget``), so
    its text counts at most ``budget``, its images in full."""
    if m.token_count <= budget or not cut_to_budget(m):
        return m.token_count
    images = image_tokens_of((m,), fallback_tokens=fallback_tokens)
    return min(m.token_count - images, budget) + images


def context_total(messages: Iterable[Message], budget: int, *, fallback_tokens: int = DEFAULT_FALLBACK_TOKENS) -> int:
    """What the context rows of ``messages`` add to their session's count (``context_share`` each)."""
    return sum(context_share(m, budget, fallback_tokens=fallback_tokens) for m in messages if m.flags.is_context)


# --- text counters -------------------------------------------------------------------------


class TextCounter(Protocol):
    """Counts text tokens. ``overhead`` is added once per prompt (template framing)."""

    @property
    def method(self) -> EstimateMethod: ...

    @property
    def overhead(self) -> int: ...

    @property
    def margin_rate(self) -> float:
        """Relative margin of what this counter prices (from the fit's recent residuals)."""
        ...

    def count_text(self, text: str) -> int: ...

    def count_messages(self, messages: Iterable[Message]) -> int:
        """Text tokens of the messages, without the overhead; images excluded."""
        ...

    def count_and_margin(self, messages: Sequence[Message]) -> tuple[int, float]:
        """``count_messages`` of the messages and the tokens that count may be short by."""
        ...


@dataclass(slots=True, frozen=True)
class CalibratedCounter:
    """Counts with a model's calibration (or its family's cold prior) over content-class units."""

    calibration: Calibration

    @property
    def method(self) -> EstimateMethod:
        return EstimateMethod.CALIBRATED if self.calibration.fitted else EstimateMethod.FALLBACK

    @property
    def overhead(self) -> int:
        return round(self.calibration.overhead)

    @property
    def margin_rate(self) -> float:
        return self.calibration.margin

    def count_text(self, text: str) -> int:
        return max(0, round(self.calibration.price(text_features(text))))

    def count_messages(self, messages: Iterable[Message]) -> int:
        # Sum the units first, round once: per-message rounding would drift on long contexts.
        # Per-message and per-tool-call framing only: a list is never charged a view's overhead.
        return max(0, round(self.calibration.price(messages_features(messages))))

    def count_and_margin(self, messages: Sequence[Message]) -> tuple[int, float]:
        # One pass over the features: each feature's price times its own margin (Cyrillic text
        # gets a wider one than code).
        if not messages:
            return 0, 0.0
        return self.count_and_margin_of(messages_features(messages))

    def count_and_margin_of(self, x: Sequence[float] | None) -> tuple[int, float]:
        """``count_and_margin`` of messages whose ``messages_features`` are ``x`` (None: no messages)."""
        if x is None:
            return 0, 0.0
        return max(0, round(self.calibration.price(x))), max(0.0, self.calibration.margin_of(x))

    def count_features(self, x: Sequence[float]) -> int:
        """``count_messages`` of messages whose ``messages_features`` are ``x``."""
        return max(0, round(self.calibration.price(x)))


@dataclass(slots=True, frozen=True)
class ExactCounter:
    """Counts text with a real tokenizer (``count`` maps text to its token count).

    Parts are encoded one by one, as a chat template separates them. A tokenizer file holds no
    chat template, so the template's framing (per message, per tool call, and the reply primer a
    whole prompt adds once) is priced by ``framing``, the model's calibration: its framing
    weights are what the baselines say the template costs (the family's prior before any). The
    framing is real prompt tokens: counted as nothing, a view of many short messages looked far
    smaller than the prompt sent (300 messages: ~1,200 tokens unseen), with no margin to warn.
    Without ``framing`` only the text is counted.
    """

    count: Callable[[str], int]
    framing: Calibration | None = None

    @property
    def method(self) -> EstimateMethod:
        return EstimateMethod.EXACT

    @property
    def overhead(self) -> int:
        return round(self.framing.overhead) if self.framing is not None else 0

    @property
    def margin_rate(self) -> float:
        # The text is counted exactly; the framing's margin is in ``count_and_margin``.
        return 0.0

    def count_text(self, text: str) -> int:
        return self.count(text) if text else 0

    def count_messages(self, messages: Iterable[Message]) -> int:
        return self.count_and_margin(list(messages))[0]

    def count_and_margin(self, messages: Sequence[Message]) -> tuple[int, float]:
        text = sum(self.count(p) for m in messages for p in message_parts(m))
        if self.framing is None or not messages:
            return text, 0.0
        x = [0.0] * N_FEATURES
        x[MESSAGE] = float(len(messages))
        x[TOOL_CALL] = float(sum(len(m.tool_calls) for m in messages))
        framing = max(0.0, self.framing.price(x))
        return text + round(framing), max(0.0, self.framing.margin_of(x))


@functools.lru_cache(maxsize=16)
def load_tokenizer(path: str) -> Callable[[str], int]:
    """A token-counting function from a Hugging Face ``tokenizer.json`` (cached per path).

    ``tokenizers`` is imported here, not at module level, so the core imports without it.
    Raises ValueError naming the path when the file is missing or not a tokenizer.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - it is a declared dependency
        raise ValueError(f"tokenizer file {path!r} is configured but the 'tokenizers' package is missing") from None
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises a bare Exception for a missing or bad file
        raise ValueError(f"cannot load tokenizer file {path!r}: {exc}") from None

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count


def counter_for(model: str, calibration: Calibration, settings: TokenSettings) -> TextCounter:
    """The exact counter when the operator configured a tokenizer file for ``model``, else the calibrated one."""
    path = settings.tokenizer_files.get(model)
    if path:
        return ExactCounter(load_tokenizer(path), framing=calibration)
    return CalibratedCounter(calibration)


# --- window arithmetic ---------------------------------------------------------------------


def output_reserve(window: int, reserve: int) -> int:
    """Tokens kept free for the reply: ``reserve`` capped at a quarter of the window.

    The cap keeps a deliberately small window from failing every size check.
    """
    return max(0, min(reserve, window // 4))


def message_budget(window: int, budget: int) -> int:
    """Per-message view budget in tokens; 0 means ``window // 6``."""
    return budget if budget > 0 else window // 6


def truncation_check(reported: int, estimated: int, ratio: float = _DEFAULTS.truncation_ratio) -> bool:
    """True when the provider's ``reported`` count is below ``ratio`` of our ``estimated`` view.

    Such a count means the provider silently cut the prompt's head: it must not become the
    baseline (the previous one survives) and the session is flagged ``context_truncated``.
    """
    return estimated > 0 and reported < ratio * estimated


# --- the estimate of a view ----------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class TokenSegments:
    """Where a view's tokens go. Images are all in ``images`` (incoming ones too); the
    counter's per-prompt overhead is in ``system``. The segments sum to the estimate's total."""

    system: int = 0
    records: int = 0
    summaries: int = 0
    pinned: int = 0
    messages: int = 0
    images: int = 0
    incoming: int = 0
    #: excerpts of compacted history recalled into the view (engine/recall.py adds them last).
    recall: int = 0

    @property
    def total(self) -> int:
        return (
            self.system
            + self.records
            + self.summaries
            + self.pinned
            + self.messages
            + self.images
            + self.incoming
            + self.recall
        )


@dataclass(slots=True, frozen=True)
class TokenEstimate:
    """A view's estimate. ``budget`` is what the view may use: window minus the output reserve."""

    total: int
    text: int
    images: int
    method: EstimateMethod
    window: int
    budget: int
    fraction: float
    segments: TokenSegments
    #: tokens the estimate may be short by (from the calibration's recent residuals); guards and
    #: triggers use ``total + margin``.
    margin: int = 0
    #: tokens of the estimate that were priced by the counter (all of its text, or only the delta
    #: after a baseline, which is a real count): with ``margin_view_share`` of the view's text,
    #: the ``margin_base`` the margin scales and a baseline's residual is relative to.
    priced: int = 0

    @property
    def guarded(self) -> int:
        """``total + margin``: what the compression trigger compares. The size guard fails on ``total``
        alone; over the budget by the margin only, a view gets a notice."""
        return self.total + self.margin

    @property
    def over_budget(self) -> bool:
        return self.guarded > self.budget


@dataclass(slots=True, frozen=True)
class Baseline:
    """The real prompt count of an earlier view, and the newest stored sequence number it held."""

    tokens: int
    last_sequence: int


def baseline_delta(
    baseline_tokens: int,
    messages_since: Iterable[Message],
    counter: TextCounter,
    *,
    image_fallback: int = DEFAULT_FALLBACK_TOKENS,
    counted: int | None = None,
) -> int:
    """The real count of the last view plus the estimate of what was appended after it.
    ``counted``: ``counter.count_messages`` of those messages, when the caller has it already."""
    since = list(messages_since)
    text = counter.count_messages(since) if counted is None else counted
    return baseline_tokens + text + image_tokens_of(since, fallback_tokens=image_fallback)


def estimate(
    *,
    counter: TextCounter,
    window: int,
    reserve: int,
    system: str = "",
    records: Sequence[Message] = (),
    context: Sequence[Message] = (),
    incoming: Sequence[Message] = (),
    baseline: Baseline | None = None,
    image_fallback: int = DEFAULT_FALLBACK_TOKENS,
    view: bool = True,
    segment_features: Sequence[Sequence[float] | None] | None = None,
    margin_share: float = 0.0,
    since: Sequence[Message] | None = None,
    image_free: bool = False,
    beside: int = 0,
) -> TokenEstimate:
    """Estimate the view made of ``system`` prompt, ``records``, ``context`` and ``incoming``.

    Pass the messages as they appear in the view (already truncated, images already
    budgeted). ``reserve`` is the profile's output reserve before the window/4 cap.

    With a ``baseline``, the total is the baseline plus the estimate of the records/context
    rows newer than ``baseline.last_sequence`` and the incoming messages (method
    BASELINE_DELTA); the per-segment estimate is then scaled to that total so the breakdown
    keeps its proportions and still sums to it.

    ``view=False`` prices a standalone message list: no per-view overhead. The margin is what the
    counter says the text it priced may be short by (each content class with its own relative
    margin; with a baseline: of the delta only, the baseline being a real count).

    ``margin_share`` (``tokens.margin_view_share``): with a baseline and a calibrated counter, the
    margin also covers the part of ``margin_base`` (that share of the view's text) past the delta,
    at the rate of the recorded residuals (``Calibration.margin_beyond``), which are relative to
    the same base.

    ``segment_features`` (a calibrated counter only): the ``messages_features`` of each of
    ``estimate_segments`` (None for an empty one), kept by a caller that re-prices the same view;
    the segments are then priced from them, without reading the messages again (the same sums).

    ``beside``: tokens the client sends beside the view (tool definitions), counted in the system
    segment and never priced (the margin does not scale with them). A view priced whole adds
    them; a baseline's count already holds them, so with a baseline the other segments share
    the rest of the total.

    ``since`` (with a baseline): the rows of ``records`` and ``context`` the baseline's view did
    not hold, in their order, when the caller knows them (a view extended by the rows appended
    since: ``engine.views``); ``image_free``: no message carries an image. Both spare a pass over
    every row of the view.
    """
    # Each segment priced once, with the tokens its price may be short by (the margin).
    if segment_features is not None and isinstance(counter, CalibratedCounter):
        priced_segments = [counter.count_and_margin_of(x) for x in segment_features]
    else:
        priced_segments = [
            counter.count_and_margin(part) for part in estimate_segments(system, records, context, incoming)
        ]
    system_tokens, records_tokens, summary_tokens, pinned_tokens, others_tokens, incoming_tokens = (
        count for count, _ in priced_segments
    )
    overhead = counter.overhead if view else 0
    raw = TokenSegments(
        # The system prompt is counted as the message it is sent as (with its framing), like the
        # system row of the view whose size the engine records for the calibration. A negative
        # fitted intercept cannot make the segment negative.
        system=max(0, overhead + system_tokens),
        records=records_tokens,
        summaries=summary_tokens,
        pinned=pinned_tokens,
        messages=others_tokens,
        images=0 if image_free else image_tokens_of([*records, *context, *incoming], fallback_tokens=image_fallback),
        incoming=incoming_tokens,
    )
    priced = raw.total - raw.images
    if beside > 0 and baseline is None and view:
        raw = dataclasses.replace(raw, system=raw.system + beside)
    segments, method = raw, counter.method
    margin_tokens = sum(m for _, m in priced_segments) + counter.margin_rate * max(0, overhead)
    if baseline is not None:
        # Rows newer than the baseline's view; an unnumbered row cannot be in it either.
        if since is None:
            since = [
                m for m in (*records, *context) if m.sequence_number == 0 or m.sequence_number > baseline.last_sequence
            ]
        delta = [*since, *incoming]
        # Priced once: ``count_and_margin``'s count is ``count_messages``'.
        priced, margin_tokens = counter.count_and_margin(delta)
        total = baseline_delta(baseline.tokens, delta, counter, image_fallback=image_fallback, counted=priced)
        segments, method = _scaled(raw, total), EstimateMethod.BASELINE_DELTA
        held = min(beside, total) if view else 0
        if held > 0:  # what the count holds beside the view is system tokens, not a share of each
            segments = _scaled(raw, total - held)
            segments = dataclasses.replace(segments, system=segments.system + held)
        if isinstance(counter, CalibratedCounter):
            base = margin_base(priced, segments.total - segments.images, margin_share)
            margin_tokens += counter.calibration.margin_beyond(base - priced)
    total = segments.total
    margin = math.ceil(max(0.0, margin_tokens) - 1e-9)  # (a float sum a hair over an integer)
    return TokenEstimate(
        total=total,
        text=total - segments.images,
        images=segments.images,
        method=method,
        window=window,
        budget=window - output_reserve(window, reserve),
        fraction=total / window if window > 0 else 0.0,
        segments=segments,
        margin=margin,
        priced=max(0, priced),
    )


def estimate_segments(
    system: str, records: Sequence[Message], context: Sequence[Message], incoming: Sequence[Message]
) -> tuple[Sequence[Message], ...]:
    """The messages of each segment ``estimate`` prices, in its order: the system prompt (as the
    message it is sent as), records, summaries, pinned rows, the other context rows, incoming."""
    summaries = [m for m in context if m.flags.is_summary]
    pinned = [m for m in context if m.flags.is_pinned and not m.flags.is_summary]
    others = [m for m in context if not m.flags.is_pinned and not m.flags.is_summary]
    return ([Message(Role.SYSTEM, system)] if system else [], records, summaries, pinned, others, incoming)


def _scaled(raw: TokenSegments, total: int) -> TokenSegments:
    """``raw`` scaled to sum to ``total`` (largest-remainder rounding)."""
    # ``TokenSegments``' first seven fields, in their order (``recall`` is added to a view later).
    values = (raw.system, raw.records, raw.summaries, raw.pinned, raw.messages, raw.images, raw.incoming)
    base = sum(values)
    if base <= 0:
        return TokenSegments(messages=total)
    exact = [v * total / base for v in values]
    floors = list(map(int, exact))
    short = total - sum(floors)
    if short:  # (most totals split evenly: nothing to hand out)
        for i in sorted(range(len(values)), key=lambda i: exact[i] - floors[i], reverse=True)[:short]:
            floors[i] += 1
    return TokenSegments(*floors)
