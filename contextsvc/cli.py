"""The ``contextsvc`` command."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pydantic import ValidationError

from contextsvc import __version__
from contextsvc.config import Settings, load_settings
from contextsvc.logs import setup_logging

DESCRIPTION = """\
contextsvc owns an agent's conversation context: append turns, ask BuildContext for the exact
messages to send to the model, report real prompt token counts back, and the service keeps the
context inside the model's window. Every setting can also be given as CONTEXTSVC_<NAME>.
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
    serve.add_argument("--config", metavar="FILE", help="TOML file with settings and [profiles.NAME] tables")
    serve.add_argument(
        "--durability",
        choices=["fsync", "batch"],
        help="files store: fsync every append (default) or batch fsyncs within --fsync-batch-ms",
    )
    serve.add_argument("--fsync-batch-ms", type=int, metavar="MS", help="bound of a batched fsync (default 50)")
    serve.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO (default), WARNING, ERROR")
    commands.add_parser(
        "config", help="print the effective settings as JSON", description="Print the effective settings as JSON."
    ).add_argument("--config", metavar="FILE", help="TOML settings file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        settings = load_settings(
            args.config,
            listen=getattr(args, "listen", None),
            store=getattr(args, "store", None),
            durability=getattr(args, "durability", None),
            fsync_batch_ms=getattr(args, "fsync_batch_ms", None),
            log_level=getattr(args, "log_level", None),
        )
    except (ValidationError, ValueError) as exc:
        print(f"contextsvc: invalid settings: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(settings.model_dump_json(indent=2))
        return 0
    setup_logging(settings.log_level)
    from contextsvc.startup import StartupError

    try:
        asyncio.run(_serve(settings))
    except (OSError, StartupError) as exc:
        print(f"contextsvc: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(settings: Settings) -> None:
    # Imported here so that `contextsvc --help` does not load grpc.
    from contextsvc.server import serve

    await serve(settings)


if __name__ == "__main__":
    raise SystemExit(main())
