"""tests/integration: nothing may be downloaded; transformers and Lightning stay quiet about the tiny runs.
Shared fixture: ``nan_filled_uninitialised_memory``."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Set before any test module imports transformers / huggingface_hub: they read it at import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture
def nan_filled_uninitialised_memory() -> Iterator[None]:
    """Deterministic mode fills uninitialised memory with NaN (the project's own tests use it)."""
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill  # type: ignore[attr-defined]
