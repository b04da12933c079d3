"""The entry point pauses the cyclic collector for a server's start only (issue #9, start-up time).

``contextsvc._launch`` turns the collector off before anything is imported; ``serve`` turns it on
again once it is listening (asserted on a started server by ``test_startup_imports.py``), and every
other command turns it on before doing its work.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from contextsvc import cli

ROOT = Path(__file__).resolve().parents[2]


def test_commands_other_than_serve_run_with_the_collector_on(capsys: pytest.CaptureFixture[str]) -> None:
    gc.disable()  # as the entry point does
    try:
        assert cli.main(["config"]) == 0
        assert gc.isenabled()
    finally:
        gc.enable()
    assert '"store"' in capsys.readouterr().out


def test_only_serve_keeps_the_collector_paused() -> None:
    assert cli._serves(["serve", "--listen", "127.0.0.1:0"])
    assert cli._serves(["--version"]) is False
    assert cli._serves(["fsck", "--repair"]) is False
    assert cli._serves(["config"]) is False
    assert cli._serves([]) is False


def test_the_command_and_python_dash_m_start_at_the_entry_point() -> None:
    # The installed console script and ``python -m contextsvc`` both go through ``_launch.main``.
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "contextsvc"]
    assert script.value == "contextsvc._launch:main"
    assert "from contextsvc._launch import main" in (ROOT / "contextsvc" / "__main__.py").read_text()
    done = subprocess.run(
        [sys.executable, "-m", "contextsvc", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("contextsvc ")


def _plugins_setting(env: dict[str, str]) -> str:
    probe = "import os, contextsvc._launch as l, contextsvc.cli as c; c.main = lambda: 0; l.main(); "
    probe += "print(repr(os.environ.get('PYDANTIC_DISABLE_PLUGINS')))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_entry_point_skips_the_pydantic_plugin_search_unless_told_otherwise() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    assert _plugins_setting(env) == "'__all__'"
    assert _plugins_setting({**env, "PYDANTIC_DISABLE_PLUGINS": ""}) == "''"  # an operator's choice stands
