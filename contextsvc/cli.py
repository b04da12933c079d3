"""The ``contextsvc`` command."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
from typing import Any

from pydantic import ValidationError

from contextsvc import __version__
from contextsvc.cli_tokens import add_tokens_parser, run_tokens
from contextsvc.config import Settings, ignored_environment_names, load_settings, redacted_url
from contextsvc.logs import setup_logging

DESCRIPTION = """\
contextsvc owns an agent's conversation context: append turns, ask BuildContext for the exact
messages to send to the model, report real prompt token counts back, and the service keeps the
context inside the model's window. Every setting can also be given as CONTEXTSVC_<NAME>, a nested
one as CONTEXTSVC_<SECTION>__<NAME> (e.g. CONTEXTSVC_LIMITS__MAX_PAGE_SIZE); a TOML file as
--config FILE or CONTEXTSVC_CONFIG.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contextsvc", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"contextsvc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the gRPC service",
        description="Run the gRPC service (ContextService, health, reflection) until SIGTERM/SIGINT.",
    )
    serve.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="address to listen on (default 127.0.0.1:50051; env CONTEXTSVC_LISTEN; port 0 picks a free one)",
    )
    serve.add_argument(
        "--store",
        metavar="URL",
        help="memory | files:PATH | postgres://... (default files:./.contextsvc; env CONTEXTSVC_STORE)",
    )
    serve.add_argument(
        "--config", metavar="FILE", help="TOML file with settings and [profiles.NAME] tables (env CONTEXTSVC_CONFIG)"
    )
    serve.add_argument(
        "--durability",
        choices=["fsync", "batch"],
        help="files store: fsync every append (default) or batch fsyncs within --fsync-batch-ms",
    )
    serve.add_argument("--fsync-batch-ms", type=int, metavar="MS", help="bound of a batched fsync (default 50)")
    serve.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO (default), WARNING, ERROR")
    _add_transport_flags(serve)
    fsck = commands.add_parser(
        "fsck",
        help="check the files store's session logs; --repair rebuilds what can be rebuilt",
        description=(
            "Check every session log of the files store (record checksums, sequence numbers, headers) and "
            "report each damaged session. With --repair: rewrite recovered logs without their bad lines, "
            "rebuild lost headers and make damaged sessions writable again (lost sequence numbers stay "
            "taken). Originals are kept aside. Takes the data directory's lock: stop the server first. "
            "Exit status: 0 when every session is fine (or was repaired), 1 when damage remains."
        ),
    )
    fsck.add_argument("--store", metavar="URL", help="files:PATH (default files:./.contextsvc; env CONTEXTSVC_STORE)")
    fsck.add_argument("--config", metavar="FILE", help="TOML settings file")
    fsck.add_argument("--repair", action="store_true", help="rewrite and rebuild what can be rebuilt")
    maintain = commands.add_parser(
        "maintain",
        help="run store maintenance once (prune idle sessions, cap their number, disk budget)",
        description=(
            "Run store maintenance once over the files store, by the [maintenance] settings: remove sessions "
            "idle past prune_after_days, the longest idle past max_sessions, and down to the high-water mark "
            "when over disk_budget_mb; never a pinned session. Prints each removal and why. In mode 'warn' "
            "(the default) nothing is removed unless --enforce is given. Takes the data directory's lock: "
            "stop the server first (serve runs it every interval_seconds by itself)."
        ),
    )
    maintain.add_argument(
        "--store", metavar="URL", help="files:PATH (default files:./.contextsvc; env CONTEXTSVC_STORE)"
    )
    maintain.add_argument("--config", metavar="FILE", help="TOML settings file")
    maintain.add_argument("--dry-run", action="store_true", help="only print what would be removed and why")
    maintain.add_argument("--enforce", action="store_true", help="remove even when maintenance.mode is 'warn'")
    serve.add_argument(
        "--gateway",
        metavar="HOST:PORT",
        help="also serve the WebSocket gateway and inspector page here, in-process (env CONTEXTSVC_GATEWAY__LISTEN)",
    )
    gateway = commands.add_parser(
        "gateway",
        help="run the WebSocket gateway and inspector page alone",
        description="Run the WebSocket gateway for browsers (and the inspector page); it calls the service over gRPC.",
    )
    gateway.add_argument("--listen", metavar="HOST:PORT", help="address of the gateway (default 127.0.0.1:8080)")
    gateway.add_argument("--target", metavar="HOST:PORT", help="the service to call (default 127.0.0.1:50051)")
    gateway.add_argument("--target-tls", action="store_true", default=None, help="call the service over TLS")
    gateway.add_argument("--target-ca", metavar="FILE", help="PEM CA bundle trusted for the service's certificate")
    gateway.add_argument(
        "--target-server-name", metavar="NAME", help="name in the service's certificate (if not the host)"
    )
    gateway.add_argument("--target-client-cert", metavar="FILE", help="client certificate for a mutual-TLS service")
    gateway.add_argument("--target-client-key", metavar="FILE", help="private key of --target-client-cert")
    gateway.add_argument(
        "--tls-cert", dest="gateway_tls_cert", metavar="FILE", help="PEM certificate chain: serve https:// and wss://"
    )
    gateway.add_argument("--tls-key", dest="gateway_tls_key", metavar="FILE", help="PEM private key of --tls-cert")
    gateway.add_argument("--config", metavar="FILE", help="TOML file with settings (the [gateway] table)")
    gateway.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO (default), WARNING, ERROR")
    gateway.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help=(
            "allow a gateway beyond loopback in front of a service that lets anonymous callers in (or that "
            "cannot be asked), or without --tls-cert/--tls-key in front of one that wants tokens"
        ),
    )
    commands.add_parser(
        "config", help="print the effective settings as JSON", description="Print the effective settings as JSON."
    ).add_argument("--config", metavar="FILE", help="TOML settings file")
    add_tokens_parser(commands)
    return parser


def _add_transport_flags(serve: argparse.ArgumentParser) -> None:
    """TLS, mutual TLS, authentication mode and --insecure (DESIGN §5.10; README "Running it on a network")."""
    serve.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve TLS (env CONTEXTSVC_TLS_CERT)")
    serve.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert (env CONTEXTSVC_TLS_KEY)")
    serve.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="PEM CA bundle: require client certificates signed by it, mutual TLS (env CONTEXTSVC_TLS_CLIENT_CA)",
    )
    serve.add_argument(
        "--auth",
        choices=["auto", "tokens", "none"],
        help="API tokens: auto (default) = required unless listening on loopback; tokens = always; none = never",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow listening beyond loopback without TLS or without authentication",
    )


def main(argv: list[str] | None = None) -> int:
    if not _serves(argv):
        gc.enable()  # paused by the entry point (``_launch``) only for a server's start
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    gateway_flags = {
        k: v
        for k, v in {
            "listen": getattr(args, "gateway", None) if args.command == "serve" else getattr(args, "listen", None),
            "target": getattr(args, "target", None),
            "target_tls": getattr(args, "target_tls", None),
            "target_ca": getattr(args, "target_ca", None),
            "target_server_name": getattr(args, "target_server_name", None),
            "target_client_cert": getattr(args, "target_client_cert", None),
            "target_client_key": getattr(args, "target_client_key", None),
            "tls_cert": getattr(args, "gateway_tls_cert", None),
            "tls_key": getattr(args, "gateway_tls_key", None),
        }.items()
        if v is not None and args.command in ("serve", "gateway")
    }
    try:
        settings = load_settings(
            args.config,
            listen=getattr(args, "listen", None) if args.command != "gateway" else None,
            store=getattr(args, "store", None),
            durability=getattr(args, "durability", None),
            fsync_batch_ms=getattr(args, "fsync_batch_ms", None),
            log_level=getattr(args, "log_level", None),
            tls_cert=getattr(args, "tls_cert", None),
            tls_key=getattr(args, "tls_key", None),
            tls_client_ca=getattr(args, "tls_client_ca", None),
            insecure=getattr(args, "insecure", None),
            **_auth_override(getattr(args, "auth", None)),
            # Merged into the [gateway] table and validated with the rest: a bad value is named
            # ``gateway.listen``, not ``listen`` (the server's own --listen).
            gateway=gateway_flags or None,
        )
    except ValueError as exc:  # pydantic's ValidationError included
        print(f"contextsvc: invalid settings: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(_shown(settings.model_dump(mode="json")), indent=2))
        for name in ignored_environment_names(Settings):
            # Ignored by every command (other programs may share the prefix): said here, where an
            # operator looks to see what serve will use.
            print(f"contextsvc: note: {name} names no setting and is ignored", file=sys.stderr)
        return 0
    if args.command == "fsck":
        from contextsvc.store_tools import run_fsck

        return run_fsck(settings, repair=args.repair)
    if args.command == "maintain":
        from contextsvc.store_tools import run_maintain

        setup_logging("ERROR")  # the report is the output; warnings would repeat it
        # ... but a removal's audit line (logger contextsvc.audit) is the trail of a deletion.
        logging.getLogger("contextsvc.audit").setLevel(logging.INFO)
        return run_maintain(settings, dry_run=args.dry_run, enforce=args.enforce)
    setup_logging(settings.log_level)
    if args.command == "tokens":
        return run_tokens(args, settings)
    if args.command == "serve":
        # The server's own listen address and TLS pair: not a standalone gateway's business (the
        # image sets CONTEXTSVC_LISTEN=0.0.0.0:50051, and a gateway run from it was refused for
        # the server's address; the gateway checks its own settings as it starts).
        try:
            _check_transport(settings)
        except ValueError as exc:
            print(f"contextsvc: {exc}", file=sys.stderr)
            return 2
    from contextsvc.startup import StartupError
    from contextsvc.transport import TransportError

    try:
        asyncio.run(_gateway(settings) if args.command == "gateway" else _serve(settings))
    except TransportError as exc:
        # TLS files that do not load, an exposure the settings do not allow: a configuration
        # error like any refused setting (exit 2), whether found by serve, its bundled gateway or
        # a standalone gateway.
        print(f"contextsvc: {exc}", file=sys.stderr)
        return 2
    except (OSError, StartupError) as exc:
        print(f"contextsvc: {exc}", file=sys.stderr)
        return 1
    return 0


#: settings holding a URL, which may carry a password (``store``, ``auth.token_store``, ``*_url``).
_URL_SETTINGS = ("store", "token_store")


def _shown(values: dict[str, Any]) -> dict[str, Any]:
    """Settings as ``contextsvc config`` prints them: every URL setting without its password."""
    shown: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, dict):
            value = _shown(value)
        elif isinstance(value, str) and (name in _URL_SETTINGS or name.endswith("_url")):
            value = redacted_url(value)
        shown[name] = value
    return shown


def _one_line(exc: ValueError) -> str:
    """A refused setting as one line: each bad field's path and what is wrong with it (pydantic's
    own text spans lines and repeats the input, which may be long)."""
    if not isinstance(exc, ValidationError):
        return " ".join(str(exc).split())
    return "; ".join(_field_error(error["loc"], error["msg"]) for error in exc.errors())


def _field_error(loc: tuple[int | str, ...], message: str) -> str:
    where = ".".join(str(part) for part in loc)
    what = message.removeprefix("Value error, ")
    return f"{where}: {what}" if where else what


def _auth_override(mode: str | None) -> dict[str, object]:
    # --auth sets one field of the nested auth settings; the rest keep their file/env values.
    return {"auth": {"mode": mode}} if mode is not None else {}


def _check_transport(settings: Settings) -> None:
    """Refuse, in one line, to expose the service beyond loopback unprotected (and unreadable
    certificates), before anything is opened."""
    from contextsvc.transport import CertificateReloader, check_transport

    if check_transport(settings).tls:
        CertificateReloader(settings.tls_cert, settings.tls_key, settings.tls_client_ca)


def _serves(argv: list[str] | None) -> bool:
    """Whether this command line runs the server (the first word that is not an option)."""
    words = sys.argv[1:] if argv is None else argv
    return next((w for w in words if not w.startswith("-")), None) == "serve"


async def _serve(settings: Settings) -> None:
    # Imported here so that `contextsvc --help` does not load grpc.
    from contextsvc.server import serve

    await serve(settings)


async def _gateway(settings: Settings) -> None:
    from contextsvc.gateway import run

    await run(settings)


if __name__ == "__main__":
    raise SystemExit(main())
