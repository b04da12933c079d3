"""``contextsvc tokens create|list|revoke``: API tokens for the service (DESIGN §5.10).

``create`` prints the token on stdout, alone on its line, once (``TOKEN=$(contextsvc tokens create
--user alice)``); everything else goes to stderr. Tokens are kept in the store the server uses
(``--store``/``CONTEXTSVC_STORE``) or in ``auth.token_store`` when that is set. Creating and revoking
write an audit line (logger ``contextsvc.audit``) that names the token by its id, never its value.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from contextsvc.config import Settings
from contextsvc.core.credentials import ApiToken, check_user, hash_token, issue, looks_like_token, parse_expiry

audit = logging.getLogger("contextsvc.audit")


def add_tokens_parser(commands: Any) -> None:
    """Register ``tokens`` and its subcommands on the main parser's subparsers."""
    tokens = commands.add_parser(
        "tokens",
        help="create, list and revoke API tokens",
        description="Manage API tokens. The server checks them when authentication is on "
        "(always beyond loopback). Only a hash of each token is stored.",
    )
    actions = tokens.add_subparsers(dest="tokens_command", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create a token and print it once")
    create.add_argument("--user", required=True, help="the user the token acts as (owner of what it creates)")
    create.add_argument("--admin", action="store_true", help="an admin token: sees every user's sessions")
    create.add_argument(
        "--expires", metavar="DURATION", help="12h, 90d, 4w or never (default: auth.default_expiry_days)"
    )
    create.add_argument("--note", default="", help="a free-text note shown by `tokens list`")
    listing = actions.add_parser("list", help="list tokens (ids, users, state; never the tokens themselves)")
    listing.add_argument("--json", action="store_true", help="one JSON object per token")
    revoke = actions.add_parser("revoke", help="revoke a token by its id (or by the token itself)")
    revoke.add_argument("token", metavar="ID_OR_TOKEN")
    for sub in (create, listing, revoke):
        sub.add_argument("--store", metavar="URL", help="the server's store (default from settings)")
        sub.add_argument("--config", metavar="FILE", help="TOML settings file")


def run_tokens(args: argparse.Namespace, settings: Settings) -> int:
    try:
        return asyncio.run(_run(args, settings))
    except ValueError as exc:
        print(f"contextsvc: {exc}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    # Imported here: the PostgreSQL driver loads only when a command needs it.
    from contextsvc.errors import ContextError
    from contextsvc.stores.token_access import token_store_at

    url = settings.auth.token_store or settings.store
    try:
        async with token_store_at(url, settings) as tokens:
            folder = getattr(tokens, "root", None)
            if args.tokens_command != "create" and isinstance(folder, Path) and not folder.is_dir():
                # A mistyped path read as an empty store would say there are no tokens to revoke.
                print(f"contextsvc tokens {args.tokens_command}: no data directory at {folder}", file=sys.stderr)
                return 1
            now = datetime.now(UTC)
            if args.tokens_command == "create":
                return await _create(args, settings, tokens, now)
            if args.tokens_command == "list":
                return _list(await tokens.list_api_tokens(), now, as_json=args.json)
            return await _revoke(args.token, tokens, now)
    except ContextError as exc:
        print(f"contextsvc: the token store is unavailable: {exc.message}", file=sys.stderr)
        return 1


async def _create(args: argparse.Namespace, settings: Settings, tokens: Any, now: datetime) -> int:
    user = check_user(args.user)
    if args.expires is not None:
        expires = parse_expiry(args.expires, now)
    elif settings.auth.default_expiry_days:
        expires = now + timedelta(days=settings.auth.default_expiry_days)
    else:
        expires = None
    issued = issue(user=user, is_admin=args.admin, now=now, expire_time=expires, note=args.note)
    await tokens.add_api_token(issued.record)
    audit.info("api token created", extra=_audit_fields(issued.record))
    print(issued.secret, flush=True)
    kind = "admin token" if args.admin else "token"
    until = f"expires {_show(expires)}" if expires else "never expires"
    print(
        f"created {kind} {issued.record.token_id} for user {user} ({until}); it is shown only this once",
        file=sys.stderr,
    )
    return 0


def _list(records: list[ApiToken], now: datetime, *, as_json: bool) -> int:
    if as_json:
        for t in records:
            fields = {k: v for k, v in _audit_fields(t).items() if k != "audit"}
            print(json.dumps({**fields, "state": t.state(now).value, "note": t.note}))
        return 0
    header = ("ID", "USER", "ADMIN", "STATE", "CREATED", "LAST USED", "EXPIRES", "NOTE")
    rows = [
        (
            t.token_id,
            t.user_id,
            "yes" if t.is_admin else "no",
            t.state(now).value,
            _show(t.create_time),
            _show(t.last_used_time),
            _show(t.expire_time),
            t.note,
        )
        for t in records
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


async def _revoke(which: str, tokens: Any, now: datetime) -> int:
    token_id = which
    if looks_like_token(which):
        found = await tokens.find_api_token(hash_token(which))
        token_id = found.token_id if found is not None else ""
    revoked = await tokens.revoke_api_token(token_id, now) if token_id else None
    if revoked is None:
        print("contextsvc: no such token (see `contextsvc tokens list`)", file=sys.stderr)
        return 1
    if revoked.revoke_time is not None and revoked.revoke_time != now:
        # Revoked before (the store keeps the first revocation): nothing changed, so no audit line
        # claiming a revocation now, and the message says when it happened.
        print(
            f"token {revoked.token_id} of user {revoked.user_id} was already revoked at {_show(revoked.revoke_time)}",
            file=sys.stderr,
        )
        return 0
    audit.info("api token revoked", extra=_audit_fields(revoked))
    print(f"revoked token {revoked.token_id} of user {revoked.user_id}", file=sys.stderr)
    return 0


def _audit_fields(t: ApiToken) -> dict[str, Any]:
    return {
        "audit": True,
        "token_id": t.token_id,
        "user": t.user_id,
        "admin": t.is_admin,
        "create_time": _show(t.create_time),
        "expire_time": _show(t.expire_time),
        "last_used_time": _show(t.last_used_time),
        "revoke_time": _show(t.revoke_time),
    }


def _show(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if value is not None else "-"
