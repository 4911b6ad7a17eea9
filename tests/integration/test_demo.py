"""``./scripts/demo``, the first command README gives a newcomer: it replays the bundled capture, with the rule
a user meets (no trusted names in its environment), and names the culprit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def test_the_demo_names_the_bundled_overflow() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NANHUNT_TRUST_NAMES"}
    env["PYTHONPATH"] = str(ROOT)  # as scripts/demo sets it
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first = done.stdout.splitlines()[1]
    assert first.startswith("Inf born in phase forward, in blocks.1.ff.wo (Linear, call 0) at aten::addmm"), first
