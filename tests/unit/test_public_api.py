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


def test_the_generated_modules_import_by_their_public_path() -> None:
    # `from contextsvc.v1 import context_service_pb2` worked, but not the module path itself
    # (`from contextsvc.v1.context_service_pb2 import GetSessionRequest`: ModuleNotFoundError).
    import importlib

    from contextsvc import v1

    for name in v1.__all__:
        module = importlib.import_module(f"contextsvc.v1.{name}")
        assert module is getattr(v1, name)
        assert module is importlib.import_module(f"contextsvc._gen.v1.{name}")
