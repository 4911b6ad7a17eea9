"""./scripts/demo: replay the bundled overflow capture and print where its Inf was born."""

from __future__ import annotations

import os
import shlex
import sys

from nanhunt.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
fixture = os.path.join("fixtures", "overflow")
# The capture names its model and loss in fixtures.models, this repository's code: confirmed by name, as a user
# confirms their own (a name given on the command line is found in the current directory, the repository root).
argv = ["replay", os.path.join(fixture, "checkpoint.pt"), os.path.join(fixture, "batch.pt"),
        "--model", "fixtures.models:TinyTransformer", "--loss", "fixtures.models:LMLoss", *sys.argv[1:]]
# The command as a fresh shell runs it from anywhere: the nanhunt installed beside this Python, in the root.
nanhunt = os.path.join(os.path.dirname(sys.executable), "nanhunt")
if not os.path.exists(nanhunt):
    nanhunt = f"{sys.executable} -m nanhunt"
elif os.path.commonpath([ROOT, nanhunt]) == ROOT:
    nanhunt = os.path.relpath(nanhunt, ROOT)
print(f"$ cd {shlex.quote(ROOT)} && {nanhunt} " + shlex.join(argv), flush=True)
code = main(argv)
# Exit code 1 means "a non-finite value was found": what this fixture is for.
sys.exit(0 if code == 1 else (code or 1))
