"""Which rank's capture to say to replay when a rank's own capture replays finite (nanhunt.hunt._ranks)."""

from __future__ import annotations

import dataclasses

from nanhunt.hunt._ranks import received_note
from nanhunt.records import GuardEvent, Report
from tests._support.golden import GOLDEN


def _clean(event: GuardEvent | None) -> Report:
    report = Report.from_json((GOLDEN / "report.json").read_text(encoding="utf-8"))
    return dataclasses.replace(report, status="clean", first=None, guard_event=event)


def test_a_finite_capture_of_a_rank_that_alone_saw_the_failure_gets_no_note() -> None:
    said: list[str] = []
    for event in (None, GuardEvent(step=3, kind="grads", detail="", rank=1, ranks=(1,))):
        report = _clean(event)
        assert received_note(report, said.append) is report
    assert said == []


def test_a_finite_capture_names_the_other_ranks_that_saw_the_failure() -> None:
    # GIVEN rank 1's capture, replayed finite, of a step the Guard saw fail on ranks 0, 1 and 2
    said: list[str] = []
    report = _clean(GuardEvent(step=3, kind="grads", detail="", rank=1, ranks=(0, 1, 2)))
    # WHEN the note is added  THEN it names the other ranks' captures, in the report and as it is said
    noted = received_note(report, said.append)
    note = ("the Guard saw the failure at step 3 on rank(s) 0, 1, 2; this capture's batch (rank 1's) replays "
            "finite: what it saw arrived from another rank through a collective; replay the capture of rank 0, 2")
    assert said == [note]
    assert noted.notes == (*report.notes, note)
