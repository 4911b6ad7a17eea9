"""A capture directory of one rank written in this process, laid out as the Guard writes one under DDP:
``manifest.json``, ``state/`` (a ``torch.distributed.checkpoint`` saved without a process group) and
``batch-rank0.pt``. The model is ``torch.nn:Linear``, which a replay builds with no confirmation."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanhunt.capture.capture import capture_record


def one_rank_capture(path: Path) -> Path:
    """Write the capture directory ``path`` (a new directory) and return it."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    fields, batch = capture_record(model=model, batch=(torch.randn(3, 4), torch.randn(3, 2)), loss_fn=F.mse_loss,
                                   model_factory="torch.nn:Linear", model_kwargs={"in_features": 4, "out_features": 2},
                                   model_state={}, dtype=torch.bfloat16)
    for key in ("model", "optimizer", "optimizer_params"):  # the tensors are in the shards
        fields.pop(key)
    path.mkdir()
    with warnings.catch_warnings():  # saving with no process group is what this helper means to do
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(path / "state"))
    torch.save(batch, path / "batch-rank0.pt")
    manifest = {"nanhunt_capture_dir": 1, "world_size": 1, "wrapper": "ddp", "ranks_seen": [0], "step": 0, **fields}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def read_metadata(path: Path) -> Any:
    """The DCP metadata of the capture ``path`` (written by this process: trusted here)."""
    return pickle.loads((path / "state" / ".metadata").read_bytes())


def write_metadata(path: Path, meta: Any) -> None:
    (path / "state" / ".metadata").write_bytes(pickle.dumps(meta))
