"""The same faults on a GPU when there is one (CI has none: these are skipped there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _overflowing() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    with torch.no_grad():
        m[2].weight.mul_(3e4)
    return m.cuda()


def test_float16_overflow_on_cuda() -> None:
    m = _overflowing()
    x, y = torch.randn(8, 16, device="cuda") * 10, torch.randn(8, 4, device="cuda")
    scaler = torch.amp.GradScaler("cuda")
    with nanhunt.trace(m) as t:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(m(x), y)
        scaler.scale(loss).backward()
    assert t.first is not None
    assert (t.first.phase.value, t.first.module, t.first.kind) == ("forward", "2", "inf")
    assert t.first.op in ("aten::addmm", "aten::mm", "aten::linear")


def test_backward_on_cuda_is_attributed() -> None:
    class Sqrt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x * 0)

    m = nn.Sequential(nn.Linear(4, 4), Sqrt()).cuda()
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4, device="cuda")).sum().backward()
    assert t.first is not None
    assert (t.first.phase.value, t.first.module, t.first.op) == ("backward", "1", "aten::div")


def test_replay_and_bisect_on_cuda() -> None:
    # A cell that overflows float16 in its matmul and scales back, so that in float32 neither
    # its output nor the gradients it sends back are large: it alone is the culprit.
    from test_bisect import Chain

    m = Chain(6, hot=(3,)).cuda()
    x, y = torch.ones(4, 8, device="cuda"), torch.zeros(4, 8, device="cuda")
    rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, device_type="cuda", bisect=True)
    assert rep.first is not None and rep.first.module == "layers.3.fc"
    v = rep.verdict
    assert v is not None and v.kind == "precision" and v.culprits == ("layers.3.fc",) and v.confirmed


def test_scoped_pass_on_cuda_matches_the_whole_step() -> None:
    # The scope's backward runs on autograd's CUDA device thread: the node hooks must put the
    # mode on that thread's stack, and every op of the scope must be seen as in a whole-step trace.
    from test_trace_scope_gate import _op_rows

    class Sqrt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x * 0)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), Sqrt()), nn.Linear(4, 2)).cuda()

    x = torch.randn(2, 4, device="cuda")
    m = make()
    with nanhunt.trace(m) as whole:
        m(x).sum().backward()
    m = make()
    with nanhunt.trace(m, scope=["1"]) as part:
        m(x).sum().backward()
    assert _op_rows(part, "1") == _op_rows(whole, "1")
    assert part.first is not None
    assert (part.first.phase.value, part.first.module, part.first.op) == ("backward", "1.1", "aten::div")
    assert torch._C._len_torch_dispatch_stack() == 0
