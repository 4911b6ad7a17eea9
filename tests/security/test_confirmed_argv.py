"""The argv a capture records for a script is shown whole before you confirm the script and in the replay's note:
a capture cannot hide the argument that acts (``--log /victim``) behind padding."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nanhunt.capture import _names
from nanhunt.cli import main as cli_main
from tests.integration.test_script_argv import _WRITES_LOG, _capture_of

_PADDING = "x" * 5000


def test_a_padded_argv_is_shown_whole_before_the_script_is_confirmed(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture naming a script's Net, recorded as run with a long padding argument before --log (a terminal
    # escape in its value)
    script = tmp_path / "proj" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(_WRITES_LOG))
    argv = ["train.py", "--pad", _PADDING, "--log", "/victim\x1b[2J"]
    files = _capture_of(script, tmp_path, argv=argv, cwd=str(script.parent), loss=None)
    # WHEN it is replayed unconfirmed
    code = cli_main(["replay", *files, "--no-bisect"])
    err = capsys.readouterr().err.strip().splitlines()
    # THEN the one error line shows every argument, --log's value escaped, after the argv's size
    shown = f"train.py --pad {_PADDING} --log '/victim\\x1b[2J'"
    assert code == 2
    assert len(err) == 1, err
    assert err[0].endswith(f"; confirmed, it runs with the argv its capture recorded (5 arguments, {len(shown)} "
                           f"characters, all shown: {shown}) in {script.parent}"), err[0][-300:]


def test_the_replays_note_shows_a_padded_argv_whole(tmp_path: Path) -> None:
    # GIVEN the same script, its run recorded with the padded argv
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_WRITES_LOG))
    record = {"path": str(script), "argv": ["train.py", "--pad", _PADDING, "--log", "out.txt"], "cwd": str(tmp_path),
              "sha256": None}
    notes: list[str] = []
    # WHEN the replay loads Net, confirmed (argparse takes --pad as an unknown argument: the load fails)
    with _names.recorded({"script": record}, "checkpoint 'ck.pt'", notes), pytest.raises(Exception) as failed:
        _names.load_script(str(script), "Net")
    # THEN the note and the error both hold the whole argv
    shown = f"train.py --pad {_PADDING} --log out.txt"
    assert notes == [f"script {script}'s definitions ran with the argv its capture recorded (5 arguments, "
                     f"{len(shown)} characters, all shown: {shown}) in {tmp_path}"]
    assert f"(5 arguments, {len(shown)} characters, all shown: {shown})" in str(failed.value)
    assert "unrecognized arguments: --pad" in str(failed.value)


def test_a_short_argv_is_shown_as_it_is() -> None:
    # GIVEN an argv shorter than the size that is said, with a control character
    # WHEN it is shown
    # THEN it is the command line, escaped, nothing before it
    assert _names._argv_text(["train.py", "--log", "a\nb"]) == "train.py --log 'a\\nb'"
