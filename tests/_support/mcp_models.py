"""A model for the MCP server's tests (``nanhunt mcp``): the Guard records it by this module's name, so a replay
needs it confirmed. It leaves a mark where ``NANHUNT_TEST_MARKS`` says when this module is imported and when the
model is built (a refused replay must do neither), and it prints from forward, as a model being debugged does,
on sys.stdout and on file descriptor 1 (a server's stdout carries the protocol alone)."""

from __future__ import annotations

import os

import torch

from fixtures.models import MLP

NOISE = "forward of MarkedMLP"


def _mark(what: str) -> None:
    path = os.environ.get("NANHUNT_TEST_MARKS")
    if path:
        with open(path, "a") as f:
            f.write(what + "\n")


_mark("imported")


class MarkedMLP(MLP):
    def __init__(self, d_in: int = 16) -> None:
        super().__init__(d_in=d_in)
        _mark("built")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print(NOISE)
        os.write(1, f"{NOISE} (fd 1)\n".encode())
        return super().forward(x)
