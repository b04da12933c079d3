"""End-to-end fixtures: a real ``contextsvc serve`` process over loopback, generated stubs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2_grpc
from tests.support.fake_llm import FakeLLM
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def server(data_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(f"files:{data_dir}").start() as proc:
        yield proc


@pytest.fixture
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with server.channel() as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.Channel) -> context_service_pb2_grpc.ContextServiceStub:
    return context_service_pb2_grpc.ContextServiceStub(channel)


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    """The fake OpenAI/Ollama summarizer as a separate process on loopback."""
    fake = FakeLLM(max_lifetime=900).start()
    try:
        yield fake
    finally:
        fake.stop()
