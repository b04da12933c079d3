"""The ``contextsvc`` command's entry point (console script and ``python -m contextsvc``).

It pauses the cyclic garbage collector before anything else is imported: a start imports a few
hundred modules and builds the settings classes, which makes many long-lived objects and almost no
garbage, so the collections their allocations trigger are ~10 % of a start's CPU for nothing
(issue #9). ``serve`` turns the collector back on once it is listening, after freezing what the
start made (``server.serve``); every other command turns it on before doing its work
(``cli.main``).
"""

from __future__ import annotations

import gc


def main() -> int:
    gc.disable()
    from contextsvc.cli import main as run

    return run()
