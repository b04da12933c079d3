"""The ``contextsvc`` command's entry point (console script and ``python -m contextsvc``).

It pauses the cyclic garbage collector before anything else is imported: a start imports a few
hundred modules and builds the settings classes, which makes many long-lived objects and almost no
garbage, so the collections their allocations trigger are ~10 % of a start's CPU for nothing
(issue #9). ``serve`` turns the collector back on once it is listening, after freezing what the
start made (``server.serve``); every other command turns it on before doing its work
(``cli.main``). It also tells pydantic not to look for plugins (the service has none) unless the
environment says otherwise.
"""

from __future__ import annotations

import gc
import os
import sys


def main() -> int:
    gc.disable()
    # The service uses no pydantic plugin, and looking for them reads the metadata of every
    # installed package at the first model built (~20 ms of a start). An operator who runs one
    # sets the variable (to empty, or to the names to leave out) and it is looked for again.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    # Our logs are JSON lines on stderr. gRPC's C core writes lines of its own format there, among
    # them one per failed TLS handshake (INFO: a plaintext client, a port scanner or a balancer's
    # TCP check can add them without end). Its errors only, unless the operator asks for more
    # (GRPC_VERBOSITY=info or debug); read by the core when grpc is first imported, below.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        from contextsvc.cli import main as run  # inside: a Ctrl-C may come while it loads

        return run()
    except KeyboardInterrupt:
        # Ctrl-C on a command (``tokens list`` waiting for a database, a start not yet listening;
        # a serving ``serve`` or ``gateway`` drains on SIGINT instead): no traceback, the shell's
        # status for an interrupted command.
        print("contextsvc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout left (``contextsvc config | head``): not an error worth a traceback.
        # Python's advice: point stdout at devnull so the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
