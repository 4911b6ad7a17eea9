"""A report file's float8 casts (an origin's ``casts``, each record's ``cast``) are read like any other of its
strings: its format, recipe and module reach the terminal, the Markdown and the HTML escaped, on the line they
belong to, and cut past 200 characters. A file, not nanhunt, may have written them."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[2]
FORGED = "nanhunt: error: forged"
PAYLOAD = f"\n{FORGED}\x1b[2J\r\u202e"
LONG = "e" * 5000
FORMAT = "float8_e4m3fn" + PAYLOAD + LONG
RECIPE = "tensorwise" + PAYLOAD + LONG


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden Guard-capture report, its origin given a float8 cast whose strings are hostile."""
    data: dict[str, Any] = json.loads((ROOT / "tests" / "golden" / "report_context.json").read_text("utf-8"))
    cast = copy.deepcopy(data["first"]["output"])
    cast.update(op="aten::_to_copy", module="proj" + PAYLOAD, dtype="float8_e4m3fn", cast={
        "format": FORMAT, "numel": 512, "zeros": 480, "saturated": 1,
        "format_max": 448.0, "gemm_input": "input" + PAYLOAD, "recipe": RECIPE,
        "amax": 32768.0, "scale_min": 0.013671875, "scale_max": 0.013671875, "source": 1})
    data["first"]["casts"] = [cast]
    path = tmp_path_factory.mktemp("casts") / "report.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _render(path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["report", str(path), "--format", fmt]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


@pytest.mark.parametrize("fmt", ["console", "md", "html"])
def test_a_hostile_cast_is_escaped_one_line_and_cut(hostile: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a report file whose origin's float8 cast holds line breaks, an escape sequence, a bidi override and
    # 5,000-character words WHEN rendered
    out = _render(hostile, fmt, capsys)
    # THEN no control character is printed, no forged line stands on its own, and the long words are cut
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", out)
    assert not any(line.lstrip("| ").startswith(FORGED) for line in out.splitlines())
    assert "lost 94% of its values to zero in its float8 cast" in " ".join(out.split())
    assert LONG not in out
    flat = " ".join(out.split())
    assert f"({len(FORMAT):,} characters)" in flat and f"({len(RECIPE):,} characters)" in flat
    assert FORGED in out
