"""``nanhunt compare``: float32 reference against autocast, the introduced-error ranking, decision flips, the rule."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from nanhunt import compare
from nanhunt.cli import main
from nanhunt.comparison.engine import TIE_RULE, top_two
from nanhunt.records import Comparison, Report
from nanhunt.report.console import render_text

import tests._support.compare as compare_models
from tests._support.compare import (CARRIED_X, CARRIED_Y, FLIP_X, FLIP_Y, Absorbed, Carried, Exploding, Flip, Net,
                                    Overflow, Scalar, Underflow)

ROOT = Path(__file__).resolve().parents[2]
HELPERS = "tests._support.compare"
CE = "torch.nn.functional:cross_entropy"


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # --model tests._support.compare:... imports from the repository root


def _cmp(report: Report) -> Comparison:
    assert report.comparison is not None
    return report.comparison


def _save(tmp_path: Path, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    ck, bt = tmp_path / "checkpoint.pt", tmp_path / "batch.pt"
    torch.save(model.state_dict(), ck)
    torch.save((x, y), bt)
    return [str(ck), str(bt)]


# ------------------------------------------------------------------ decisions


def test_flip_is_reported_and_the_sample_identified() -> None:
    # GIVEN a classifier whose sample 1 scores 1.0 and 1.0003: float16 rounds both to 1.0, a tie
    rep = compare(Flip(), (FLIP_X, FLIP_Y), loss_fn=F.cross_entropy, task="classify")
    c = _cmp(rep)
    # THEN the flip breaks the default rule (no flip), and names sample 1: class 1 in float32, 0 in float16
    assert rep.status == "diverged" and not c.accepted
    assert c.flipped == (1,)
    assert c.n_samples == 4
    d = {x.index: x for x in c.decisions}
    assert (d[1].ref_class, d[1].amp_class, d[1].ref_runner_up, d[1].flipped) == (1, 0, 0, True)
    assert d[1].amp_margin == 0.0  # the tie itself, broken by the documented rule
    # AND sample 2 (margin 0.0008 < 1e-5 + 1e-3 * 1.0008) is near the boundary though unchanged
    assert c.near_boundary == (1, 2)
    assert (d[2].ref_class, d[2].amp_class, d[2].flipped, d[2].near_boundary) == (1, 1, False, True)
    assert 0 not in d and 3 not in d
    assert c.amp_finite is True and c.reference_finite
    assert c.violations == ("1 decision flip (at most 0 allowed): sample 1",)
    assert c.tie_rule == TIE_RULE and "lowest class index" in c.rule_text()


def test_max_flips_is_part_of_the_rule() -> None:
    rep = compare(Flip(), (FLIP_X, FLIP_Y), loss_fn=F.cross_entropy, task="classify", max_flips=1)
    c = _cmp(rep)
    assert rep.status == "clean" and c.accepted and c.flipped == (1,)
    assert "at most 1 decision flip;" in c.rule_text()


def test_tie_rule_lowest_index_in_both_runs_and_nan_rows_have_no_class() -> None:
    scores = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0], [math.nan, 1.0, 0.0], [math.inf, math.inf, 1.0],
                           [0.5, 3.0, 1.0]])
    first, second, top, margin = top_two(scores)
    assert first.tolist() == [0, 1, -1, 0, 1]
    assert second.tolist()[:2] == [1, 2] and second.tolist()[3:] == [1, 2]
    assert margin[0] == 0 and margin[1] == 0 and math.isnan(margin[2]) and margin[3] == 0
    assert margin[4] == pytest.approx(2.0) and top[4] == 3.0


# ------------------------------------------------------------------ the introduced-error ranking


def test_error_introduced_in_one_module_ranks_it_first_not_the_largest() -> None:
    # GIVEN lossy loses 0.1 * a to float16 and post1, post2, head only carry (and double) that error
    rep = compare(Carried(), (CARRIED_X, CARRIED_Y), loss_fn=F.cross_entropy)
    c = _cmp(rep)
    by = {m.label(): m for m in c.modules}
    # THEN lossy is ranked first, although later calls hold a larger absolute error
    assert c.modules[c.ranking[0]].label() == "lossy#0"
    assert by["post2#0"].max_abs > by["post1#0"].max_abs > by["lossy#0"].max_abs
    assert by["head#0"].max_abs == max(m.max_abs for m in c.modules)
    assert by["lossy#0"].introduced is not None and by["lossy#0"].introduced > 0.1
    assert by["lossy#0"].input_scaled == 0.0
    # AND the carriers, the exact pre-layer and the container introduce (almost) nothing
    for name in ("pre#0", "post1#0", "post2#0", "head#0", "<root>#0"):
        assert by[name].introduced is not None and by[name].introduced < 1e-3, name
    for name in ("post1#0", "post2#0"):
        assert by[name].input_scaled == pytest.approx(by["lossy#0"].scaled)
    # AND the step is finite, so the default rule (no tolerance failing) accepts it
    assert rep.status == "clean" and c.accepted
    assert by["lossy#0"].out_of_tol == 1.0 and by["lossy#0"].dtype == "float16"
    assert by["lossy#0"].headroom == pytest.approx(65504 / 0.6, rel=1e-3)  # largest |x| 0.6 (float32: 0.1 * 1 + 0.5)


def test_fail_on_tolerance_turns_the_same_result_into_a_violation() -> None:
    rep = compare(Carried(), (CARRIED_X, CARRIED_Y), loss_fn=F.cross_entropy, fail_on_tolerance=True)
    c = _cmp(rep)
    assert rep.status == "diverged" and not c.accepted
    assert [v.split(":")[0] for v in c.violations] == ["the model's output", "the loss"]
    assert "output and loss within rtol=0.001 atol=1e-05" in c.rule_text()


def test_overflow_in_float16_only_is_a_precision_finding() -> None:
    # GIVEN 300 * 300 = 90000: finite in float32, beyond float16's 65504
    rep = compare(Overflow(), (torch.tensor([[300.0, 1.0], [1.0, 1.0]]), torch.tensor([0, 1])),
                  loss_fn=F.cross_entropy)
    c = _cmp(rep)
    assert rep.status == "nonfinite" and c.reference_finite and c.amp_finite is False
    assert c.amp_first_nonfinite is not None and "big#0" in c.amp_first_nonfinite
    top = c.modules[c.ranking[0]]
    assert top.label() == "big#0" and math.isinf(top.introduced or 0.0) and top.headroom is None
    by = {m.label(): m for m in c.modules}
    assert by["head#0"].introduced == 0.0  # it only carries the Inf
    assert c.ranking == (c.modules.index(top),)


def test_overflow_absorbed_under_float16_is_listed_though_the_run_stays_finite() -> None:
    # GIVEN a hand-written RMSNorm whose float16 square of 300 overflows; rsqrt(Inf) = 0 makes the row 0, finite
    rep = compare(Absorbed(), (torch.ones(2, 2), torch.tensor([0, 1])), loss_fn=F.cross_entropy)
    c = _cmp(rep)
    # THEN the autocast run is finite and the rule holds, but the overflow is listed: op, module, source line
    assert rep.status == "clean" and c.accepted and c.amp_finite is True
    file = compare_models.__file__
    line = next(i for i, t in enumerate(Path(file).read_text().splitlines(), 1) if t.endswith("# SQUARE"))
    assert c.absorbed == (f"autocast float16: Inf born in phase forward, module norm (RMSNorm, call 0), op aten::pow, "
                          f"at {file}:{line} in forward: return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) "
                          "* self.weight  # SQUARE",)
    text = render_text(rep, width=400)
    assert "autocast float16 finite, but 1 non-finite value was born and absorbed (silent), loss 0.6931" in text
    assert f"absorbed: {c.absorbed[0]}" in text
    # AND the JSON keeps it; a comparison with none has no such key (reports keep their layout)
    assert Report.from_json(rep.to_json()).comparison == c
    clean = compare(Net(), (torch.randn(4, 8), torch.tensor([0, 1, 2, 3])), loss_fn=F.cross_entropy)
    assert _cmp(clean).absorbed == () and "absorbed" not in json.loads(clean.to_json())["comparison"]


def test_underflow_counts_values_flushed_to_zero() -> None:
    rep = compare(Underflow(), (torch.tensor([[1e-4, 1.0], [1e-4, 1.0]]), torch.tensor([0, 1])),
                  loss_fn=F.cross_entropy)
    fc = next(m for m in _cmp(rep).modules if m.name == "fc")
    assert fc.underflow == 2 and fc.max_abs == pytest.approx(1e-8, rel=1e-3)


def test_regress_reports_error_per_sample_and_extremes() -> None:
    rep = compare(Carried(), (CARRIED_X, CARRIED_Y), loss_fn=F.cross_entropy, task="regress")
    g = _cmp(rep).regression
    assert g is not None
    # float32 holds 1000.1 as 1000.0999756: its own reference is 3.2002 / 4.7998, not 3.2 / 4.8
    assert (g.ref_min, g.ref_max, g.amp_min, g.amp_max) == pytest.approx((3.2, 4.8, 4.0, 4.0), rel=1e-3)
    assert [i for i, _ in g.worst] == [0, 2, 3, 1]  # 0.8, 0.8, 0.8, then 0.6; ties by index
    assert g.worst[0][1] == pytest.approx(0.8, rel=1e-3)
    assert _cmp(rep).flipped == () and _cmp(rep).near_boundary == ()


def test_scaler_scales_the_autocast_backward_and_gradients_are_unscaled() -> None:
    torch.manual_seed(0)
    model, batch = Net(), (torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = scaler.state_dict()
    plain = {g.name: g for g in _cmp(compare(model, batch, loss_fn=F.cross_entropy)).grads}
    rep = compare(model, batch, loss_fn=F.cross_entropy, scaler=scaler)
    scaled = {g.name: g for g in _cmp(rep).grads}
    assert rep.config["scaler_scale"] == 1024.0 and scaler.state_dict() == before
    for name, g in scaled.items():  # compared unscaled: the same size of error as without the scale
        assert g.ref_absmax == plain[name].ref_absmax and g.scaled < 0.05, name


def test_bfloat16_uses_its_own_tolerances() -> None:
    torch.manual_seed(0)
    c = _cmp(compare(Net(), (torch.randn(4, 8), torch.tensor([0, 1, 2, 3])), loss_fn=F.cross_entropy,
                     dtype="bfloat16"))
    assert (c.dtype, c.rtol, c.atol) == ("bfloat16", 1e-2, 1e-5)
    assert c.modules[0].headroom is not None and c.modules[0].headroom > 1e30


def test_float16_batch_is_upcast_for_the_float32_reference_only() -> None:
    # GIVEN a float32 model and a batch the loader already gives in float16
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(4, 8).half(), torch.tensor([0, 1, 2, 3])
    c16 = _cmp(compare(model, (x, y), loss_fn=F.cross_entropy))
    # THEN the reference runs (it would meet float32 weights with float16 inputs) on the exact upcast batch
    c32 = _cmp(compare(model, (x.float(), y), loss_fn=F.cross_entropy))
    assert c16.reference_finite and (c16.ref_loss, c16.amp_loss) == (c32.ref_loss, c32.amp_loss)


# ------------------------------------------------------------------ the reference first


def test_nonfinite_float32_reference_is_reported_as_such() -> None:
    # GIVEN exp(100 x) overflows float32 too
    rep = compare(Exploding(), (torch.ones(2, 2), torch.tensor([0, 1])), loss_fn=F.cross_entropy, task="classify")
    c = _cmp(rep)
    # THEN it is no precision finding: the reference is named, and nothing is compared
    assert rep.status == "reference-nonfinite" and not c.accepted
    assert not c.reference_finite and c.amp_finite is None
    assert c.reference_first_nonfinite == "the output of module blow#0 (Exp) (forward)"
    assert c.modules == () and c.ranking == () and c.grads == () and c.flipped == ()
    assert "not a precision finding" in c.violations[0]
    text = render_text(rep)
    assert text.startswith("REFERENCE NON-FINITE") and "nothing was compared" in text


def test_model_is_left_as_it_was_and_hooks_are_removed() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    grad = torch.full_like(model.fc1.weight, 7.0)
    model.fc1.weight.grad = grad
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    compare(model, (x, y), loss_fn=F.cross_entropy, train=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.fc1.weight.grad is grad and model.fc2.weight.grad is None
    assert not model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())

    def bad_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        compare(model, (x, y), loss_fn=bad_loss)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert model.fc1.weight.grad is grad


def test_same_rng_in_both_runs_keeps_dropout_masks_equal() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).train()
    torch.manual_seed(1)
    c = _cmp(compare(model, (torch.randn(16, 8), torch.randint(0, 2, (16,))), loss_fn=F.cross_entropy))
    drop = next(m for m in c.modules if m.name == "1")
    assert drop.introduced == pytest.approx(0.0, abs=1e-3)  # same mask: dropout adds no error of its own


def test_json_round_trip_and_replay_reports_unchanged() -> None:
    rep = compare(Flip(), (FLIP_X, FLIP_Y), loss_fn=F.cross_entropy, task="classify")
    d = json.loads(rep.to_json())
    assert d["comparison"]["flipped"] == [1] and d["comparison"]["near_boundary"] == [1, 2]
    assert d["comparison"]["rule"] == _cmp(rep).rule_text()
    assert Report.from_json(rep.to_json()) == rep
    plain = Report(status="clean", first=None)
    assert "comparison" not in plain.to_dict()  # replay's JSON layout is untouched
    assert Report.from_dict(plain.to_dict()).comparison is None
    over = compare(Overflow(), (torch.tensor([[300.0, 1.0]]), torch.tensor([0])), loss_fn=F.cross_entropy)
    # inf errors, a NaN loss and the "overflowed" headroom survive strict JSON (NaN != NaN: compare the dicts)
    assert Report.from_json(over.to_json()).to_dict() == over.to_dict()
    assert math.isnan(_cmp(Report.from_json(over.to_json())).amp_loss or 0.0)


def test_bad_arguments_are_input_errors() -> None:
    from nanhunt._util._errors import InputError

    batch: Any = (FLIP_X, FLIP_Y)
    for kw in ({"dtype": torch.float32}, {"task": "rank"}, {"rtol": -1.0}, {"max_flips": -1}):
        with pytest.raises(InputError):
            compare(Flip(), batch, loss_fn=F.cross_entropy, **kw)
    with pytest.raises(InputError, match="--task classify"):
        compare(Scalar(), torch.ones(2, 4), task="classify")


# ------------------------------------------------------------------ the command line


def test_cli_clean_model_within_tolerance_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a plain state_dict and batch of an ordinary classifier
    torch.manual_seed(0)
    files = _save(tmp_path, Net(), torch.randn(8, 8), torch.randint(0, 4, (8,)))
    out = tmp_path / "r.json"
    # WHEN it is compared in float16
    code = main(["compare", *files, "--model", f"{HELPERS}:Net", "--loss", CE, "--task", "classify",
                 "--report", str(out)])
    # THEN the rule holds: exit 0, the rule is printed, and the JSON says so
    assert code == 0
    text = capsys.readouterr().out
    assert text.startswith("ACCEPTED: autocast float16")
    assert "rule (fixed before the run): float32 reference finite, autocast float16 run finite, at most 0" in text
    c = json.loads(out.read_text())["comparison"]
    assert c["accepted"] is True and c["flipped"] == [] and c["violations"] == []
    assert c["near_boundary"] == [] and c["n_samples"] == 8


def test_cli_flip_exits_1_and_lists_the_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _save(tmp_path, Flip(), FLIP_X, FLIP_Y)
    out = tmp_path / "r.json"
    args = ["compare", *files, "--model", f"{HELPERS}:Flip", "--loss", CE, "--task", "classify"]
    assert main([*args, "--report", str(out)]) == 1
    text = capsys.readouterr().out
    assert "1 flipped (1), 2 near the boundary (1, 2)" in text and "FLIPPED" in text
    assert "violation: 1 decision flip (at most 0 allowed): sample 1" in text
    c = json.loads(out.read_text())["comparison"]
    assert c["flipped"] == [1] and c["near_boundary"] == [1, 2]
    txt = tmp_path / "r.txt"
    assert main([*args, "--max-flips", "1", "--report", str(txt)]) == 0
    assert txt.read_text().startswith("ACCEPTED: autocast float16")


def test_cli_prints_the_ranking_and_fails_on_tolerance_only_when_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _save(tmp_path, Carried(), CARRIED_X, CARRIED_Y)
    args = ["compare", *files, "--model", f"{HELPERS}:Carried", "--loss", CE]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "│ 1 │ lossy#0 (Linear)" in text
    assert "largest absolute error: head#0" in text
    assert main([*args, "--fail-on-tolerance"]) == 1
    assert main([*args, "--dtype", "bfloat16", "--rtol", "0.5", "--atol", "1", "--fail-on-tolerance"]) == 0


def test_cli_nonfinite_reference_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _save(tmp_path, Exploding(), torch.ones(2, 2), torch.tensor([0, 1]))
    assert main(["compare", *files, "--model", f"{HELPERS}:Exploding", "--loss", CE]) == 1
    assert capsys.readouterr().out.startswith("REFERENCE NON-FINITE: the float32 reference is non-finite, first at "
                                              "the output of module blow#0")


@pytest.mark.parametrize("extra", [["--dtype", "float32"], ["--rtol", "-1"], ["--max-flips", "-2"],
                                   ["--task", "classify", "--model", f"{HELPERS}:Scalar"], ["--report", "r.pdf"],
                                   ["--report", "r"]])
def test_cli_input_errors_exit_2(tmp_path: Path, extra: list[str]) -> None:
    files = _save(tmp_path, Scalar(), torch.ones(2, 4), torch.zeros(2))
    model = [] if "--model" in extra else ["--model", f"{HELPERS}:Scalar"]
    assert main(["compare", *files, *model, *extra]) == 2
