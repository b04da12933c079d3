"""A scriptable fake LLM server speaking the OpenAI and Ollama chat protocols, for tests.

Run it as its own process (``python -m tests.support.fake_llm --port 0``); it prints
``fake-llm listening on 127.0.0.1:PORT`` once it accepts connections. Standard library only, so
it starts in well under a second.

Endpoints:

* ``POST /v1/chat/completions`` — OpenAI-compatible answer; ``POST /api/chat`` — Ollama answer.
* ``POST /_control`` — ``{"mode": M, "modes": [M, ...], "hang_seconds": S}``: ``modes`` are used
  by the next chat calls in order, then ``mode`` for every later call. Modes:
  ``ok`` (a summary echoing facts of the input, ending with a KEYS line), ``no_keys`` (the same
  without the KEYS line), ``fail`` (HTTP 500), ``bad_request`` (HTTP 400), ``hang`` (sleep
  ``hang_seconds``, capped, then answer ok), ``garbage`` (200, not JSON), ``wrong_shape`` (200,
  JSON without the expected fields), ``empty`` (200, empty content), ``surrogate`` (the ok summary
  with a lone surrogate ``\\ud800`` and a NUL in it: valid JSON, no valid UTF-8 text; and a line
  of terminal escapes and other control characters), ``fenced`` (the ok summary wrapped in a
  ```markdown code fence), ``refusal`` (200, "I'm sorry, but I can't help with that."),
  ``echo_key`` (HTTP 401 whose error message repeats the request's ``Authorization`` header, as
  providers do with a wrong key), ``echo_key_ok`` (the same error in a 200 answer), ``length``
  (the ok summary cut in the middle of its first half, without its KEYS line, finish_reason /
  done_reason ``length``: the output cap ran out), ``rate_limited`` (HTTP 429 with
  ``Retry-After: 1``), ``unknown_model`` (HTTP 404 naming the request's model as not found),
  ``chunked`` (the ok answer with ``Transfer-Encoding: chunked``), ``sse`` (the ok summary as a
  ``text/event-stream`` of chunks, as a server that ignores ``stream: false`` sends it; Ollama:
  JSON lines), ``text_plain`` (the ok answer labelled ``text/plain``), ``cut_body`` (the answer's
  first half, then the connection closes), ``huge`` (an ok answer whose summary is padded to
  ``HUGE_CHARS``), ``foreign`` (the ok summary in Russian and Chinese, KEYS line included),
  ``dribble`` (the ok answer a few bytes at a time, ``hang_seconds`` spread over the body),
  ``long`` (the ok summary with ``LONG_CHARS`` of detail lines before its KEYS line: longer than
  any output cap a test sets, shorter than what it replaces), ``think`` (the ok summary after a
  ``<think>…</think>`` block, as reasoning models served without a reasoning parser answer),
  ``think_cut`` (only an unclosed ``<think>`` block: the output cap ran out while the model was
  still reasoning, finish_reason / done_reason ``length``).
* ``POST /_reset`` — mode ``ok``, no queued modes, no recorded requests.
* ``GET /_requests`` — ``{"requests": [{"path", "headers", "body"}, ...]}`` of chat calls, oldest
  first (the newest ``MAX_RECORDED``).

Every wait is bounded: a hang lasts at most ``MAX_HANG_SECONDS`` and the process exits by itself
after ``--max-lifetime`` seconds, so a test that forgets it cannot leave it running forever.

``FakeLLM`` (below) starts and stops it from a test, by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

MODES = (
    "ok",
    "no_keys",
    "fail",
    "bad_request",
    "hang",
    "garbage",
    "wrong_shape",
    "empty",
    "surrogate",
    "fenced",
    "refusal",
    "echo_key",
    "echo_key_ok",
    "length",
    "rate_limited",
    "unknown_model",
    "chunked",
    "sse",
    "text_plain",
    "cut_body",
    "huge",
    "foreign",
    "dribble",
    "long",
    "think",
    "think_cut",
)
MAX_HANG_SECONDS = 30.0
MAX_RECORDED = 200
MAX_BODY_BYTES = 64 * 1024 * 1024
HUGE_CHARS = 4 * 1024 * 1024
LONG_CHARS = 12_000
_FACT = re.compile(r"(?:[\w.-]+/)+[\w.-]+|\b[A-Z][A-Z0-9]{1,9}-\d+\b|\b[A-Z][a-z]+(?:[A-Z][a-z0-9]+)+\b")


class _State:
    """Mode script and request log, shared by the handler threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mode = "ok"
        self.queue: deque[str] = deque()
        self.hang_seconds = 10.0
        self.requests: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDED)

    def next_mode(self) -> str:
        with self.lock:
            return self.queue.popleft() if self.queue else self.mode


STATE = _State()


class _Handler(BaseHTTPRequestHandler):
    server_version = "fake-llm/1"
    protocol_version = "HTTP/1.1"
    #: an idle keep-alive connection is dropped after this long, so no handler thread waits forever.
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read stdout
        return

    # --- routing ----------------------------------------------------------------------------

    def do_GET(self) -> None:
        if self.path == "/_requests":
            with STATE.lock:
                recorded = list(STATE.requests)
            self._send_json(200, {"requests": recorded})
        elif self.path in ("/", "/health"):
            self._send_json(200, {"status": "ok"})
        else:
            self._send_json(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        raw = self._read_body()
        if raw is None:
            return
        if self.path == "/_control":
            self._control(raw)
        elif self.path == "/_reset":
            with STATE.lock:
                STATE.mode, STATE.hang_seconds = "ok", 10.0
                STATE.queue.clear()
                STATE.requests.clear()
            self._send_json(200, {"reset": True})
        elif self.path in ("/v1/chat/completions", "/api/chat"):
            self._chat(raw)
        else:
            self._send_json(404, {"error": f"no route {self.path}"})

    # --- handlers ---------------------------------------------------------------------------

    def _control(self, raw: bytes) -> None:
        try:
            spec = json.loads(raw or b"{}")
            modes = [str(m) for m in spec.get("modes", [])]
            mode = str(spec.get("mode", STATE.mode))
            for m in [*modes, mode]:
                if m not in MODES:
                    raise ValueError(f"unknown mode {m!r}; known: {', '.join(MODES)}")
            hang = min(float(spec.get("hang_seconds", STATE.hang_seconds)), MAX_HANG_SECONDS)
        except (ValueError, AttributeError, TypeError) as exc:
            self._send_json(400, {"error": str(exc)})
            return
        with STATE.lock:
            STATE.mode, STATE.hang_seconds = mode, hang
            STATE.queue = deque(modes)
        self._send_json(200, {"mode": mode, "modes": modes, "hang_seconds": hang})

    def _chat(self, raw: bytes) -> None:
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        with STATE.lock:
            STATE.requests.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
            hang_seconds = STATE.hang_seconds
        mode = STATE.next_mode()
        ollama = self.path == "/api/chat"
        if mode == "fail":
            self._send_json(500, {"error": "fake-llm: scripted failure"})
            return
        if mode == "bad_request":
            self._send_json(400, {"error": "fake-llm: scripted bad request"})
            return
        if mode in ("echo_key", "echo_key_ok"):
            sent = self.headers.get("Authorization", "")
            token = sent.split()[-1] if sent.split() else ""
            error = {"message": f"Incorrect API key provided: {token} (header {sent!r})", "type": "auth"}
            self._send_json(401 if mode == "echo_key" else 200, {"error": error})
            return
        if mode == "rate_limited":
            self._send_json(
                429, {"error": {"message": "Rate limit reached", "type": "rate_limit"}}, {"Retry-After": "1"}
            )
            return
        if mode == "unknown_model":
            model = body.get("model", "") if isinstance(body, dict) else ""
            self._send_json(404, {"error": f"model {model!r} not found, try pulling it first"})
            return
        if mode == "garbage":
            self._send_raw(200, b"<html>this is not JSON {", "text/html")
            return
        if mode == "wrong_shape":
            self._send_json(200, {"unexpected": True, "choices": "nope"} if not ollama else {"done": True})
            return
        if mode == "hang":
            time.sleep(hang_seconds)  # bounded by MAX_HANG_SECONDS; the client has usually left
        content = "" if mode == "empty" else _summary(body, keys=mode not in ("no_keys", "length"))
        finish = "stop"
        if mode == "length":  # the output cap ran out mid-sentence
            content, finish = content[: max(1, len(content) // 3)], "length"
        if mode == "fenced":
            content = f"```markdown\n{content}\n```"
        if mode == "refusal":
            content = "I'm sorry, but I can't help with that."
        if mode == "huge":
            content = content + "\n" + ("- padding line of a summary that never ends.\n" * (HUGE_CHARS // 45))
        if mode == "long":  # past any output cap it was given, short of what it replaces
            filler = "".join(
                f"- detail {k}: the handler kept its behaviour and its tests passed.\n" for k in range(400)
            )
            content = content.replace("KEYS:", filler[:LONG_CHARS] + "KEYS:", 1)
        if mode == "think":
            content = "<think>\nThe user wants a summary. Let me list the facts first.\n</think>\n" + content
        if mode == "think_cut":
            reasoning = "Let me consider each turn in order. " * 40
            content, finish = "<think>\nThe user wants a summary. " + reasoning, "length"
        if mode == "foreign":
            content = content.replace("- The conversation covered", "- Разговор охватил").replace(
                "- It began with", "- 对话开始于"
            )
        if mode == "surrogate":  # json.dumps writes it as the escape "\ud800": valid JSON
            odd = "- Odd \ud800 bytes\x00 here.\n- Tty \x1b[31mred\x1b[0m\x07 \ufffe\x01text\x9b.\n"
            content = content.replace("- It began", odd + "- It began", 1)
        model = body.get("model", "fake") if isinstance(body, dict) else "fake"
        if ollama:
            answer: dict[str, Any] = {
                "model": model,
                "created_at": "2026-01-01T00:00:00Z",
                "message": {"role": "assistant", "content": content},
                "done": True,
                "done_reason": finish,
            }
        else:
            answer = {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": model,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        if mode == "sse":
            self._send_stream(content, ollama=ollama, model=model)
        elif mode == "chunked":
            self._send_chunked(json.dumps(answer).encode(), "application/json")
        elif mode == "text_plain":
            self._send_raw(200, json.dumps(answer).encode(), "text/plain; charset=utf-8")
        elif mode == "cut_body":
            self._send_cut(json.dumps(answer).encode())
        elif mode == "dribble":
            self._send_dribble(json.dumps(answer).encode(), hang_seconds)
        else:
            self._send_json(200, answer)

    # --- plumbing ---------------------------------------------------------------------------

    def _read_body(self) -> bytes | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._send_json(413, {"error": "body too large"})
            return None
        return self.rfile.read(length) if length else b""

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send_raw(status, json.dumps(payload).encode(), "application/json", headers)

    def _send_raw(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a hang that outlived its timeout)

    def _send_chunked(self, data: bytes, content_type: str, pieces: int = 5) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            step = max(1, len(data) // pieces)
            for i in range(0, len(data), step):
                part = data[i : i + step]
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send_stream(self, content: str, *, ollama: bool, model: str) -> None:
        """The summary as a stream of deltas: SSE for OpenAI, JSON lines for Ollama."""
        words = content.split(" ")
        parts = [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]
        lines: list[bytes] = []
        for part in parts:
            if ollama:
                piece = {"model": model, "message": {"role": "assistant", "content": part}, "done": False}
                lines.append(json.dumps(piece).encode() + b"\n")
            else:
                chunk = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": part}}],
                }
                lines.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if ollama:
            end = {"model": model, "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop"}
            lines.append(json.dumps(end).encode() + b"\n")
        else:
            last = {
                "id": "c",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            }
            lines.append(b"data: " + json.dumps(last).encode() + b"\n\n")
            lines.append(b"data: [DONE]\n\n")
        self._send_chunked(b"".join(lines), "application/x-ndjson" if ollama else "text/event-stream")

    def _send_cut(self, data: bytes) -> None:
        """Promise the whole body, send half, close the connection."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _send_dribble(self, data: bytes, seconds: float, pieces: int = 20) -> None:
        """The whole body, a piece at a time over ``seconds`` (each pause well under a read timeout)."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            step = max(1, len(data) // pieces + 1)
            for i in range(0, len(data), step):
                self.wfile.write(data[i : i + step])
                self.wfile.flush()
                time.sleep(min(seconds, MAX_HANG_SECONDS) / pieces)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _summary(body: Any, *, keys: bool) -> str:
    """A bullet summary that echoes facts of the user message, so tests can see the input arrived."""
    messages = body.get("messages", []) if isinstance(body, dict) else []
    user = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), {})
    content = user.get("content", "")
    images = len(user.get("images", []))
    if isinstance(content, list):  # OpenAI content parts
        images += sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image_url")
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    text = str(content)
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), "(no text)")
    facts = list(dict.fromkeys(_FACT.findall(text)))[:8]
    lines = [
        f"- The conversation covered {len(text)} characters of history.",
        f"- It began with: {first_line[:200]}",
        f"- Facts seen: {', '.join(facts) if facts else 'none'}",
        f"- Images seen: {images}",
    ]
    if keys:
        lines.append("KEYS: " + "; ".join(facts or ["fake-llm"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-lifetime", type=float, default=600.0, help="exit after this many seconds")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), _Handler)
    server.daemon_threads = True  # a hanging handler must not keep the process alive at exit
    timer = threading.Timer(args.max_lifetime, server.shutdown)
    timer.daemon = True
    timer.start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"fake-llm listening on {args.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


# --- the test-side helper ---------------------------------------------------------------------

_LISTENING = re.compile(r"fake-llm listening on (\S+):(\d+)")
_REPO_ROOT = Path(__file__).resolve().parents[2]


class FakeLLM:
    """The fake LLM as a separate process: ``start()``, ``set_mode()``, ``requests()``, ``stop()``."""

    def __init__(self, *, max_lifetime: float = 600.0, start_timeout: float = 15.0) -> None:
        self.max_lifetime = max_lifetime
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.base_url = ""
        self._stderr: IO[str] | None = None
        # Loopback only: never through a proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def start(self) -> FakeLLM:
        cmd = [sys.executable, "-m", "tests.support.fake_llm", "--port", "0", "--max-lifetime", str(self.max_lifetime)]
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            cmd,
            cwd=_REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": str(_REPO_ROOT)},
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                match = _LISTENING.search(self.proc.stdout.readline())
                if match:
                    self.base_url = f"http://{match.group(1)}:{match.group(2)}"
                    return self
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"fake-llm did not start: {self.stderr_text[-2000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()

    def stop(self) -> None:
        """SIGTERM by pid, then SIGKILL if it does not exit within a few seconds."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def set_mode(self, mode: str, *, then: str | None = None, hang_seconds: float | None = None) -> None:
        """Use ``mode`` for the next call only when ``then`` is given (then ``then`` for the rest),
        else for every call."""
        if then is None:
            self.control(mode=mode, hang_seconds=hang_seconds)
        else:
            self.control(modes=[mode], mode=then, hang_seconds=hang_seconds)

    def control(self, *, mode: str = "ok", modes: list[str] | None = None, hang_seconds: float | None = None) -> None:
        spec: dict[str, Any] = {"mode": mode, "modes": modes or []}
        if hang_seconds is not None:
            spec["hang_seconds"] = hang_seconds
        self._call("POST", "/_control", spec)

    def reset(self) -> None:
        self._call("POST", "/_reset", {})

    def requests(self) -> list[dict[str, Any]]:
        recorded: list[dict[str, Any]] = self._call("GET", "/_requests", None)["requests"]
        return recorded

    def _call(self, method: str, path: str, payload: Any) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with self._opener.open(request, timeout=10) as response:
            return json.loads(response.read())

    def __enter__(self) -> FakeLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
