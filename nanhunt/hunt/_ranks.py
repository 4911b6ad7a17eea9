"""Which rank's capture to replay when the one replayed comes out finite.

Under DDP and FSDP every rank's gradients go non-finite through the collective when one rank's backward
overflows, so every rank saw the failure, and the rank the Guard names first may not be where it was born.
``say`` is told each line as it happens (the command line prints it); the report keeps the last in its notes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..capture._options import LoadOptions
from ..capture.capture import Loaded, load_replay
from ..distributed import _dcp
from ..records import Report, Status

__all__ = ["MAX_OTHER_RANKS", "other_ranks", "received_note"]

MAX_OTHER_RANKS = 8  # replayed in turn when the first rank that saw a failure replays finite


def other_ranks(path: str, report: Report, hunted: Callable[[Loaded], Report], options: LoadOptions,
                say: Callable[[str], None]) -> Report:
    """``report``: the clean replay of the capture directory ``path``'s first rank that saw the failure. The
    other ranks' batches are replayed in turn (those that saw it first), each loaded with ``options`` and
    replayed by ``hunted``, up to :data:`MAX_OTHER_RANKS`; the first that is not clean is reported, with a first
    note saying which replayed finite. None: ``report``, noted."""
    man = _dcp.read_manifest(path)
    first = _dcp.pick_rank(man, None, path)
    seen = sorted(set(man["ranks_seen"]) - {first})
    order = seen + [r for r in range(man["world_size"]) if r != first and r not in seen]
    finite = [first]
    head = f"capture of {man['world_size']} ranks ({man['wrapper']})"
    for r in order[:MAX_OTHER_RANKS]:
        done = f"rank {finite[0]}'s batch replays" if len(finite) == 1 else f"ranks {_few_ranks(finite)} replay"
        say(f"{done} finite; replaying rank {r}'s")
        loaded = load_replay(path, None, options, rank=r)
        got = hunted(loaded)
        del loaded  # one model in memory at a time
        if got.status != Status.CLEAN:
            who = (f"rank {finite[0]}'s replays finite: the failure it saw" if len(finite) == 1 else
                   f"ranks {_few_ranks(finite)} replay finite: the failure they saw")
            note = f"{head}: rank {r}'s batch replayed ({who} came from another rank)"
            say(note)
            return dataclasses.replace(got, notes=(note, *got.notes[1:]))
        finite.append(r)
    left = order[MAX_OTHER_RANKS:]
    note = (f"every rank's batch replays finite ({_few_ranks(finite)})" if not left else
            f"rank(s) {_few_ranks(finite)} replay finite; {len(left)} more not replayed: pass --rank R, or replay "
            f"under torchrun")
    say(note)
    return dataclasses.replace(report, notes=(*report.notes, note))


def received_note(report: Report, say: Callable[[str], None]) -> Report:
    """A rank's capture files (DDP given unwrapped, FSDP1) that replay finite although the Guard saw the failure on
    that rank and others: its non-finite values came through a collective; say whose capture to replay."""
    ev = report.guard_event
    others = [] if ev is None or ev.rank is None else [r for r in ev.ranks if r != ev.rank]
    if ev is None or not others:
        return report
    note = (f"the Guard saw the failure at step {ev.step} on rank(s) {_few_ranks(list(ev.ranks))}; this capture's "
            f"batch (rank {ev.rank}'s) replays finite: what it saw arrived from another rank through a collective; "
            f"replay the capture of rank {_few_ranks(others)}")
    say(note)
    return dataclasses.replace(report, notes=(*report.notes, note))


def _few_ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
