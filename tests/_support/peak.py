"""``python -m nanhunt`` in a child process, with the child's own peak memory: what a hostile file makes the
command allocate (or whether it crashes) is measured there, not in the test's process.

The peak is the child's VmHWM (Linux): the high-water mark of its own memory since it exec'd Python. Not its
rusage: a child's ``ru_maxrss`` starts at the size of the process it was spawned from (the kernel carries the old
address space's high-water mark over exec), so once pytest itself grew past a bound, every child seemed to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# ``python -m nanhunt`` that writes its VmHWM (kB) to the file named first as it exits
_MEASURED = """import atexit, runpy, sys
peak_file = sys.argv.pop(1)
def peak():
    with open("/proc/self/status") as status, open(peak_file, "w") as out:
        out.write(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
atexit.register(peak)
sys.argv[0] = "nanhunt"
runpy.run_module("nanhunt", run_name="__main__", alter_sys=True)
"""


def own_peak_bytes() -> int:
    """This process's own peak resident memory since it exec'd (VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("VmHWM:"))) * 1024


def run_nanhunt(argv: list[str], tmp_path: Path) -> tuple[int, str, int]:
    """Its exit code, stderr and peak resident memory in bytes (see the module docstring)."""
    peak = tmp_path / "child-peak"
    p = subprocess.run([sys.executable, "-c", _MEASURED, str(peak), *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    return p.returncode, p.stderr.decode(errors="replace"), int(peak.read_text()) * 1024
