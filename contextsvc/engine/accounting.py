"""Token accounting use cases: per-model calibration kept in sync with the store, message pricing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from contextsvc.config import Settings
from contextsvc.core.arrivals import Arrivals
from contextsvc.core.calibration import Calibration, CalibrationRegistry, Observation
from contextsvc.core.images import ref_tokens
from contextsvc.core.messages import ImageRef, Message
from contextsvc.core.tokens import TextCounter, counter_for, cut_to_budget, image_tokens_of
from contextsvc.errors import FailedPrecondition
from contextsvc.ports import SessionStore

log = logging.getLogger(__name__)


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
        #: observations this process has written (all models; never reset, so eviction cannot
        #: make an older read look newer), and per model the count as it was when the read whose
        #: observations the cache holds began: that read holds every observation counted by then.
        self._written = 0
        self._applied: dict[str, int] = {}
        #: one store read per model at a time: a request that needs one while another runs waits
        #: for it and reads again only if that read began too early for it.
        self._reads: dict[str, asyncio.Lock] = {}
        #: per model, the open gathering of baselines that will share one refit (``_gather``).
        self._gathering: dict[str, _Gathering] = {}
        #: per model, when baselines of different sessions last arrived (the gathering's rule).
        self._arrivals = Arrivals()  # per model: the sessions recording a baseline
        #: models whose configured tokenizer file failed to load, each logged once.
        self._tokenizers_failed: set[str] = set()

    async def ensure_loaded(self, model: str) -> Calibration:
        """The model's calibration, re-read from the store when the cached copy is stale."""
        if self._stale(model):
            await self._refresh(model, self._written)
        if model in self._loaded_at:
            self._loaded_at.move_to_end(model)
        return self._registry.calibration(model)

    async def observe(
        self, model: str, observation: Observation, *, source: str, concurrent: bool = True, written: bool = False
    ) -> Calibration:
        """Persist a baseline observation (of session ``source``; ``written``: the store already
        holds it) and refit from the store's newest observations. ``concurrent``: other requests
        were served while the agent's turn was under way (False: it may be the only client, and
        its refit never waits for others).

        Concurrent baselines of one model share a refit (``_gather``): a baseline waits for any
        read of the model running, and reads (and fits) again only if the cache does not hold a
        read that began after its own write; the calibration it returns always holds its
        observation. Other requests meanwhile price with the calibration as it was before this
        baseline (as if they had come first) rather than each refitting it."""
        if not written:
            await self._store.add_calibration_observation(model, observation)
        self._written += 1
        mine = self._written
        await self._gather(model, mine, source, concurrent)
        if self._applied.get(model, -1) < mine:
            await self._refresh(model, mine, force=True)
        return await self.ensure_loaded(model)

    async def _gather(self, model: str, mine: int, source: str, concurrent: bool) -> None:
        """Give the model's other baselines a chance to share this one's refit (the fit is the
        largest cost of a RecordBaseline, and 50 agents of one model each make a new window).

        If a gathering of the model is open, this observation was written before it closes, so
        its leader's refit reads it: wait for that. Otherwise, when requests were ``concurrent``
        and at least ``calibration_coalesce_sessions`` other sessions recorded a baseline of the
        model within the last ``calibration_coalesce_seconds`` (many agents are recording: more
        are on their way), open one and wait that long, or until as many other sessions joined
        as had recorded within the window before it (``_Gathering``: the agents recording at
        this pace have come; waiting on delays them all, and on a busy server agents that wait
        together come back together and queue). A lone agent, a few agents, one client
        going through sessions one call at a time, or baselines further apart than the window
        refit after one loop iteration (baselines already waiting write theirs, and the first
        refit reads them all): the wait pays only when many refits share it. The rule reads what
        requests arrived and when, not how busy the loop looks (which depends on how its work is
        split into steps) nor the machine's load."""
        window = self._tokens.calibration_coalesce_seconds
        others = self._arrivals.note(model, source, time.monotonic(), window)
        gathering = self._gathering.get(model) if window > 0 else None
        if gathering is not None:
            gathering.join()
            await gathering.closed.wait()
            return
        if window <= 0 or not concurrent or others < self._tokens.calibration_coalesce_sessions:
            await asyncio.sleep(0)
            return
        gathering = self._gathering[model] = _Gathering(others)
        timer = asyncio.get_running_loop().call_later(window, gathering.full.set)
        try:
            await gathering.full.wait()
        finally:
            timer.cancel()
            # Closed before this baseline's refit: a baseline written from now on opens its own
            # gathering; those waiting here go on to the read lock, which this refit holds first.
            if self._gathering.get(model) is gathering:
                del self._gathering[model]
            gathering.closed.set()

    def _stale(self, model: str) -> bool:
        loaded = self._loaded_at.get(model)
        return loaded is None or time.monotonic() - loaded > self._tokens.calibration_refresh_seconds

    async def _refresh(self, model: str, need: int, *, force: bool = False) -> None:
        """Read the model's observations and fit, unless a read that began once ``need``
        observations were written landed while this one waited (and the cache is fresh, or
        ``force``: any such read holds what the caller wrote)."""
        lock = self._reads.setdefault(model, asyncio.Lock())
        async with lock:
            if self._applied.get(model, -1) >= need and (force or not self._stale(model)):
                return
            began = self._written
            observations = await self._store.list_calibration_observations(model, limit=self._tokens.calibration_window)
            # Reads of a model are one at a time, but an eviction meanwhile drops the lock: a read
            # that began before the one the cache holds stays out, so the cache never goes back.
            if began >= self._applied.get(model, -1):
                self._registry.load(model, observations)
                self._applied[model] = began
                self._loaded_at[model] = time.monotonic()
                self._loaded_at.move_to_end(model)
            while len(self._loaded_at) > self._tokens.max_cached_models:
                evicted, _ = self._loaded_at.popitem(last=False)
                self._registry.forget(evicted)
                self._arrivals.forget(evicted)
                self._applied.pop(evicted, None)
                evicted_lock = self._reads.get(evicted)
                if evicted_lock is not None and not evicted_lock.locked():
                    del self._reads[evicted]

    def counter(self, model: str) -> TextCounter:
        """Exact when the operator configured a tokenizer for ``model``, else the calibrated line.

        Uses the cached calibration: call ``ensure_loaded`` first in the request. A tokenizer file
        that does not load (checked at start, gone or broken since) is FAILED_PRECONDITION, not a
        fault of the call: the operator's to fix, logged once per model.
        """
        calibration = self._registry.calibration(model)
        try:
            return counter_for(model, calibration, self._tokens)
        except ValueError as exc:  # load_tokenizer's, naming the file
            raise self._tokenizer_failed(model, exc) from None

    def _tokenizer_failed(self, model: str, exc: ValueError) -> FailedPrecondition:
        if model not in self._tokenizers_failed:
            self._tokenizers_failed.add(model)
            log.error("tokenizer file does not load", extra={"model": model, "error": str(exc)})
        return FailedPrecondition(
            f"the tokenizer configured for model {model!r} cannot be loaded (tokens.tokenizer_files)",
            reason="TOKENIZER_UNAVAILABLE",
            metadata={"model": model},
        )

    def message_tokens(self, model: str, message: Message, *, images: Sequence[ImageRef] | None = None) -> int:
        """Text and image tokens of one message, as it is stored (the view may cut it later);
        with ``images``, of ``message`` carrying those images instead of its own."""
        if images is None:
            return self.messages_tokens(model, (message,))
        fallback = self._tokens.image_tokens_fallback
        return self.counter(model).count_messages((message,)) + sum(
            ref_tokens(ref, fallback_tokens=fallback) for ref in images
        )

    def context_tokens(self, model: str, messages: Iterable[Message], budget: int) -> int:
        """``messages`` priced for ``model`` as a context's count holds them (``context_share``:
        the text of each at most ``budget`` tokens, as a view cuts it)."""
        rows = list(messages)
        counter = self.counter(model)
        # Priced together, as ``messages_tokens`` (a count of the whole is not the sum of rounded
        # counts of each), less what each row over the budget is not sent of.
        over = (counter.count_messages((m,)) for m in rows if cut_to_budget(m))
        cut = sum(text - budget for text in over if text > budget)
        return self.messages_tokens(model, rows) - cut

    def messages_tokens(self, model: str, messages: Iterable[Message]) -> int:
        rows = list(messages)
        return self.counter(model).count_messages(rows) + image_tokens_of(
            rows, fallback_tokens=self._tokens.image_tokens_fallback
        )


class _Gathering:
    """Baselines of one model waiting to share a refit: the leader waits until the window ends
    or as many other sessions joined as had recorded within the window before it opened (the
    agents recording at this pace have all come: waiting on only delays them)."""

    __slots__ = ("closed", "expected", "full", "joined")

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.joined = 0
        #: set when the leader may stop waiting; ``closed`` once it did (its refit comes next).
        self.full = asyncio.Event()
        self.closed = asyncio.Event()

    def join(self) -> None:
        self.joined += 1
        if self.joined >= self.expected:
            self.full.set()
