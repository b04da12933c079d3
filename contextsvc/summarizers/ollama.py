"""A summarizer over Ollama's native ``POST {base_url}/api/chat``.

Sent with ``stream: false`` and ``think: false`` (a reasoning model would otherwise spend the
output budget thinking), the temperature and output cap in ``options``, and ``num_ctx`` so a
long summarizer input is not silently cut to Ollama's small default context. Images travel as
base64 strings in the user message's ``images`` field when the endpoint is vision-capable.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from contextsvc import telemetry
from contextsvc.config import OllamaSummarizerConfig, redacted_url
from contextsvc.ports import CutSummary, SummarizerError, SummaryRequest
from contextsvc.summarizers._http import HttpEndpoint, SharedClient, Streamed, require_text

if TYPE_CHECKING:
    import httpx

__all__ = ["OllamaSummarizer"]


class OllamaSummarizer:
    """Ollama chat, non-streaming; ``message.content`` is the summary."""

    name = "ollama"

    def __init__(self, config: OllamaSummarizerConfig, *, client: httpx.AsyncClient | SharedClient) -> None:
        self.config = config
        self.vision = config.vision
        url = config.base_url.rstrip("/") + "/api/chat"
        self._endpoint = HttpEndpoint(
            who=f"ollama summarizer ({redacted_url(url)})",  # its errors are logged and shown
            client=client,
            url=url,
            headers={"Accept": "application/json"},
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
        user: dict[str, Any] = {"role": "user", "content": request.text}
        if self.vision and request.images:
            user["images"] = [base64.b64encode(image).decode("ascii") for image in request.images]
        messages.append(user)
        options: dict[str, Any] = {"temperature": request.temperature, "num_predict": request.max_tokens}
        if self.config.num_ctx:
            options["num_ctx"] = self.config.num_ctx
        return {"model": self.config.model, "messages": messages, "stream": False, "think": False, "options": options}

    async def summarize(self, request: SummaryRequest) -> str:
        payload = await self._endpoint.post_json(self.body(request))
        if isinstance(payload, Streamed):
            payload = self._assembled(payload)
        if isinstance(payload, dict):
            telemetry.note_genai_usage(_count(payload.get("prompt_eval_count")), _count(payload.get("eval_count")))
        try:
            return self._content(payload)
        except SummarizerError as exc:  # the payload may echo the credentials it was sent
            raise self._endpoint.redacted(exc) from None

    def _assembled(self, events: Streamed) -> dict[str, Any]:
        """A streamed answer (JSON lines, the last one ``done: true``) as the one answer it stands for."""
        parts: list[str] = []
        last: dict[str, Any] = {}
        for event in events:
            if event.get("error"):
                return {"error": event["error"]}
            message = event.get("message")
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                parts.append(message["content"])
            last = event
        if last.get("done") is not True:  # the stream stopped before its last line
            raise SummarizerError(f"{self._endpoint.who}: the streamed answer ended before done: true")
        return {**last, "message": {"role": "assistant", "content": "".join(parts)}}

    def _content(self, payload: Any) -> str:
        who = self._endpoint.who
        if not isinstance(payload, dict):
            raise SummarizerError(f"{who}: the answer is not a JSON object: {self._endpoint.shown(repr(payload))}")
        if payload.get("error"):
            raise SummarizerError(f"{who}: the server reported an error: {self._endpoint.shown(str(payload['error']))}")
        message = payload.get("message")
        if not isinstance(message, dict):
            raise SummarizerError(f"{who}: the answer has no message: {self._endpoint.shown(repr(payload))}")
        reason = payload.get("done_reason")
        text = require_text(who, message.get("content"), detail=f" (done_reason={reason})" if reason else "")
        return CutSummary(text) if reason == "length" else text  # the output cap cut it

    async def close(self) -> None:
        """Nothing to release: the HTTP client belongs to the registry's ``SummarizerSet``."""


def _count(value: Any) -> int | None:
    """A token count from the provider's answer, when it is one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
