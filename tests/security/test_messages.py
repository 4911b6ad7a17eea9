"""Text read from a file (a state_dict key, a module or op name in a saved report) is shown with its control
characters as visible escapes: it can neither forge a second ``nanhunt: error:`` line nor drive the terminal."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[2]
FORGED = "fc1.weight\nnanhunt: error: forged\x1b[31m"
EVIL_MODULE = "blocks.1\nnanhunt: error: forged\x1b[31m\u202eff.wo"
EVIL_OP = "aten::add\rmm\x07\x9b2J"
RAW = ("\x1b", "\r", "\x07", "\x9b", "\u202e")
# What a terminal would act on: any C0 control but the line break, DEL, C1 and the bidi controls.
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # fixtures.models imports from the repository root


def test_visible_escapes_every_control_character() -> None:
    from nanhunt._util._errors import visible

    # GIVEN text holding a line break, an ANSI colour, a C1 CSI, a bidi override and a line separator
    text = "a\nb\r\x1b[31m\x9b\u202e\u2028\t\x00z"
    # WHEN it is made visible
    shown = visible(text)
    # THEN each is a visible escape, and only a code block keeps its line breaks
    assert shown == "a\\nb\\r\\x1b[31m\\x9b\\u202e\\u2028\\t\\x00z"
    assert visible("x\ny\x1b", multiline=True) == "x\ny\\x1b"
    assert visible("blocks.1.ff.wo") == "blocks.1.ff.wo"


def test_a_forged_state_dict_key_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fixtures.models import MLP

    # GIVEN a state_dict whose fc1.weight is renamed to a key holding a newline, a forged error line and ANSI
    sd = MLP().state_dict()
    sd[FORGED] = sd.pop("fc1.weight")
    torch.save(sd, tmp_path / "checkpoint.pt")
    torch.save((torch.randn(4, 16), torch.randn(4, 4)), tmp_path / "batch.pt")
    # WHEN it is replayed, so that the key mismatch error names the key
    code = main(["replay", str(tmp_path / "checkpoint.pt"), str(tmp_path / "batch.pt"), "--model",
                 "fixtures.models:MLP", "--loss", "torch.nn.functional:mse_loss", "--no-bisect"])
    err = capsys.readouterr().err
    # THEN exit 2 and exactly one stderr line, naming the key with visible escapes
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("nanhunt: error:"), repr(err)
    assert "fc1.weight\\nnanhunt: error: forged\\x1b[31m" in err, err
    assert not CONTROL.search(err), repr(err)


def test_a_forged_key_in_inspect_is_shown_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a checkpoint whose non-finite tensor has a forged key
    torch.save({FORGED: torch.tensor([float("inf"), 1.0])}, tmp_path / "checkpoint.pt")
    # WHEN it is inspected
    code = main(["inspect", str(tmp_path / "checkpoint.pt")])
    out = capsys.readouterr().out
    # THEN the key is listed with visible escapes, no line of it forged
    assert code == 1, out
    assert "\\x1b[31m" in out and not CONTROL.search(out), repr(out)
    assert not any(ln.lstrip().startswith("nanhunt: error") for ln in out.splitlines()), out


@pytest.fixture(scope="module")
def hostile_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden report with its origin module and op renamed to names holding control characters, everywhere
    they appear (origin, path, module tree, classes, culprits), and a note and a command holding them too."""
    text = (ROOT / "tests" / "golden" / "report.json").read_text(encoding="utf-8")
    text = text.replace('"blocks.1.ff.wo', json.dumps(EVIL_MODULE)[:-1]).replace('aten::addmm', json.dumps(EVIL_OP)[1:-1])
    data = json.loads(text)
    assert EVIL_MODULE in data["modules"] and data["first"]["op"] == EVIL_OP  # the rewrite reached them
    data["notes"] = [*data.get("notes", []), f"note {EVIL_MODULE}"]
    data["command"] = f"nanhunt replay {EVIL_OP}"
    path = tmp_path_factory.mktemp("hostile") / "report.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.mark.parametrize("fmt", ["md", "html", "console"])
def test_report_names_with_control_characters_are_rendered_escaped(fmt: str, hostile_json: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a saved report whose module and op names hold a newline, ANSI and bidi controls, a bell and a C1 CSI
    # WHEN `nanhunt report` renders it
    code = main(["report", str(hostile_json), "--format", fmt])
    out = capsys.readouterr().out
    # THEN no control character reaches the output, no line is forged, and the names show as visible escapes
    assert code == 0
    for ch in RAW:
        assert ch not in out, (ch, fmt)
    assert not CONTROL.search(out), fmt
    assert not any(ln.lstrip("#*-> ").startswith("nanhunt: error") for ln in out.splitlines()), fmt
    assert "\\nnanhunt: error: forged\\x1b[31m\\u202eff.wo" in out, fmt
    assert "aten::add\\rmm\\x07\\x9b2J" in out, fmt


def test_report_written_with_o_is_escaped(hostile_json: Path, tmp_path: Path) -> None:
    # GIVEN the hostile report
    # WHEN it is written as Markdown and HTML with -o
    for name in ("r.md", "r.html"):
        assert main(["report", str(hostile_json), "-o", str(tmp_path / name)]) == 0
        text = (tmp_path / name).read_text(encoding="utf-8")
        # THEN the files hold no control character either
        assert not CONTROL.search(text), name
        assert "forged\\x1b[31m" in text, name
