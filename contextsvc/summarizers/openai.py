"""A summarizer over any OpenAI-compatible ``POST {base_url}/v1/chat/completions``.

OpenAI itself, vLLM, llama.cpp's server, LM Studio and Ollama's ``/v1`` all speak it. The system
message carries the summary instructions, the user message the formatted dropped turns (plus
the images as data URLs when the endpoint is configured as vision-capable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from contextsvc import telemetry
from contextsvc.config import OpenAISummarizerConfig, redacted_url
from contextsvc.ports import CutSummary, SummarizerError, SummaryRequest
from contextsvc.summarizers._http import HttpEndpoint, SharedClient, Streamed, data_url, require_text

if TYPE_CHECKING:
    import httpx

__all__ = ["OpenAISummarizer"]


class OpenAISummarizer:
    """Chat completions, non-streaming; ``choices[0].message.content`` is the summary."""

    name = "openai"

    def __init__(self, config: OpenAISummarizerConfig, *, client: httpx.AsyncClient | SharedClient) -> None:
        self.config = config
        self.vision = config.vision
        headers = {"Accept": "application/json"}
        if key := config.api_key.get_secret_value():
            headers["Authorization"] = f"Bearer {key}"
        url = config.base_url.rstrip("/") + "/v1/chat/completions"
        self._endpoint = HttpEndpoint(
            who=f"openai summarizer ({redacted_url(url)})",  # its errors are logged and shown
            client=client,
            url=url,
            headers=headers,
            timeout_seconds=config.timeout_seconds,
            connect_timeout_seconds=config.connect_timeout_seconds,
            total_timeout_seconds=config.total_timeout_seconds,
            max_retries=config.max_retries,
            backoff_seconds=config.retry_backoff_seconds,
            max_answer_bytes=config.max_answer_bytes,
        )

    def body(self, request: SummaryRequest) -> dict[str, Any]:
        """The JSON body sent for ``request``."""
        messages: list[dict[str, Any]] = []
        if request.instructions:
            messages.append({"role": "system", "content": request.instructions})
        user: str | list[dict[str, Any]] = request.text
        if self.vision and request.images:
            user = [{"type": "text", "text": request.text}]
            user += [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in request.images]
        messages.append({"role": "user", "content": user})
        return {
            "model": self.config.model,
            "messages": messages,
            self.config.max_tokens_field: request.max_tokens,
            "temperature": request.temperature,
            "stream": False,
        }

    async def summarize(self, request: SummaryRequest) -> str:
        payload = await self._endpoint.post_json(self.body(request))
        if isinstance(payload, Streamed):
            payload = self._assembled(payload)
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict):
            telemetry.note_genai_usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")))
        try:
            return self._content(payload)
        except SummarizerError as exc:  # the payload may echo the credentials it was sent
            raise self._endpoint.redacted(exc) from None

    def _assembled(self, events: Streamed) -> dict[str, Any]:
        """A streamed answer (chat.completion.chunk events) as the one answer it stands for."""
        parts: list[str] = []
        reason: Any = None
        usage: Any = None
        for event in events:
            if event.get("error"):
                return {"error": event["error"]}
            usage = event.get("usage") or usage
            choices = event.get("choices")
            for choice in choices if isinstance(choices, list) else []:
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or choice.get("message")
                if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                    parts.append(delta["content"])
                reason = choice.get("finish_reason") or reason
        if reason is None:  # the stream stopped before its last chunk: the summary may be cut anywhere
            raise SummarizerError(f"{self._endpoint.who}: the streamed answer ended without a finish_reason")
        message = {"role": "assistant", "content": "".join(parts)}
        return {"choices": [{"index": 0, "message": message, "finish_reason": reason}], "usage": usage}

    def _content(self, payload: Any) -> str:
        who = self._endpoint.who
        if not isinstance(payload, dict):
            raise SummarizerError(f"{who}: the answer is not a JSON object: {self._endpoint.shown(repr(payload))}")
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices:
            error = payload.get("error")
            if error:
                raise SummarizerError(f"{who}: the server reported an error: {self._endpoint.shown(repr(error))}")
            raise SummarizerError(f"{who}: the answer has no choices: {self._endpoint.shown(repr(payload))}")
        first = choices[0]
        message = first.get("message") if isinstance(first, dict) else None
        if not isinstance(message, dict):
            raise SummarizerError(f"{who}: choices[0] has no message: {self._endpoint.shown(repr(first))}")
        reason = first.get("finish_reason") if isinstance(first, dict) else None
        text = require_text(who, message.get("content"), detail=f" (finish_reason={reason})" if reason else "")
        return CutSummary(text) if reason == "length" else text  # the output cap cut it

    async def close(self) -> None:
        """Nothing to release: the HTTP client belongs to the registry's ``SummarizerSet``."""


def _count(value: Any) -> int | None:
    """A token count from the provider's answer, when it is one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
