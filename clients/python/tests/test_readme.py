"""The README's example is examples/quickstart.py, and it runs against the gateway."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def test_readme_shows_the_example_file() -> None:
    readme = (HERE / "README.md").read_text()
    example = (HERE / "examples" / "quickstart.py").read_text()
    assert f"```python\n{example}```" in readme


def test_the_example_runs(live: tuple[str, str]) -> None:
    env = {**os.environ, "INTAKE_BASE_URL": live[0], "INTAKE_API_KEY": live[1]}
    runs = [
        subprocess.run([sys.executable, str(HERE / "examples" / "quickstart.py")], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    for run in runs:
        print(run.stdout, run.stderr)
        assert run.returncode == 0, run.stderr
    first, second = (run.stdout.splitlines() for run in runs)
    assert first[1] in ("created", "unchanged") and second[1] == "unchanged"
