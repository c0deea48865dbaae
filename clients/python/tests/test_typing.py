"""The package and its example type-check under mypy --strict (the package ships py.typed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]


def test_mypy_strict() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e './clients/python[test]')")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", "/dev/null", "src", "examples"],
        cwd=HERE,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
