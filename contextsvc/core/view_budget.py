"""The view's size rules (DESIGN §5.2): per-message cuts, the image budget, the size guard.

Everything here works on copies: the stored message is never touched, the view is derived.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contextsvc.config import TokenSettings
from contextsvc.core.images import DEFAULT_FALLBACK_TOKENS, ref_tokens
from contextsvc.core.message_memo import IdentityMemo
from contextsvc.core.messages import ImageRef, Message
from contextsvc.core.priors import N_FEATURES
from contextsvc.core.tokens import (
    CalibratedCounter,
    ExactCounter,
    TextCounter,
    message_features,
    output_reserve,
    remember_cut,
    remember_features,
    text_chars,
)
from contextsvc.errors import ContextTooLarge

#: Share of the kept characters taken from the head of a cut field; the rest is its tail.
HEAD_SHARE = 0.5
#: Rounds of re-measuring a cut message: tokens are not linear in characters.
_CUT_ROUNDS = 8
#: After a cut that still does not fit, aim this share under the budget: the density of what is
#: kept differs from the whole's (a dense JSON head, a sparse prose tail), so aiming exactly at
#: the budget can miss it by a token, round after round.
_CUT_MARGIN = 0.02
#: A cut keeps a whole number of grid steps of characters, a step being the power of two between
#: 1/256 and 1/128 of what the budget lets the row keep: a new fit moves a long row's cut by a
#: few characters (median ~0.02 % of the row in the long-tool-results turn loop, issue #15), so
#: on a grid of ~0.4-0.8 % of the kept part most fits cut where the last one did (and the step
#: itself changes only where the kept part crosses a power of two). The row's view copy, its
#: features and its encoding are then the ones already made, and a provider's prompt cache keeps
#: its prefix through the row. A cut keeps less than 1/128 of what the budget allows fewer
#: characters than it allows. (Steps sized by the whole row instead cut a row 150 times the
#: budget to nothing but its marker.)
_CUT_GRID = 128
#: Cuts kept per message (by how much each cut, weakly: a cut lives while a view shows it).
_CUTS_KEPT = 4


def cut_marker(chars: int) -> str:
    """The marker left where ``chars`` characters were cut."""
    return f"\n[… {chars:,} chars cut …]\n"


# --- per-message truncation ----------------------------------------------------------------


def additive(counter: TextCounter) -> bool:
    """A list's count is at least each member's: exact counts (sums of per-part counts) and
    calibrated prices whose weights are all non-negative (linear in non-negative features)."""
    if isinstance(counter, ExactCounter):
        return True
    return isinstance(counter, CalibratedCounter) and min(counter.calibration.weights, default=0.0) >= 0


def column_max(features: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Each column's largest value over ``features`` (zeros for none): a message with these
    features costs at least what any one of them costs, under any calibration whose weights are
    non-negative (``additive``), since every feature is a non-negative count."""
    return tuple(map(max, zip(*features, strict=True))) if features else (0,) * N_FEATURES


def none_cut(counter: TextCounter, cap: tuple[int, ...] | None, budget: int) -> bool:
    """Does no message whose features ``cap`` bounds column by column (``column_max`` of theirs,
    or a larger bound) exceed ``budget`` alone, so that ``truncate_for_view`` keeps each as it is?
    A calibrated counter whose weights are non-negative (``additive``: the caller checks it)
    prices the cap once, which bounds every message's own price; without a cap (or with another
    counter), the caller checks another way."""
    return cap is not None and isinstance(counter, CalibratedCounter) and counter.count_features(cap) <= budget


def truncate_for_view(m: Message, budget: int, counter: TextCounter) -> Message:
    """``m`` as the view shows it: unchanged when within ``budget`` tokens or pinned, else a copy
    whose ``content`` and ``thinking`` are cut head + tail with a marker saying how much was cut.

    Only those two fields are cut: tool-call arguments must stay valid JSON for the runtime
    that parses them, so a message too large in its arguments alone stays too large (the size
    guard and compression deal with it).
    """
    if m.flags.is_pinned:
        return m  # pinned messages are never truncated
    tokens = counter.count_messages([m])
    if tokens <= budget:
        return m
    budget = max(budget, 0)
    chars = text_chars(m)
    original = (m.content, m.thinking)
    # Aim by the message's own density (tokens per char), then re-measure: neither a tokenizer
    # nor the size measure is linear in characters, so a few rounds tighten the cut until it fits.
    aim = chars * budget // tokens
    grid = _grid_step(aim)
    allowed = _on_grid(aim, grid)
    target = budget - int(budget * _CUT_MARGIN)
    made = _CUTS.get(m, _no_cuts)
    # A calibrated counter prices a cut from its features alone: a cut made before, at the same
    # place, is priced without its text (the one kept is made again only if its copy is gone).
    priced = counter.count_features if isinstance(counter, CalibratedCounter) else None
    cut: Message | None = m
    for _ in range(_CUT_ROUNDS):
        excess = chars - allowed
        known = made.get(excess)
        if known is None:
            content, thinking, spans = _cut_fields(original, excess=excess)
            if not spans:
                return m  # nothing cuttable (e.g. the size is in tool-call arguments)
            cut = dataclasses.replace(m, content=content, thinking=thinking)
            remember_cut(m, cut, spans)
            for oldest in list(made)[: len(made) - _CUTS_KEPT + 1]:  # (a copy of the keys: taken at once)
                made.pop(oldest, None)
            known = made[excess] = _Cut(message_features(cut), text_chars(cut), weakref.ref(cut))
            now = counter.count_messages([cut])
        elif priced is not None:
            cut, now = None, priced(known.features)
        else:
            cut = _remade(m, known, excess)
            now = counter.count_messages([cut])
        if now <= budget:
            break
        # Keep strictly less each round, so the rounds cannot stall just over the budget.
        aim = known.chars * target // now - len(cut_marker(chars))
        allowed = _on_grid(max(0, min(allowed - 1, aim)), grid)
    if cut is None:  # the last round priced a known cut by its features: the cut itself is needed
        assert known is not None
        cut = _remade(m, known, excess)
    return cut


@dataclass(slots=True)
class _Cut:
    """A cut ``truncate_for_view`` made of a message: what pricing it needs, and the cut itself
    while something holds it (a view showing it)."""

    features: tuple[int, ...]
    chars: int
    ref: weakref.ref[Message]


#: The cuts ``truncate_for_view`` made of a message, by the characters each removed (``_CUT_GRID``).
_CUTS: IdentityMemo[dict[int, _Cut]] = IdentityMemo()


def _no_cuts(_: Message) -> dict[int, _Cut]:
    return {}


def _remade(m: Message, known: _Cut, excess: int) -> Message:
    """The cut of ``m`` by ``excess`` characters that ``known`` describes: the kept copy, or the
    same fields cut again, given the features already measured."""
    cut = known.ref()
    if cut is None:
        content, thinking, _spans = _cut_fields((m.content, m.thinking), excess=excess)
        cut = dataclasses.replace(m, content=content, thinking=thinking)
        remember_features(cut, known.features)
        known.ref = weakref.ref(cut)
    return cut


def _grid_step(kept: int) -> int:
    """The grid step of a cut keeping about ``kept`` characters (``_CUT_GRID``): the largest power
    of two at most ``kept / _CUT_GRID``, at least 1."""
    return 1 << max(0, (kept // _CUT_GRID).bit_length() - 1)


def _on_grid(chars: int, grid: int) -> int:
    """``chars`` rounded down to a whole number of ``grid`` steps."""
    return chars - chars % grid


#: The fields ``_cut_fields`` cuts, in ``fields`` order.
_CUT_FIELDS = ("content", "thinking")


def _cut_fields(fields: tuple[str, str], *, excess: int) -> tuple[str, str, list[tuple[str, int, int]]]:
    """Remove ``excess`` characters (plus room for the markers), largest field first; the fields,
    and where each one cut was made (its name, the head kept, where the tail kept starts)."""
    out = list(fields)
    spans: list[tuple[str, int, int]] = []
    for i in sorted(range(len(fields)), key=lambda i: len(fields[i]), reverse=True):
        text = fields[i]
        if excess <= 0 or not text:
            break
        marker_room = len(cut_marker(len(text)))
        keep = max(0, len(text) - excess - marker_room)
        removed = len(text) - keep
        if removed <= marker_room:
            continue  # cutting would not make it shorter
        head = int(keep * HEAD_SHARE)
        tail = len(text) - (keep - head)
        out[i] = text[:head] + cut_marker(removed) + text[tail:]
        spans.append((_CUT_FIELDS[i], head, tail))
        excess -= removed - marker_room
    return out[0], out[1], spans


def truncate_view(messages: Sequence[Message], budget: int, counter: TextCounter) -> list[Message]:
    """Every message through ``truncate_for_view``; the untouched ones are the same objects."""
    return [truncate_for_view(m, budget, counter) for m in messages]


# --- images --------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ImageSlot:
    """One image of the view: the message's sequence number (0 = incoming), its blob and price."""

    sequence_number: int
    blob_id: str
    tokens: int


@dataclass(slots=True, frozen=True)
class ImagePlan:
    """The view's messages after image budgeting, with what was kept and left out."""

    messages: list[Message]
    kept: tuple[ImageSlot, ...]
    left_out: tuple[ImageSlot, ...]
    notices: tuple[str, ...]
    budget: int

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.kept)


def image_budget(window: int, text_tokens: int, fraction: float = TokenSettings().view_image_budget_fraction) -> int:
    """Tokens images may take in a view: ``fraction * window - text_tokens`` (never negative)."""
    return max(0, int(fraction * window) - text_tokens)


def budget_images(
    messages: Sequence[Message],
    *,
    window: int,
    text_tokens: int,
    vision: bool,
    fraction: float = TokenSettings().view_image_budget_fraction,
    image_fallback: int = DEFAULT_FALLBACK_TOKENS,
    notice_tokens: Callable[[str], int] | None = None,
    max_bytes: int | None = None,
) -> ImagePlan:
    """Keep the newest images that fit the image budget; leave the rest out with a notice.

    Images are taken newest message first, each priced by its own size; one that does not fit
    is skipped and older, smaller ones may still fit. A message that lost images gets a notice
    appended to its view copy naming them (sequence number and blob id) so the model knows
    they exist and a runtime can fetch them. Without ``vision`` no image is kept.
    ``text_tokens`` is the view's text estimate without the notices; with ``notice_tokens`` (the
    text price of a notice) the notices' tokens come out of the image budget too, so text, notices
    and images together stay within it (the view's estimate must still be made again).
    ``max_bytes`` bounds the kept images' bytes too (the view is one gRPC response): a 2048-pixel
    screenshot costs ~4,100 tokens but may weigh 12 MB, so a few fit the token budget and not a
    response.
    """
    budget = image_budget(window, text_tokens, fraction) if vision else 0
    if not any(m.images for m in messages):
        return ImagePlan(list(messages), (), (), (), budget)  # most views: nothing to budget
    plan = _planned(messages, budget, vision, image_fallback, max_bytes)
    if notice_tokens is None or not vision:
        return plan
    # Leaving images out adds notices, and less room may leave more out: shrink until the kept
    # images and the notices fit together (each pass keeps fewer images, so this ends).
    for _ in range(len(plan.kept) + 1):
        noticed = sum(map(notice_tokens, plan.notices))
        if plan.tokens + noticed <= budget:
            break
        plan = _planned(messages, max(0, min(budget - noticed, plan.tokens - 1)), vision, image_fallback, max_bytes)
    return dataclasses.replace(plan, budget=budget)


def _planned(
    messages: Sequence[Message], budget: int, vision: bool, image_fallback: int, max_bytes: int | None
) -> ImagePlan:
    remaining = budget
    bytes_left = max_bytes
    heavy = False  # an image that fit the tokens was left out for its bytes
    keep: set[tuple[int, int]] = set()  # (message index, image index)
    for i in range(len(messages) - 1, -1, -1):
        for j, ref in enumerate(messages[i].images):
            cost = ref_tokens(ref, fallback_tokens=image_fallback)
            if vision and cost <= remaining:
                if bytes_left is not None and ref.size_bytes > bytes_left:
                    heavy = True
                    continue
                keep.add((i, j))
                remaining -= cost
                if bytes_left is not None:
                    bytes_left -= ref.size_bytes
    reason = "this model has no vision"
    if vision:
        reason = "over the image budget or the response size limit" if heavy else "over the image budget"
    out: list[Message] = []
    kept: list[ImageSlot] = []
    left: list[ImageSlot] = []
    notices: list[str] = []
    for i, m in enumerate(messages):
        if not m.images:
            out.append(m)
            continue
        slots = [
            ImageSlot(m.sequence_number, r.blob_id, ref_tokens(r, fallback_tokens=image_fallback)) for r in m.images
        ]
        mine_kept = [s for j, s in enumerate(slots) if (i, j) in keep]
        mine_left = [s for j, s in enumerate(slots) if (i, j) not in keep]
        kept += mine_kept
        left += mine_left
        if not mine_left:
            out.append(m)
            continue
        notice = _notice(m.sequence_number, mine_left, reason)
        notices.append(notice)
        refs: tuple[ImageRef, ...] = tuple(r for j, r in enumerate(m.images) if (i, j) in keep)
        content = f"{m.content}\n\n{notice}" if m.content else notice
        out.append(dataclasses.replace(m, images=refs, content=content))
    return ImagePlan(out, tuple(kept), tuple(left), tuple(notices), budget)


def _notice(sequence_number: int, left: Sequence[ImageSlot], reason: str) -> str:
    where = f"message #{sequence_number}" if sequence_number else "the incoming message"
    blobs = ", ".join(f"blob {s.blob_id}" for s in left)
    return f"[{len(left)} image(s) of {where} not in this view ({reason}): {blobs}]"


# --- the size guard ------------------------------------------------------------------------


#: How a CONTEXT_TOO_LARGE message ends when the build could compress (and did what it could).
AFTER_COMPRESSION = "even after compression"


def too_large(
    estimate_total: int, window: int, reserve: int, *, after: str = AFTER_COMPRESSION
) -> ContextTooLarge | None:
    """The CONTEXT_TOO_LARGE error when the view's estimate exceeds ``window - reserve``
    (reserve capped at window/4), else None. The error's metadata holds the very numbers
    compared, so what it prints is what was decided; ``after`` ends the message with what the
    build did about it (a build that did not compress must not say it did)."""
    budget = window - output_reserve(window, reserve)
    if estimate_total <= budget:
        return None
    return ContextTooLarge(
        f"the view needs ~{estimate_total} tokens but {budget} fit "
        f"(window {window} minus {window - budget} reserved for the reply), {after}",
        metadata={"estimate": str(estimate_total), "budget": str(budget), "window": str(window)},
    )


def check_fits(estimate_total: int, window: int, reserve: int) -> None:
    """Raise ``ContextTooLarge`` when the view does not fit (see ``too_large``)."""
    error = too_large(estimate_total, window, reserve)
    if error is not None:
        raise error
