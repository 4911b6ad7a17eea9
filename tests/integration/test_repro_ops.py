"""Standalone repros of unusual ops (tuple outputs, foreach updates, index_put, dtype keywords) verify."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.hunt.repro import INPUTS, SCRIPT, make_repro
from nanhunt.step.step import Step

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


# ================================================================== repro


def _sum_loss(out: torch.Tensor, y: Any = None) -> torch.Tensor:
    return out.float().sum()


class _VarMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(self.fc(x), dim=-1)  # correction=1 over one element: 0/0
        return var + mean


class _ConvGrad(nn.Module):
    """Finite forward; the weight gradient (1e30 * a sum of 1e10s) overflows in convolution_backward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 1, 3)
        with torch.no_grad():
            self.conv.weight.fill_(1e-30)
            self.conv.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * 1e30


class _Fc1000(nn.Module):
    """``fc`` with every weight 1000: outputs of 4000 * x, large enough to overflow float16 once summed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(1000.0)
            self.fc.bias.zero_()


class _IndexPut(_Fc1000):
    """float16 scatter-accumulate of many rows into one: aten::index_put_ with a list of integer indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).half()
        idx = torch.arange(h.shape[0]) % 2
        return torch.zeros(2, 4, dtype=torch.float16).index_put_((idx,), h, accumulate=True)


class _SumDtype(_Fc1000):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum(dim=0, dtype=torch.float16)  # a dtype keyword: float32 values summed into float16


def _repro(model: nn.Module, x: torch.Tensor, y: Any, loss_fn: Any, directory: Path, *,
           optimizer: torch.optim.Optimizer | None = None, cap: int = 1 << 20) -> tuple[Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # var_mean's degrees-of-freedom warning
        rep = nanhunt.replay(model, (x, y), loss_fn=loss_fn, dtype=torch.float32, optimizer=optimizer)
        assert rep.first is not None
        rp = make_repro(Step.of(model, (x, y), loss_fn=loss_fn, dtype=torch.float32, optimizer=optimizer), rep.first,
                        str(directory), cap_bytes=cap)
    assert rp is not None
    return rep.first, rp


@pytest.mark.subprocess
@pytest.mark.parametrize("case", ["var_mean", "convolution_backward"])
def test_repro_of_an_op_returning_a_tuple_is_verified(case: str, tmp_path: Path) -> None:
    # GIVEN an origin in an op with several outputs: var_mean's NaN in forward, or the weight gradient of a conv
    if case == "var_mean":
        model, x, op, phase, kind = _VarMean(), torch.ones(2, 1), "aten::var_mean", "forward", "nan"
    else:
        model, x, op, phase, kind = _ConvGrad(), torch.full((2, 1, 8), 1e10), "aten::convolution_backward", \
            "backward", "inf"
    first, rp = _repro(model, x, None, _sum_loss, tmp_path)
    assert (first.op, first.phase.value, first.kind) == (op, phase, kind)
    # THEN the op alone reproduces in a fresh process (it does in process: the inputs are right)
    assert rp.verified, rp.result
    assert rp.result == kind


@pytest.mark.subprocess
def test_repro_of_a_foreach_update_is_verified(tmp_path: Path) -> None:
    # GIVEN SGD(foreach=True) with a learning rate that takes finite gradients to Inf in the update
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e36, foreach=True)
    first, rp = _repro(model, torch.full((3, 4), 100.0), torch.zeros(3, 4), F.mse_loss, tmp_path, optimizer=opt)
    assert (first.op, first.phase.value, first.kind) == ("aten::_foreach_add_", "update", "inf")
    assert "_foreach_add_" in rp.call
    # THEN a fresh process reproduces the Inf the update wrote
    assert rp.verified, rp.result


@pytest.mark.subprocess
def test_repro_of_index_put_with_integer_index_list_is_sliced_and_verified(tmp_path: Path) -> None:
    # GIVEN index_put_ with a list of integer index tensors, its 64 rows above a 200-byte cap
    first, rp = _repro(_IndexPut(), torch.full((64, 4), 10.0), None, _sum_loss, tmp_path / "a", cap=200)
    assert (first.op, first.kind) == ("aten::index_put_", "inf")
    # THEN the smallest slice still overflows in a fresh process; its index is still an integer tensor in a list
    assert rp.verified and rp.sliced, rp.result
    assert rp.nbytes <= 200 and rp.original_shapes == ((2, 4), (64,), (64, 4))
    assert [d for d, _ in rp.inputs] == ["float16", "int64", "float16"]
    assert rp.call.startswith("torch.ops.aten.index_put_.default(t[0], [t[1]], t[2], True")
    assert {p.name for p in (tmp_path / "a").iterdir()} == {".nanhunt-bundle", SCRIPT, INPUTS}


@pytest.mark.subprocess
def test_repro_of_an_op_with_a_dtype_keyword_is_verified(tmp_path: Path) -> None:
    # GIVEN a sum of float32 values into float16, asked for by a dtype keyword argument
    first, rp = _repro(_SumDtype(), torch.full((32, 4), 10.0), None, _sum_loss, tmp_path / "b")
    assert (first.op, first.kind) == ("aten::sum", "inf")
    assert rp.verified, rp.result
    assert "dtype=torch.float16" in rp.call
