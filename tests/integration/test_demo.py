"""``./scripts/demo``, the first command README gives a newcomer: it replays the bundled capture, with the rule
a user meets (no trusted names, no PYTHONPATH in its environment), names the culprit, and prints a command that
does the same when pasted into a fresh shell."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _user_env() -> dict[str, str]:
    """The environment of a user's fresh shell: nothing nanhunt's tests or scripts/demo.py's caller set."""
    return {k: v for k, v in os.environ.items() if k not in ("NANHUNT_TRUST_NAMES", "PYTHONPATH")}


def _demo() -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], env=_user_env(), capture_output=True,
                          text=True, timeout=300)


def test_the_demo_names_the_bundled_overflow() -> None:
    done = _demo()
    assert done.returncode == 0, done.stderr[-2000:]
    first = done.stdout.splitlines()[1]
    assert first.startswith("Inf born in phase forward, in blocks.1.ff.wo (Linear, call 0) at aten::addmm"), first


def test_the_command_the_demo_prints_runs_as_printed(tmp_path: Path) -> None:
    # GIVEN the command line the demo prints first ("$ " and the command)
    printed = _demo().stdout.splitlines()[0]
    assert printed.startswith("$ "), printed
    # WHEN it is pasted into a fresh shell (no PYTHONPATH) in the directory the demo says
    done = subprocess.run(["bash", "-c", printed[2:]], env=_user_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    # THEN it finds the non-finite value (exit 1) and names the culprit the demo names
    assert done.returncode == 1, (shlex.split(printed[2:]), done.stderr[-2000:])
    first = done.stdout.splitlines()[0]
    assert first.startswith("Inf born in phase forward, in blocks.1.ff.wo (Linear, call 0) at aten::addmm"), first
