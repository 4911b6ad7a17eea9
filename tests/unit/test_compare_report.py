"""Comparison reports (``nanhunt compare``) in every format: Markdown, HTML with its picture of error by module,
console, JSON; goldens, hostile module names, a self-contained page, and the command line.

Regenerate the golden files (``tests/golden/compare.*``) after an intended change with

    NANHUNT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_compare_report.py -q -p no:cacheprovider

and read the diff before committing it. The reports here are built by hand (no torch); only the command-line tests
at the end run a model.
"""

from __future__ import annotations

import base64
import dataclasses
import html.parser
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._support.golden import GOLDEN, check_golden, markdown_to_html, render
from nanhunt.records import Comparison, Decision, Regression, Report, TensorDiff

ROOT = Path(__file__).resolve().parents[2]
TIE_RULE = "equal top scores go to the lowest class index, in both runs; a row holding NaN has no class (-1)"
HOSTILE = "enc.[bold red]lay[/].<script>alert(1)</script>|`x``y`|$x$"
HOSTILE_CLASS = "Evil<img src=x onerror=alert(1)>*cls*"


# ------------------------------------------------------------------ the fixed reports


def _diff(name: str, call: int, cls: str | None, depth: int, scaled: float, introduced: float | None,
          input_scaled: float | None, *, kind: str = "module", max_abs: float | None = None, ref_absmax: float = 1.0,
          out_of_tol: float = 0.0, headroom: float | None = 1e4, underflow: int = 0, dtype: str = "float16",
          shape: tuple[int, ...] = (8, 32)) -> TensorDiff:
    numel = 1
    for s in shape:
        numel *= s
    return TensorDiff(name=name, kind=kind, call_index=call, module_class=cls, dtype=dtype, shape=shape, numel=numel,
                      max_abs=scaled * ref_absmax if max_abs is None else max_abs, max_rel=scaled * 2, scaled=scaled,
                      out_of_tol=out_of_tol, headroom=headroom, underflow=underflow, ref_absmax=ref_absmax,
                      input_scaled=input_scaled, introduced=introduced, depth=depth)


def sample_comparison(module: str = "enc.layers.1.attn.proj", cls: str = "Linear") -> Report:
    """A classifier compared in float16: ``module`` introduces most of the error, ``head`` carries the largest
    absolute error, sample 3 flips and sample 6 is near the boundary; one module call ran in float32 only."""
    modules = (
        _diff("", 0, "TinyClassifier", 0, 0.0123, 0.0, 0.0, ref_absmax=33.3, out_of_tol=0.5, headroom=1967.0),
        _diff("embed", 0, "Embedding", 1, 0.0, 0.0, 0.0, headroom=math.inf, shape=(8, 16)),
        _diff("norm", 0, "LayerNorm", 1, 0.00021, 0.00021, 0.0, ref_absmax=3.1, headroom=2.1e4),
        _diff("enc", 0, "Sequential", 1, 0.0121, 0.0, 0.00021, ref_absmax=7.5, out_of_tol=0.31, headroom=8733.0),
        _diff("enc.layers.0", 0, "Block", 2, 0.00052, 0.00031, 0.00021, ref_absmax=5.0, headroom=1.3e4),
        _diff("enc.layers.1", 0, "Block", 2, 0.0121, 0.0, 0.00052, ref_absmax=7.5, out_of_tol=0.31, headroom=8733.0),
        _diff(module, 0, cls, 3, 0.0121, 0.0116, 0.00052, ref_absmax=7.5, out_of_tol=0.31, headroom=8733.0),
        _diff("norm", 1, "LayerNorm", 1, 0.01215, 5e-05, 0.0121, ref_absmax=3.2, out_of_tol=0.12, headroom=2.0e4,
              underflow=3),
        _diff("head", 0, "Linear", 1, 0.0123, 0.00012, 0.01215, ref_absmax=33.3, out_of_tol=0.5, headroom=1967.0,
              shape=(8, 4)),
    )
    ranking = (6, 4, 8, 7)
    decisions = (
        Decision(index=3, ref_class=2, amp_class=0, ref_runner_up=0, ref_margin=0.0004, amp_margin=0.0, ref_score=4.1,
                 amp_score=4.1, flipped=True, near_boundary=True),
        Decision(index=6, ref_class=1, amp_class=1, ref_runner_up=3, ref_margin=0.0009, amp_margin=0.001953,
                 ref_score=2.5, amp_score=2.5, flipped=False, near_boundary=True),
    )
    c = Comparison(
        dtype="float16", device_type="cpu", rtol=0.001, atol=1e-05, task="classify", max_flips=0,
        fail_on_tolerance=False, tie_rule=TIE_RULE, accepted=False,
        violations=("1 decision flip (at most 0 allowed): sample 3",), reference_finite=True,
        reference_first_nonfinite=None, amp_finite=True, amp_first_nonfinite=None, ref_loss=1.2345, amp_loss=1.2351,
        modules=modules, ranking=ranking,
        output=_diff("<output>", 0, None, 0, 0.0123, None, None, kind="output", ref_absmax=33.3, out_of_tol=0.5,
                     headroom=1967.0, shape=(8, 4)),
        loss=_diff("<loss>", 0, None, 0, 0.00049, None, None, kind="loss", ref_absmax=1.2345, out_of_tol=1.0,
                   headroom=5.3e4, dtype="float32", shape=()),
        grads=(
            _diff("embed.weight", 0, None, 0, 0.0021, None, None, kind="grad", dtype="float32", shape=(100, 16),
                  underflow=5, headroom=1.1e6),
            _diff(f"{module}.weight", 0, None, 0, 0.0098, None, None, kind="grad", dtype="float32", shape=(32, 32),
                  headroom=3.0e5),
            _diff("head.bias", 0, None, 0, 0.0004, None, None, kind="grad", dtype="float32", shape=(4,),
                  headroom=2.2e6),
        ),
        n_samples=8, flipped=(3,), near_boundary=(3, 6), decisions=decisions, regression=None,
        unmatched=("module call enc.layers.1.drop#0 (float32 run only)",),
    )
    return Report(
        status="diverged", first=None, loss=1.2345,
        config={"dtype": "float16", "device_type": "cpu", "train": False, "loss_fn": "cross_entropy",
                "task": "classify", "rtol": 0.001, "atol": 1e-05, "max_flips": 0, "fail_on_tolerance": False,
                "scaler_scale": None},
        module_classes={m.name: m.module_class or "" for m in modules},
        environment={"nanhunt": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7", "os": "Linux-6.1-x86_64",
                     "device_type": "cpu", "device": "Intel(R) Xeon(R) Processor"},
        command="nanhunt compare fixtures/flip/checkpoint.pt fixtures/flip/batch.pt --task classify --report out.html",
        notes=("captured with torch 2.12.0, compared with 2.13.0+cpu",),
        comparison=c,
    )


def hostile_comparison() -> Report:
    r = sample_comparison(HOSTILE, HOSTILE_CLASS)
    c = r.comparison
    assert c is not None
    c = dataclasses.replace(c, amp_finite=False, amp_first_nonfinite=f"the output of module {HOSTILE}#0 (forward)",
                            violations=(*c.violations, f"the autocast float16 run is non-finite, first at {HOSTILE}#0"),
                            unmatched=(f"gradient of {HOSTILE}.bias (float32 run only)",))
    return dataclasses.replace(r, comparison=c, notes=(f"note about {HOSTILE} **bold** _it_ [link](x)",),
                               command=f"nanhunt compare 'a|b.pt' '{HOSTILE}' --report out.html")


def _cmp(r: Report) -> Comparison:
    assert r.comparison is not None
    return r.comparison


def reference_nonfinite() -> Report:
    """As compare returns it when float32 itself overflows: nothing compared."""
    r = sample_comparison()
    why = ("the float32 reference is non-finite, first at the output of module blow#0 (Exp) (forward): not a "
           "precision finding; fix the float32 step first (nanhunt replay --dtype float32 names the op)")
    c = dataclasses.replace(_cmp(r), accepted=False, violations=(why,), reference_finite=False,
                            reference_first_nonfinite="the output of module blow#0 (Exp) (forward)", amp_finite=None,
                            amp_loss=None, ref_loss=math.nan, modules=(), ranking=(), output=None, loss=None, grads=(),
                            n_samples=0, flipped=(), near_boundary=(), decisions=(), unmatched=())
    return dataclasses.replace(r, status="reference-nonfinite", comparison=c)


def amp_overflow() -> Report:
    """float16 overflows in ``big``: infinite errors, an overflowed headroom, a NaN loss; task none."""
    r = sample_comparison()
    modules = (
        _diff("", 0, "Overflow", 0, math.inf, 0.0, 0.0, max_abs=math.inf, out_of_tol=0.5, headroom=None),
        _diff("small", 0, "Linear", 1, 0.0, 0.0, 0.0, headroom=218.3),
        _diff("big", 0, "Linear", 1, math.inf, math.inf, 0.0, max_abs=math.inf, out_of_tol=0.25, headroom=None),
        _diff("head", 0, "Linear", 1, math.inf, 0.0, math.inf, max_abs=math.inf, out_of_tol=0.5, headroom=None),
    )
    inf_out = _diff("<output>", 0, None, 0, math.inf, None, None, kind="output", max_abs=math.inf, out_of_tol=0.5,
                    headroom=None)
    c = dataclasses.replace(_cmp(r), task="none", tie_rule="", violations=(
        "the autocast float16 run is non-finite, first at the output of module big#0 (Linear) (forward)",),
        amp_finite=False, amp_first_nonfinite="the output of module big#0 (Linear) (forward)", amp_loss=math.nan,
        modules=modules, ranking=(2,), output=inf_out, loss=dataclasses.replace(inf_out, name="<loss>", kind="loss"),
        grads=(), n_samples=0, flipped=(), near_boundary=(), decisions=(), unmatched=())
    return dataclasses.replace(r, status="nonfinite", comparison=c)


def regress_clean() -> Report:
    """Accepted, task regress, no module call introduces error."""
    r = sample_comparison()
    modules = tuple(dataclasses.replace(m, introduced=0.0, scaled=0.0, input_scaled=0.0, max_abs=0.0, max_rel=0.0,
                                        out_of_tol=0.0) for m in _cmp(r).modules)
    c = dataclasses.replace(_cmp(r), task="regress", tie_rule="", accepted=True, violations=(), modules=modules,
                            ranking=(), n_samples=8, flipped=(), near_boundary=(), decisions=(),
                            regression=Regression(ref_min=-3.2, ref_max=4.8, amp_min=-3.2, amp_max=4.8,
                                                  worst=((0, 0.0), (1, 0.0))), unmatched=())
    return dataclasses.replace(r, status="clean", comparison=c, command=None, notes=())


def many_calls(n: int = 260) -> Report:
    """More module calls than any table or picture shows."""
    r = sample_comparison()
    modules = tuple(_diff(f"blocks.{i}", 0, "Block", 1, 1e-4 * (1 + i % 7), 1e-5 * (i % 5), 1e-4)
                    for i in range(n))
    ranking = tuple(sorted((i for i, m in enumerate(modules) if (m.introduced or 0) > 0),
                           key=lambda i: (-(modules[i].introduced or 0.0), i)))
    return dataclasses.replace(r, comparison=dataclasses.replace(_cmp(r), modules=modules, ranking=ranking))


def _variants() -> list[Report]:
    return [sample_comparison(), hostile_comparison(), reference_nonfinite(), amp_overflow(), regress_clean(),
            many_calls()]


# ------------------------------------------------------------------ helpers


class _Page(html.parser.HTMLParser):
    """Tags, attributes, text, and the cell count of every row of every table."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str, str | None]] = []
        self.text: list[str] = []
        self.tables: list[list[int]] = []
        self._open: list[list[int]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += [(tag, k, v) for k, v in attrs]
        if tag == "table":
            self._open.append([])
        elif tag == "tr" and self._open:
            self._open[-1].append(0)
        elif tag in ("td", "th") and self._open and self._open[-1]:
            self._open[-1][-1] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "table" and self._open:
            self.tables.append(self._open.pop())

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    p.close()
    return p


def _md_text(md: str) -> str:
    """What a reader sees of the Markdown: the text of its HTML rendering."""
    return "".join(_parse(markdown_to_html(md)).text)


# ------------------------------------------------------------------ goldens


@pytest.mark.parametrize("fmt,name", [("md", "compare.md"), ("html", "compare.html"), ("console", "compare.txt"),
                                      ("json", "compare.json")])
def test_golden(fmt: str, name: str) -> None:
    # GIVEN the fixed comparison WHEN rendered THEN byte for byte the golden file
    check_golden(name, render(fmt, sample_comparison()))


def test_golden_hostile_markdown() -> None:
    check_golden("compare.hostile.md", render("md", hostile_comparison()))


def test_json_golden_reads_back() -> None:
    text = (GOLDEN / "compare.json").read_text(encoding="utf-8")
    assert Report.from_json(text) == sample_comparison()


# ------------------------------------------------------------------ the same sentences everywhere


@pytest.mark.parametrize("make", [sample_comparison, reference_nonfinite, amp_overflow, regress_clean])
def test_status_and_rule_are_the_same_in_every_format(make: Any) -> None:
    from nanhunt.report._compare_text import compare_summary

    r = make()
    summary, rule = compare_summary(r), _cmp(r).rule_text()
    console = " ".join(render("console", r, width=1000).split())
    page = "".join(_parse(render("html", r)).text)
    md = _md_text(render("md", r))
    for out in (console, page, md):
        assert summary in out and rule in out
    assert console.startswith(summary)
    assert render("md", r).startswith("## nanhunt compare: ")
    for v in _cmp(r).violations:
        assert v in page and v in md


def test_report_order() -> None:
    # The status and the rule, the runs, the picture (HTML), the ranking, the decisions, output and loss, the rest.
    md = render("md", sample_comparison())
    marks = ["**REJECTED: autocast float16", "**Rule (fixed before the run):**", "Violations:", "#### Runs",
             "#### Where the error is introduced", "Largest absolute error: `head#0`", "All 9 module calls",
             "#### Decisions", "#### Output and loss", "Gradients: 3 tensors", "Not compared",
             "#### Configuration and environment", "#### Reproduce", "nanhunt compare fixtures", "Notes (1)"]
    at = [md.index(m) for m in marks]
    assert at == sorted(at)
    from nanhunt.report.html import render as page

    out = page(sample_comparison())
    marks = ["REJECTED: autocast float16", "Rule (fixed before the run)", "<h2>Runs", "<h2>Error by module",
             "data:image/png;base64,", "<h2>Where the error is introduced", "All 9 module calls", "<h2>Decisions",
             "<h2>Output and loss", "Gradients: 3 tensors", "Not compared", "<h2>Configuration and environment",
             "<h2>Reproduce", "Notes (1)"]
    at = [out.index(m) for m in marks]
    assert at == sorted(at)


def test_content_of_the_comparison() -> None:
    r = sample_comparison()
    md = render("md", r)
    # the ranking: the introducing module first, with its class, its numbers right-aligned
    assert "| 1 | `enc.layers.1.attn.proj#0` (Linear) | 0.0116 | 0.0121 | 0.00052 |" in md
    assert "| 2 | `enc.layers.0#0` (Block) |" in md and "| 4 | `norm#1` (LayerNorm) |" in md
    # every call in the folded table, in execution order, with its rank and depth
    assert "| `enc.layers.1.attn.proj#0` (Linear) (rank 1) | 3 |" in md
    assert "| `embed#0` (Embedding) | 1 | 0 | 0 | 0 | 0 | 0 | 0 | inf | 0 |" in md
    # decisions: the flipped sample and the near-boundary one
    assert "**8 samples, 1 flipped (3), 2 near the boundary (3, 6).**" in md
    assert "| 3 | 2 (0) | 0.0004 | 0 | 0 | FLIPPED |" in md
    assert "| 6 | 1 (3) | 0.0009 | 1 | 0.001953 | near the boundary, unchanged |" in md
    # gradients: largest error first
    grads = md[md.index("Gradients: 3 tensors"):]
    assert grads.index("enc.layers.1.attn.proj.weight") < grads.index("embed.weight") < grads.index("head.bias")
    page = _parse(render("html", r))
    text = "".join(page.text)
    assert "FLIPPED" in text and "near the boundary, unchanged" in text and "rank 1" in text
    assert ("tr", "class", "flip") in page.attrs and ("tr", "class", "near") in page.attrs
    assert ("span", "class", "badge b-bad") in page.attrs
    for table in page.tables:  # every row of a table has the header's number of cells
        assert len(set(table)) == 1, table


def test_variants_in_every_format() -> None:
    for r in _variants():
        for fmt in ("md", "html", "console", "json"):
            out = render(fmt, r)
            assert out.endswith("\n") and len(out) > 200, fmt
            if fmt == "html":
                p = _parse(out)
                assert all(len(set(t)) == 1 for t in p.tables)
            if fmt == "md":
                assert out.count("<details>") == out.count("</details>")
            if fmt == "json":
                assert Report.from_json(out).to_dict() == r.to_dict()


def test_reference_nonfinite_compares_nothing() -> None:
    r = reference_nonfinite()
    md, page = render("md", r), render("html", r)
    for out in (md, page, render("console", r)):
        assert "REFERENCE NON-FINITE" in out and "othing was compared" in out
        assert "Decisions" not in out and "decisions:" not in out  # nothing was compared: no decisions either
        assert "Where the error is introduced" not in out
    assert "**autocast float16:** not run" in md
    from nanhunt.report.picture import comparison_figure, png

    assert comparison_figure(r) is None and png(r) is None
    assert "<img" not in _render_page_with_picture(r)


def test_amp_overflow_shows_infinite_errors() -> None:
    r = amp_overflow()
    md = render("md", r)
    assert "| 1 | `big#0` (Linear) | inf | inf | 0 | inf | inf | 25.0% | overflowed | 0 |" in md
    assert "NON-FINITE (first at the output of module big\\#0 (Linear) (forward)), loss nan" in md
    page = _parse(render("html", r))
    assert ("td", "class", "num bad") in page.attrs  # the infinite introduced error and the overflowed headroom
    assert "Decisions" not in md  # task none


def test_many_calls_are_cut_with_a_count() -> None:
    r = many_calls()
    md = render("md", r)
    assert f"... and {len(_cmp(r).ranking) - 10} more module calls introduce some error" in md
    assert "... and 160 more" in md  # the folded table shows 100 calls
    page = render("html", r)
    assert f"... and {len(_cmp(r).ranking) - 20} more module calls introduce some error" in page
    assert "... and 60 more" in page  # 200 calls
    from nanhunt.report.picture import comparison_figure

    fig = comparison_figure(r)
    assert fig is not None
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) == 40
    top = {f"blocks.{i}#0 (Block)" for i in _cmp(r).ranking[:40]}
    assert set(labels) == top  # the ranked calls first (here they fill the picture)
    assert labels == sorted(labels, key=lambda s: int(s.split(".")[1].split("#")[0]))  # in execution order


# ------------------------------------------------------------------ hostile names


def test_hostile_names_markdown() -> None:
    md = render("md", hostile_comparison())
    page = _parse(markdown_to_html(md))
    # THEN no element came from the names, every table row kept its cells, and the names read literally
    assert not {"script", "a", "img", "em"} & set(page.tags) and "strong" in page.tags
    for table in page.tables:
        assert len(set(table)) == 1, table
    text = "".join(page.text)
    assert f"{HOSTILE}#0" in text and f" ({HOSTILE_CLASS})" in text
    assert f"{HOSTILE}.weight" in text and f"gradient of {HOSTILE}.bias" in text
    assert f"first at {HOSTILE}#0" in text
    assert "note about " + HOSTILE + " **bold** _it_ [link](x)" in text
    assert f"nanhunt compare 'a|b.pt' '{HOSTILE}' --report out.html" in text


def test_hostile_names_html() -> None:
    from nanhunt.report.html import render as page

    out = page(hostile_comparison())
    p = _parse(out)
    assert "script" not in p.tags and "<script>" not in out
    assert [t for t in p.tags if t == "img"] == ["img"]  # the picture only, none from the class name
    assert all(k != "onerror" for _, k, _v in p.attrs)
    text = "".join(p.text)
    assert f"{HOSTILE}#0" in text and HOSTILE_CLASS in text and "**bold** _it_ [link](x)" in text
    assert f"the output of module {HOSTILE}#0 (forward)" in text


def test_hostile_names_console() -> None:
    out = render("console", hostile_comparison(), width=1000)
    assert f"first at {HOSTILE}#0" in out  # markup not eaten
    assert f"{HOSTILE}#0 ({HOSTILE_CLASS})" in out


def test_hostile_names_picture() -> None:
    from nanhunt.report.picture import comparison_figure, svg

    r = hostile_comparison()
    fig = comparison_figure(r)
    assert fig is not None
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert any(lab.startswith(HOSTILE.replace("$", r"\$")[:40]) for lab in labels)  # '$' is no mathtext
    pic = svg(r)
    assert pic is not None and "<script>" not in pic and "&lt;script&gt;" in pic


# ------------------------------------------------------------------ the page and its picture


def _render_page_with_picture(r: Report) -> str:
    from nanhunt.report.html import render as page

    return page(r)


def test_html_self_contained_with_picture() -> None:
    out = _render_page_with_picture(sample_comparison())
    p = _parse(out)
    assert p.tags[0] == "html" and "body" in p.tags and "table" in p.tags
    assert "http://" not in out and "https://" not in out and 'src="//' not in out
    assert "<link" not in out and "@import" not in out and "url(" not in out and "<script" not in out
    srcs = [v for tag, k, v in p.attrs if k in ("src", "href", "srcset", "data", "action", "poster")]
    assert len(srcs) == 1 and all(v is not None and v.startswith("data:image/png;base64,") for v in srcs)
    png = base64.b64decode(srcs[0].split(",", 1)[1])  # type: ignore[union-attr]
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert 'http-equiv="Content-Security-Policy"' in out and "default-src 'none'" in out


def test_picture_of_error_by_module() -> None:
    from nanhunt.report import picture

    r = sample_comparison()
    c = _cmp(r)
    fig = picture.figure(r)  # a comparison report gets its own picture
    assert fig is not None
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [f"{m.label()} ({m.module_class})" for m in c.modules]  # every call, in execution order
    bars = [p for p in ax.patches if p.get_gid() == "introduced"]
    assert len(bars) == sum(1 for m in c.modules if m.introduced)  # one bar per call that introduces error
    widest = max(bars, key=lambda b: b.get_x() + b.get_width())
    assert widest.get_y() + widest.get_height() / 2 == labels.index("enc.layers.1.attn.proj#0 (Linear)")
    assert math.isclose(widest.get_x() + widest.get_width(), 0.0116)
    tol = [ln for ln in ax.lines if ln.get_gid() == "tolerance"]
    assert len(tol) == 1 and list(tol[0].get_xdata()) == [0.001, 0.001]
    dots = [col for col in ax.collections if col.get_gid() == "output-error"]
    assert len(dots) == 1 and len(dots[0].get_offsets()) == sum(1 for m in c.modules if m.scaled > 0)
    assert {t.get_gid() for t in ax.texts} >= {"rank-1", "rank-2", "rank-3"}
    png = picture.png(r)
    assert png is not None and png.startswith(b"\x89PNG")
    svg = picture.svg(r)
    assert svg is not None and 'id="tolerance"' in svg and 'id="output-error"' in svg


def test_picture_puts_infinite_errors_in_their_own_column() -> None:
    from nanhunt.report.picture import comparison_figure

    fig = comparison_figure(amp_overflow())
    assert fig is not None
    ax = fig.axes[0]
    bad = [col for col in ax.collections if col.get_gid() == "nonfinite"]
    assert len(bad) == 1 and len(bad[0].get_offsets()) == 3  # root, big, head: infinite output error
    brk = next(ln for ln in ax.lines if ln.get_gid() == "nonfinite-break")
    x_break = brk.get_xdata()[0]
    assert all(x > x_break for x, _ in bad[0].get_offsets())
    assert all(t <= x_break * 1.0001 for t in ax.get_xticks())  # no scale in the non-finite column
    zero = [col for col in ax.collections if col.get_gid() == "zero-error"]
    assert len(zero) == 1 and len(zero[0].get_offsets()) == 1  # small: exact


@pytest.mark.subprocess
def test_picture_leaves_no_pyplot_state() -> None:
    # A fresh interpreter: drawing must not import pyplot nor register a figure anywhere.
    code = ("import sys, json; from tests.unit.test_compare_report import sample_comparison; "
            "from nanhunt.report.picture import png; b = png(sample_comparison()); "
            "print(json.dumps([b[:4] == b'\\x89PNG', 'matplotlib.pyplot' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MPLBACKEND": "Agg"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False]


def test_write_puts_the_picture_beside_the_page(tmp_path: Path) -> None:
    from nanhunt.report import write

    written = write(sample_comparison(), str(tmp_path / "cmp.html"))
    assert [Path(p).name for p in written] == ["cmp.html", "cmp.png"]
    png = (tmp_path / "cmp.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert base64.b64encode(png).decode("ascii") in (tmp_path / "cmp.html").read_text()  # drawn once, the same
    assert write(sample_comparison(), str(tmp_path / "cmp.md")) == [str(tmp_path / "cmp.md")]
    assert (tmp_path / "cmp.md").read_text().startswith("## nanhunt compare: rejected")
    assert [Path(p).name for p in write(reference_nonfinite(), str(tmp_path / "ref.html"))] == ["ref.html"]


# ------------------------------------------------------------------ the command line (runs a model)


@pytest.fixture
def flip_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import torch

    from tests._support.compare import FLIP_X, FLIP_Y, Flip

    monkeypatch.chdir(ROOT)  # --model tests._support.compare:Flip imports from the repository root
    ck, bt = tmp_path / "checkpoint.pt", tmp_path / "batch.pt"
    torch.save(Flip().state_dict(), ck)
    torch.save((FLIP_X, FLIP_Y), bt)
    return [str(ck), str(bt), "--model", "tests._support.compare:Flip", "--loss", "torch.nn.functional:cross_entropy",
            "--task", "classify"]


def test_cli_compare_writes_markdown_and_html(tmp_path: Path, flip_files: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from nanhunt.cli import main

    # WHEN the flip fixture is compared with a Markdown and then an HTML report
    assert main(["compare", *flip_files, "--report", str(tmp_path / "cmp.md")]) == 1
    assert main(["compare", *flip_files, "--report", str(tmp_path / "cmp.html")]) == 1
    console = capsys.readouterr().out
    # THEN the Markdown names the flipped sample and the rule, like the console
    md = (tmp_path / "cmp.md").read_text()
    assert md.startswith("## nanhunt compare: rejected\n\n**REJECTED: autocast float16 against the float32 reference")
    assert "**4 samples, 1 flipped (1), 2 near the boundary (1, 2).**" in md
    assert "| 1 | 1 (0) | 0.0003 | 0 | 0 | FLIPPED |" in md
    assert "| 1 | `head#0` (Linear) |" in md
    assert "1 flipped (1), 2 near the boundary (1, 2)" in console
    # AND the page carries its picture, also written beside it
    page = (tmp_path / "cmp.html").read_text()
    png = (tmp_path / "cmp.png").read_bytes()
    assert png.startswith(b"\x89PNG") and base64.b64encode(png).decode("ascii") in page
    text = "".join(_parse(page).text)
    assert "FLIPPED" in text and "head#0" in text and "Error by module" in text


def test_cli_report_rerenders_a_saved_comparison(tmp_path: Path, flip_files: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from nanhunt.cli import main

    saved = str(tmp_path / "cmp.json")
    assert main(["compare", *flip_files, "--report", saved]) == 1
    capsys.readouterr()
    assert main(["report", saved, "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("## nanhunt compare: rejected") and "FLIPPED" in md
    assert main(["report", saved, "--format", "html", "-o", str(tmp_path / "again.html")]) == 0
    assert (tmp_path / "again.png").read_bytes().startswith(b"\x89PNG")
    assert "nanhunt compare" in (tmp_path / "again.html").read_text()
    assert main(["report", saved, "--format", "html"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("<!DOCTYPE html>") and "data:image/png;base64," in out
    assert main(["report", saved]) == 0
    assert capsys.readouterr().out.startswith("REJECTED: autocast float16")
