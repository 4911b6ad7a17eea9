"""./scripts/demo: replay the bundled overflow capture and print where its Inf was born."""

from __future__ import annotations

import os
import sys

from nanhunt.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
fixture = os.path.join("fixtures", "overflow")
# fixtures.models is this repository's code: trusted here, as a user trusts their own package
argv = ["replay", os.path.join(fixture, "checkpoint.pt"), os.path.join(fixture, "batch.pt"), "--trust-names", "fixtures",
        *sys.argv[1:]]
print("$ nanhunt " + " ".join(argv), flush=True)
code = main(argv)
# Exit code 1 means "a non-finite value was found": what this fixture is for.
sys.exit(0 if code == 1 else (code or 1))
