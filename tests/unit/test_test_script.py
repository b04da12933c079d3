"""``scripts/test.sh``, the project's one test command: ``--help`` only prints what it does."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test.sh"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_touches_nothing(tmp_path: Path, flag: str) -> None:
    # A copy beside nothing else, and a python3 that only leaves a mark: were the script to go on
    # past its usage, its first step (pip install) would leave the mark and the next one fail.
    (tmp_path / "scripts").mkdir()
    copy = tmp_path / "scripts" / "test.sh"
    shutil.copy(SCRIPT, copy)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    mark = tmp_path / "ran"
    stub = stubs / "python3"
    stub.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    stub.chmod(0o755)
    done = subprocess.run(
        ["bash", str(copy), flag],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: scripts/test.sh [PYTEST-ARGS...]")
    for promise in ("installs", "PostgreSQL", "pytest"):
        assert promise in done.stdout
    assert not mark.exists()
