"""The memory store: everything in process memory, for tests and throwaway runs.

Several ``MemoryStore`` objects may share one ``MemoryData``; a store "reopened" over the same
data sees every session as it was, which is how the conformance suite tests reloads.
"""

from __future__ import annotations

from contextsvc.config import Settings
from contextsvc.core.calibration import Observation
from contextsvc.core.recall import RecallIndex
from contextsvc.ports import Clock
from contextsvc.stores._base import RowStore, check_blob, is_blob_id
from contextsvc.stores._session import SessionState
from contextsvc.stores.api_tokens import MemoryTokenStore


class MemoryData:
    """The backing state of a memory store: sessions, blobs, calibration observations and each
    session's raw history index."""

    __slots__ = ("api_tokens", "blobs", "history", "observations", "sessions")

    def __init__(self) -> None:
        self.sessions: dict[str, SessionState] = {}
        self.blobs: dict[str, bytes] = {}
        self.observations: dict[str, list[Observation]] = {}
        #: session id -> its history chunks (ranked in process by ``core/recall.py``).
        self.history: dict[str, RecallIndex] = {}
        self.api_tokens = MemoryTokenStore()


class MemoryStore(RowStore):
    """A ``SessionStore`` in memory; nothing survives the process."""

    def __init__(
        self, settings: Settings | None = None, *, clock: Clock | None = None, data: MemoryData | None = None
    ) -> None:
        self.data = data if data is not None else MemoryData()
        super().__init__(settings, clock, self.data.sessions, self.data.observations, self.data.history)

    def api_tokens(self) -> MemoryTokenStore:
        """This store's API tokens (``ports.ApiTokenStore``): they live as long as the process."""
        return self.data.api_tokens

    async def open(self) -> None:
        """Nothing to load."""

    async def close(self) -> None:
        await self._drain()

    async def put_blob(self, data: bytes, *, blob_id: str) -> None:
        check_blob(data, blob_id)
        self.data.blobs.setdefault(blob_id, bytes(data))

    async def get_blob(self, blob_id: str) -> bytes | None:
        return self.data.blobs.get(blob_id) if is_blob_id(blob_id) else None
