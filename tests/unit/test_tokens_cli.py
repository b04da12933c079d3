"""``contextsvc tokens create|list|revoke`` on the files store, as an operator runs them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from contextsvc.core.credentials import hash_token, looks_like_token


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "contextsvc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_create_prints_the_token_once_and_stores_only_its_hash(tmp_path: Path) -> None:
    store = f"files:{tmp_path / 'data'}"
    made = cli("tokens", "create", "--user", "alice", "--expires", "90d", "--note", "laptop", "--store", store)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert looks_like_token(token) and made.stdout.count("\n") == 1
    assert token not in made.stderr
    audit = [json.loads(line) for line in made.stderr.splitlines() if line.startswith("{")]
    assert audit and audit[0]["event"] == "api token created" and audit[0]["user"] == "alice"

    path = tmp_path / "data" / "tokens.json"
    text = path.read_text()
    assert token not in text and hash_token(token) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    admin = cli("tokens", "create", "--user", "root", "--admin", "--store", store)
    listed = cli("tokens", "list", "--json", "--store", store)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["user"], r["admin"], r["state"]) for r in rows] == [("alice", False, "active"), ("root", True, "active")]
    assert rows[0]["expire_time"] != "-" and rows[1]["expire_time"] == "-"
    assert token not in listed.stdout + listed.stderr and admin.stdout.strip() not in listed.stdout

    by_token = cli("tokens", "revoke", token, "--store", store)  # the token itself works as well as its id
    assert by_token.returncode == 0, by_token.stderr
    assert "api token revoked" in by_token.stderr and token not in by_token.stderr
    by_id = cli("tokens", "revoke", rows[1]["token_id"], "--store", store)
    assert by_id.returncode == 0
    # Revoked again: it said "revoked token …" and wrote a second audit line of a revocation now.
    again = cli("tokens", "revoke", rows[1]["token_id"], "--store", store)
    assert again.returncode == 0
    assert "api token revoked" not in again.stderr, again.stderr
    assert again.stderr.strip().startswith(f"token {rows[1]['token_id']} of user root was already revoked at ")
    states = [
        json.loads(line)["state"] for line in cli("tokens", "list", "--json", "--store", store).stdout.splitlines()
    ]
    assert states == ["revoked", "revoked"]
    table = cli("tokens", "list", "--store", store).stdout
    assert "laptop" in table and "revoked" in table


def test_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    store = f"files:{tmp_path / 'data'}"
    # A data directory that is not there (a mistyped path) is said so, not listed as empty.
    for command in (["list"], ["revoke", "nosuchid"]):
        missing = cli("tokens", *command, "--store", store)
        assert (
            missing.returncode == 1
            and missing.stderr == f"contextsvc tokens {command[0]}: no data directory at {tmp_path / 'data'}\n"
        )
    assert not (tmp_path / "data").exists()
    (tmp_path / "data").mkdir()
    unknown = cli("tokens", "revoke", "nosuchid", "--store", store)
    assert unknown.returncode == 1 and "no such token" in unknown.stderr
    bad_user = cli("tokens", "create", "--user", "a b", "--store", store)
    assert bad_user.returncode == 2 and bad_user.stderr.count("\n") == 1
    bad_expiry = cli("tokens", "create", "--user", "a", "--expires", "soon", "--store", store)
    assert bad_expiry.returncode == 2 and "90d" in bad_expiry.stderr
    memory = cli("tokens", "create", "--user", "a", "--store", "memory")
    assert memory.returncode == 2 and "auth.token_store" in memory.stderr
    # A memory store with a token file of its own.
    own = cli("tokens", "create", "--user", "a", "--store", "memory", env={"CONTEXTSVC_AUTH__TOKEN_STORE": store})
    assert own.returncode == 0 and looks_like_token(own.stdout.strip())


def test_serve_refuses_beyond_loopback_in_one_line() -> None:
    done = cli("serve", "--listen", "0.0.0.0:0", "--store", "memory")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--insecure" in done.stderr and "TLS" in done.stderr
    missing = cli("serve", "--listen", "0.0.0.0:0", "--store", "memory", "--tls-cert", "/nope.pem", "--tls-key", "/k")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "/nope.pem" in missing.stderr


def test_a_token_file_that_cannot_be_written_is_said_so(tmp_path: Path) -> None:
    """``tokens create`` on a data directory that is a file said the token store "cannot be read"."""
    (tmp_path / "a-file").write_text("not a directory")
    made = cli("tokens", "create", "--user", "alice", "--store", f"files:{tmp_path / 'a-file'}")
    assert made.returncode == 1 and not made.stdout
    last = made.stderr.strip().splitlines()[-1]
    assert last == "contextsvc: the token store is unavailable: the token store cannot be written; try again later"
    assert "Traceback" not in made.stderr
