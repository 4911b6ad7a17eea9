"""The Guard's read of a step's loss: from the loss's own value where that tells exactly, on the CPU (one scalar
at a time) and as a device gathers it (one stacked read), the same bit as the loss's flag."""

from __future__ import annotations

import math

import pytest
import torch

from nanhunt.guard import _guard_flags
from nanhunt.guard._guard_flags import GRADS, LOSS, Detector, scaler_entry

VALUES = (1.0, -2.5, 65504.0, 1e30, math.nan, math.inf, -math.inf)


def _detector() -> Detector:
    return Detector(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))


@pytest.mark.parametrize("gathered", [False, True], ids=["cpu", "gathered"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_loss_bit_is_the_flags(monkeypatch: pytest.MonkeyPatch, gathered: bool, dtype: torch.dtype) -> None:
    if gathered:  # the read a GPU takes: every scalar stacked into one
        monkeypatch.setattr(_guard_flags, "free_read", lambda t: False)
    det = _detector()
    for value in (*VALUES, 1e300):
        loss = torch.tensor(value).to(dtype)  # 1e30 is Inf in float16; 1e300 Inf below float64
        # GIVEN what the loss's flag (0 * loss) says of it
        (want,), _ = det.read([det.loss_flag(loss), None, None, None], [])
        # WHEN the loss is handed to the read itself, with a gradient flag and a value beside it
        per_rank, values = det.read([None, torch.zeros(()), None, None], [torch.tensor(7.0)], loss=loss)
        # THEN its bit is the flag's (a finite float64 1e300 too), and the values read are only those asked for
        assert per_rank == [want] and want == (0 if math.isfinite(float(loss)) else LOSS), (dtype, value)
        assert values == [7.0]


def test_a_loss_of_many_values_and_a_loss_also_asked_for_are_read_once() -> None:
    det = _detector()
    # GIVEN a loss of four values, one of them NaN: its flag decides
    per_rank, _ = det.read([None, torch.tensor(1.0), None, None], [], loss=torch.tensor([1.0, math.nan, 2.0, 3.0]))
    assert per_rank == [LOSS | GRADS]
    # AND a scalar loss the caller also reads: read once, its value where the caller put it
    loss = torch.tensor(3.5)
    per_rank, values = det.read([None, None, None, None], [torch.tensor(1.0), loss], loss=loss)
    assert per_rank == [0] and values == [1.0, 3.5]


def test_the_scalers_entry_is_numbers_on_the_cpu_and_copies_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    # GIVEN a GradScaler that has not made its scale yet: nothing to keep
    assert scaler_entry(scaler) == (None, None)
    scaler.scale(torch.ones(()))
    # THEN on the CPU its numbers, read as the step begins
    assert scaler_entry(scaler) == (1024.0, 0)
    # AND where a read would wait for a device, copies that later changes to the scaler leave as they were
    monkeypatch.setattr(_guard_flags, "free_read", lambda t: False)
    scale, tracker = scaler_entry(scaler)
    assert isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor)
    assert scaler._scale is not None
    scaler._scale.fill_(8.0)
    assert (float(scale), int(tracker)) == (1024.0, 0)
