"""Every string of a report file reaches the terminal escaped and one line where a line is expected: ``nanhunt
report`` renders a file from anywhere (a ticket's attachment). A line break in a module path, an op, a note, a
command or the suggested fix must not let the file print a line of its own (a forged ``nanhunt: error:``), an
escape sequence or a bidi control; code to paste (the fix) keeps its line breaks only as code: indented on the
console, in a fenced block in Markdown, in a ``<pre>`` in HTML. A name as long as the file allows is shown cut."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from nanhunt.cli import main
from nanhunt.records import Report

ROOT = Path(__file__).resolve().parents[2]
FORGED = "nanhunt: error: forged"
PAYLOAD = f"\n{FORGED}\x1b[2J\r\u202e"


def _leaves(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where ``node`` holds a string: each as its path of keys and indices."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _leaves(v, (*at, k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _leaves(v, (*at, i))]
    return [at] if isinstance(node, str) else []


def _reads(data: dict[str, Any]) -> bool:
    try:
        Report.from_dict(data)
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden report of a Guard capture (its Guard event, headroom history, advice, repro, notes), every
    string it holds ending in PAYLOAD where the report still reads with it (not a status or a phase, which are
    one of a few words), and the keys of its objects keyed by names (modules, classes, environment,
    alternatives)."""
    data: dict[str, Any] = json.loads((ROOT / "tests" / "golden" / "report_context.json").read_text("utf-8"))
    for key in ("modules", "module_classes", "environment"):
        data[key] = {k + PAYLOAD: v for k, v in data[key].items()}
    data["verdict"]["alternatives"] = {k + PAYLOAD: v for k, v in data["verdict"]["alternatives"].items()}
    changed = 0
    for at in _leaves(data):
        parent = data
        for step in at[:-1]:
            parent = parent[step]
        parent[at[-1]] += PAYLOAD
        if _reads(data):
            changed += 1
        else:
            parent[at[-1]] = parent[at[-1]].removesuffix(PAYLOAD)
    assert changed > 100, changed  # most strings took it: names, ops, sources, notes, commands, the fix
    assert PAYLOAD in data["verdict"]["fix"] and PAYLOAD in data["command"]
    path = tmp_path_factory.mktemp("fields") / "report.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _render(path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["report", str(path), "--format", fmt]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def _no_controls(text: str) -> None:
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", text), \
        [m.group() for m in re.finditer("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e]", text)]


def test_every_field_of_a_report_file_is_escaped_on_the_console(hostile: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a report file whose every string (names, op, source line, event, notes, advice, commands, the fix)
    # ends in a line break, a forged nanhunt line, an escape sequence and a bidi override
    # WHEN `nanhunt report` prints it on the console
    out = _render(hostile, "console", capsys)
    # THEN no control character is printed, and no line of the file stands on its own: the forged text follows
    # an escaped \n on the line it belongs to, or, in code to paste (the advice's), is indented under it
    _no_controls(out)
    assert out.count(FORGED) > 20
    for line in out.splitlines():
        if line.startswith(FORGED):
            pytest.fail(f"a line of the file printed as a line of nanhunt's: {line!r}")
        if FORGED in line and "\\n" + FORGED not in line:
            assert line.startswith("    ") and line.strip().startswith(FORGED), line
    assert "\\n" + FORGED + "\\x1b[2J\\r\\u202e" in out


def _fenced(md: str) -> list[tuple[str, list[str]]]:
    """The fenced code blocks of ``md``: (info string, lines)."""
    out: list[tuple[str, list[str]]] = []
    lines = iter(md.splitlines())
    for line in lines:
        m = re.match(r"\s*(`{3,})(\w*)$", line)
        if m:
            body = []
            for inner in lines:
                if inner.strip() == m.group(1):
                    break
                body.append(inner.strip())
            out.append((m.group(2), body))
    return out


def test_every_field_of_a_report_file_is_one_line_in_markdown(hostile: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the same file WHEN rendered as Markdown (to the terminal, or a ticket)
    md = _render(hostile, "md", capsys)
    _no_controls(md)
    # THEN a command to paste is one line: the file's line break in it is written as \n
    blocks = _fenced(md)
    commands = [body for lang, body in blocks if lang == "sh"]
    assert len(commands) == 2 and all(len(body) == 1 for body in commands), commands
    assert all(body[0].endswith("\\n" + FORGED + "\\x1b[2J\\r\\u202e") for body in commands)
    # AND only code to paste (the advice's fixes, Python) keeps a line break of the file: every other line
    # holding the forged text holds it after an escaped \n
    in_code = {line for lang, body in blocks if lang == "python" for line in body}
    for line in md.splitlines():
        if FORGED in line and line.strip() not in in_code:
            assert "\\n" + FORGED in line or "\\\\n" + FORGED in line, line


def test_every_field_of_a_report_file_is_escaped_in_html(hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the same file WHEN rendered as HTML
    page = _render(hostile, "html", capsys)
    _no_controls(page)
    # THEN a command to paste is one line in its block: the file's line break in it is written as \n
    commands = re.findall(r"<p>(?:Replay the step|Run the op alone[^<]*):</p>\s*<pre><code>(.*?)</code></pre>", page,
                          flags=re.S)
    assert len(commands) == 2 and all("\n" not in c and c.endswith("\\n" + FORGED + "\\x1b[2J\\r\\u202e")
                                      for c in commands), commands
    # AND outside the code to paste (the fixes' <pre> blocks), the forged text never starts a line of the page
    rest = re.sub(r"<pre><code>.*?</code></pre>", "", page, flags=re.S)
    assert rest.count(FORGED) > 20
    assert not [line for line in rest.splitlines() if line.startswith(FORGED)]


def test_a_name_as_long_as_the_file_allows_is_shown_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a report whose origin's module path is half a million characters long (the file is near its 16 MiB cap)
    data: dict[str, Any] = json.loads((ROOT / "tests" / "golden" / "report_context.json").read_text("utf-8"))
    long_name = "m" * 500_000
    text = json.dumps(data).replace('"blocks.1.ff.wo', json.dumps(long_name + ".wo")[:-1])
    path = tmp_path / "report.json"
    path.write_text(text, encoding="utf-8")
    # WHEN rendered in every format
    for fmt in ("console", "md", "html"):
        out = _render(path, fmt, capsys)
        # THEN each time the name is shown, it is its first 200 characters and its length
        assert "m" * 200 + "... (500,003 characters)" in out.replace("\n", "")  # the console folds it
        assert len(out) < 200_000, (fmt, len(out))
