"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths of every file fsynced (through any descriptor), in order."""
    calls: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return calls
