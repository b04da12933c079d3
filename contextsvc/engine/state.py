"""The engine's per-session state, kept by stores as an opaque JSON mapping on the session."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

from contextsvc.core.priors import current_cuts
from contextsvc.core.session import SessionInfo

#: id of a session's state mapping -> (that mapping, its parse), for ``EngineState.of``; cleared
#: whole when full (a few KB a session: the mappings are small and the store holds most anyway).
_parsed: dict[int, tuple[dict[str, Any], EngineState]] = {}
_PARSED_MAX = 4096
#: key of ``EngineState.beside`` in the state mapping (kept across compactions, as ``extra`` is).
BESIDE_KEY = "beside_tokens"


@dataclass(slots=True, frozen=True)
class BaselineState:
    """The real prompt count of a view, and the newest sequence number that view held."""

    tokens: int
    last_sequence: int
    view_id: str
    #: ``core.profile.view_shape`` of the counted view ("" when anchored before it was kept): a
    #: build of another shape (model, system prompt, vision, per-message budget) does not use it.
    shape: str = ""
    #: ``ports.ViewRecord.cuts`` of the counted view: how it cut the rows it sent cut (a later view
    #: that cuts them elsewhere prices the difference); None when not known (anchored before cuts
    #: were kept): every row is then priced as the count held it
    cuts: tuple[tuple[int, tuple[int, ...]], ...] | None = None


@dataclass(slots=True, frozen=True)
class EngineState:
    #: the real-count anchor for estimates; cleared by compression.
    baseline: BaselineState | None = None
    #: number of compactions committed; views remember it so an old view cannot set a baseline.
    epoch: int = 0
    #: anything later capabilities keep here, preserved verbatim.
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, session: SessionInfo) -> EngineState:
        """The state of ``session``. A store shares one state mapping between every read of an
        unchanged session (``SessionInfo`` dicts are never changed in place), so the parse is kept
        per mapping: a turn reads its session's state about nine times."""
        d = session.state
        kept = _parsed.get(id(d))
        if kept is not None and kept[0] is d:
            return kept[1]
        state = cls.from_dict(d)
        if len(_parsed) >= _PARSED_MAX:
            _parsed.clear()
        # The mapping is held with its parse, so its id cannot be reused while the entry lives.
        _parsed[id(d)] = (d, state)
        return state

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineState:
        raw = d.get("baseline")
        baseline = (
            BaselineState(
                int(raw["tokens"]),
                int(raw["last_sequence"]),
                str(raw.get("view_id", "")),
                str(raw.get("shape", "")),
                _cuts_of(raw.get("cuts")),
            )
            if isinstance(raw, dict)
            else None
        )
        extra = {k: v for k, v in d.items() if k not in ("baseline", "epoch")}
        return cls(baseline=baseline, epoch=int(d.get("epoch", 0)), extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out["epoch"] = self.epoch
        if self.baseline is not None:
            out["baseline"] = {
                "tokens": self.baseline.tokens,
                "last_sequence": self.baseline.last_sequence,
                "view_id": self.baseline.view_id,
            }
            if self.baseline.shape:
                out["baseline"]["shape"] = self.baseline.shape
            if self.baseline.cuts is not None:
                out["baseline"]["cuts"] = _cuts_text(self.baseline.cuts)
        return out

    def with_baseline(
        self,
        tokens: int,
        last_sequence: int,
        view_id: str,
        shape: str = "",
        cuts: tuple[tuple[int, tuple[int, ...]], ...] | None = None,
    ) -> EngineState:
        return replace(self, baseline=BaselineState(tokens, last_sequence, view_id, shape, cuts))

    def for_shape(self, shape: str) -> EngineState:
        """This state for a build of ``shape`` (``core.profile.view_shape``): without its baseline
        when that counted a view of another shape (a change of model or system prompt since)."""
        baseline = self.baseline
        if baseline is None or not baseline.shape or baseline.shape == shape:
            return self
        return replace(self, baseline=None)

    @property
    def beside(self) -> int:
        """Tokens the session's client sends beside each view (tool definitions), learned from its
        baselines (``ViewService``); 0 when none were seen."""
        value = self.extra.get(BESIDE_KEY, 0)
        return value if isinstance(value, int) and value > 0 else 0

    def with_beside(self, tokens: int) -> EngineState:
        if tokens == self.beside:
            return self
        extra = {k: v for k, v in self.extra.items() if k != BESIDE_KEY}
        if tokens > 0:
            extra[BESIDE_KEY] = tokens
        return replace(self, extra=extra)

    def after_compaction(self) -> EngineState:
        return replace(self, baseline=None, epoch=self.epoch + 1)


#: One anchor's cuts as its state keeps them: one string ("seq:f,f,...;seq:..."; "" for none), not
#: nested lists. Stores copy a session's state on every write, and ~18 integers a cut row as lists
#: made those copies a tenth of a long-tool-result turn (``bench/load/turns_inproc.py --long-every 4``).
_CUTS_CACHED = 1024


@functools.lru_cache(maxsize=_CUTS_CACHED)
def _cuts_text(cuts: tuple[tuple[int, tuple[int, ...]], ...]) -> str:
    return ";".join(f"{seq}:{','.join(map(str, features))}" for seq, features in cuts)


@functools.lru_cache(maxsize=_CUTS_CACHED)
def _cuts_from_text(text: str) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    try:
        pairs = [part.split(":", 1) for part in text.split(";")] if text else []
        return current_cuts([(seq, features.split(",")) for seq, features in pairs])
    except ValueError:  # a part without its ':'
        return None


def _cuts_of(raw: Any) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """``BaselineState.cuts`` of the state's ``cuts`` (None, not known, when absent or unreadable)."""
    if isinstance(raw, str):
        return _cuts_from_text(raw)
    return current_cuts(raw) if isinstance(raw, list) else None
