"""tests/integration: nothing may be downloaded; transformers and Lightning stay quiet about the tiny runs."""

from __future__ import annotations

import os

# Set before any test module imports transformers / huggingface_hub: they read it at import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
