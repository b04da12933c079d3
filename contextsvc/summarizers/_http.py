"""What the HTTP summarizers share: one POST with timeouts, bounded retries, and error mapping.

Every failure leaves as ``SummarizerError`` with a message that names the endpoint and what went
wrong; httpx exceptions never escape (the engine falls back on ``SummarizerError`` only).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from contextsvc.ports import SummarizerError, SummarizerUnavailable

if TYPE_CHECKING:
    # Imported when first used (``_with_retries``), not with this module: importing httpx is
    # ~0.15 s of every start, and most services never summarize over HTTP.
    import httpx

__all__ = [
    "HttpEndpoint",
    "SharedClient",
    "Streamed",
    "data_url",
    "mime_type_of",
    "require_text",
    "snippet",
    "streamed_events",
    "strip_thinking",
]

_SNIPPET_CHARS = 300
_THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.S | re.I)
#: a leading ``<think>`` whose block never closes (``strip_thinking`` removes a closed one)
_OPEN_THINK = re.compile(r"^\s*<think>(?!.*</think>)", re.S | re.I)
_SPACES = re.compile(r"\s+")


class SharedClient:
    """The one ``httpx.AsyncClient`` the HTTP summarizers share, made when first needed: making one
    imports httpcore and loads the CA bundle (about half a second of a server's start), which a
    service whose profiles never call an HTTP summarizer should not pay."""

    def __init__(self, make: Callable[[], httpx.AsyncClient]) -> None:
        self._make = make
        self._client: httpx.AsyncClient | None = None
        self._closed = False

    @classmethod
    def of(cls, client: httpx.AsyncClient | SharedClient) -> SharedClient:
        """``client`` as a shared client (one given ready-made is used as is)."""
        if isinstance(client, SharedClient):
            return client
        shared = cls(lambda: client)
        shared._client = client
        return shared

    @property
    def is_closed(self) -> bool:
        return self._closed or (self._client is not None and self._client.is_closed)

    def get(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = self._make()
        return self._client

    async def aclose(self) -> None:
        """Close the client if it was made; none is made after this."""
        self._closed = True
        if self._client is not None:
            await self._client.aclose()


class HttpEndpoint:
    """``POST url`` with a JSON body over a shared client; returns the decoded JSON answer.

    Retries (``max_retries`` extra attempts, backoff doubling from ``backoff_seconds``) follow a
    connect error, a timeout, a dropped connection, a 5xx or a 429 (rate limited). A pause is at
    least what the answer's ``Retry-After`` asks; one that would end past the whole call's bound
    fails at once, saying so, rather than sleeping into the timeout. Any other 4xx or an answer
    that is not JSON is final: asking again would get the same answer. ``total_timeout_seconds``
    bounds the whole call, retries and pauses included.
    """

    def __init__(
        self,
        *,
        who: str,
        client: httpx.AsyncClient | SharedClient,
        url: str,
        headers: dict[str, str],
        timeout_seconds: float,
        connect_timeout_seconds: float,
        total_timeout_seconds: float,
        max_retries: int,
        backoff_seconds: float,
        max_answer_bytes: int,
    ) -> None:
        self.who = who
        self.url = url
        self._client = SharedClient.of(client)
        self._headers = headers
        self._connect_timeout_seconds = connect_timeout_seconds
        self._timeout_seconds = timeout_seconds
        self._total_timeout_seconds = total_timeout_seconds
        self._attempts = max_retries + 1
        self._backoff_seconds = backoff_seconds
        self._max_answer_bytes = max_answer_bytes
        self._secrets = credentials(url, headers)

    async def post_json(self, body: dict[str, Any]) -> Any:
        if self._client.is_closed:  # httpx would raise a bare RuntimeError
            raise SummarizerError(f"{self.who}: closed (the summarizers were shut down)")
        try:
            async with asyncio.timeout(self._total_timeout_seconds):
                return await self._with_retries(body)
        except TimeoutError:
            raise SummarizerUnavailable(
                f"{self.who}: no answer within {self._total_timeout_seconds:g}s (the whole call, retries included)"
            ) from None
        except SummarizerError as exc:
            raise self.redacted(exc) from None

    def shown(self, text: str) -> str:
        """``snippet`` of what the endpoint answered, its credentials taken out first: cut first, a
        key echoed across the cut would be shown in part, which ``redacted`` no longer matches."""
        return snippet(redact(text, self._secrets))

    def redacted(self, exc: SummarizerError) -> SummarizerError:
        """``exc`` without this endpoint's credentials: an endpoint may echo the key it was sent
        (``Incorrect API key provided: sk-…``), and the message is logged and shown. Its class is
        kept (``SummarizerUnavailable`` tells the engine not to ask again at once)."""
        return type(exc)(redact(str(exc), self._secrets))

    async def _read_capped(self, response: httpx.Response) -> bytes | None:
        """The answer's body, or None once it passes ``max_answer_bytes`` (nothing more is read)."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self._max_answer_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _with_retries(self, body: dict[str, Any]) -> Any:
        import httpx

        timeout = httpx.Timeout(self._timeout_seconds, connect=self._connect_timeout_seconds)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._total_timeout_seconds
        last_problem = ""
        unanswered = False  # the last attempt got no answer at all (a timeout, no connection)
        asked = 0.0  # the pause the last answer's Retry-After asked for
        for attempt in range(self._attempts):
            if attempt:
                pause = max(self._backoff_seconds * 2 ** (attempt - 1), asked)
                if asked and loop.time() + pause >= deadline:
                    raise SummarizerError(
                        f"{self.who}: {last_problem}; Retry-After {asked:g}s runs past the call's "
                        f"{self._total_timeout_seconds:g}s (total_timeout_seconds)"
                    )
                await asyncio.sleep(pause)
            asked, unanswered = 0.0, True
            try:
                client = self._client.get()
                request = client.build_request("POST", self.url, json=body, headers=self._headers, timeout=timeout)
                response = await client.send(request, stream=True)
                try:
                    data = await self._read_capped(response)
                finally:
                    await response.aclose()
            except httpx.TimeoutException as exc:
                last_problem = f"timed out ({type(exc).__name__}, {self._timeout_seconds:g}s per attempt)"
                continue
            except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                last_problem = f"connection failed ({type(exc).__name__}: {exc})"
                continue
            except httpx.HTTPError as exc:  # bad URL, unsupported scheme, proxy trouble: final
                raise SummarizerError(f"{self.who}: request failed ({type(exc).__name__}: {exc})") from None
            unanswered = False
            status = response.status_code
            if data is None:  # past the cap: the same request would get the same runaway answer
                raise SummarizerError(
                    f"{self.who}: HTTP {status}, the answer is longer than {self._max_answer_bytes} bytes "
                    "(max_answer_bytes); not read further"
                )
            text = _decoded(data, response.charset_encoding)
            if status >= 500 or status == 429:
                last_problem = f"HTTP {status}: {self.shown(text)}"
                asked = retry_after(response.headers.get("retry-after", ""))
                continue
            if status >= 400:
                raise SummarizerError(f"{self.who}: HTTP {status} (not retried): {self.shown(text)}")
            if status != 200:
                raise SummarizerError(f"{self.who}: unexpected HTTP {status}: {self.shown(text)}")
            try:
                return json.loads(data)
            except ValueError:  # JSONDecodeError and undecodable bytes alike
                events = streamed_events(text)
                if events is not None:
                    return events
                raise SummarizerError(f"{self.who}: the answer is not JSON: {self.shown(text)}") from None
        attempts = f"{self._attempts} attempt{'s' if self._attempts != 1 else ''}"
        # No answer at all (every retry timed out or found nobody listening) is the endpoint being
        # unavailable: the engine then skips its second try with a wider keep window, which would
        # wait as long again (a hung summarizer held a pre-turn build for twice the whole-call bound).
        failed = SummarizerUnavailable if unanswered else SummarizerError
        raise failed(f"{self.who}: failed after {attempts}; last: {last_problem}")


class Streamed(list[Any]):
    """An answer sent as a stream although ``stream: false`` was asked (some servers and proxies
    always stream): the JSON object of each event, in order. Each summarizer assembles its own
    protocol's events (``choices[0].delta`` pieces; Ollama's ``message`` pieces)."""

    __slots__ = ()


def streamed_events(text: str) -> Streamed | None:
    """``text`` as a stream's events: server-sent events (``data: {…}`` lines, ``data: [DONE]``) or
    JSON lines; None when it is neither (a line that is no JSON object), or holds no event."""
    events = Streamed()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(":") or line.startswith(("event:", "id:", "retry:")):
            continue  # blank separators, SSE comments and fields other than data
        if line.startswith("data:"):
            line = line[5:].strip()
            if line == "[DONE]":
                continue
        try:
            event = json.loads(line)
        except ValueError:
            return None
        if not isinstance(event, dict):
            return None
        events.append(event)
    return events or None


def _decoded(data: bytes, encoding: str | None) -> str:
    """The body as text for an error message, as ``httpx.Response.text`` decodes it."""
    try:
        return data.decode(encoding or "utf-8", "replace")
    except LookupError:  # a charset Python does not know
        return data.decode("utf-8", "replace")


def retry_after(value: str, *, now: datetime | None = None) -> float:
    """Seconds a ``Retry-After`` header asks to wait (delay-seconds or an HTTP date); 0 when it is
    missing or not understood."""
    value = value.strip()
    if not value:
        return 0.0
    if value.isascii() and value.isdigit():  # str.isdigit takes "²" too, which float() refuses
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    if when.tzinfo is None:  # an HTTP date is GMT; a date without a zone is taken as such
        when = when.replace(tzinfo=UTC)
    return max((when - (now or datetime.now(UTC))).total_seconds(), 0.0)


#: shorter values are not taken for credentials (replacing them would garble the message).
_MIN_SECRET_CHARS = 6


def credentials(url: str, headers: dict[str, str]) -> tuple[str, ...]:
    """What an endpoint sends that must never be shown: each credential header's value and its
    token (``Bearer <token>``), and the password of the URL's user part with the Basic
    credential httpx makes of it. Longest first, so a value goes before a part of it."""
    found: set[str] = set()
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in ("authorization", "proxy-authorization") or "key" in lowered or "token" in lowered:
            found.update({value, value.split()[-1] if value.split() else value})
    parts = urlsplit(url)
    if parts.password:
        found.update({parts.password, unquote(parts.password)})
        pair = f"{unquote(parts.username or '')}:{unquote(parts.password)}"
        found.add(base64.b64encode(pair.encode()).decode("ascii"))
    return tuple(sorted((f for f in found if len(f) >= _MIN_SECRET_CHARS), key=len, reverse=True))


def redact(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def snippet(text: str) -> str:
    """The start of a response body, on one line, for an error message."""
    flat = _SPACES.sub(" ", text).strip()
    if not flat:
        return "(empty body)"
    return flat if len(flat) <= _SNIPPET_CHARS else flat[:_SNIPPET_CHARS] + "…"


def mime_type_of(data: bytes) -> str:
    """The image type from its magic bytes (PNG when unknown: every vision API takes it)."""
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "image/png"


def data_url(data: bytes) -> str:
    return f"data:{mime_type_of(data)};base64,{base64.b64encode(data).decode('ascii')}"


def strip_thinking(content: str) -> str:
    """Drop a leading ``<think>…</think>`` block some reasoning models put in the content."""
    return _THINK_BLOCK.sub("", content, count=1).strip()


#: a terminal's escape sequences (colours, cursor moves: ESC [ ... final byte), removed whole.
_TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
#: control characters but tab and line breaks (C0, DEL, C1), and the noncharacters (U+FDD0-U+FDEF and
#: the last two code points of every plane): no text a model should be sent or a page shown.
_NOT_TEXT = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufdd0-\ufdef"
    + "".join(f"{chr(plane + 0xFFFE)}{chr(plane + 0xFFFF)}" for plane in range(0, 0x110000, 0x10000))
    + "]"
)


def storable(text: str) -> str:
    """``text`` as a stored message may hold it: JSON can carry a lone surrogate (``"\\ud800"``),
    which is no UTF-8 (a summary holding one committed, then failed every read of its session as
    INTERNAL), and NUL, which PostgreSQL's text refuses. Lone surrogates become U+FFFD. A model's
    answer may also hold terminal escapes and other control characters, which would reach the
    context every later view sends, the inspector and the logs: they go, as NULs do."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if "\x1b" in text:
        text = _TERMINAL_ESCAPE.sub("", text)
    return _NOT_TEXT.sub("", text)


def require_text(who: str, content: object, *, detail: str = "") -> str:
    """``content`` as a non-empty summary (``storable``), else ``SummarizerError``."""
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    if not isinstance(content, str):
        raise SummarizerError(f"{who}: the answer has no text content (got {type(content).__name__}){detail}")
    text = strip_thinking(storable(content))
    if _OPEN_THINK.match(text):
        # A reasoning model whose output cap ran out while it was still thinking: what came back
        # is its unfinished reasoning, which stored as the summary would reach every later view.
        raise SummarizerError(f"{who}: the answer is reasoning only (a <think> block never closed){detail}")
    if not text:
        raise SummarizerError(f"{who}: the answer's content is empty{detail}")
    return text
