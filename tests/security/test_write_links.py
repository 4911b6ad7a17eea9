"""Writes go where they say: a symbolic link or a FIFO planted at a name nanhunt writes is refused, never written
through, replaced or waited on.

Each file is created under a new name beside its own and renamed onto it (``nanhunt._util._files.new_file``), or,
for an append-only log, opened with no-follow and no-block and checked to be a regular file of one name
(``append_file``). A FIFO with no reader would block an ordinary ``open`` for writing forever: every test here runs
under an alarm that turns a hang into a failure. In a training loop (the Guard, ``nanhunt run``) a refused file is
a warning or the event's capture error and the training goes on; on the command line it is one error line, exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt._util._errors import InputError
from nanhunt._util._files import WriteError, append_file, new_files, write_file
from nanhunt.cli import main
from nanhunt.guard.guard import GuardWarning
from tests._support.guard import batch, guard_for, mlp_setup, train_step

ROOT = Path(__file__).resolve().parents[2]
VICTIM = b"the user's own file\n"
HANG_LIMIT_S = 30  # far above any of these runs (a second or two each): only a blocked write reaches it
KINDS = ("link", "fifo")


class _Hung(BaseException):
    """Raised by the alarm: a BaseException, so that no ``except Exception`` in nanhunt takes it for a failed
    write and goes on."""


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A blocking open (a FIFO no one reads) fails the test instead of hanging the suite: the alarm's handler
    raises in the main thread, which interrupts the blocked system call (PEP 475 retries it only when the handler
    returns)."""
    def hung(signum: int, frame: Any) -> None:
        raise _Hung(f"a write blocked for {HANG_LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _plant(path: Path, kind: str, victim: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        path.symlink_to(victim)
    else:
        os.mkfifo(path)


def _untouched(path: Path, kind: str, victim: Path) -> None:
    """The planted entry is still there, as planted, and the file a link named holds what it held."""
    assert victim.read_bytes() == VICTIM
    if kind == "link":
        assert os.readlink(path) == str(victim)
    else:
        assert stat.S_ISFIFO(os.lstat(path).st_mode)


def _refusal(path: Path, kind: str, victim: Path) -> str:
    if kind == "link":
        return (f"refusing to write {str(path)!r}: it is a symbolic link (to {str(victim)!r}) and nanhunt never "
                "writes through a link; remove it or give another path")
    return (f"refusing to write {str(path)!r}: it is a named pipe (FIFO), not a regular file, and nanhunt writes "
            "only regular files; remove it or give another path")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    p = tmp_path / "victim.txt"
    p.write_bytes(VICTIM)
    return p


# ------------------------------------------------------------------ the Guard in a training loop
BAD = 3
EVENT, LOG, SKIPS = f"step{BAD:06d}-event.json", "rollbacks.jsonl", "skip_batches.json"
CKPT, BATCH = f"step{BAD:06d}-checkpoint.pt", f"step{BAD:06d}-batch.pt"
WHAT = {EVENT: "the event file", LOG: "to the rollback log", SKIPS: "the skip list"}


def _rolled_back_loop(dump: Path) -> tuple[nanhunt.Guard, list[str]]:
    """Six float16 steps under on_fail="rollback", batch 3 overflowing: a capture, its event file, the rollback
    log and the skip list. Returns the Guard and the GuardWarnings' texts."""
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, dump, on_fail="rollback")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            train_step(guard, model, opt, scaler, batch(i, big_input=i == BAD))
    said = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    return guard, [s for s in said if s.startswith("nanhunt.Guard: could not write")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [EVENT, LOG, SKIPS])
def test_a_guard_warns_of_a_link_or_fifo_at_its_event_log_or_skip_list_and_trains_on(
        name: str, kind: str, tmp_path: Path, victim: Path) -> None:
    # GIVEN a dump directory where someone planted a link to the user's file, or a FIFO, at a name the Guard writes
    dump = tmp_path / "dump"
    _plant(dump / name, kind, victim)
    # WHEN a rollback loop fails at step 3 (a capture, its event, the log and the skip list are written)
    guard, failed = _rolled_back_loop(dump)
    # THEN the training went on past the step, as with no link: rolled back once, five updates
    assert (guard.iterations, guard.updates, guard.rollbacks) == (6, 5, 1)
    # AND one GuardWarning names the refused file; the link or FIFO is as planted, its target unchanged
    assert failed == [f"nanhunt.Guard: could not write {WHAT[name]} in {dump}: {_refusal(dump / name, kind, victim)}"]
    _untouched(dump / name, kind, victim)
    # AND every other file is written, and no temporary file is left
    assert sorted(os.listdir(dump)) == sorted([BATCH, CKPT, EVENT, LOG, SKIPS])
    if name != SKIPS:  # the skip list names the event file only when the Guard wrote it
        (entry,) = json.loads((dump / SKIPS).read_text())["skipped"]
        assert entry["event"] == (None if name == EVENT else EVENT)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [CKPT, BATCH])
def test_a_link_or_fifo_at_a_capture_file_leaves_no_capture_and_the_reason_in_the_event(
        name: str, kind: str, tmp_path: Path, victim: Path) -> None:
    # GIVEN a link or a FIFO planted at the checkpoint's or the batch's name of the step that fails
    dump = tmp_path / "dump"
    _plant(dump / name, kind, victim)
    # WHEN the loop fails there
    guard, failed = _rolled_back_loop(dump)
    # THEN no capture: neither file is written (an event never sits beside half a capture), the event says why,
    # and the training went on
    assert (guard.iterations, guard.updates, guard.rollbacks) == (6, 5, 1)
    detection = guard.events[0]
    assert detection.checkpoint is None
    assert detection.capture_error == f"WriteError: {_refusal(dump / name, kind, victim)}"
    _untouched(dump / name, kind, victim)
    assert sorted(os.listdir(dump)) == sorted([name, LOG, SKIPS]) and failed == []


@pytest.mark.parametrize("kind", KINDS)
def test_on_fail_dump_warns_of_a_link_or_fifo_at_its_event_file(kind: str, tmp_path: Path, victim: Path) -> None:
    # GIVEN on_fail="dump" (the step is recorded and the loop goes on), a link or FIFO at step 1's event name
    dump = tmp_path / "dump"
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, dump, on_fail="dump", max_captures=5)
    train_step(guard, model, opt, scaler, batch(0))
    _plant(dump / "step000001-event.json", kind, victim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(guard, model, opt, scaler, batch(1, big_input=True))
        train_step(guard, model, opt, scaler, batch(2))
    # THEN the capture is written, the event file refused with a warning, and the run went on
    assert guard.iterations == 3 and guard.events[0].checkpoint is not None
    said = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    path = dump / "step000001-event.json"
    assert f"nanhunt.Guard: could not write the event file in {dump}: {_refusal(path, kind, victim)}" in said
    _untouched(path, kind, victim)


# ------------------------------------------------------------------ save_capture (the library call)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", [0, 1])
def test_save_capture_refuses_a_link_or_fifo_and_writes_neither_file(which: int, kind: str, tmp_path: Path,
                                                                     victim: Path) -> None:
    from fixtures.models import MLP

    paths = [tmp_path / "c.pt", tmp_path / "b.pt"]
    _plant(paths[which], kind, victim)
    with pytest.raises(InputError) as e:
        nanhunt.save_capture(paths[0], paths[1], model=MLP(), batch=(torch.zeros(2, 16), torch.zeros(2, 4)),
                             loss_fn=F.mse_loss)
    # THEN one line naming the refused file, an OSError too (code that catches a failed save as one still does)
    assert str(e.value) == _refusal(paths[which], kind, victim) and isinstance(e.value, OSError)
    _untouched(paths[which], kind, victim)
    assert sorted(os.listdir(tmp_path)) == sorted([paths[which].name, victim.name])


# ------------------------------------------------------------------ nanhunt run --dump-dir
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_nanhunt_run_warns_of_a_link_or_fifo_at_its_event_file_and_the_script_runs_on(
        kind: str, tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN nanhunt run --dump-dir caps --on-fail continue, where caps holds a link or FIFO at step 2's event name
    monkeypatch.chdir(tmp_path)
    caps = tmp_path / "caps"
    event = caps / "step000002-event.json"
    _plant(event, kind, victim)
    script = ROOT / "tests" / "user_scripts" / "plain_loop.py"
    # WHEN the script's batch 2 overflows float16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["run", "--dump-dir", str(caps), "--on-fail", "continue", str(script), "--bad-step", "2"])
    out = capsys.readouterr().out
    # THEN the script ran all its steps and its exit code is its own; the refusal is a warning
    assert code == 0 and out.count("loss") == 6
    said = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    assert f"nanhunt.Guard: could not write the event file in {caps}: {_refusal(event, kind, victim)}" in said
    _untouched(event, kind, victim)
    assert sorted(os.listdir(caps)) == ["step000002-batch.pt", "step000002-checkpoint.pt", event.name]


# ------------------------------------------------------------------ the command line's reports and history
def _one_error_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanhunt: error: "), err
    return lines[0][len("nanhunt: error: "):]


@pytest.fixture
def flip_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from tests._support.compare import FLIP_X, FLIP_Y, Flip

    monkeypatch.chdir(ROOT)  # --model tests._support.compare:Flip imports from the repository root
    ck, bt = tmp_path / "checkpoint.pt", tmp_path / "batch.pt"
    torch.save(Flip().state_dict(), ck)
    torch.save((FLIP_X, FLIP_Y), bt)
    return [str(ck), str(bt), "--model", "tests._support.compare:Flip", "--loss", "torch.nn.functional:cross_entropy",
            "--task", "classify"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_link_or_fifo_at_the_compare_history_is_refused_before_the_compare(
        kind: str, flip_files: list[str], tmp_path: Path, victim: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN nanhunt compare --report out/r.json, where out/ holds a link or FIFO at the history's name
    history = tmp_path / "out" / "nanhunt-compare-history.jsonl"
    _plant(history, kind, victim)
    # WHEN it runs
    code = main(["compare", *flip_files, "--report", str(tmp_path / "out" / "r.json")])
    # THEN one error line, before anything is compared or written; nothing read or appended through it
    kind_text = ("it is a symbolic link (to {!r}) and nanhunt never reads or writes through a link"
                 .format(str(victim)) if kind == "link" else
                 "it is a named pipe (FIFO), not a regular file, and nanhunt reads and writes only regular files")
    err = capsys.readouterr().err  # the rule's lines come first: the history is read once the rule is settled
    assert err.splitlines()[:2] == [line for line in err.splitlines() if line.startswith("rule")]
    assert _one_error_line(code, "\n".join(err.splitlines()[2:])) == (
        f"cannot read the compare history {str(history)!r}: {kind_text}; move it away to start a new one")
    _untouched(history, kind, victim)
    assert sorted(os.listdir(tmp_path / "out")) == [history.name]


def test_a_fifo_at_a_report_path_is_one_error_line_naming_it(tmp_path: Path, victim: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a saved JSON report, and nanhunt report -o out.md where out.md is a FIFO (a link there: test_bundle.py)
    kind = "fifo"
    saved = tmp_path / "r.json"
    saved.write_text((ROOT / "tests" / "golden" / "report.json").read_text(encoding="utf-8"))
    out = tmp_path / "out.md"
    _plant(out, kind, victim)
    code = main(["report", str(saved), "-o", str(out)])
    # THEN one error line names it; nothing is written through it, nothing waits on it
    assert _one_error_line(code, capsys.readouterr().err) == _refusal(out, kind, victim)
    _untouched(out, kind, victim)


# ------------------------------------------------------------------ the writers themselves
@pytest.mark.parametrize("kind", KINDS)
def test_append_file_refuses_a_link_or_fifo(kind: str, tmp_path: Path, victim: Path) -> None:
    log = tmp_path / "log.jsonl"
    _plant(log, kind, victim)
    with pytest.raises(WriteError) as e:
        append_file(str(log), b"line\n")
    assert str(e.value) == _refusal(log, kind, victim)
    _untouched(log, kind, victim)


def test_append_file_refuses_a_fifo_someone_reads(tmp_path: Path) -> None:
    # GIVEN a FIFO with a reader at the other end (an open for writing would succeed at once)
    log = tmp_path / "log.jsonl"
    os.mkfifo(log)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(log.read_bytes()), daemon=True)
    reader.start()
    fd = os.open(log, os.O_WRONLY)  # waits for the reader: then it is there while nanhunt writes
    try:
        with pytest.raises(WriteError, match=r"it is a named pipe \(FIFO\), not a regular file"):
            append_file(str(log), b"line\n")
    finally:
        os.close(fd)
    reader.join(HANG_LIMIT_S)
    # THEN nothing reached the reader
    assert got == [b""]


def test_append_file_refuses_a_hard_link_and_appends_to_its_own_file(tmp_path: Path, victim: Path) -> None:
    # GIVEN a log that is a second name of the user's file (a hard link planted in the directory)
    log = tmp_path / "log.jsonl"
    os.link(victim, log)
    with pytest.raises(WriteError, match=r"^refusing to append to .*: it is also another file's name \(2 names\), "
                                         r"and nanhunt appends only to a file of its own; move it away$"):
        append_file(str(log), b"line\n")
    assert victim.read_bytes() == VICTIM
    # AND its own log (made when missing) is appended to, line after line
    own = tmp_path / "own.jsonl"
    append_file(str(own), b"a\n")
    append_file(str(own), b"b\n")
    assert own.read_bytes() == b"a\nb\n"


def test_new_files_writes_all_or_none(tmp_path: Path) -> None:
    paths = [str(tmp_path / "c.pt"), str(tmp_path / "b.pt")]
    # GIVEN an earlier pair under the names
    for p in paths:
        write_file(p, b"old")
    # WHEN a write of both fails half way, THEN neither name changed and no temporary file is left
    with pytest.raises(RuntimeError):
        with new_files(*paths) as (c, b):
            c.write(b"new")
            raise RuntimeError
    assert [Path(p).read_bytes() for p in paths] == [b"old", b"old"]
    assert sorted(os.listdir(tmp_path)) == ["b.pt", "c.pt"]
    # AND a whole write replaces both
    with new_files(*paths) as (c, b):
        c.write(b"c")
        b.write(b"b")
    assert [Path(p).read_bytes() for p in paths] == [b"c", b"b"]
    assert sorted(os.listdir(tmp_path)) == ["b.pt", "c.pt"]


def test_a_link_to_a_directory_named_as_the_dump_dir_is_followed(tmp_path: Path) -> None:
    # GIVEN a dump directory that is a link the user made to a real directory (the user named it)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "dump").symlink_to(real)
    guard, failed = _rolled_back_loop(tmp_path / "dump")
    # THEN the Guard writes into the directory it names, and the link stays
    assert failed == [] and guard.rollbacks == 1
    assert sorted(os.listdir(real)) == sorted([BATCH, CKPT, EVENT, LOG, SKIPS])
    assert os.readlink(tmp_path / "dump") == str(real)
    assert json.loads((real / EVENT).read_text())["step"] == BAD
