"""``python -m nanhunt`` in a child process, with the child's own peak memory: what a hostile file makes the
command allocate (or whether it crashes) is measured there, not in the test's process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_nanhunt(argv: list[str], tmp_path: Path) -> tuple[int, str, int]:
    """Its exit code, stderr and peak resident memory in bytes."""
    with open(tmp_path / "child-stderr", "wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "nanhunt", *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=err, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            _, status, usage = os.wait4(p.pid, 0)  # this child's own peak, not the largest child's so far
        except BaseException:
            p.kill()
            raise
    return os.waitstatus_to_exitcode(status), (tmp_path / "child-stderr").read_text(errors="replace"), \
        usage.ru_maxrss * 1024
