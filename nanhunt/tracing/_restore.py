"""``trace(model, restore=True)``: what a step run inside the block changed, put back when it exits.

At a ``breakpoint()`` in a training loop, tracing the step by hand runs it: its dropout draws from the random
generators, its backward adds into every parameter's ``.grad``, and an optimizer step inside the block moves the
weights. Continuing the script then runs the script's own step from that state: another step than the one it was
about to run. With ``restore=True`` the block leaves the model as it found it: the generators (torch's CPU and
CUDA ones, Python's and NumPy's), each parameter's data and ``.grad``, and the buffers (BatchNorm's running
statistics). The optimizer and the GradScaler are the script's objects, not the model's: an ``optimizer.step()``
or ``scaler.update()`` run inside the block is not undone (say so where it matters; ``nanhunt.replay`` restores
those too).

The copies are taken on entry on the tensors' own devices (a model's worth of memory, for interactive use).
"""

from __future__ import annotations

import torch
from torch import nn

from .._util._rng import preserve_rng

__all__ = ["ModelState"]


class ModelState:
    """The model's parameters, gradients and buffers, and the random generators, as they were when made;
    :meth:`put_back` restores them in place (the same tensor objects the script and its optimizer hold)."""

    def __init__(self, model: nn.Module | None) -> None:
        self._rng = preserve_rng()
        self._rng.__enter__()
        with torch.no_grad():
            self._params = [] if model is None else [
                (p, p.detach().clone(), None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]
            self._buffers = [] if model is None else [(b, b.detach().clone()) for b in model.buffers()]

    def put_back(self) -> None:
        with torch.no_grad():
            for p, data, grad in self._params:
                p.copy_(data)
                if grad is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == grad.shape:
                    p.grad.copy_(grad)  # the same .grad tensor: an optimizer may hold it
                else:
                    p.grad = grad
            for b, data in self._buffers:
                b.copy_(data)
        self._params, self._buffers = [], []
        self._rng.__exit__(None, None, None)
