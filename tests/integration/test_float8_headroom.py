"""The Guard's headroom history of torchao float8 layers: the share of a cast's non-zero values that underflow to 0.

torchao 0.18 scales every float8 cast dynamically, so nothing saturates; what an outlier does instead is set the
amax, and the tensor's small values fall below e4m3's smallest subnormal once scaled. On the CPU float8 matmuls
are emulated (``emulate=True``); the layers are tiny (dimensions multiples of 16).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.guard._float8_headroom import UNDERFLOW_SHARE
from nanhunt.guard._headroom import Headroom
from nanhunt.guard.guard import HeadroomWarning

float8 = pytest.importorskip("torchao.float8")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

OUTLIER = 104.0  # sample 0's first feature, against the others' std of 0.01 ...
GROWTH = 1.0437  # ... growing 4.4% a step: proj's input loses 10% of its values near step 40, and every row but
# the outlier's is all zero (its projection 0, z / z.norm() 0/0) near step 100


class Head(nn.Module):
    """A bias-free projection and L2 normalisation without eps, as CLIP's code has it, and a readout."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 16, bias=False)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        return self.out(z / z.norm(dim=-1, keepdim=True))


def _float8(model: nn.Module) -> nn.Module:
    return float8.convert_to_float8_training(model, config=float8.Float8LinearConfig(emulate=True))


def _run(guard: nanhunt.Guard, model: nn.Module, opt: torch.optim.Optimizer, steps: int, *,
         outlier: bool) -> int | None:
    """Train ``steps`` steps; the step of the first detection, or None."""
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, 32, generator=g) * 0.01
        if outlier:
            x[0, 0] = OUTLIER * GROWTH ** i
        y = torch.randn(16, 16, generator=g)
        with guard.step((x, y)):
            opt.zero_grad(set_to_none=True)
            loss = guard.loss(F.mse_loss(model(x), y))
            loss.backward()
            opt.step()
        if any(e.kind != "warning" for e in guard.events):
            return i
    return None


def _setup(tmp_path: Path, *, convert: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, nanhunt.Guard]:
    torch.manual_seed(0)
    model = _float8(Head()) if convert else Head()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nanhunt.Guard(model, opt, dump_dir=tmp_path, loss_fn=F.mse_loss, headroom_every=1, on_fail="dump")
    return model, opt, guard


@pytest.mark.slow
def test_outlier_growing_into_tensorwise_scale_warns_naming_proj_before_the_nan(tmp_path: Path) -> None:
    # GIVEN a tensorwise float8 head whose input has one outlier feature growing each step
    model, opt, guard = _setup(tmp_path)
    # WHEN it trains until z / z.norm() is 0/0
    with pytest.warns(HeadroomWarning) as record:
        bad = _run(guard, model, opt, 128, outlier=True)
    # THEN the Guard warned about proj's input cast, with the measured share, before the NaN
    assert bad is not None and guard.events[-1].kind == "loss"
    warned = [e for e in guard.events if e.kind == "warning"]
    assert [(e.condition, e.module) for e in warned] == [("float8 underflow", "proj")]
    first = warned[0]
    assert first.step < bad
    assert first.measured is not None and UNDERFLOW_SHARE <= first.measured < 1.0
    assert first.limit == UNDERFLOW_SHARE
    share = f"{first.measured:.1%}"
    assert re.fullmatch(
        rf"proj float8 input cast: {re.escape(share)} of its non-zero values underflow to 0 in float8_e4m3fn "
        r"\(tensorwise scaling: values below 2\.18e-06x the tensor's amax become 0; amax [\d.e+]+\); usual fixes: "
        r'the rowwise recipe \(Float8LinearConfig\.from_recipe_name\("rowwise"\): one scale per row, .*'
        r'module_filter_fn=lambda mod, fqn: fqn != "proj"\)\)', first.detail)
    # AND it went through the Guard's warning path once
    texts = [str(w.message) for w in record if issubclass(w.category, HeadroomWarning)]
    assert texts == [first.describe()]


@pytest.mark.slow
def test_healthy_float8_run_warns_nothing(tmp_path: Path) -> None:
    # GIVEN the same float8 head on inputs without an outlier
    model, opt, guard = _setup(tmp_path)
    # WHEN it trains 100 steps, every one sampled
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        bad = _run(guard, model, opt, 100, outlier=False)
    # THEN nothing is detected nor warned, and every float8 cast was measured
    assert bad is None and guard.events == []
    assert not [w for w in record if issubclass(w.category, HeadroomWarning)]
    f8 = guard._watch.float8
    assert f8 is not None and f8.names == ["proj", "out"] and sorted(f8.history) == [0, 1, 2, 3, 4, 5]


def test_model_without_float8_layers_gets_no_extra_hook() -> None:
    # GIVEN a plain model's headroom history
    model = Head()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = Headroom(model, opt, every=1, horizon=100, device_type="cpu")
    # WHEN a sampled step begins
    watch.begin(0)
    # THEN each module holds the history's one forward hook, and no float8 history exists
    assert watch.float8 is None
    assert [len(m._forward_hooks) for m in model.modules()] == [1, 1, 1]
    watch.discard()
    assert [len(m._forward_hooks) for m in model.modules()] == [0, 0, 0]


def test_float8_layers_get_their_hook_only_on_a_sampled_step() -> None:
    # GIVEN a float8 model's history sampled every other step
    model = _float8(Head())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = Headroom(model, opt, every=2, horizon=100, device_type="cpu")
    assert watch.float8 is not None and watch.float8.names == ["proj", "out"]
    # WHEN an unsampled step and then a sampled one begin
    watch.begin(1)
    unsampled = [len(m._forward_hooks) for m in model.modules()]
    watch.begin(2)
    # THEN the float8 layers carry a second hook only on the sampled step
    assert unsampled == [0, 0, 0]
    assert [len(m._forward_hooks) for m in model.modules()] == [1, 2, 2]
    watch.discard()
    assert [len(m._forward_hooks) for m in model.modules()] == [0, 0, 0]
