"""The Guard's detection part on its own: on-device flags, one read, every rank's bits (CPU, one process)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nanhunt.guard._guard_flags import GRADS, LOSS, PARAMS, SKIP, Detector, any_set, nonfinite, seen


def _detector() -> tuple[nn.Linear, Detector]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)  # the bias is not updated by this optimizer
    return model, Detector(opt)


def test_outside_torch_distributed_there_is_one_rank() -> None:
    _, det = _detector()
    assert (det.rank, det.world, det.device) == (None, 1, torch.device("cpu"))


@pytest.mark.parametrize(("value", "flagged"), [(1.0, False), (6e4, False), (math.nan, True), (math.inf, True)])
def test_loss_flag(value: float, flagged: bool) -> None:
    _, det = _detector()
    flag = det.loss_flag(torch.full((4,), value, dtype=torch.float16))
    assert flag is not None and flag.dim() == 0
    (bits,), _ = det.read([flag, None, None, None], [])
    assert bits == (LOSS if flagged else 0)
    assert det.loss_flag(None) is None


def test_one_read_gives_each_flag_its_bit_and_the_extra_values() -> None:
    _, det = _detector()
    bad, good = torch.tensor(math.nan), torch.tensor(0.0)
    per_rank, values = det.read([good, bad, None, torch.tensor(True)], [torch.tensor(1024.0), torch.tensor(7)])
    assert per_rank == [GRADS | SKIP] and values == [1024.0, 7.0]
    assert det.own(per_rank) == GRADS | SKIP


def test_params_and_weights_flags() -> None:
    model, det = _detector()
    with torch.no_grad():
        model.bias[0] = math.inf  # not a parameter the optimizer updates
    assert det.read([None, None, det.params_flag(), None], [])[0] == [0]
    assert det.read([None, None, det.weights_flag(model), None], [])[0] == [PARAMS]


def test_grads_flag_without_a_scaler() -> None:
    model, det = _detector()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    assert float(det.grads_flag(opt, None)) == 0
    assert model.weight.grad is not None
    model.weight.grad[0, 0] = -math.inf
    assert float(det.grads_flag(opt, None)) != 0


def test_nonfinite_leaves_the_values_as_they_were() -> None:
    ts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, math.nan])]
    before = [t.clone() for t in ts]
    assert float(nonfinite(ts, torch.device("cpu"))) != 0
    torch.testing.assert_close(ts, before, rtol=0, atol=0, equal_nan=True)
    assert float(nonfinite(ts[:1], torch.device("cpu"))) == 0
    assert float(nonfinite([], torch.device("cpu"))) == 0


def test_any_set_and_seen() -> None:
    per_rank = [0, LOSS, LOSS | GRADS, SKIP]
    assert any_set(per_rank) == LOSS | GRADS | SKIP
    assert seen(per_rank, LOSS) == (1, 2) and seen(per_rank, PARAMS) == ()
