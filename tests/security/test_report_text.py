"""Text read from a file or said by the model, pasted into a ticket as ``report.md``, pings nobody and links
nowhere: ``@name`` and ``@org/team`` are mentions on GitHub and GitLab, a bare URL, a ``www.`` address or an
e-mail address becomes a link. In Markdown each is neutralised (a zero-width space after ``@``, a URL in a code
span); the HTML page holds no link at all."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[2]
PINGS = ("@everyone", "@org/team")
LINKS = ("https://evil.example/x", "http://x", "www.evil.example", "ops@evil.example")
HOSTILE = "@everyone @org/team see https://evil.example/x or [click](http://x), www.evil.example, ops@evil.example"
# What GitHub / GitLab act on in rendered text: a mention, a URL, a www. address, an e-mail address.
MENTION = re.compile(r"(?<![\w`])@[\w-]")
AUTOLINK = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://|(?<![\w.])www\.|[\w.+-]@[\w-]+\.")


@pytest.fixture(scope="module")
def hostile_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden report of a Guard capture whose every string a file or the model supplies holds the pings and
    links: the origin's module (path, tree, classes), its op, source file and line, the Guard's event, the
    loss and optimizer names, the repro's result and a note."""
    text = (ROOT / "tests" / "golden" / "report_context.json").read_text(encoding="utf-8")
    module = f"blocks.1.{HOSTILE}"
    text = text.replace('"blocks.1.ff.wo', json.dumps(module)[:-1]).replace("aten::addmm", f"aten::{HOSTILE}")
    data: dict[str, Any] = json.loads(text)
    assert module in data["modules"]  # the rewrite reached them
    data["module_classes"][module] = HOSTILE
    data["first"]["source"] = f"/src/{HOSTILE}.py:3 in forward"
    data["first"]["source_text"] = HOSTILE
    data["guard_event"].update(kind=HOSTILE, detail=HOSTILE)
    data["config"].update(loss_fn=HOSTILE, optimizer=HOSTILE)
    data["repro"].update(verified=False, result=HOSTILE)
    data["notes"] = [*data["notes"], HOSTILE]
    path = tmp_path_factory.mktemp("pings") / "report.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _shown_text(md: str) -> list[str]:
    """Every piece of the Markdown a ticket shows as text (where mentions and autolinks happen): inline text and
    raw HTML (a ``<summary>``), not code spans or code blocks."""
    out: list[str] = []
    for token in MarkdownIt("commonmark").enable("table").parse(md):
        if token.type == "html_block":
            out.append(token.content)
        for child in token.children or ():
            if child.type in ("text", "html_inline"):
                out.append(child.content)
            assert child.type != "link_open", md  # no Markdown link either
    return out


def test_markdown_report_neither_pings_nor_links(hostile_json: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a saved report whose names, event, notes and source hold @everyone, @org/team, URLs and a Markdown link
    # WHEN `nanhunt report` renders it as Markdown
    code = main(["report", str(hostile_json), "--format", "md"])
    md = capsys.readouterr().out
    assert code == 0
    # THEN no text a ticket shows holds a mention, a URL, a www. or an e-mail address it would act on
    shown = _shown_text(md)
    assert any("everyone" in s for s in shown)  # the names are there, as text
    for s in shown:
        assert not MENTION.search(s), s
        assert not AUTOLINK.search(s), s
    # ... and each still reads as written: a mention with a zero-width space after its @, a URL as code
    assert "@\u200beveryone @\u200borg/team see `https://evil.example/x` or \\[click\\](`http://x`), " \
           "`www.evil.example`, ops@\u200bevil.example" in md
    for word in ("everyone", "org/team", "evil.example/x"):
        assert md.count(word) > 5, word


@pytest.mark.parametrize("text,shown", [
    ("@everyone", "@\u200beveryone"),
    ("cc @org/team-a.", "cc @\u200borg/team-a."),
    ("a @ b, a@", "a @ b, a@"),  # no name after it: no mention
    ("https://evil.example/x.", "`https://evil.example/x`."),
    ("(see http://x/a_b)", "(see `http://x/a_b`)"),
    ("javascript:alert(1)", "javascript:alert(1)"),  # no link without brackets, which are escaped
    ("<https://x>", "\\<`https://x`\\>"),
    ("[click](http://x)", "\\[click\\](`http://x`)"),
    ("ftp://x|y", "`ftp://x`\\|y"),
    ("model.www.x www.x", "model.www.x `www.x`"),
])
def test_markdown_escape_neutralises_mentions_and_urls(text: str, shown: str) -> None:
    from nanhunt.report.markdown import escape

    # GIVEN text from a file WHEN escaped as Markdown text THEN each mention and URL is inert, the rest as written
    assert escape(text) == shown


def test_html_report_holds_no_link(hostile_json: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the same report, with a javascript: URL in a note too
    data = json.loads(hostile_json.read_text(encoding="utf-8"))
    data["notes"].append('javascript:alert(1) <a href="javascript:alert(1)">x</a>')
    path = hostile_json.with_name("js.json")
    path.write_text(json.dumps(data), encoding="utf-8")
    # WHEN rendered as HTML
    assert main(["report", str(path), "--format", "html"]) == 0
    page = capsys.readouterr().out
    # THEN the page has no link and no attribute a file's text reached: every name is escaped text
    assert "<a " not in page and "href" not in page.replace("&lt;a href=", ""), page
    assert "&lt;a href=&quot;javascript:alert(1)&quot;&gt;" in page
    assert not re.search(r"""=["']?\s*javascript:""", page)
