"""The package's public surface is exactly what __init__ exports (CONVENTIONS: httpx)."""

from __future__ import annotations

import contextsvc


def test_public_names_are_sorted_and_exported() -> None:
    assert contextsvc.__all__ == sorted(contextsvc.__all__)
    for name in contextsvc.__all__:
        assert hasattr(contextsvc, name), name


def test_every_public_error_is_a_context_error() -> None:
    for name in contextsvc.__all__:
        value = getattr(contextsvc, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, contextsvc.ContextError)
