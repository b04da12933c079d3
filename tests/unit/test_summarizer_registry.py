"""The one summarizer registry, the typed endpoint configs, and the HTTP helpers (no network)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from pydantic import ValidationError

import contextsvc.summarizers as summarizers_pkg
from contextsvc.config import (
    SUMMARIZER_NAMES,
    CompressionDefaults,
    OllamaSummarizerConfig,
    OpenAISummarizerConfig,
    ProfileConfig,
    Settings,
)
from contextsvc.errors import InvalidArgument
from contextsvc.ports import Summarizer, SummarizerError, SummaryRequest
from contextsvc.summarizers import (
    SUMMARIZERS,
    ExtractiveSummarizer,
    OllamaSummarizer,
    OpenAISummarizer,
    build_summarizers,
)
from contextsvc.summarizers._http import mime_type_of, strip_thinking


def test_public_api() -> None:
    assert set(summarizers_pkg.__all__) == {
        "SUMMARIZERS",
        "ExtractiveSummarizer",
        "OllamaSummarizer",
        "OpenAISummarizer",
        "SummarizerFactory",
        "SummarizerSet",
        "build_summarizers",
    }


def test_registry_names_every_implementation() -> None:
    assert sorted(SUMMARIZERS) == ["extractive", "ollama", "openai"]


async def test_build_makes_each_one_with_its_config() -> None:
    settings = Settings(
        summarizer={
            "openai": {"base_url": "http://openai.test/", "model": "gpt-x", "vision": True},
            "ollama": {"base_url": "http://ollama.test", "model": "llama-y"},
        }
    )
    built = build_summarizers(settings)
    try:
        assert built.names == ["extractive", "ollama", "openai"]
        extractive, openai, ollama = built.get("extractive"), built.get("openai"), built.get("ollama")
        assert isinstance(extractive, ExtractiveSummarizer)
        assert isinstance(openai, OpenAISummarizer) and isinstance(ollama, OllamaSummarizer)
        assert (openai.name, openai.vision, openai.config.model) == ("openai", True, "gpt-x")
        assert (ollama.name, ollama.vision, ollama.config.model) == ("ollama", False, "llama-y")
        assert openai._endpoint.url == "http://openai.test/v1/chat/completions"
        assert ollama._endpoint.url == "http://ollama.test/api/chat"
        assert "openai" in built and "nope" not in built
    finally:
        await built.close()


async def test_unknown_name_is_invalid_argument() -> None:
    built = build_summarizers(Settings())
    try:
        with pytest.raises(InvalidArgument) as caught:
            built.get("gpt-5-turbo")
        assert [v.field for v in caught.value.violations] == ["profile.compression.summarizer"]
        assert "unknown summarizer 'gpt-5-turbo'; known: extractive, ollama, openai" in caught.value.message
    finally:
        await built.close()


def test_a_profile_naming_an_unknown_summarizer_stops_the_build() -> None:
    # Settings refuse it when they load; settings made without validation are refused by the build.
    with pytest.raises(ValueError, match=r"profiles\.coder\.compression\.summarizer: unknown summarizer 'olama'"):
        Settings(profiles={"default": {}, "coder": {"compression": {"summarizer": "olama"}}})
    typo = ProfileConfig(compression=CompressionDefaults(summarizer="olama"))
    settings = Settings().model_copy(update={"profiles": {"default": ProfileConfig(), "coder": typo}})
    with pytest.raises(ValueError, match=r"coder: 'olama'"):
        build_summarizers(settings)


def test_the_settings_know_every_registered_summarizer_by_name() -> None:
    assert tuple(sorted(SUMMARIZERS)) == SUMMARIZER_NAMES


def test_endpoint_configs_are_typed_and_closed() -> None:
    assert OpenAISummarizerConfig().type == "openai"
    assert OllamaSummarizerConfig().type == "ollama"
    with pytest.raises(ValidationError):
        OpenAISummarizerConfig.model_validate({"base_uri": "http://typo"})
    with pytest.raises(ValidationError):
        OllamaSummarizerConfig.model_validate({"type": "openai"})
    with pytest.raises(ValidationError):
        Settings(summarizer={"openai_base_url": "http://old-flat-name"})


def test_endpoint_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTSVC_SUMMARIZER__OLLAMA__BASE_URL", "http://gpu-box:11434")
    monkeypatch.setenv("CONTEXTSVC_SUMMARIZER__OPENAI__API_KEY", "sk-secret")
    settings = Settings()
    assert settings.summarizer.ollama.base_url == "http://gpu-box:11434"
    assert settings.summarizer.openai.api_key.get_secret_value() == "sk-secret"
    assert "sk-secret" not in repr(settings)  # never printed


def test_defaults_pinned() -> None:
    s = Settings().summarizer
    assert (s.openai.timeout_seconds, s.openai.max_retries, s.openai.total_timeout_seconds) == (60.0, 2, 150.0)
    assert (s.ollama.timeout_seconds, s.ollama.max_retries, s.ollama.num_ctx) == (60.0, 2, 32768)
    assert (s.breadcrumb_limit, s.breadcrumb_max_chars) == (40, 120)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("<think>hmm, let me see</think>\n\n- summary\nKEYS: a", "- summary\nKEYS: a"),
        ("- summary without thinking", "- summary without thinking"),
        ("- summary mentioning <think> later", "- summary mentioning <think> later"),
    ],
)
def test_strip_thinking(content: str, expected: str) -> None:
    assert strip_thinking(content) == expected


@pytest.mark.parametrize(
    ("data", "mime"),
    [
        (b"\x89PNG\r\n\x1a\nrest", "image/png"),
        (b"\xff\xd8\xff\xe0rest", "image/jpeg"),
        (b"GIF89arest", "image/gif"),
        (b"RIFF\x00\x00\x00\x00WEBPrest", "image/webp"),
        (b"unknown", "image/png"),
    ],
)
def test_mime_type_of(data: bytes, mime: str) -> None:
    assert mime_type_of(data) == mime


def _openai(base_url: str, client: httpx.AsyncClient) -> Summarizer:
    return OpenAISummarizer(OpenAISummarizerConfig(base_url=base_url, max_retries=0), client=client)


def _ollama(base_url: str, client: httpx.AsyncClient) -> Summarizer:
    return OllamaSummarizer(OllamaSummarizerConfig(base_url=base_url, max_retries=0), client=client)


@pytest.mark.parametrize("make", [_openai, _ollama])
async def test_a_summarizer_error_names_its_endpoint_without_the_password(
    make: Callable[[str, httpx.AsyncClient], Summarizer],
) -> None:
    # The error is logged and reaches compression events: the base_url's password must not.
    answer_401 = httpx.MockTransport(lambda request: httpx.Response(401, text="no"))
    async with httpx.AsyncClient(transport=answer_401) as client:
        summarizer = make("http://user:hunter2@127.0.0.1:56450", client)
        request = SummaryRequest(messages=(), text="x", instructions="", max_tokens=64, temperature=0.3)
        with pytest.raises(SummarizerError) as caught:
            await summarizer.summarize(request)
    assert "user:***@127.0.0.1:56450" in str(caught.value) and "hunter2" not in str(caught.value)
