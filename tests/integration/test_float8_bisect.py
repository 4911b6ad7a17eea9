"""Bisection by taking torchao float8 layers out of float8: the layers a step needs in high precision, the rowwise
recipe tried on them, and the fix given as the conversion to paste, each measured (CPU: float8 matmuls emulated).

The CLIP-style head: ``proj`` (bias-free, tensorwise float8) projects image features, then L2 normalisation without
eps, as CLIP's code has it. One sample's outlier feature (3e4) sets the tensorwise scale for the whole batch: every
other sample's input (about 0.01) lands below e4m3's smallest subnormal once scaled (0.01 * 448 / 3e4 = 1.5e-4 <
2**-9), their projections are exactly 0, and ``z / z.norm()`` is 0/0. ``text_proj`` (well scaled) is float8 too.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt.hunt.bisection import bisect
from nanhunt.records import Report, Status, Verdict, VerdictKind
from nanhunt.report import markdown
from nanhunt.step.step import Step

float8 = pytest.importorskip("torchao.float8")

pytestmark = pytest.mark.filterwarnings("ignore")


class Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 16, bias=False)
        self.text_proj = nn.Linear(32, 16, bias=False)

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        zi = self.proj(img)
        zi = zi / zi.norm(dim=-1, keepdim=True)
        zt = self.text_proj(txt)
        zt = zt / zt.norm(dim=-1, keepdim=True)
        return 10 * zi @ zt.t()


def _plain() -> Clip:
    torch.manual_seed(0)
    return Clip()


def _tensorwise() -> object:
    return float8.Float8LinearConfig(emulate=True)


def _convert(m: nn.Module, **kw: object) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float8.convert_to_float8_training(m, **kw)  # type: ignore[no-any-return]


def _batch() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    img = torch.randn(16, 32, generator=g) * 0.01
    img[0, 3] = 3e4  # the outlier sample
    return (img, torch.randn(16, 32, generator=g)), torch.arange(16)


def _finite(model: nn.Module) -> bool:
    """Ground truth by hand: one forward and backward; loss and every gradient finite."""
    (img, txt), y = _batch()
    loss = F.cross_entropy(model(img, txt), y)
    loss.backward()
    return bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                                              if p.grad is not None)


def _verdict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Verdict:
    """The bisection alone (no trace): the step replayed with float8 layers taken out."""
    step = Step.of(model, _batch(), loss_fn=F.cross_entropy, dtype=torch.float32, optimizer=optimizer)
    return bisect(step, origin=None)


def test_bisection_names_proj_as_the_layer_to_take_out_of_float8() -> None:
    # truth by hand, on fresh models: tensorwise float8 fails; float32, proj left out and rowwise do not
    assert not _finite(_convert(_plain(), config=_tensorwise()))
    assert _finite(_plain())
    assert _finite(_convert(_plain(), config=_tensorwise(), module_filter_fn=lambda mod, fqn: fqn != "proj"))
    assert not _finite(_convert(_plain(), config=_tensorwise(), module_filter_fn=lambda mod, fqn: fqn != "text_proj"))
    assert _finite(_convert(_plain(), config=float8.Float8LinearConfig.from_recipe_name("rowwise")))
    # every other sample's projection is exactly 0 in tensorwise float8: 0/0 at the normalisation
    m = _convert(_plain(), config=_tensorwise())
    (img, _), _ = _batch()
    with torch.no_grad():
        z = m.proj(img)  # type: ignore[operator]
    assert int((z[1:] == 0).all(dim=-1).sum()) == 15 and bool((z[0] != 0).any())
    # WHEN its step is bisected
    m = _convert(_plain(), config=_tensorwise())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    before = copy.deepcopy(m.state_dict())
    forwards = {n: mod.__dict__.get("forward") for n, mod in m.named_modules()}
    v = _verdict(m, opt)
    # THEN float8-induced, proj alone, confirmed by a clean run; the rowwise recipe on proj alone fixes it, and
    # the fix given (rowwise) left no origin in its traced replay
    assert (v.kind, v.culprits, v.confirmed, v.candidates) == ("float8-induced", ("proj",), True, 2)
    assert (v.rowwise_fixes, v.alternatives) == (True, {})
    assert v.remaining == ()
    assert v.fix is not None and 'Float8LinearConfig.from_recipe_name("rowwise")' in v.fix
    assert "rowwise = {'proj'}" in v.fix
    # AND the model is exactly as it was: float8 layers, their forwards and configurations, weights, no state
    assert isinstance(m.proj, float8.float8_linear.Float8Linear) and m.proj.config == _tensorwise()
    assert {n: mod.__dict__.get("forward") for n, mod in m.named_modules()} == forwards
    assert all(torch.equal(t, before[k]) for k, t in m.state_dict().items())
    assert not opt.state


def test_the_fix_as_given_makes_the_step_finite() -> None:
    v = _verdict(_convert(_plain(), config=_tensorwise()))
    assert v.fix is not None
    # the code pasted after building the model, with the user's config
    model = _plain()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(v.fix, {"model": model, "config": _tensorwise()})
    assert isinstance(model.proj, float8.float8_linear.Float8Linear)
    assert model.proj.config == float8.Float8LinearConfig.from_recipe_name("rowwise")
    assert model.text_proj.config == _tensorwise()
    assert _finite(model)


def test_when_rowwise_does_not_fix_it_the_layer_is_left_out_of_float8() -> None:
    # GIVEN a projection whose every weight row holds one huge entry (column 5): rowwise scales (one per row of
    # the weight) are as small as the tensorwise one, and the row's other entries (0.01) underflow to 0 in both
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 16, bias=False)
            with torch.no_grad():
                self.proj.weight.mul_(0.01)
                self.proj.weight[:, 0] = 0.01
                self.proj.weight[:, 5] = 3e4  # one column dominating every row's scale

        def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
            z = self.proj(img)
            return z / z.norm(dim=-1, keepdim=True)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    (img, txt), _ = _batch()
    img = torch.zeros_like(img)
    img[:, 0] = 1.0  # only the small column is fed: every row's product is 0 once the weight is cast
    torch.manual_seed(0)
    m = _convert(Head(), config=_tensorwise())
    step = Step.of(m, ((img, txt), None), loss_fn=loss_fn, dtype=torch.float32)
    v = bisect(step, origin=None)
    assert (v.kind, v.culprits, v.confirmed, v.rowwise_fixes) == ("float8-induced", ("proj",), True, False)
    assert v.fix is not None and "fqn not in keep_high_precision" in v.fix and "{'proj'}" in v.fix
    assert v.remaining == ()


def test_a_float8_model_whose_failure_is_not_float8_goes_on_to_the_precision_search() -> None:
    # GIVEN float8 layers around a plain Linear (left out of float8) that overflows float16 under autocast
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.hot = nn.Linear(16, 16)
            self.out = nn.Linear(16, 16)
            with torch.no_grad():
                self.hot.weight.fill_(5e4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.hot(self.fc(x)) * 1e-3)

    torch.manual_seed(0)
    m = _convert(M(), config=_tensorwise(), module_filter_fn=lambda mod, fqn: fqn != "hot")
    step = Step.of(m, (torch.ones(16, 16) * 3, torch.zeros(16, 16)), loss_fn=F.mse_loss, dtype=torch.float16)
    trials: list[str] = []
    v = bisect(step, origin=None, progress=lambda _i, label: trials.append(label))
    # THEN taking every float8 layer out is tried and does not help (nor is it part of float32 everywhere's
    # answer); the float32 search names hot
    assert trials[:4] == ["float32 everywhere", "original configuration", "bfloat16 instead",
                          "every float8 layer as nn.Linear"]
    assert (v.kind, v.culprits, v.confirmed) == ("precision", ("hot",), True)


def test_float8_verdict_round_trips_through_json_and_reads_in_reports() -> None:
    v = _verdict(_convert(_plain(), config=_tensorwise()))
    assert (v.kind, v.culprits) == ("float8-induced", ("proj",))
    text = Report(status=Status.NONFINITE, first=None, verdict=v).to_json()
    assert '"rowwise_fixes": true' in text
    again = Report.from_json(text)
    assert again.verdict == v and again.verdict.kind is VerdictKind.FLOAT8_INDUCED
    md = markdown.render(again)
    assert "Float8-induced: running `proj` as nn.Linear on the same weights, out of float8, makes the step finite " \
           "(confirmed;" in md
    assert "With the rowwise recipe (a scale per row) instead, the step is finite too" in md


def test_the_bisection_section_says_what_its_trials_changed() -> None:
    # a float8-induced verdict's section is titled for what the trials did (layers taken out of float8), every
    # other verdict's for local float32
    from nanhunt.records import Report, Verdict, VerdictKind
    from nanhunt.report import html, markdown

    f8 = Report(status="nonfinite", first=None, verdict=Verdict(kind=VerdictKind.FLOAT8_INDUCED, culprits=("proj",)))
    fp = Report(status="nonfinite", first=None, verdict=Verdict(kind=VerdictKind.PRECISION, culprits=("fc",)))
    assert "#### Bisection by taking layers out of float8" in markdown.render(f8)
    assert "<h2>Bisection by taking layers out of float8</h2>" in html.render(f8)
    assert "#### Bisection by local float32" in markdown.render(fp)
