"""Uninitialised memory, write-only destinations and views: no false origins, real reads reported."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import Phase

from tests._support.models import where


# ---------------------------------------------------------------- write-only destinations (out=, copy_)


class ExpIntoBuffer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.full((4,), float("-inf"))  # a running-max style initial value
        torch.exp(x, out=buf)  # exp(100) overflows float32: born here
        return buf.sum()


class CastIntoBuffer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = torch.full((2, 4), float("-inf"), dtype=torch.float16)  # a -inf-initialised fp16 cache
        cache[0].copy_(x)  # 1e5 into float16: born here
        return cache[0].float().sum()


@pytest.mark.parametrize(("block", "x", "op"), [(ExpIntoBuffer, 100.0, "aten::exp"), (CastIntoBuffer, 1e5, "aten::copy_")],
                         ids=["exp-out=", "copy_-cast"])
def test_write_only_destination_is_no_input(block: type[nn.Module], x: float, op: str) -> None:
    m = block()
    with nanhunt.trace(m) as t:
        out = m(torch.full((4,), x))
    assert torch.isinf(out)
    assert where(t.first) == (Phase.FORWARD, "", op, 0, "inf")


# ---------------------------------------------------------------- inference_mode: no version counters


class MaskThroughView(nn.Module):
    def forward(self, s: torch.Tensor) -> torch.Tensor:
        s = s * 1.0
        s[:, 0].fill_(float("-inf"))  # intentional -inf mask written through a view
        return (s * 2).softmax(-1)


def test_inference_mode_mask_written_through_view_has_no_origin() -> None:
    m = MaskThroughView()
    torch.manual_seed(0)
    with torch.no_grad(), nanhunt.trace(m) as t0:
        m(torch.randn(3, 4))
    assert t0.first is None  # right under no_grad
    with torch.inference_mode(), nanhunt.trace(m) as t:
        out = m(torch.randn(3, 4))
    assert torch.isfinite(out).all()
    assert t.first is None, t.first.describe() if t.first else ""


# ---------------------------------------------------------------- uninitialised memory (deterministic NaN fill)


class ComplementaryMasks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        out = torch.empty_like(h)
        pos = h > 0
        out[pos] = h[pos]  # index_put_ into empty: half written
        out[~pos] = 0.1 * h[~pos]  # the other half
        return out


class IndexCopyFill(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(4, 2)
        out.index_copy_(0, torch.tensor([0, 2]), x[:2])
        out.index_copy_(0, torch.tensor([1, 3]), x[2:])
        return out


class ResizeThenCopy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.new_zeros(0)
        b.resize_(4)  # grows: uninitialised memory
        b.copy_(x)
        return b.sum()


@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
@pytest.mark.parametrize("block", [ComplementaryMasks, IndexCopyFill, ResizeThenCopy],
                         ids=["index_put_-masks", "index_copy_", "resize_"])
def test_filling_uninitialised_memory_without_views_is_no_origin(block: type[nn.Module]) -> None:
    torch.manual_seed(0)
    m = block()
    with nanhunt.trace(m) as t:
        out = m(torch.randn(4, 4) if block is ComplementaryMasks else torch.ones(4, 2) if block is IndexCopyFill
                else torch.ones(4))
    assert torch.isfinite(out).all()
    assert t.first is None, t.first.describe() if t.first else ""


class ReadsGarbage(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.empty(4)
        e[:2] = x[:2]  # e[2:] never written
        return e.sum()  # reads uninitialised memory


@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
def test_read_of_uninitialised_memory_is_reported() -> None:
    # GIVEN torch.empty(4) written in half through a view, then read whole (its other half: whatever memory held)
    m = ReadsGarbage()
    with nanhunt.trace(m) as t:
        out = m(torch.ones(4))
    assert torch.isnan(out)
    # THEN the read of the unwritten memory is the origin: where it was read, as memory no op wrote
    occ = t.first
    assert occ is not None, "the output is NaN, yet no finding"
    assert (occ.phase, occ.module, occ.op, occ.output.role, occ.kind) == (
        Phase.FORWARD, "", None, nanhunt.Role.UNWRITTEN, "nan")
    # AND the sum that read it is no origin of its own
    assert [o.output.role for o in t.origins] == [nanhunt.Role.UNWRITTEN]


@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
def test_unwritten_memory_is_no_origin_when_a_written_nan_explains_it() -> None:
    # GIVEN torch.empty(4) whose first half is written NaN (an origin of its own) and whose second half is
    # written finite, then read whole
    class WritesNaN(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e = torch.empty(4)
            e[:2] = x[:2].log() * 0  # -inf * 0: NaN, made here
            e[2:] = x[2:]
            return e.sum()

    m = WritesNaN()
    with nanhunt.trace(m) as t:
        m(torch.tensor([0.0, 0.0, 1.0, 1.0]))
    # THEN the origin is the op that made the NaN; the read of the fully written tensor is none
    assert t.first is not None and t.first.op == "aten::log"
    assert all(o.output.role is not nanhunt.Role.UNWRITTEN for o in t.origins)


def test_non_contiguous_view_then_overflow() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.t()[::2].exp().sum()

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.full((4, 4), 100.0))
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 0, "inf")


def test_inplace_on_view_of_view_is_named() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 1
            h.view(2, 4)[1][::2].mul_(1e39)  # overflow through a view of a view
            return h.sum()

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.ones(8))
    assert where(t.first) == (Phase.FORWARD, "", "aten::mul_", 0, "inf")
    assert t.first is not None and "loss" not in (t.first.reached or ()) and "output" in (t.first.reached or ())


@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
def test_a_replay_of_an_uninitialised_read_says_what_it_is_and_what_to_fix() -> None:
    from nanhunt.hunt.pipeline import hunt
    from nanhunt.step.step import Step

    # GIVEN the step whose loss reads torch.empty(4) written only in half
    # WHEN it is replayed
    report = hunt(Step.of(ReadsGarbage(), (torch.ones(4), None), dtype=torch.float32))
    # THEN the finding says it is a read of memory no op wrote, and the advice is to allocate it written
    first = report.first
    assert first is not None
    assert first.describe() == ("NaN born in phase forward, module <root> (ReadsGarbage, call 0), a read of memory "
                                "no op wrote (allocated uninitialised, written in part)")
    assert [(a.pattern, a.because) for a in report.advice] == [(
        "uninitialised-read",
        "a float32 [4] tensor read in phase forward (module <root>) holds NaN where no op wrote it: it was "
        "allocated uninitialised (torch.empty, new_empty, empty_like) and what was written into it since is "
        "finite")]
    assert "torch.zeros" in report.advice[0].fix
