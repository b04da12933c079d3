"""Secrets never leave through an output (issue 13, item 8).

One run touches every path a secret travels: ``tokens create`` / ``list`` / ``revoke``, calls with
a good token, an unknown one, a revoked one and a malformed ``authorization`` value, a
compression through an OpenAI-compatible summarizer that needs an API key, an event stream, and
``contextsvc config``; the server logs at DEBUG. Then every byte any of them wrote (server stderr
and stdout, CLI output, error messages, events, the config dump) is searched for each secret.
The summarizer key reached the summarizer (so the test is not vacuous), and nowhere else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import events_pb2
from contextsvc._gen.v1 import resources_pb2 as r
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from contextsvc.core.credentials import issue, looks_like_token
from tests.support.fake_llm import FakeLLM
from tests.support.rpc import assistant, error_details, tool, user
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e

API_KEY = "sk-test-0123456789-never-log-me"
CALL_S = 30.0


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "contextsvc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=False,
    )


def test_no_token_or_key_appears_in_any_output(tmp_path: Path, llm: FakeLLM) -> None:
    llm.reset()
    store = f"files:{tmp_path / 'data'}"
    env = {
        "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": llm.base_url,
        "CONTEXTSVC_SUMMARIZER__OPENAI__API_KEY": API_KEY,
        "CONTEXTSVC_LOG_LEVEL": "DEBUG",
        "CONTEXTSVC_AUTH__CACHE_SECONDS": "0",
    }
    outputs: list[str] = []

    created = _cli("tokens", "create", "--user", "alice", "--store", store, env=env)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert looks_like_token(token)
    outputs.append(created.stderr)
    doomed = _cli("tokens", "create", "--user", "alice", "--store", store, env=env)
    doomed_token = doomed.stdout.strip()
    outputs.append(doomed.stderr)
    unknown = issue(user="alice", is_admin=False, now=datetime.now(UTC), expire_time=None).secret
    malformed = "Bearer not-a-token-but-still-secret-xyz"

    proc = ServerProcess(store, extra_args=["--auth", "tokens"], env=env).start()
    try:
        with grpc.insecure_channel(proc.address) as channel:
            stub = ContextServiceStub(channel)
            md = [("authorization", f"Bearer {token}")]
            sid = stub.CreateSession(pb.CreateSessionRequest(name="secrets"), metadata=md, timeout=CALL_S).id
            turns: list[r.Message] = []
            for t in range(8):
                turns += [
                    user(f"turn {t}: read config_{t}.toml"),
                    assistant("", [(f"c{t}", "read_file")]),
                    tool(f"c{t}", f"[section_{t}]\nvalue = {t}\n" * 25),
                    assistant(f"config_{t}.toml has section_{t}"),
                ]
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=turns), metadata=md, timeout=CALL_S)
            profile = r.Profile(
                model="m",
                context_window=4096,
                compression=r.CompressionSettings(summarizer="openai", strategies=["summarize"], keep_recent=1),
            )
            done = stub.Compress(pb.CompressRequest(session_id=sid, profile=profile), metadata=md, timeout=CALL_S)
            assert done.compressed and done.method == events_pb2.COMPRESSION_METHOD_SUMMARY

            revoked = _cli("tokens", "revoke", doomed_token, "--store", store, env=env)
            assert revoked.returncode == 0
            outputs.append(revoked.stdout + revoked.stderr)
            listed = _cli("tokens", "list", "--store", store, env=env)
            outputs.append(listed.stdout + listed.stderr)
            as_json = _cli("tokens", "list", "--json", "--store", store, env=env).stdout
            rows = [json.loads(line) for line in as_json.splitlines()]
            assert [row["state"] for row in rows] == ["active", "revoked"]
            assert rows[0]["last_used_time"] != "-"  # the server recorded alice's use

            for value in (f"Bearer {unknown}", f"Bearer {doomed_token}", malformed, f"bearer {token}x"):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.GetSession(
                        pb.GetSessionRequest(session_id=sid), metadata=[("authorization", value)], timeout=CALL_S
                    )
                details = error_details(caught.value)
                assert details["code"] == grpc.StatusCode.UNAUTHENTICATED
                if doomed_token in value:
                    assert details["reason"] == "TOKEN_REVOKED"  # seen by the running server at once
                outputs.append(repr(details) + str(caught.value.debug_error_string()))

            events = stub.StreamEvents(pb.StreamEventsRequest(after_event_id=1), metadata=md, timeout=2)
            with pytest.raises(grpc.RpcError):
                for event in events:
                    outputs.append(str(event))
            assert any("context_compressed" in o for o in outputs)
        assert proc.terminate() == 0
        assert proc.proc is not None and proc.proc.stdout is not None
        outputs.append(proc.proc.stdout.read())
        outputs.append(proc.stderr_text)
    finally:
        proc.kill()

    config = _cli("config", env=env)
    assert config.returncode == 0
    outputs.append(config.stdout + config.stderr)

    # The key did its job: the summarizer was called with it.
    assert any(req["headers"].get("Authorization") == f"Bearer {API_KEY}" for req in llm.requests())
    everything = "\n".join(outputs)
    assert '"level": "debug"' in everything or '"level": "info"' in everything  # the log was captured
    for secret in (token, doomed_token, unknown, malformed.split()[1], API_KEY):
        assert secret not in everything, f"a secret leaked: {secret[:8]}…"
    # Not even a recognisable fragment of a token.
    for secret in (token, doomed_token, unknown):
        assert secret[4:20] not in everything
