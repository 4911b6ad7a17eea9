"""A step's inputs: the batch split into inputs and targets, and the RNG state (torch, CUDA, Python, numpy)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._util._errors import InputError


def rng_state(*, python_numpy: bool = False) -> dict[str, Any]:
    """torch's (and CUDA's) generator state; with ``python_numpy``, also Python's ``random`` and NumPy's
    global generator (in-memory snapshots only: capture files hold torch's, and load with weights_only)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    # initialised first: it implies available, and is_available() costs microseconds a call (every guarded step)
    if torch.cuda.is_initialized() and torch.cuda.is_available():  # type: ignore[no-untyped-call]  # untyped in torch
        state["cuda"] = torch.cuda.get_rng_state_all()
    if python_numpy:
        state["python"] = random.getstate()
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Set the generators ``state`` holds; the others (keys it lacks, as in older files) stay as they are."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = list(state["cuda"])
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` from the batch shapes users have."""
    if isinstance(batch, Mapping):
        if "nanhunt_batch" in batch:
            return batch.get("inputs"), batch.get("targets")
        if "inputs" in batch:
            return batch["inputs"], batch.get("targets")
        return dict(batch), None  # keyword arguments of the model (HF style)
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) == 1:
            return batch[0], None
        raise InputError(f"the batch is a sequence of {len(batch)} items; expected (inputs, targets)")
    if isinstance(batch, torch.Tensor):
        return batch, None
    raise InputError(f"the batch is a {type(batch).__name__}; expected a tensor, (inputs, targets) or a dict")
