"""nanhunt compare on a model holding torchao float8 layers: float8 as it ran and bfloat16 autocast, each against
one float32 reference from the same state and RNG, module by module, under a rule fixed before the run (CPU:
float8 matmuls emulated).

The model is the CLIP-style head of ``test_float8_bisect``: bias-free ``proj`` and ``text_proj`` (tensorwise
float8), then L2 normalisation. The text features are the image features (so float32 classifies every sample
right, by a wide margin), except that one image sample has an outlier feature of 3e4: it sets ``proj``'s
tensorwise scale for the whole batch, and every other sample's input to ``proj`` lands below e4m3's smallest
value once scaled (0.01 * 448 / 3e4 < 2**-9), so its projection is exactly 0. ``F.normalize`` (eps) makes those
rows 0: 15 decisions flip. Without eps (as CLIP's own code) ``z / z.norm()`` is 0/0. bfloat16 keeps every row.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.cli import main
from nanhunt.records import Report, Rule
from nanhunt.report import markdown

float8 = pytest.importorskip("torchao.float8")

pytestmark = pytest.mark.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.integration.test_compare_float8:Head"
CE = "torch.nn.functional:cross_entropy"
LABEL = "float8 (tensorwise) on proj, text_proj"


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


class Head(nn.Module):
    """Image and text projections, L2-normalised (``eps``: F.normalize's; without it, CLIP's z / z.norm())."""

    def __init__(self, eps: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(32, 16, bias=False)
        self.text_proj = nn.Linear(32, 16, bias=False)

    def _norm(self, z: torch.Tensor) -> torch.Tensor:
        return F.normalize(z, dim=-1) if self.eps else z / z.norm(dim=-1, keepdim=True)

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return 10 * self._norm(self.proj(img)) @ self._norm(self.text_proj(txt)).t()


def _model(*, eps: bool = True, convert: bool = True) -> nn.Module:
    torch.manual_seed(0)
    m = Head(eps)
    with torch.no_grad():
        m.text_proj.weight.copy_(m.proj.weight)  # matching pairs score 10, the others about +-2.5
    if convert:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            float8.convert_to_float8_training(m, config=float8.Float8LinearConfig(emulate=True))
    return m


def _batch(*, outlier: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    img = torch.randn(16, 32, generator=g) * 0.01
    txt = img.clone()
    img[0, 3] = txt[0, 3] = 3e4 if outlier else 0.05
    txt[0, 3] = 1.0  # the text of sample 0 points the same way, without the outlier
    return (img, txt), torch.arange(16)


def _ranking(c: Any) -> list[str]:
    return [c.modules[i].label() for i in c.ranking]


def test_float8_is_compared_beside_bfloat16_and_proj_is_where_it_introduces_the_error() -> None:
    # truth by hand: float32 is right on every sample; tensorwise float8 zeroes proj's output for 15 of them
    model = _model()
    (img, txt), y = _batch(outlier=True)
    with torch.no_grad():
        assert torch.equal(model(img, txt).argmax(dim=1), torch.arange(16)) is False
        assert int((model.proj(img)[1:] == 0).all(dim=-1).sum()) == 15  # type: ignore[operator]
        assert torch.equal(_model(convert=False)(img, txt).argmax(dim=1), torch.arange(16))
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # WHEN compared with no dtype asked: float8 as it ran, and bfloat16, against float32
    rule = Rule(task="classify", max_flips=0)
    report = nanhunt.compare(model, _batch(outlier=True), loss_fn=F.cross_entropy, rule=rule)
    f8, bf16 = report.comparison.candidates()  # type: ignore[union-attr]
    # THEN the float8 run is named for its recipe and layers, rejected for its 15 flips; bfloat16 is accepted
    assert (f8.dtype, f8.variant, f8.accepted, f8.flipped) == ("float8", LABEL, False, tuple(range(1, 16)))
    assert f8.violations == ("15 decision flips (at most 0 allowed): samples 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, "
                             "13, 14, 15",)
    assert (bf16.dtype, bf16.variant, bf16.accepted, bf16.flipped, bf16.violations) == ("bfloat16", "", True, (), ())
    assert report.status == "diverged" and report.config["dtype"] == "float8,bfloat16"
    # AND proj is where float8 introduces the error: every row it zeroed has error 1 against its own row; the
    # normalisation that carries it on introduces nothing of its own
    assert _ranking(f8) == ["proj#0", "text_proj#0"]
    proj = f8.modules[f8.ranking[0]]
    assert (proj.module_class, proj.introduced, proj.underflow, f8.per_row) == ("Float8Linear", 1.0, 240, True)
    assert f8.rtol == 0.125 and bf16.rtol == 0.01
    # AND the float8 layers are as they were: in float8, their forwards and weights untouched
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards
    assert isinstance(model.proj, float8.float8_linear.Float8Linear)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # AND the reports name the run
    again = Report.from_json(report.to_json())
    assert again.comparison == report.comparison
    md = markdown.render(again).replace("\\_", "_")
    assert f"REJECTED: {LABEL} REJECTED (1 violation), autocast bfloat16 ACCEPTED against the float32 reference" in md
    assert f"float32 reference finite, {LABEL} and autocast bfloat16 runs finite, at most 0 decision flips" in md
    assert "Columns: err = the largest over a value's rows (vectors along its last dimension) of max" in md
    assert "float8 layers proj, text_proj: run as nn.Linear on the same weights (out of float8) in the float32 " \
           "reference and autocast bfloat16" in md


def test_without_eps_float8_goes_non_finite_at_the_division_after_proj() -> None:
    report = nanhunt.compare(_model(eps=False), _batch(outlier=True), loss_fn=F.cross_entropy, dtype="float8",
                             task="classify")
    c = report.comparison
    assert c is not None and c.alternatives == ()
    assert (c.amp_finite, c.amp_first_nonfinite) == (False, "the output of module <root>#0 (Head) (forward)")
    assert c.violations[0].startswith(f"the {LABEL} run is non-finite, first at the output of module <root>#0")
    # the 0/0 is born in the model's own code, from the rows proj sent to zero
    assert _ranking(c) == ["<root>#0", "proj#0", "text_proj#0"]
    assert c.modules[c.ranking[1]].underflow == 240


def test_a_batch_without_the_outlier_passes_in_float8_and_is_timed() -> None:
    model = _model()
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    report = nanhunt.compare(model, _batch(outlier=False), loss_fn=F.cross_entropy, task="classify", speed=1)
    c = report.comparison
    assert c is not None and [(x.dtype, x.accepted) for x in c.candidates()] == [("float8", True), ("bfloat16", True)]
    # the speed of each, after the numbers passed: float32 (layers out of float8) against each run
    assert [(x.speed.repeats, x.speed.reason) for x in c.candidates() if x.speed is not None] == [(1, ""), (1, "")]
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards


def test_float8_under_the_steps_autocast_is_named_so() -> None:
    report = nanhunt.compare(_model(), _batch(outlier=False), loss_fn=F.cross_entropy, dtype="float8",
                             float8_autocast=torch.bfloat16)
    assert report.comparison is not None
    assert report.comparison.variant == f"{LABEL}, under autocast bfloat16"


def _save(tmp_path: Path, *, convert: bool = True) -> tuple[str, Path]:
    model = _model(convert=convert)
    ck = tmp_path / "ck.pt"
    d = tmp_path / "set"
    d.mkdir()
    for outlier in (False, True):
        nanhunt.save_capture(ck, d / f"{'outlier' if outlier else 'ordinary'}.pt", model=model,
                             batch=_batch(outlier=outlier), loss_fn=F.cross_entropy, model_factory=FACTORY,
                             dtype=torch.float32)
    return str(ck), d


def test_cli_compares_a_float8_capture_on_a_set_and_exits_by_the_rule(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck, d = _save(tmp_path)
    rule = tmp_path / "rule.json"
    rule.write_text(json.dumps({"task": "classify", "max_flips": 0}))
    base = ["compare", ck, str(d), "--model", FACTORY, "--loss", CE, "--rule", str(rule)]
    out = tmp_path / "report.json"
    capsys.readouterr()
    # the outlier batch flips 15 samples in float8: exit 1; bfloat16 passes
    assert main([*base, "--report", str(out)]) == 1
    io = capsys.readouterr()
    assert "rule sha256: " in io.err
    assert f"REJECTED: {LABEL} REJECTED (1 violation), autocast bfloat16 ACCEPTED against the float32 reference on " \
           "2 batches (32 samples)" in " ".join(io.out.split())
    c = Report.from_json(out.read_text()).comparison
    assert c is not None and [(x.dtype, x.accepted) for x in c.candidates()] == [("float8", False), ("bfloat16", True)]
    assert [(b.batch, b.accepted) for b in c.batches] == [("ordinary.pt", True), ("outlier.pt", False)]
    assert _ranking(c.batches[1]) == ["proj#0", "text_proj#0"]
    assert c.flipped == tuple(range(17, 32))
    # bfloat16 alone passes; float8 alone fails; a rule allowing the flips passes
    assert main([*base, "--dtype", "bfloat16"]) == 0
    assert main([*base, "--dtype", "float8"]) == 1
    rule.write_text(json.dumps({"task": "classify", "max_flips": 15}))
    assert main([*base, "--dtype", "float8"]) == 0


def test_cli_float8_on_a_model_without_float8_layers_is_one_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck, d = _save(tmp_path, convert=False)
    capsys.readouterr()
    assert main(["compare", ck, str(d / "outlier.pt"), "--model", FACTORY, "--loss", CE, "--dtype", "float8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["nanhunt: error: float8 compares a model's torchao float8 layers (Float8Linear, from "
                   "convert_to_float8_training) in float8, and this model holds none: compare it under float16 or "
                   "bfloat16"]


def test_cli_float8_runs_under_the_captures_autocast_whatever_else_is_asked(tmp_path: Path) -> None:
    # GIVEN a capture of a float8 step that ran under bfloat16 autocast
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=_model(), batch=_batch(outlier=False), loss_fn=F.cross_entropy,
                         model_factory=FACTORY, dtype=torch.bfloat16)
    out = tmp_path / "r.json"
    # WHEN float8 is compared beside float16 THEN the float8 run keeps the capture's bfloat16, float16 is float16
    assert main(["compare", str(ck), str(bt), "--model", FACTORY, "--loss", CE, "--task", "classify", "--dtype",
                 "float8,float16", "--report", str(out)]) == 0
    c = Report.from_json(out.read_text()).comparison
    assert c is not None
    assert [(x.dtype, x.run_name()) for x in c.candidates()] == [
        ("float8", f"{LABEL}, under autocast bfloat16"), ("float16", "autocast float16")]
