"""Report layer: every renderer pinned by a golden file, JSON round trips, old schemas, hostile names, the picture.

Regenerate the golden files after an intended change with

    NANHUNT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_report.py -q -p no:cacheprovider

and read the diff before committing it. Nothing here imports torch: renderers only format plain data.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import html.parser
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests._support.golden import GOLDEN, check_golden, markdown_to_html, render
from nanhunt.records import FullStats, Occurrence, Phase, Record, Report, Repro, Role, Verdict



# ------------------------------------------------------------------ the fixed report


def _rec(index: int, phase: Phase, module: str | None, op: str | None, dtype: str, shape: tuple[int, ...],
         lo: float, hi: float, *, role: Role = Role.OUTPUT, inputs: tuple[int, ...] = (), full: FullStats | None = None,
         source: str | None = None) -> Record:
    return Record(index=index, phase=phase, module=module, call_index=0, op=op, role=role, dtype=dtype, shape=shape,
                  min=lo, max=hi, inputs=inputs, source=source, full=full)


def _full(numel: int, *, nan: int = 0, posinf: int = 0, neginf: int = 0, zeros: int = 0) -> FullStats:
    return FullStats(nan=nan, posinf=posinf, neginf=neginf, zeros=zeros, numel=numel, min_nonzero_abs=0.001,
                     over_fp16=0, over_bf16=0, subnormal=0)


def sample_report(module: str = "blocks.1.ff.wo", *, with_repro: bool = True) -> Report:
    """A hand-built report shaped like the overflow fixture's; ``module`` names the culprit Linear."""
    parent = module.rpartition(".")[0]
    src = "/src/models.py:19 in forward"
    ins = (
        _rec(8, Phase.FORWARD, module, "aten::_to_copy", "float16", (32,), -0.1199, 0.1247, full=_full(32)),
        _rec(7, Phase.FORWARD, parent, "aten::relu", "float16", (2, 16, 64), 0.0, 1.713, full=_full(2048, zeros=1057)),
        _rec(9, Phase.FORWARD, module, "aten::_to_copy", "float16", (32, 64), -24960.0, 24980.0, full=_full(2048)),
    )
    out = _rec(10, Phase.FORWARD, module, "aten::addmm", "float16", (32, 32), -math.inf, math.inf, inputs=(8, 7, 9),
               source=src, full=_full(1024, posinf=96, neginf=67))
    first = Occurrence(phase=Phase.FORWARD, module=module, module_class="Linear", call_index=0, op="aten::addmm",
                       kind="inf", source=src, output=out, inputs=ins, reached=("output", "loss", "gradients"),
                       path=(10, 11, 13))
    ln = _rec(12, Phase.FORWARD, "ln_f", "aten::native_layer_norm", "float16", (2, 16, 32), math.nan, math.nan,
              inputs=(11,))
    second = Occurrence(phase=Phase.FORWARD, module="ln_f", module_class="LayerNorm", call_index=0,
                        op="aten::native_layer_norm", kind="nan", source="/src/models.py:60 in forward", output=ln,
                        inputs=(), reached=("loss",))
    path = (
        out,
        _rec(11, Phase.FORWARD, parent, "aten::add", "float16", (2, 16, 32), -math.inf, math.inf, inputs=(10,)),
        ln,
        _rec(13, Phase.LOSS, None, "aten::_log_softmax", "float32", (32, 64), math.nan, math.nan, inputs=(12,)),
    )
    timeline: list[tuple[int, str, float, str]] = []
    mags = [0.02, 0.9, 3.5, 40.0, 250.0, 1800.0, 1.7, 2.5e4, 0.12, 2.5e4, math.nan, math.nan, math.nan, math.nan]
    for i, m in enumerate(mags):
        phase = "weights" if i < 2 else ("loss" if i == 13 else "forward")
        kind = "finite" if not math.isnan(m) else ("inf" if i in (10, 11) else "nan")
        timeline.append((i, phase, m, kind))
    for i in range(14, 22):
        timeline.append((i, "backward", math.nan if i % 3 else 0.0, "nan" if i % 3 else "finite"))
    timeline.append((22, "update", 5e-4, "finite"))
    verdict = Verdict(kind="precision", culprits=(module,), origin_alone_fixes=True, confirmed=True, replays=13,
                      seconds=2.4, alternatives={"bfloat16": True, "scale 1": False},
                      fix=f"import nanhunt\nnanhunt.keep_fp32_permanently(model, [{module!r}])  # after building the model",
                      candidates=20)
    extra: dict[str, Any] = {}
    if with_repro:  # schema 2; golden/report_v1.json is this report without it, as schema 1 wrote it
        extra["repro"] = Repro(op="aten::addmm", overload="default", device_type="cpu", autocast_dtype="float16",
                               inputs=(("float16", (32,)), ("float16", (32, 64)), ("float16", (64, 32))),
                               call="torch.ops.aten.addmm.default(t[0], t[1], t[2])", nbytes=8256, sliced=False, original_shapes=(),
                               files=("repro.py", "repro_inputs.pt"), verified=True, result="inf",
                               command="python repro.py")
    return Report(
        status="nonfinite",
        first=first,
        origins=(first, second),
        path=path,
        runs=(first, first),
        loss=math.nan,
        config={"dtype": "float16", "device_type": "cpu", "level": "op", "train": True, "loss_fn": "LMLoss",
                "optimizer": "Adam", "scaler_scale": 1024.0, "scaler_growth_tracker": 0, "grads_finite": False,
                "scaler_would_skip": True},
        modules={"": "finite", "blocks": "finite", "blocks.1": "inf in forward", parent: "inf in forward",
                 module: "inf in forward", "ln_f": "nan in forward", "blocks.0": "nan in backward"},
        module_classes={"": "TinyTransformer", "blocks": "ModuleList", "blocks.0": "Block", "blocks.1": "Block",
                        parent: "FeedForward", module: "Linear", "ln_f": "LayerNorm"},
        environment={"nanhunt": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7", "os": "Linux-6.1-x86_64",
                     "device_type": "cpu", "device": "Intel(R) Xeon(R) Processor"},
        command="nanhunt replay fixtures/overflow/checkpoint.pt fixtures/overflow/batch.pt --bundle out",
        notes=("captured with torch 2.12.0, replayed with 2.13.0+cpu",),
        n_records=23,
        verdict=verdict,
        timeline=tuple(timeline),
        **extra,
    )


HOSTILE = "enc.[bold red]lay[/].<script>alert(1)</script>|`x``y`|$x$"


# A line break, then a line that passes for nanhunt's own, an escape sequence that clears the screen and a bidi
# override: in a free-text field of a report file, it must stay one line (escaped) where a line is expected.
FORGED = "\nnanhunt: error: forged\x1b[2J\u202e"


def hostile_report() -> Report:
    from nanhunt.records import Advice

    r = sample_report(HOSTILE)
    first, verdict, repro = r.first, r.verdict, r.repro
    assert first is not None and verdict is not None and verdict.fix is not None and repro is not None
    first = dataclasses.replace(first, source=f"/src/{HOSTILE}.py:3 in <lambda>{FORGED}",
                                source_text=f"return self.wo(h){FORGED}", op=f"aten::addmm{FORGED}")
    long_name = "blocks." + "L" * 300  # cut at 200 characters, its length said
    advice = Advice(pattern="p", advice=f"do this{FORGED}", because=f"measured{FORGED}", fix=f"x = 1{FORGED}")
    return dataclasses.replace(
        r, first=first, origins=(first, *r.origins[1:]), notes=(f"note about {HOSTILE} **bold** _it_ [link](x)",
                                                                f"a note{FORGED}"),
        command=f"nanhunt replay 'a|b.pt' '{HOSTILE}' --bundle out{FORGED}",
        verdict=dataclasses.replace(verdict, fix=verdict.fix + FORGED),
        repro=dataclasses.replace(repro, command=f"python repro.py{FORGED}"), advice=(advice,),
        modules={**r.modules, long_name: "nan in forward"}, module_classes={**r.module_classes, long_name: "X" * 300})


# ------------------------------------------------------------------ goldens


@pytest.mark.parametrize("fmt,name", [("md", "report.md"), ("html", "report.html"), ("console", "report.txt"),
                                      ("json", "report.json")])
def test_golden(fmt: str, name: str) -> None:
    # GIVEN the fixed report WHEN rendered THEN byte for byte the golden file
    check_golden(name, render(fmt, sample_report()))


def test_golden_hostile_markdown() -> None:
    check_golden("report_hostile.md", render("md", hostile_report()))


# ------------------------------------------------------------------ JSON


def test_json_round_trip() -> None:
    r = sample_report()
    text = r.to_json()
    back = Report.from_json(text)
    assert back.to_json() == text
    assert back.repro == r.repro and back.verdict == r.verdict and back.config == r.config
    assert len(back.timeline) == len(r.timeline) and back.first is not None
    assert back.first.output.has_inf and math.isnan(back.loss or 0.0)
    json.loads(text)  # strict JSON: no bare NaN/Infinity
    assert "NaN" not in text and "Infinity" not in text


def test_schema_v1_file_still_loads() -> None:
    # GIVEN a file written by schema version 1 (before Report.repro existed)
    text = (GOLDEN / "report_v1.json").read_text(encoding="utf-8")
    assert json.loads(text)["schema_version"] == 1 and "repro" not in json.loads(text)
    # WHEN read THEN it is the same report, held in the current schema
    old = Report.from_json(text)
    from nanhunt.records import SCHEMA_VERSION

    assert old.schema_version == SCHEMA_VERSION >= 2
    assert old.repro is None
    assert old.to_dict() == sample_report(with_repro=False).to_dict()
    for fmt in ("md", "html", "console", "json"):
        assert "blocks.1.ff.wo" in render(fmt, old)


def test_unknown_keys_from_a_newer_schema_are_ignored() -> None:
    d = sample_report().to_dict()
    d["schema_version"] = 99
    d["something_new"] = {"x": 1}
    assert d["repro"] is not None
    d["repro"]["new_field"] = 3
    assert Report.from_dict(d).repro == sample_report().repro


# ------------------------------------------------------------------ hostile names


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str, str | None]] = []
        self.text: list[str] = []
        self.stack: list[str] = []
        self.rows: list[int] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += [(tag, k, v) for k, v in attrs]
        if tag == "tr":
            self.rows.append(0)
        if tag in ("td", "th") and self.rows:
            self.rows[-1] += 1

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    p.close()
    return p


def test_hostile_names_markdown() -> None:
    md = render("md", hostile_report())
    page = _parse(markdown_to_html(md))
    # THEN no element came from the names, every table row kept its cells, and the names read literally
    assert "script" not in page.tags and "a" not in page.tags and "strong" in page.tags
    assert set(page.rows) == {12} or all(n in (12, 2) for n in page.rows)
    text = "".join(page.text)
    assert HOSTILE in text
    assert "note about " + HOSTILE + " **bold** _it_ [link](x)" in text
    assert f"nanhunt replay 'a|b.pt' '{HOSTILE}' --bundle out" in text


def test_hostile_names_html() -> None:
    from nanhunt.report.html import render as page

    out = page(hostile_report(), draw=False)
    p = _parse(out)
    assert "script" not in p.tags
    assert "<script>" not in out
    text = "".join(p.text)
    assert HOSTILE in text and "**bold** _it_ [link](x)" in text


def test_hostile_names_console() -> None:
    out = render("console", hostile_report())
    assert "enc.[bold red]lay[/].<script>alert(1)</script>|`x``y`|$x$" in out  # markup not eaten


def test_hostile_names_json_and_picture() -> None:
    r = hostile_report()
    assert Report.from_json(r.to_json()).to_json() == r.to_json()
    from nanhunt.report.picture import svg

    pic = svg(r)
    assert pic is not None and "&lt;script&gt;" in pic and "<script>" not in pic


# ------------------------------------------------------------------ HTML is self-contained


def test_html_self_contained_with_picture() -> None:
    from nanhunt.report.html import render as page

    out = page(sample_report())
    p = _parse(out)  # parses
    assert p.tags[0] == "html" and "body" in p.tags and "table" in p.tags
    assert "http://" not in out and "https://" not in out and 'src="//' not in out
    assert "<link" not in out and "@import" not in out and "url(" not in out
    srcs = [v for tag, k, v in p.attrs if k in ("src", "href", "srcset", "data", "action")]
    assert srcs and all(v is not None and v.startswith("data:image/png;base64,") for v in srcs)
    png = base64.b64decode(srcs[0].split(",", 1)[1])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert 'http-equiv="Content-Security-Policy"' in out and "default-src 'none'" in out


def test_report_order() -> None:
    # The order: verdict, birth place, the op's tensors, path, bisection + fix, GradScaler, environment, command.
    md = render("md", sample_report())
    marks = ["Inf born in phase forward", "#### Where it was born", "#### The op's tensors", "#### Propagation path",
             "#### Bisection", "Suggested fix", "#### GradScaler", "#### Environment", "#### Reproduce",
             "nanhunt replay fixtures"]
    at = [md.index(m) for m in marks]
    assert at == sorted(at)
    page = render("html", sample_report())
    marks = ["Inf born in phase forward", "Where it was born", "The op's tensors", "Propagation path", "Bisection",
             "Suggested fix", "GradScaler", "Environment", "Reproduce", "nanhunt replay fixtures"]
    at = [page.index(m) for m in marks]
    assert at == sorted(at)


def test_markdown_summary_fits_a_screen() -> None:
    md = render("md", sample_report())
    summary = md.split("#### Propagation path")[0]
    assert len(summary.splitlines()) <= 40
    assert "```python\nimport nanhunt\n" in md and "```sh\nnanhunt replay" in md
    assert md.count("<details>") == md.count("</details>") >= 3


def test_code_fences_and_spans_survive_backticks() -> None:
    from nanhunt.report.markdown import code, fence

    assert code("a`b") == "``a`b``" and code("`x`") == "`` `x` ``"
    assert code("a|b", table=True) == "`a\\|b`"
    assert fence("x = 1\n```\ny", "python").startswith("````python\n")
    html_out = markdown_to_html(fence("```\n<b>", "sh"))
    assert "&lt;b&gt;" in html_out and "<b>" not in html_out


# ------------------------------------------------------------------ the picture


def test_picture_marks_origin_limits_and_nonfinite() -> None:
    from nanhunt.report import picture

    r = sample_report()
    fig = picture.figure(r)
    assert fig is not None
    gids = {a.get_gid() for ax in fig.axes for a in (*ax.lines, *ax.collections, *ax.texts)}
    assert {"origin", "origin-marker", "origin-label", "limit-float16", "limit-bfloat16", "nonfinite-nan",
            "nonfinite-inf"} <= gids
    # the origin's vertical line stands at the origin record's index
    origin_lines = [ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == "origin"]
    assert origin_lines and all(list(ln.get_xdata()) == [10, 10] for ln in origin_lines)
    fp16 = [ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == "limit-float16"]
    assert math.isclose(fp16[0].get_ydata()[0], math.log10(65504))
    svg = picture.svg(r)
    assert svg is not None and 'id="origin"' in svg and 'id="limit-bfloat16"' in svg
    png = picture.png(r)
    assert png is not None and png.startswith(b"\x89PNG")


def test_picture_without_timeline_or_origin() -> None:
    from nanhunt.report import picture
    from nanhunt.report.html import render as page

    bare = dataclasses.replace(sample_report(), timeline=())
    assert picture.figure(bare) is None and picture.png(bare) is None
    assert "<img" not in page(bare)
    clean = Report(status="clean", first=None, timeline=((0, "forward", 1.0, "finite"), (1, "loss", 0.0, "finite")))
    assert picture.png(clean) is not None


# ------------------------------------------------------------------ every renderer, every status


def _variants() -> list[Report]:
    r = sample_report()
    return [
        r,
        Report(status="clean", first=None, config={"dtype": "bfloat16", "device_type": "cpu"}),
        dataclasses.replace(r, status="not-reproducible", verdict=None, repro=None, runs=(r.first, None)),
        dataclasses.replace(r, verdict=Verdict(kind="not-precision", float32_first=r.first), repro=None,
                            config={}),
        dataclasses.replace(r, verdict=Verdict(kind="scale-induced"), repro=dataclasses.replace(
            r.repro, verified=False, result="the script ran and its output was finite") if r.repro else None),
        dataclasses.replace(r, first=dataclasses.replace(r.first, module=None, op=None, reached=()), path=(),
                            modules={}, environment={}, command=None),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("fmt", ["md", "html", "console", "json"])
def test_every_renderer_every_status(fmt: str) -> None:
    for r in _variants():
        out = render(fmt, r)
        assert out.endswith("\n") and len(out) > 40
        if fmt == "html":
            _parse(out)
        if fmt == "md":
            assert out.count("<details>") == out.count("</details>")


def test_sentences() -> None:
    from nanhunt.report.markdown import render as md

    v = _variants()
    assert "The step stayed finite" in md(v[1])
    assert "Not reproducible" in md(v[2]) and "run 2: finite" in md(v[2])
    assert "not a precision problem" in md(v[3])
    assert "Repro not verified" in md(v[4]) and "output was finite" in md(v[4])
    assert "outside the model" in md(v[5]) and "silent" in md(v[5])


def test_a_value_outside_the_model_is_born_outside_it() -> None:
    # GIVEN a not-precision verdict whose float32 run also starts outside the model (a NaN in the batch)
    from nanhunt.report._common import verdict_text
    from nanhunt.report.picture import _origin_label

    r = sample_report()
    outside = dataclasses.replace(r.first, phase=Phase.INPUT, module=None, op=None, kind="nan")
    rep = dataclasses.replace(r, first=outside, verdict=Verdict(kind="not-precision", float32_first=outside))
    # THEN it reads "born outside the model", not "born in outside the model"
    text = "".join(s.text for s in verdict_text(rep))
    assert text == "Not a precision problem: the step fails in float32 too; in float32 NaN is born outside the model."
    assert _origin_label(rep) == "origin: NaN outside the model · output"


# ------------------------------------------------------------------ files and the command line


def test_renderer_for_suffixes() -> None:
    from nanhunt._util._errors import InputError
    from nanhunt.report import render_for_format, renderer_for

    for path in ("a.md", "a.MARKDOWN", "a.html", "a.htm", "a.json", "a.txt"):
        assert callable(renderer_for(path))
    with pytest.raises(InputError):
        renderer_for("a.pdf")
    with pytest.raises(InputError):
        render_for_format("pdf")


def test_write_puts_the_picture_beside_the_page(tmp_path: Path) -> None:
    from nanhunt.report import write, write_bundle

    written = write(sample_report(), str(tmp_path / "r.html"))
    assert [Path(p).name for p in written] == ["r.html", "r.png"]
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG")
    got = write_bundle(sample_report(), str(tmp_path / "b"))
    assert sorted(Path(p).name for p in got) == ["report.html", "report.json", "report.md", "report.png"]


def test_cli_report_rerenders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nanhunt.cli import main

    src = str(GOLDEN / "report_v1.json")
    assert main(["report", src, "--format", "md"]) == 0
    assert "#### Where it was born" in capsys.readouterr().out
    assert main(["report", src]) == 0
    assert "Inf born in phase forward" in capsys.readouterr().out
    assert main(["report", src, "-o", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.png").exists() and "<!DOCTYPE html>" in (tmp_path / "x.html").read_text()
    assert main(["report", src, "--format", "console", "-o", str(tmp_path / "x.txt")]) == 0
    assert "blocks.1.ff.wo" in (tmp_path / "x.txt").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["report", str(bad)]) == 2
    assert "not a nanhunt JSON report" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2


def test_cli_report_refuses_an_unknown_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nanhunt.cli import main

    # GIVEN a saved report whose status no version writes
    data = json.loads((GOLDEN / "report_v1.json").read_text())
    data["status"] = "finished"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    # THEN it is refused as a file that is not a report, in one line
    assert main(["report", str(bad)]) == 2
    assert capsys.readouterr().err == (
        f"nanhunt: error: {str(bad)!r} is not a nanhunt JSON report (ValueError: 'finished' is not a valid Status); "
        "write it again with nanhunt replay --report x.json\n")


# ------------------------------------------------------------------ import rule


def test_report_layer_imports_no_torch() -> None:
    # report/* imports only nanhunt.records (and _errors, _files: safe writes; _text: names cut; _limits: the
    # Guard's overflow rule, all torch-free), rich in console.py, matplotlib in picture.py.
    import sys

    import nanhunt.report as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        roots: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level == 2:
                    assert node.module in ("records", "_util._errors", "_util._files", "_util._bundle", "_util._text",
                                           "_util._limits"), (path.name, node.module)
                elif node.level == 0:
                    roots.add((node.module or "").split(".")[0])
        third = roots - set(sys.stdlib_module_names) - {"__future__"}
        expected = {"console.py": {"rich"}, "picture.py": {"matplotlib"}}.get(path.name, set())
        assert third == expected, (path.name, third)
