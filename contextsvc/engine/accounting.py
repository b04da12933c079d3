"""Token accounting use cases: per-model calibration kept in sync with the store, message pricing."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable

from contextsvc.config import Settings
from contextsvc.core.calibration import Calibration, CalibrationRegistry, Observation
from contextsvc.core.messages import Message
from contextsvc.core.tokens import TextCounter, counter_for, image_tokens_of
from contextsvc.ports import SessionStore


class TokenAccounting:
    """Prices messages for a model. Observations live in the store, so every replica (and a
    restarted one) prices alike; this object only caches them for ``refresh_seconds``."""

    def __init__(self, store: SessionStore, settings: Settings):
        self._store = store
        self._tokens = settings.tokens
        self._registry = CalibrationRegistry(settings.tokens)
        # Least recently used first: models past max_cached_models are forgotten (and re-read
        # from the store when they come back), so arbitrary model names cannot grow memory.
        self._loaded_at: OrderedDict[str, float] = OrderedDict()
        #: model -> observations this process has written (a counter), and model -> that counter as
        #: it was when the cached observations were read: a read that started after an observation
        #: was written holds it (``observe``).
        self._written: dict[str, int] = {}
        self._read_upto: dict[str, int] = {}

    async def ensure_loaded(self, model: str) -> Calibration:
        """The model's calibration, re-read from the store when the cached copy is stale."""
        loaded = self._loaded_at.get(model)
        if loaded is None or time.monotonic() - loaded > self._tokens.calibration_refresh_seconds:
            written = self._written.get(model, 0)
            observations = await self._store.list_calibration_observations(model, limit=self._tokens.calibration_window)
            self._registry.load(model, observations)
            self._loaded_at[model] = time.monotonic()
            self._read_upto[model] = max(written, self._read_upto.get(model, 0))
            while len(self._loaded_at) > self._tokens.max_cached_models:
                evicted, _ = self._loaded_at.popitem(last=False)
                self._registry.forget(evicted)
                self._written.pop(evicted, None)
                self._read_upto.pop(evicted, None)
        self._loaded_at.move_to_end(model)
        return self._registry.calibration(model)

    async def observe(self, model: str, observation: Observation) -> Calibration:
        """Persist a baseline observation and refit from the store's newest observations.

        Concurrent baselines of one model share a refit: after writing, the call yields once to
        let baselines already waiting write theirs, and reads (and fits) again only if no read
        began after its own write did; the calibration it returns always holds its observation.
        Other requests meanwhile price with the calibration as it was before this baseline (as if
        they had come first) rather than each refitting it."""
        await self._store.add_calibration_observation(model, observation)
        written = self._written[model] = self._written.get(model, 0) + 1
        await asyncio.sleep(0)
        if self._read_upto.get(model, 0) < written:
            self._loaded_at.pop(model, None)
        return await self.ensure_loaded(model)

    def counter(self, model: str) -> TextCounter:
        """Exact when the operator configured a tokenizer for ``model``, else the calibrated line.

        Uses the cached calibration: call ``ensure_loaded`` first in the request.
        """
        return counter_for(model, self._registry.calibration(model), self._tokens)

    def message_tokens(self, model: str, message: Message) -> int:
        """Text and image tokens of one message, as it is stored (the view may cut it later)."""
        return self.messages_tokens(model, (message,))

    def messages_tokens(self, model: str, messages: Iterable[Message]) -> int:
        rows = list(messages)
        return self.counter(model).count_messages(rows) + image_tokens_of(
            rows, fallback_tokens=self._tokens.image_tokens_fallback
        )
