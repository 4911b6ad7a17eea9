"""A bundle's report.json rendered again with ``nanhunt report`` is the bundle's report, byte for byte: the
leading origin read back from the file is the origin it was (its NaN statistics compare unequal as numbers), so
it is not listed again among the other origins."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanhunt.cli import main
from nanhunt.records import Report

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # fixtures.models imports from the repository root


@pytest.mark.parametrize("fixture", ["nan_weight", "nan_batch"])
def test_a_bundles_report_rendered_again_is_the_bundles(fixture: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the bundle of a replay whose leading origin holds NaN (a weight, a batch)
    bundle = tmp_path / "bundle"
    pair = [str(ROOT / "fixtures" / fixture / name) for name in ("checkpoint.pt", "batch.pt")]
    assert main(["replay", *pair, "--model", "fixtures.models:MLP", "--bundle", str(bundle)]) == 1
    written = Report.from_json((bundle / "report.json").read_text(encoding="utf-8"))
    assert written.first is not None and not written.first.output.finite
    capsys.readouterr()
    # WHEN its report.json is rendered again as Markdown and as HTML
    for fmt, name in (("md", "report.md"), ("html", "report.html"), ("json", "report.json")):
        assert main(["report", str(bundle / "report.json"), "--format", fmt]) == 0
        # THEN each is the bundle's file byte for byte
        assert capsys.readouterr().out.encode("utf-8") == (bundle / name).read_bytes(), name
    # AND the leading origin is the first of the origins read back, not a copy beside them
    assert written.first is written.origins[0]
