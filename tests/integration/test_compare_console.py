"""``nanhunt compare`` when the autocast run is non-finite: non-finite samples are their own category,
never flips; the console shows the counts per category and the worst rows, the other formats every row. And
``--speed``'s peak memory on CPU: measured where Linux lets the peak RSS be reset, "not measured"
elsewhere (structure only: no number is asserted).

Goldens: ``tests/golden/compare.nonfinite.{txt,md}`` from a real run of :class:`Mixed`; regenerate with
NANHUNT_UPDATE_GOLDEN=1 and read the diff.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt import compare
from nanhunt.cli import main
from nanhunt.records import Comparison, Report
from tests._support.golden import check_golden, fixed_environment, prints_alike, render
from tests._support.compare import FLIP_SCORES, FLIP_X, FLIP_Y, Flip

ROOT = Path(__file__).resolve().parents[2]
CE = "torch.nn.functional:cross_entropy"
N_BAD = 20  # samples whose float16 scores are NaN
MIX = 2.0 ** -13  # exact in float32 and float16 (above float16's smallest normal, 2**-14)


class Mixed(nn.Module):
    """Scores of ``FLIP_SCORES`` (the first four features pick a row), plus ``mix(big(x[:, 4:]))``: exactly 0 in
    float32 (300 * 300 = 90000 twice, times 2**-13 and -2**-13), NaN under float16 autocast where x[:, 4] = 300
    (90000 > 65504 gives inf; inf * 2**-13 - inf * 2**-13 and inf * 0 are NaN).

    The mix weights are powers of two so that 90000 * 2**-13 is exact: with 1e-4 (not exact in float32) a kernel
    that fuses the multiply-add (MKL's AVX-512 sgemm) leaves the product's rounding error, 2.3e-07, in place of
    0, and the goldens' margins read 0.0002998 where other kernels give 0.0003."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)
        self.big = nn.Linear(1, 2, bias=False)
        self.mix = nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor(FLIP_SCORES).T)
            self.head.bias.zero_()
            self.big.weight.fill_(300.0)
            self.mix.weight.copy_(torch.tensor([[MIX, -MIX], [0.0, 0.0], [0.0, 0.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x[:, :4]) + self.mix(self.big(x[:, 4:]))  # type: ignore[no-any-return]


def mixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 0-3: the flip rows (1 flips, 2 near the boundary); rows 4-23: the same rows with x[:, 4] = 300."""
    x = torch.zeros(4 + N_BAD, 5)
    for i in range(4 + N_BAD):
        x[i, i % 4] = 1.0
    x[4:, 4] = 300.0
    return x, torch.tensor([0, 1, 1, 2] * (1 + N_BAD // 4))


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # --model tests.integration.test_compare_console:Mixed imports from the repository root


def _cmp(report: Report) -> Comparison:
    assert report.comparison is not None
    return report.comparison


def _mixed() -> Report:
    return fixed_environment(
        compare(Mixed(), mixed_batch(), loss_fn=F.cross_entropy, dtype=torch.float16, task="classify"))


def test_the_goldens_run_computes_the_same_on_every_machine() -> None:
    # GIVEN the model and batch the goldens come from
    m, (x, _) = Mixed(), mixed_batch()
    with torch.no_grad():
        f32, f64 = m(x), m.double()(x.double())
    # THEN its float32 scores equal float64's: exact, so no kernel (fused multiply-add, another order) changes them
    assert torch.equal(f32.double(), f64)
    # AND the one number the goldens show that cannot be exact, the reference loss, is far from a rounding boundary
    ref_loss = _cmp(_mixed()).ref_loss
    assert ref_loss is not None and prints_alike(ref_loss) and f"{ref_loss:.4g}" == "0.5285"


def test_nonfinite_samples_are_no_flips() -> None:
    # GIVEN 24 samples: one tie that float16 flips (1), twenty whose float16 scores are NaN (4-23)
    c = _cmp(_mixed())
    # THEN the NaN rows are their own category, and only the tie is a flip
    assert c.nonfinite == tuple(range(4, 24)) and c.flipped == (1,)
    assert c.near_boundary == (1, 2, 5, 6, 9, 10, 13, 14, 17, 18, 21, 22)
    assert [(d.index, d.amp_class, d.flipped) for d in c.decisions if d.index in c.nonfinite] == [
        (i, -1, False) for i in range(4, 24)]
    # AND the rule fails on two clauses: the non-finite run (naming the 20 samples) and the one flip
    assert [(f.clause, f.samples) for f in c.failures] == [
        ("amp_finite", tuple(str(i) for i in range(4, 24))), ("max_flips", ("1",))]
    assert c.violations[1] == "1 decision flip (at most 0 allowed): sample 1"
    # AND a failure's message names at most 20 samples, its samples all of them
    assert c.violations[0].endswith("non-finite output in samples " + ", ".join(map(str, range(4, 24))))


def test_console_shows_the_counts_and_the_worst_rows_only() -> None:
    r = _mixed()
    text = render("console", r, width=1000)
    # THEN one line of counts per category, every sample in exactly one
    assert "by category: 3 agree (same class), 1 flipped, 20 non-finite (autocast scores hold NaN/Inf: no " \
           "decision)" in text
    assert "decisions: 24 samples, 1 flipped (1), 12 near the boundary (1, 2, 5, 6, 9, 10, 13, 14, 17, 18, 21, " \
           "22), 20 non-finite (4, 5, " in text
    # AND ten rows, the flip first, then the non-finite ones in sample order; the rest counted
    table = text[text.index("by category:"):text.index("... and 12 more")]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["1", *map(str, range(4, 13))]
    assert rows[0].split("│")[6].strip() == "FLIPPED" and rows[1].split("│")[6].strip() == "NON-FINITE"
    assert "... and 12 more: the JSON, Markdown and HTML reports (--report) list every sample" in text
    assert text.count("FLIPPED") == 1
    check_golden("compare.nonfinite.txt", render("console", r))


def test_markdown_html_and_json_list_every_sample() -> None:
    r = _mixed()
    md = render("md", r)
    # THEN all 22 listed samples (the flip, the near-boundary one, the 20 non-finite), each row once
    assert md.count("| NON-FINITE |") == 20 and md.count("| FLIPPED |") == 1
    assert md.count("| near the boundary, unchanged |") == 1
    assert "| 4 | 0 (1) | 1.5 | -1 | nan | NON-FINITE |" in md
    assert "By category: 3 agree (same class), 1 flipped, 20 non-finite" in md
    page = render("html", r)
    assert page.count('<tr class="nonfinite">') == 20 and page.count('<tr class="flip">') == 1
    assert "20 non-finite samples</span>" in page
    back = Report.from_json(render("json", r))
    assert _cmp(back).nonfinite == tuple(range(4, 24)) and back.to_dict() == r.to_dict()
    check_golden("compare.nonfinite.md", md)


def test_a_set_numbers_the_nonfinite_samples_across_it() -> None:
    # GIVEN the mixed batch split in two files of a set
    x, y = mixed_batch()
    r = compare(Mixed(), batches={"a.pt": (x[:6], y[:6]), "b.pt": (x[6:], y[6:])}, loss_fn=F.cross_entropy,
                task="classify")
    c = _cmp(r)
    # THEN the totals count across the set and name each sample by its file
    assert c.nonfinite == tuple(range(4, 24)) and c.flipped == (1,)
    assert [b.nonfinite for b in c.batches] == [(4, 5), tuple(range(18))]
    assert c.failures[0].samples == ("a.pt:4", "a.pt:5", *(f"b.pt:{i}" for i in range(18)))
    assert "non-finite output in samples a.pt:4, a.pt:5, b.pt:0, " in c.violations[0]
    assert c.violations[0].endswith("b.pt:17")  # 20 named: all of them
    text = render("console", r, width=1000)
    assert "20 non-finite (a.pt:4, a.pt:5, b.pt:0" in text


def test_a_long_list_of_samples_is_cut_in_the_message_only() -> None:
    # GIVEN 40 NaN rows
    x = torch.zeros(40, 5)
    x[:, 0] = 1.0
    x[:, 4] = 300.0
    c = _cmp(compare(Mixed(), (x, torch.zeros(40, dtype=torch.long)), loss_fn=F.cross_entropy, task="classify"))
    # THEN the message names 20 and counts the rest; the failure keeps all 40
    assert c.violations[0].endswith("non-finite output in samples " + ", ".join(map(str, range(20)))
                                    + ", ... (20 more)")
    assert c.failures[0].samples == tuple(map(str, range(40))) and c.flipped == ()


def test_cli_nonfinite_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck, bt = tmp_path / "checkpoint.pt", tmp_path / "batch.pt"
    torch.save(Mixed().state_dict(), ck)
    torch.save(mixed_batch(), bt)
    out = tmp_path / "r.json"
    code = main(["compare", str(ck), str(bt), "--model", "tests.integration.test_compare_console:Mixed", "--loss", CE,
                 "--task", "classify", "--report", str(out)])
    assert code == 1
    text = capsys.readouterr().out
    assert text.count("NON-FINITE\n") + text.count("NON-FINITE ") >= 9 and text.count("FLIPPED") == 1
    c = json.loads(out.read_text())["comparison"]
    assert c["nonfinite"] == list(range(4, 24)) and c["flipped"] == [1] and len(c["decisions"]) == 22


# ------------------------------------------------------------------ --speed: peak memory on CPU


def _speed() -> Comparison:
    return _cmp(compare(Flip(), (FLIP_X, FLIP_Y), loss_fn=F.cross_entropy, task="classify", max_flips=1, speed=2))


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="the peak RSS cannot be reset here")
def test_speed_measures_peak_rss_growth_on_cpu() -> None:
    # GIVEN a candidate that passes WHEN timed THEN both peaks are byte counts measured by VmHWM (no value asserted)
    c = _speed()
    sp = c.speed
    assert sp is not None and sp.reason == "" and sp.repeats == 2
    assert isinstance(sp.ref_peak_bytes, int) and isinstance(sp.amp_peak_bytes, int)
    assert sp.ref_peak_bytes >= 0 and sp.amp_peak_bytes >= 0
    assert sp.peak_memory == "peak RSS growth (Linux VmHWM) above the resident size before each batch"
    text = render("console", Report(status="clean", first=None, comparison=c), width=1000)
    assert ("peak memory: peak RSS growth (Linux VmHWM) above the resident size before each batch, in one untimed "
            "pass per run") in text
    assert "MiB" in text and "not measured" not in text


def test_speed_says_not_measured_where_the_peak_cannot_be_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN no writable clear_refs (not Linux, or not allowed)
    monkeypatch.setattr(sys.modules["nanhunt.comparison._speed"], "_CLEAR_REFS", "/nonexistent/clear_refs")
    c = _speed()
    sp = c.speed
    # THEN the times are there, the peaks are None and say why, in every format
    assert sp is not None and sp.ratio_median is not None and math.isfinite(sp.ratio_median)
    assert sp.ref_peak_bytes is None and sp.amp_peak_bytes is None
    assert sp.peak_memory.startswith("not measured: the peak resident set cannot be reset here")
    r = Report(status="clean", first=None, comparison=c)
    for fmt in ("console", "md", "html"):
        out = render(fmt, r, width=1000) if fmt == "console" else render(fmt, r)
        assert out.count("not measured") >= 3, fmt  # two cells and the line saying why
