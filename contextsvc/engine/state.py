"""The engine's per-session state, kept by stores as an opaque JSON mapping on the session."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from contextsvc.core.session import SessionInfo


@dataclass(slots=True, frozen=True)
class BaselineState:
    """The real prompt count of a view, and the newest sequence number that view held."""

    tokens: int
    last_sequence: int
    view_id: str


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
        return cls.from_dict(session.state)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineState:
        raw = d.get("baseline")
        baseline = (
            BaselineState(int(raw["tokens"]), int(raw["last_sequence"]), str(raw.get("view_id", "")))
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
        return out

    def with_baseline(self, tokens: int, last_sequence: int, view_id: str) -> EngineState:
        return replace(self, baseline=BaselineState(tokens, last_sequence, view_id))

    def after_compaction(self) -> EngineState:
        return replace(self, baseline=None, epoch=self.epoch + 1)
