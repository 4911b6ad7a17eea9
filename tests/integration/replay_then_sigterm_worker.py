"""One rank of ``torchrun ... replay_then_sigterm_worker.py ARGS``: ``nanhunt ARGS``, then, on rank 0 only, the
SIGTERM torchrun sends a rank that is still running when another rank has exited non-zero.

On a loaded machine that happens now and then: rank 1 exits with the agreed code while rank 0 is still tearing
down (its process group, its interpreter), torchrun's poll sees rank 1's non-zero code and stops rank 0. Here it
happens every time, at the latest moment, once ``main`` has returned: the code every rank agreed on must still be
rank 0's exit code.
"""

from __future__ import annotations

import os
import signal
import sys

from nanhunt.cli import main

code = main(sys.argv[1:])
if os.environ.get("RANK") == "0":
    os.kill(os.getpid(), signal.SIGTERM)
sys.exit(code)
