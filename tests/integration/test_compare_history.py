"""``nanhunt compare --report``'s history: a rule widened after a failing run of the same checkpoint is
visible in the new report as a warning naming the earlier rule's hash and the clause it failed.

The history is ``nanhunt-compare-history.jsonl`` in the report's directory, one JSON object per run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from nanhunt.cli import main
from nanhunt.comparison.engine import HISTORY_FILE, History
from nanhunt.records import Report
from tests._support.golden import render
from tests._support.compare import FLIP_X, FLIP_Y, Flip

ROOT = Path(__file__).resolve().parents[2]
CE = "torch.nn.functional:cross_entropy"
WARNING = re.compile(r"the rule changed after a failing run \(was ([0-9a-f]{12}) failing clause (.+), now "
                     r"([0-9a-f]{12}); \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00, nanhunt-compare-history\.jsonl\)")


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # --model tests._support.compare:Flip imports from the repository root


def _files(tmp_path: Path, name: str = "checkpoint.pt", scale: float = 1.0) -> list[str]:
    model = Flip()
    with torch.no_grad():
        model.head.weight.mul_(scale)
    ck, bt = tmp_path / name, tmp_path / "batch.pt"
    torch.save(model.state_dict(), ck)
    torch.save((FLIP_X, FLIP_Y), bt)
    return [str(ck), str(bt)]


def _run(files: list[str], tmp_path: Path, max_flips: int, report: str) -> tuple[int, Report]:
    """``nanhunt compare`` under a rule file allowing ``max_flips``, the report written to ``report``."""
    rule = tmp_path / "rule.json"
    rule.write_text(json.dumps({"task": "classify", "max_flips": max_flips}))
    out = tmp_path / report
    code = main(["compare", *files, "--model", "tests._support.compare:Flip", "--loss", CE, "--rule", str(rule),
                 "--report", str(out)])
    # only a JSON report is read back; another format's stands in as an empty report
    return code, Report.from_json(out.read_text()) if out.suffix == ".json" else Report(status="clean", first=None)


def _warnings(r: Report) -> tuple[str, ...]:
    assert r.comparison is not None
    return r.comparison.rule_warnings


def test_a_rule_widened_after_a_failing_run_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _files(tmp_path)
    # GIVEN a run that fails: sample 1 flips and the rule allows no flip
    code, first = _run(files, tmp_path, 0, "run1.json")
    assert code == 1 and _warnings(first) == ()
    capsys.readouterr()
    # WHEN the rule is widened to allow one flip and the same checkpoint compared again
    code, second = _run(files, tmp_path, 1, "run2.json")
    # THEN it passes, under another hash, and the report names the earlier hash and the clause it failed
    assert code == 0
    assert first.comparison is not None and second.comparison is not None
    old, new = first.comparison.rule_sha256, second.comparison.rule_sha256
    assert old != new
    (line,) = _warnings(second)
    m = WARNING.fullmatch(line)
    assert m is not None, line
    assert m.groups() == (old[:12], "max_flips (autocast float16)", new[:12])
    # AND the warning is printed before the run (stderr, with the rule) and in the report on stdout
    out, err = capsys.readouterr()
    assert f"warning: {line}" in err and f"warning: {line}" in " ".join(out.split())  # the console wraps
    assert err.index("rule sha256:") < err.index("warning: the rule changed")
    # AND in every format
    assert f"**Warning:** {line}." in render("md", second).replace("\\", "")
    assert "<b>Warning:</b> the rule changed after a failing run" in render("html", second)


def test_the_history_file_records_each_run(tmp_path: Path) -> None:
    files = _files(tmp_path)
    _run(files, tmp_path, 0, "a.json")
    _run(files, tmp_path, 1, "b.md")  # another report, another format, same directory: the same history
    runs = [json.loads(line) for line in (tmp_path / HISTORY_FILE).read_text().splitlines()]
    # THEN one line per run: the checkpoint by content hash, the rule by hash, the verdict and the failed clauses
    assert [(r["accepted"], r["failed"], r["report"]) for r in runs] == [
        (False, ["max_flips (autocast float16)"], str(tmp_path / "a.json")), (True, [], str(tmp_path / "b.md"))]
    assert runs[0]["checkpoint_sha256"] == runs[1]["checkpoint_sha256"] and len(runs[0]["checkpoint_sha256"]) == 64
    assert runs[0]["rule_sha256"] != runs[1]["rule_sha256"]
    assert json.loads(runs[1]["rule"]) == {"allow_nonfinite": [], "atol": None, "fail_on_tolerance": False,
                                           "higher_is_better": True, "max_flips": 1, "max_quality_drop": None,
                                           "metric": "accuracy", "min_quality": None, "rtol": None,
                                           "task": "classify"}
    assert runs[1]["batches"] == ["batch.pt"] and runs[1]["dtype"] == "float16"
    assert "the rule changed after a failing run" in (tmp_path / "b.md").read_text()


def test_a_report_in_a_missing_directory_gets_its_history_there(tmp_path: Path) -> None:
    # GIVEN a report path in a directory that does not exist yet
    files = _files(tmp_path)
    # WHEN compare writes it
    code, report = _run(files, tmp_path, 0, "new/dir/a.json")
    # THEN the directory is made and holds the report and the history of the run
    assert code == 1 and report.comparison is not None
    assert sorted(p.name for p in (tmp_path / "new" / "dir").iterdir()) == ["a.json", HISTORY_FILE]


def test_the_same_rule_again_warns_of_nothing_new(tmp_path: Path) -> None:
    files = _files(tmp_path)
    _run(files, tmp_path, 0, "1.json")
    # GIVEN the failing rule run again: no change of rule, no warning
    assert _warnings(_run(files, tmp_path, 0, "2.json")[1]) == ()
    # AND once widened, every later run under the wider rule still says it came after a failure
    assert len(_warnings(_run(files, tmp_path, 1, "3.json")[1])) == 1
    assert len(_warnings(_run(files, tmp_path, 1, "4.json")[1])) == 1
    # AND back to the first rule: the wider one never failed, so nothing to say
    assert _warnings(_run(files, tmp_path, 0, "5.json")[1]) == ()


def test_another_checkpoint_has_its_own_history(tmp_path: Path) -> None:
    _run(_files(tmp_path), tmp_path, 0, "1.json")
    # GIVEN other weights (scaled by 2: the same tie flips) compared under the wider rule in the same directory
    code, r = _run(_files(tmp_path, "other.pt", scale=2.0), tmp_path, 1, "2.json")
    # THEN no warning: that checkpoint never failed
    assert code == 0 and _warnings(r) == ()


def test_history_api_and_unreadable_lines(tmp_path: Path) -> None:
    files = _files(tmp_path)
    h = History.beside(str(tmp_path / "r.json"), files[0])
    # GIVEN a history holding a line that is no run, another checkpoint's failure and this one's
    (tmp_path / HISTORY_FILE).write_text("not json\n" + json.dumps(
        {"checkpoint_sha256": "0" * 64, "rule_sha256": "a" * 64, "accepted": False, "failed": ["x"]}) + "\n" +
        json.dumps({"checkpoint_sha256": h.checkpoint_sha256, "rule_sha256": "b" * 64, "accepted": False,
                    "failed": ["max_flips (autocast float16)", "amp_finite (autocast float16)"],
                    "time": "2026-01-02T03:04:05+00:00"}) + "\n")
    # THEN only this checkpoint's failure under another rule is named, with both clauses
    assert h.warnings("c" * 64) == (
        "the rule changed after a failing run (was bbbbbbbbbbbb failing clauses max_flips (autocast float16), "
        "amp_finite (autocast float16), now cccccccccccc; 2026-01-02T03:04:05+00:00, "
        "nanhunt-compare-history.jsonl)",)
    assert h.warnings("b" * 64) == ()
