"""Validating autocast on a fixed set (``nanhunt compare CKPT SET``): batches named by their files, a quality metric
on both runs, the acceptance rule as data (printed, hashed, its failed clause and samples named), several candidate
dtypes against one reference, speed only for a candidate that passed, and the reports showing all of it."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt import compare
from nanhunt._util._errors import InputError
from nanhunt.cli import main
from nanhunt.records import Comparison, Report, Rule

from tests._support.compare import Net, Overflow
from .set_models import RAMP_SET, SET, Boundary, Ramp, agreement, squared_error

ROOT = Path(__file__).resolve().parents[2]
MODELS = "tests.integration.set_models"
CE = "torch.nn.functional:cross_entropy"
ALLOW_BIG = Rule(task="classify", allow_nonfinite=("big",), max_quality_drop=0.0)


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # --model tests.integration.set_models:... imports from the repository root


def _cmp(report: Report) -> Comparison:
    assert report.comparison is not None
    return report.comparison


def _clauses(c: Comparison) -> list[str]:
    return [f.clause for f in c.failures]


@pytest.fixture
def set_files(tmp_path: Path) -> dict[str, Any]:
    """The checkpoint and the three batch files of ``SET`` in a directory of their own."""
    ck = tmp_path / "checkpoint.pt"
    torch.save(Boundary().state_dict(), ck)
    d = tmp_path / "set"
    d.mkdir()
    for name, batch in SET.items():
        torch.save(batch, d / name)
    (d / "README.txt").write_text("not a batch")  # a directory's other files are not batches
    return {"checkpoint": str(ck), "dir": str(d), "files": [str(d / n) for n in SET],
            "args": ["--model", f"{MODELS}:Boundary", "--loss", CE, "--task", "classify"]}


# ------------------------------------------------------------------ the library


def test_float16_flips_the_boundary_sample_bfloat16_does_not() -> None:
    # GIVEN a classifier whose float16 run overflows in `big` for one boundary sample (the overflow is absorbed:
    # 1 / inf = 0), a set of three batches and a rule that explains that overflow but allows no flip and no
    # loss of accuracy
    rep = compare(Boundary(), batches=SET, loss_fn=F.cross_entropy, dtype="float16,bfloat16", rule=ALLOW_BIG)
    fp16, bf16 = _cmp(rep).candidates()
    # THEN float16 fails the flip and the quality clauses, naming the sample by its file; bfloat16 passes
    assert (fp16.dtype, fp16.accepted, _clauses(fp16)) == ("float16", False, ["max_flips", "max_quality_drop"])
    assert [f.samples for f in fp16.failures] == [("boundary.pt:0",), ("boundary.pt:0",)]
    assert fp16.violations[0] == "1 decision flip (at most 0 allowed): sample boundary.pt:0"
    assert (bf16.dtype, bf16.accepted, bf16.failures, bf16.flipped) == ("bfloat16", True, (), ())
    assert rep.status == "diverged"
    # AND the accuracy is exact: 11 of 12 in float32 (one ordinary target is wrong on purpose), 10 of 12 in float16
    q16, qbf = fp16.quality, bf16.quality
    assert q16 is not None and qbf is not None
    assert (q16.metric, q16.n, q16.ref, q16.amp) == ("accuracy", 12, 11 / 12, 10 / 12)
    assert q16.drop() == 11 / 12 - 10 / 12 and q16.worse == (8,) and fp16.sample(8) == "boundary.pt:0"
    assert (qbf.ref, qbf.amp, qbf.drop()) == (11 / 12, 11 / 12, 0.0)
    # AND the overflow is allowed, not hidden
    assert fp16.amp_finite and fp16.allowed == ("boundary.pt: autocast float16: the output of module big#0 (Linear) "
                                                "(forward)",)
    # AND per batch, in the order given: the flip is in the boundary batch only, with its own accuracy
    assert [b.batch for b in fp16.batches] == ["ordinary.pt", "edge.pt", "boundary.pt"]
    assert [b.flipped for b in fp16.batches] == [(), (), (0,)]
    assert [(b.quality.ref, b.quality.amp) for b in fp16.batches if b.quality] == [(0.75, 0.75), (1.0, 1.0), (1.0, 0.75)]
    assert [b.accepted for b in fp16.batches] == [True, True, False]
    assert fp16.n_samples == 12 and fp16.flipped == (8,)
    assert fp16.modules[fp16.ranking[0]].label() == "big#0" and math.isinf(fp16.modules[fp16.ranking[0]].introduced or 0)
    # AND both candidates carry the same rule and hash
    assert fp16.acceptance == bf16.acceptance and fp16.rule_sha256 == bf16.rule_sha256 != ""


def test_without_the_allowance_the_overflow_fails_finiteness() -> None:
    rep = compare(Boundary(), batches=SET, loss_fn=F.cross_entropy, dtype=torch.float16, task="classify")
    c = _cmp(rep)
    assert rep.status == "nonfinite" and _clauses(c) == ["amp_finite", "max_flips"]
    assert c.violations[0] == ("the autocast float16 run is non-finite, first at boundary.pt: the output of module "
                               "big#0 (Linear) (forward)")
    assert [b.amp_finite for b in c.batches] == [True, True, False]


def test_an_allowed_module_never_excuses_a_nonfinite_loss() -> None:
    # GIVEN an overflow in `big` that reaches the output and the loss
    rep = compare(Overflow(), batches=[(torch.tensor([[300.0, 1.0]]), torch.tensor([0]))], loss_fn=F.cross_entropy,
                  rule=Rule(allow_nonfinite=("big",)))
    c = _cmp(rep)
    assert _clauses(c) == ["amp_finite"] and c.amp_first_nonfinite == "batch0: the loss"


def test_regressor_mse_and_max_error_are_exact() -> None:
    # GIVEN y = (1 + 2**-12) x on x = 1, 2, 4, 8 with targets x + 1: float32's error is 1 - x/4096, float16's 1
    rule = Rule(task="regress", max_quality_drop=0.0)
    c = _cmp(compare(Ramp(), batches=RAMP_SET, loss_fn=F.mse_loss, rule=rule))
    q = c.quality
    assert q is not None
    ref_mse = sum((1 - x / 4096) ** 2 for x in (1, 2, 4, 8)) / 4
    assert (q.metric, q.higher_is_better, q.n) == ("mse", False, 4)
    assert (q.ref, q.amp, q.ref_max_error, q.amp_max_error) == (ref_mse, 1.0, 1 - 1 / 4096, 1.0)
    assert q.drop() == 1.0 - ref_mse
    # THEN the drop fails the rule, naming the samples whose error grew most first
    assert _clauses(c) == ["max_quality_drop"]
    assert c.failures[0].samples == ("high.pt:1", "high.pt:0", "low.pt:1", "low.pt:0")
    # AND a minimum quality: mse at most 1 holds, at most 0.999 fails (float32 alone would pass it)
    assert _cmp(compare(Ramp(), batches=RAMP_SET, loss_fn=F.mse_loss,
                        rule=Rule(task="regress", min_quality=1.0))).accepted
    c = _cmp(compare(Ramp(), batches=RAMP_SET, loss_fn=F.mse_loss, rule=Rule(task="regress", min_quality=0.999)))
    assert _clauses(c) == ["min_quality"] and "fails it too" not in c.violations[0]
    assert "mse 1 under autocast float16 (at most 0.999 required)" in c.violations[0]


def test_user_metric_with_its_direction() -> None:
    c = _cmp(compare(Boundary(), batches=SET, loss_fn=F.cross_entropy, rule=Rule(allow_nonfinite=("big",),
                     min_quality=0.9), metric=agreement))
    q = c.quality
    assert q is not None and q.metric == f"{MODELS}:agreement" and (q.ref, q.amp) == (11 / 12, 10 / 12)
    assert _clauses(c) == ["min_quality"]
    c = _cmp(compare(Ramp(), batches=RAMP_SET, loss_fn=F.mse_loss, metric=squared_error))
    q = c.quality
    assert q is not None and q.higher_is_better is False and q.amp == 4.0 and c.acceptance is not None
    assert c.acceptance.higher_is_better is False


def test_the_rule_is_data_and_its_hash_changes_with_it() -> None:
    rule = Rule(task="classify", allow_nonfinite=("big",))
    c = _cmp(compare(Boundary(), batches=SET, loss_fn=F.cross_entropy, rule=rule))
    assert c.acceptance is not None and c.acceptance.metric == "accuracy"  # the default, made explicit
    canonical = c.acceptance.canonical()
    assert json.loads(canonical)["allow_nonfinite"] == ["big"]
    assert c.rule_sha256 == hashlib.sha256(canonical.encode()).hexdigest()
    widened = _cmp(compare(Boundary(), batches=SET, loss_fn=F.cross_entropy,
                           rule=dataclasses.replace(rule, max_flips=1)))
    assert widened.accepted and widened.rule_sha256 != c.rule_sha256
    again = _cmp(compare(Boundary(), batches=SET, loss_fn=F.cross_entropy, rule=rule))
    assert again.rule_sha256 == c.rule_sha256


def test_one_batch_reads_as_before() -> None:
    # GIVEN the old call (one batch, no name) THEN samples are plain indices and nothing names a file
    x, y = SET["boundary.pt"]
    c = _cmp(nanhunt.compare(Boundary(), (x, y), loss_fn=F.cross_entropy, task="classify", max_flips=1))
    assert c.batches == () and c.batch == "" and c.flipped == (0,) and _clauses(c) == ["amp_finite"]
    assert c.violations[0] == "the autocast float16 run is non-finite, first at the output of module big#0 (Linear) (forward)"
    assert c.quality is not None and c.quality.worse == (0,) and c.sample(0) == "0"


def test_bad_arguments_are_input_errors() -> None:
    x, y = SET["edge.pt"]
    for kw in ({"batches": SET}, {"rule": Rule(), "rtol": 1e-2}, {"rule": Rule(min_quality=0.5)},
               {"rule": Rule(task="regress", metric="accuracy", higher_is_better=False)},
               {"dtype": "float16,float16"}, {"speed": -1}):
        with pytest.raises(InputError):
            compare(Boundary(), (x, y), loss_fn=F.cross_entropy, **kw)
    with pytest.raises(InputError):
        compare(Boundary(), loss_fn=F.cross_entropy)


def test_old_comparison_files_still_load() -> None:
    # a comparison written before the rule became data: none of the new keys
    c = _cmp(compare(Boundary(), batches=SET, loss_fn=F.cross_entropy, rule=ALLOW_BIG))
    d = json.loads(Report(status="diverged", first=None, comparison=c).to_json())
    for k in ("acceptance", "rule_sha256", "failures", "quality", "allowed", "batch", "batches", "alternatives", "speed"):
        del d["comparison"][k]
    old = _cmp(Report.from_dict(d))
    assert old.acceptance is None and old.batches == () and old.violations == c.violations


# ------------------------------------------------------------------ the command line


def test_cli_directory_of_a_clean_model_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN an ordinary classifier and a directory of two batch files
    torch.manual_seed(0)
    ck = tmp_path / "net.pt"
    torch.save(Net().state_dict(), ck)
    d = tmp_path / "set"
    d.mkdir()
    torch.save((torch.randn(8, 8), torch.randint(0, 4, (8,))), d / "a.pt")
    torch.save((torch.randn(8, 8), torch.randint(0, 4, (8,))), d / "b.pt")
    # AND a look at stderr at the moment the runs start: the rule must already be printed
    cmp_mod = importlib.import_module("nanhunt.comparison.engine")  # the module (nanhunt.compare is the function)
    real = cmp_mod.compare
    seen: list[str] = []

    def spy(*a: Any, **kw: Any) -> Report:
        seen.append(capsys.readouterr().err)
        return real(*a, **kw)

    monkeypatch.setattr(cmp_mod, "compare", spy)
    out = tmp_path / "r.json"
    code = main(["compare", str(ck), str(d), "--model", "tests._support.compare:Net", "--loss", CE, "--task",
                 "classify", "--report", str(out)])
    assert code == 0
    assert "rule (fixed before the run): {" in seen[0] and "rule sha256: " in seen[0]
    text = capsys.readouterr().out
    assert text.startswith("ACCEPTED: autocast float16 against the float32 reference on 2 batches (16 samples)")
    c = json.loads(out.read_text())["comparison"]
    assert [b["batch"] for b in c["batches"]] == ["a.pt", "b.pt"] and c["accepted"] is True
    assert c["rule_sha256"] in seen[0]


def test_cli_two_dtypes_names_the_sample_and_clause_and_times_only_the_pass(
        set_files: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = main(["compare", set_files["checkpoint"], *set_files["files"], *set_files["args"], "--dtype",
                 "float16,bfloat16", "--allow-nonfinite", "big", "--max-quality-drop", "0", "--speed", "2",
                 "--report", str(out)])
    assert code == 1  # a candidate failed
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("REJECTED: autocast float16 REJECTED (2 violations), bfloat16 ACCEPTED against the "
                           "float32 reference on 3 batches (12 samples)")
    assert ("violation: autocast float16: 1 decision flip (at most 0 allowed): sample boundary.pt:0 "
            "(clause max_flips)") in text
    assert "speed of autocast float16 not measured: the candidate failed the rule" in text
    c = json.loads(out.read_text())["comparison"]
    assert c["speed"]["ratio_median"] is None and c["speed"]["reason"].startswith("not measured")
    bf = c["alternatives"][0]
    assert bf["dtype"] == "bfloat16" and bf["accepted"] and bf["speed"]["repeats"] == 2
    assert bf["speed"]["ratio_median"] > 0 and bf["speed"]["reason"] == ""


def test_cli_rule_file_and_its_hash(set_files: dict[str, Any], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    rule_path = tmp_path / "rule.json"
    rule_path.write_text(json.dumps({"task": "classify", "allow_nonfinite": ["big"]}))
    base = ["compare", set_files["checkpoint"], set_files["dir"], "--model", f"{MODELS}:Boundary", "--loss", CE]
    out = tmp_path / "r.json"
    # GIVEN a rule file WHEN float16 fails it THEN the report holds the rule and its hash
    assert main([*base, "--rule", str(rule_path), "--report", str(out)]) == 1
    first = json.loads(out.read_text())["comparison"]
    assert first["rule_sha256"] == Rule(task="classify", metric="accuracy", higher_is_better=True,
                                        allow_nonfinite=("big",)).sha256()
    assert first["failures"] == [{"clause": "max_flips", "message": "1 decision flip (at most 0 allowed): sample "
                                  "boundary.pt:0", "samples": ["boundary.pt:0"]}]
    # WHEN the rule is widened after the failure THEN it passes, under another hash
    rule_path.write_text(json.dumps({"task": "classify", "allow_nonfinite": ["big"], "max_flips": 1}))
    assert main([*base, "--rule", str(rule_path), "--report", str(out)]) == 0
    assert json.loads(out.read_text())["comparison"]["rule_sha256"] != first["rule_sha256"]
    capsys.readouterr()
    # AND a rule file is checked: unknown keys, flags that would change it, an unconfirmed metric function
    for content, extra in (({"max_flip": 1}, []), ({"task": "classify"}, ["--max-flips", "2"]),
                           ({"task": "classify", "max_flips": -1}, []), ({"task": "regress"}, ["--task", "classify"]),
                           ({"metric": f"{MODELS}:agreement"}, [])):
        rule_path.write_text(json.dumps(content))
        assert main([*base, "--rule", str(rule_path), *extra]) == 2, content
    err = capsys.readouterr().err
    assert "unknown key(s) 'max_flip'" in err and f"pass --metric {MODELS}:agreement to confirm" in err
    rule_path.write_text(json.dumps({"metric": f"{MODELS}:agreement", "min_quality": 0.9,
                                     "allow_nonfinite": ["big"]}))
    assert main([*base, "--rule", str(rule_path), "--metric", f"{MODELS}:agreement", "--dtype", "bfloat16"]) == 0
    assert main([*base, "--rule", str(rule_path), "--metric", f"{MODELS}:agreement"]) == 1
    assert "(clause min_quality)" in " ".join(capsys.readouterr().out.split())


def test_cli_input_errors(set_files: dict[str, Any], tmp_path: Path) -> None:
    base = ["compare", set_files["checkpoint"], *set_files["files"], *set_files["args"]]
    empty = tmp_path / "empty"
    empty.mkdir()
    for extra in (["--dtype", "float16,float32"], ["--speed", "0"], ["--min-quality", "nan"],
                  ["--rule", str(tmp_path / "missing.json")]):
        assert main([*base, *extra]) == 2, extra
    assert main(["compare", set_files["checkpoint"], str(empty), *set_files["args"]]) == 2


# ------------------------------------------------------------------ the reports


def test_every_format_shows_the_rule_its_hash_and_the_failed_clause(tmp_path: Path) -> None:
    from tests._support.golden import render

    rep = compare(Boundary(), batches=SET, loss_fn=F.cross_entropy, dtype="float16,bfloat16", rule=ALLOW_BIG,
                  speed=1)
    c = _cmp(rep)
    for fmt in ("md", "html", "console"):
        out = render(fmt, rep, width=400)
        flat = " ".join(out.split())
        for needle in (c.rule_sha256, "max_flips", "max_quality_drop", "boundary.pt:0", "bfloat16", "ordinary.pt"):
            assert needle in flat, (fmt, needle)
        assert "quality (accuracy, higher is better) on 12 samples".lower() in flat.lower(), fmt
        assert "not measured: the candidate failed the rule" in flat, fmt
    md = render("md", rep)
    marks = ["**Rule (fixed before the run):**", "**Rule sha256:**", "Violations:", "Allowed by the rule:",
             "#### Candidates", "### autocast float16: REJECTED", "#### Batches", "#### Quality",
             "### autocast bfloat16: ACCEPTED", "#### Speed, after validation", "#### Reproduce"]
    at = [md.index(m) for m in marks]
    assert at == sorted(at)
    assert "| boundary.pt | 4 | finite | finite | 1 (boundary.pt:0) | 1 | 0.75 |" in md
    assert "| float16 | REJECTED | max\\_flips, max\\_quality\\_drop | boundary.pt:0 |" in md
    assert Report.from_json(render("json", rep)) == rep
    from tests.unit.test_compare_report import _parse

    assert all(len(set(t)) == 1 for t in _parse(render("html", rep)).tables)  # every row has the header's cells
