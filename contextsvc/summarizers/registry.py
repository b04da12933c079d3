"""The one place summarizers are registered and built (DESIGN §5.5).

A profile names its summarizer (``compression.summarizer``); ``SUMMARIZERS`` maps every accepted
name to a factory, and ``build_summarizers`` builds them all once per process over one shared
``httpx.AsyncClient`` (made on first use), which ``SummarizerSet.close`` closes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from contextsvc.config import Settings
from contextsvc.errors import InvalidArgument, quoted
from contextsvc.ports import Summarizer
from contextsvc.summarizers._http import SharedClient
from contextsvc.summarizers.extractive import ExtractiveSummarizer
from contextsvc.summarizers.ollama import OllamaSummarizer
from contextsvc.summarizers.openai import OpenAISummarizer

if TYPE_CHECKING:
    import httpx

__all__ = ["SUMMARIZERS", "SummarizerFactory", "SummarizerSet", "build_summarizers"]

#: builds one summarizer from the settings and the shared HTTP client.
SummarizerFactory = Callable[[Settings, SharedClient], Summarizer]

SUMMARIZERS: dict[str, SummarizerFactory] = {
    "extractive": lambda settings, _client: ExtractiveSummarizer.from_settings(settings),
    "openai": lambda settings, client: OpenAISummarizer(settings.summarizer.openai, client=client),
    "ollama": lambda settings, client: OllamaSummarizer(settings.summarizer.ollama, client=client),
}


class SummarizerSet:
    """The built summarizers by name, and the HTTP client they share."""

    def __init__(self, summarizers: Mapping[str, Summarizer], *, client: SharedClient | None = None) -> None:
        self._summarizers = dict(summarizers)
        self._client = client
        self._closed = False

    @property
    def names(self) -> list[str]:
        return sorted(self._summarizers)

    def get(self, name: str) -> Summarizer:
        """The summarizer called ``name``; ``InvalidArgument`` naming the profile field otherwise."""
        try:
            return self._summarizers[name]
        except KeyError:
            raise InvalidArgument.field(
                "profile.compression.summarizer",
                f"unknown summarizer {quoted(name)}; known: {', '.join(self.names)}",
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._summarizers

    async def close(self) -> None:
        """Close every summarizer, then the shared client; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            for summarizer in self._summarizers.values():
                await summarizer.close()
        finally:
            if self._client is not None:
                await self._client.aclose()


def build_summarizers(settings: Settings, *, client: httpx.AsyncClient | None = None) -> SummarizerSet:
    """Every registered summarizer, built over one shared client (made on the first HTTP summary
    unless given; the set closes it either way). Loaded settings already refuse a profile naming an
    unknown summarizer (``config.SUMMARIZER_NAMES``, kept equal to ``SUMMARIZERS`` by a test); settings
    made in code without validation (``model_copy``) are refused here with ``ValueError``."""
    unknown = {
        f"{profile_id}: {profile.compression.summarizer!r}"
        for profile_id, profile in settings.profiles.items()
        if profile.compression.summarizer not in SUMMARIZERS
    }
    if unknown:
        raise ValueError(
            f"profiles name unknown summarizers ({', '.join(sorted(unknown))}); known: {', '.join(sorted(SUMMARIZERS))}"
        )
    if client is not None:
        shared = SharedClient.of(client)
    else:
        trust_env = settings.summarizer.http_trust_env
        shared = SharedClient(lambda: _new_client(trust_env))
    return SummarizerSet({name: factory(settings, shared) for name, factory in SUMMARIZERS.items()}, client=shared)


def _new_client(trust_env: bool) -> httpx.AsyncClient:
    import httpx  # here, not at module level: a start that never summarizes over HTTP skips it

    # Per-request timeouts come from each summarizer's config; none here so none is implied.
    return httpx.AsyncClient(timeout=None, follow_redirects=False, trust_env=trust_env)
