"""A capture directory is read from the files it holds itself: a symbolic link inside it (the Guard writes none)
to a file elsewhere on the machine is never followed. The state, the manifest and a batch are refused in one
line (exit 2); a Guard event that is a link is ignored, with a note, and nothing of the file it points to is
shown in the report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nanhunt.cli import main
from nanhunt.records import Report
from tests._support.capture_dir import one_rank_capture

LINKED = ("is a symbolic link; nanhunt reads only the files a capture directory holds, never one a link points to: "
          "copy the real files into it")


@pytest.mark.parametrize("name, said", [
    ("manifest.json", "capture directory '{cap}': its manifest.json"),
    ("state", "the capture's state '{cap}/state'"),
    ("state/.metadata", "the capture's state '{cap}/state': its .metadata"),
    ("state/__0_0.distcp", "the capture's state '{cap}/state': its shard file '__0_0.distcp'"),
    ("batch-rank0.pt", "capture directory '{cap}': its batch-rank0.pt"),
], ids=["manifest", "state", "metadata", "shard", "batch"])
def test_a_part_of_the_capture_that_links_outside_it_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 name: str, said: str) -> None:
    # GIVEN a capture directory whose file or directory `name` was moved out of it and left as a link to where
    # it now lies (so that following the link would read a whole, valid capture)
    cap = one_rank_capture(tmp_path / "cap")
    outside = tmp_path / "elsewhere" / name.replace("/", "-")
    outside.parent.mkdir()
    shutil.move(cap / name, outside)
    (cap / name).symlink_to(outside, target_is_directory=outside.is_dir())
    # WHEN it is replayed  THEN one line refuses it, naming the link: exit 2
    assert main(["replay", str(cap)]) == 2
    assert capsys.readouterr().err.strip() == f"nanhunt: error: {said.format(cap=cap)} {LINKED}"


def test_a_guard_event_that_links_outside_is_ignored_and_not_shown(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture directory whose event-rank0.json links to a file elsewhere that reads as a Guard event
    cap = one_rank_capture(tmp_path / "cap")
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps({"step": 0, "kind": "loss", "detail": "the text of a file outside the capture"}))
    (cap / "event-rank0.json").symlink_to(outside)
    # WHEN it is replayed
    report = tmp_path / "r.json"
    assert main(["replay", str(cap), "--report", str(report)]) == 0
    # THEN the replay is that of the capture alone: no Guard event, a note saying the link was ignored, and nothing
    # of the file it points to in the report
    rep = Report.from_json(report.read_text())
    assert rep.guard_event is None
    assert f"the Guard event '{cap / 'event-rank0.json'}' beside the checkpoint was ignored: it is not a regular " \
           "file" in rep.notes
    assert "outside the capture" not in report.read_text() and "outside the capture" not in capsys.readouterr().out
