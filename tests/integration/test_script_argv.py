"""The replay command a Guard prints works for scripts that read their command line when their definitions run
(arguments parsed at the module level, ``sys.argv`` in default values): the capture records the script's argv,
working directory and text, the confirmed replay runs the definitions with that argv and the module-level
statements they use, and the Guard says when it is made what a replay of the script would lack."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nanhunt
from nanhunt.capture import _names
from nanhunt.capture.capture import save_capture
from nanhunt.cli import main as cli_main
from tests.integration.test_guard_command import _run_as_printed

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "user_scripts"
CULPRIT = "Inf born in phase forward, in fc1 (Linear, call 0) at aten::_to_copy."


def _train(script: Path, *args: str, where: Path) -> subprocess.CompletedProcess[str]:
    """``python script args`` run in ``where`` as a user runs it."""
    where.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), *args], cwd=where, env=env, capture_output=True, text=True,
                          timeout=120)


def _printed_command(text: str) -> str:
    """The replay command on the last line that holds one (a GuardError's message, or the script's own print)."""
    lines = [line for line in text.splitlines() if "nanhunt replay " in line]
    assert lines, text[-2000:]
    return "nanhunt replay " + lines[-1].split("nanhunt replay ", 1)[1]


def _names_the_culprit_from_elsewhere(command: str, tmp_path: Path) -> None:
    """``command`` run as printed from a directory other than the script's names the culprit."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run_as_printed(command, elsewhere)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == CULPRIT


@pytest.mark.subprocess
def test_a_script_that_parses_its_arguments_at_module_level_replays_as_printed_elsewhere(tmp_path: Path) -> None:
    # GIVEN a script that parses --hidden 16 at its top level (Net's default width) and --scale (read by the loss
    # when called), stopped by its Guard at the bad step (on_fail="raise")
    script = SCRIPTS / "argparse_train.py"
    dump = tmp_path / "nan"
    ran = _train(script, "--hidden", "16", "--scale", "2", "--dump-dir", str(dump), where=tmp_path / "run")
    assert ran.returncode == 1 and "GuardError" in ran.stderr, ran.stderr[-2000:]
    command = _printed_command(ran.stderr)
    assert command == (f"nanhunt replay {dump}/step000002-checkpoint.pt {dump}/step000002-batch.pt "
                       f"--model {script}:Net --loss {script}:my_loss")
    # WHEN the printed command is run as printed from another directory
    # THEN it names the culprit: Net was rebuilt 16 wide, from the argv the script ran with
    _names_the_culprit_from_elsewhere(command, tmp_path)


@pytest.mark.subprocess
def test_a_script_that_reads_sys_argv_in_its_defaults_replays_as_printed_elsewhere(tmp_path: Path) -> None:
    # GIVEN a script whose Net and loss take sys.argv[1] and [2] as default values, its Guard recording (on_fail="dump")
    script = SCRIPTS / "argv_train.py"
    dump = tmp_path / "nan"
    ran = _train(script, "16", "0.5", str(dump), where=tmp_path / "run")
    assert ran.returncode == 0, ran.stderr[-2000:]
    command = _printed_command(ran.stdout)
    assert command.endswith(f" --model {script}:Net --loss {script}:my_loss"), command
    # WHEN the printed command is run as printed from another directory
    # THEN the defaults read the script's argv, not the replay's, and it names the culprit
    _names_the_culprit_from_elsewhere(command, tmp_path)


@pytest.mark.subprocess
def test_a_changed_script_is_said_and_an_argv_it_no_longer_parses_is_one_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture of a copy of the script (its loop module beside it) run with --hidden 16, then the copy's
    # --hidden renamed --width
    script = tmp_path / "train.py"
    script.write_text((SCRIPTS / "argparse_train.py").read_text())
    shutil.copy(SCRIPTS / "amp_steps.py", tmp_path)
    dump = tmp_path / "nan"
    ran = _train(script, "--hidden", "16", "--dump-dir", str(dump), where=tmp_path)
    assert ran.returncode == 1, ran.stderr[-2000:]
    argv = shlex.split(_printed_command(ran.stderr))[2:]
    script.write_text(script.read_text().replace('"--hidden"', '"--width"').replace("args.hidden", "args.width"))
    # WHEN the printed command is replayed
    code = cli_main(["replay", *argv, "--no-bisect"])
    err = capsys.readouterr().err.strip().splitlines()
    # THEN argparse's exit is one error line naming the argument, and it says the script changed since
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"nanhunt: error: running the definitions of script {str(script)!r} with the argv its "
                             f"capture recorded ({script} --hidden 16 "), err[0]
    assert "train.py: error: unrecognized arguments: --hidden 16" in err[0]
    assert "the script changed since the capture" in err[0]


@pytest.mark.subprocess
def test_the_guard_says_when_made_what_a_replay_of_the_script_lacks(tmp_path: Path) -> None:
    # GIVEN a script that parses its arguments in its main block, which Net's constructor reads
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import argparse, torch
        from torch import nn
        import nanhunt

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, args.hidden)

        if __name__ == "__main__":
            parser = argparse.ArgumentParser()
            parser.add_argument("--hidden", type=int, default=8)
            args = parser.parse_args()
            model = Net()
            guard = nanhunt.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), dump_dir="nan")
    """))
    # WHEN the Guard is made
    ran = _train(script, "--hidden", "4", where=tmp_path)
    # THEN one warning line says what to add for the printed replay command to work
    assert ran.returncode == 0, ran.stderr[-2000:]
    lines = [line for line in ran.stderr.splitlines() if "GuardWarning" in line]
    assert len(lines) == 1, ran.stderr
    assert lines[0].endswith(
        f"GuardWarning: nanhunt.Guard: the printed replay command will fail on model factory {script}:Net: it uses "
        "'args', which the script assigns only in its `if __name__ == \"__main__\":` block (line 14); a replay "
        "runs only a script's definitions and the module-level statements they use (never its main block, loops, "
        "with blocks or plain calls): assign args at the module level, or put Net in a module"), lines[0]


def test_a_replay_runs_the_statements_the_definitions_use_with_the_recorded_argv(tmp_path: Path) -> None:
    # GIVEN a script that parses its arguments at its top level around a model it builds and trains there
    marks = tmp_path / "marks.txt"
    (tmp_path / "train.py").write_text(textwrap.dedent(f"""
        import argparse, os
        def mark(what):
            with open({str(marks)!r}, "a") as f:
                f.write(what + "\\n")
            return what
        parser = argparse.ArgumentParser()
        parser.add_argument("--hidden", type=int, default=8)
        parser.add_argument("--unused", default=mark("unused default"))
        args = parser.parse_args()
        args.hidden *= 2
        os.environ.setdefault("NANHUNT_TEST_SCRIPT_RAN", "1")  # a call on a module the definitions use
        WHERE = os.getcwd()
        HIDDEN = args.hidden
        class Net:
            def __init__(self, hidden=HIDDEN):
                self.hidden, self.where = hidden, WHERE
        model = Net()
        log = mark("not used by a definition")
        mark("a call")
        for _ in range(1):
            late = mark("loop")
        with open(os.devnull) as _f:
            late = mark("with")
        if __name__ == "__main__":
            late = mark("main")
    """))
    # (recorded when the script read differently)
    record = {"path": str(tmp_path / "train.py"), "argv": ["train.py", "--hidden", "3"], "cwd": str(tmp_path),
              "sha256": "0" * 64}
    argv, cwd = list(sys.argv), os.getcwd()
    notes: list[str] = []
    # WHEN the replay loads Net with the argv and working directory its capture recorded
    with _names.recorded({"script": record}, "checkpoint 'ck.pt'", notes):
        module = _names.load_script(str(tmp_path / "train.py"), "Net")
    # THEN it says the script changed, Net's default came from that argv, read in that directory, and only what
    # Net uses ran
    assert notes == [f"script {tmp_path / 'train.py'} changed since the capture (its sha256 differs): its "
                     "definitions ran as they are now, with the argv the capture recorded",
                     f"script {tmp_path / 'train.py'}'s definitions ran with the argv its capture recorded (train.py "
                     f"--hidden 3) in {tmp_path}"]
    assert module.Net().hidden == 6 and module.Net().where == str(tmp_path)
    assert marks.read_text() == "unused default\n"  # parser.add_argument(...) configures the parser args reads
    assert not hasattr(module, "model") and not hasattr(module, "log") and not hasattr(module, "late")
    assert "NANHUNT_TEST_SCRIPT_RAN" not in os.environ
    assert (sys.argv, os.getcwd()) == (argv, cwd)


@pytest.mark.parametrize("script", [
    {"path": "train.py", "argv": [], "cwd": None, "sha256": None},  # a relative path
    {"path": "/x/train.py", "argv": "train.py --hidden 16", "cwd": None, "sha256": None},  # argv not a list
    {"path": "/x/train.py", "argv": ["x"] * 10_001, "cwd": None, "sha256": None},  # more than any command line
    {"path": "/x/train.py", "argv": [], "cwd": "rel", "sha256": None},
    {"path": "/x/train.py", "argv": [], "cwd": None, "sha256": "not a digest"},
])
def test_a_script_field_that_is_not_a_recorded_run_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], script: object) -> None:
    # GIVEN a capture whose field script is not what a Guard writes
    files = [str(tmp_path / "ck.pt"), str(tmp_path / "bt.pt")]
    save_capture(files[0], files[1], model=torch.nn.Linear(2, 2), batch=(torch.ones(1, 2), torch.ones(1, 2)),
                 loss_fn=torch.nn.MSELoss())
    ck = torch.load(files[0], weights_only=True)
    ck["script"] = script
    torch.save(ck, files[0])
    # WHEN it is replayed
    code = cli_main(["replay", *files, "--no-bisect"])
    # THEN one error line says the capture is damaged
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"nanhunt: error: checkpoint {files[0]!r} is not a valid nanhunt capture: field 'script' is not a "
                   "script's absolute path, argv, working directory and sha256; save the capture again"]


# A script whose module-level statements draw from every RNG and count their runs in a file, and whose Net and
# loss read what they assign: its training draws the same numbers and counts one run with or without nanhunt.
_DRAWING = """
    import random, sys
    import numpy as np
    import torch
    from torch import nn
    import torch.nn.functional as F

    def _count():
        with open("runs.txt", "a") as f:
            f.write("run\\n")
        return 2

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    SCALE = float(torch.rand(1)) + random.random() + float(np.random.rand())
    HIDDEN = _count()

    class Net(nn.Module):
        def __init__(self, hidden=HIDDEN):
            super().__init__()
            self.l = nn.Linear(hidden, 1)

        def forward(self, x):
            return self.l(x) * SCALE

    def my_loss(out, y):
        return F.mse_loss(out, y)

    if __name__ == "__main__":
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if sys.argv[1:] == ["guard"]:
            import nanhunt
            guard = nanhunt.Guard(model, opt, dump_dir="nan", loss_fn=my_loss)
        x, y = torch.randn(4, 2), torch.randn(4, 1)
        for _ in range(2):
            my_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        print(float(torch.rand(1)), random.random(), float(np.random.rand()), SCALE)
"""


@pytest.mark.subprocess
def test_making_a_guard_runs_nothing_of_the_script(tmp_path: Path) -> None:
    # GIVEN a script whose module-level statements draw random numbers and count their runs, which Net reads
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_DRAWING))
    # WHEN it trains without nanhunt, then with a Guard made before its loop
    plain = _train(script, where=tmp_path / "plain")
    guarded = _train(script, "guard", where=tmp_path / "guarded")
    # THEN both draw the same numbers after, each counted one run of the script, and the Guard warned of nothing
    assert plain.returncode == 0 and guarded.returncode == 0, guarded.stderr[-2000:]
    assert guarded.stdout == plain.stdout, (plain.stdout, guarded.stdout)
    assert (tmp_path / "plain" / "runs.txt").read_text() == (tmp_path / "guarded" / "runs.txt").read_text() == "run\n"
    assert "GuardWarning" not in guarded.stderr, guarded.stderr[-2000:]


@pytest.mark.subprocess
def test_nanhunt_run_runs_the_scripts_module_level_statements_once(tmp_path: Path) -> None:
    # GIVEN the same script, trained plainly and under `nanhunt run` (its Guard learns the loss in the first step)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_DRAWING))
    plain = _train(script, where=tmp_path / "plain")
    where = tmp_path / "run"
    where.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # WHEN it runs under nanhunt run
    ran = subprocess.run([sys.executable, "-m", "nanhunt", "run", str(script)], cwd=where, env=env,
                         capture_output=True, text=True, timeout=120)
    # THEN its statements ran once, and the training drew what it draws without nanhunt
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert (where / "runs.txt").read_text() == "run\n"
    assert ran.stdout.splitlines()[0] == plain.stdout.strip(), (plain.stdout, ran.stdout)


def test_what_a_replay_of_the_script_lacks_is_found_without_running_it(tmp_path: Path) -> None:
    # GIVEN a script whose Net reads, as its default, a name assigned in a loop, and whose module-level statements
    # would mark a file and draw a random number if they ran
    marks = tmp_path / "marks.txt"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        def mark():
            with open({str(marks)!r}, "a") as f:
                f.write("ran\\n")
            return 1
        SCALE = float(torch.rand(1)) + mark()
        for WIDTH in (2, 4):
            pass
        class Net(torch.nn.Module):
            def __init__(self, hidden=WIDTH):
                super().__init__()
                self.scale = SCALE
    """))
    before = torch.random.get_rng_state()
    # WHEN the Guard asks what a replay of Net would lack
    problem = _names.replay_problem(f"{script}:Net", "model factory")
    # THEN it names WIDTH and where it is assigned, and nothing of the script ran
    assert problem == (
        f"the printed replay command will fail on model factory {script}:Net: it uses 'WIDTH', which the script "
        "assigns only in a loop (line 8); a replay runs only a script's definitions and the module-level statements "
        "they use (never its main block, loops, with blocks or plain calls): assign WIDTH at the module level, or put "
        "Net in a module")
    assert not marks.exists()
    assert torch.equal(torch.random.get_rng_state(), before)
    # and a name the script does not define at its top level is said
    assert _names.replay_problem(f"{script}:Missing", "loss function") == (
        f"the printed replay command will fail on loss function {script}:Missing: script {str(script)!r} defines no "
        "'Missing' at its top level; put what the replay needs in a module and pass it as package.module:name")


@pytest.mark.parametrize("binds", ["from widths import *\nCONFIG = 0", "CONFIG = globals().update(WIDTH=2)"])
def test_a_script_whose_names_only_running_it_would_tell_is_not_judged(tmp_path: Path, binds: str) -> None:
    # GIVEN a script whose Net reads WIDTH, bound by what only running the script would show (a star import of
    # the module beside it, globals() changed by a statement Net needs)
    (tmp_path / "widths.py").write_text("WIDTH = 2\n")
    script = tmp_path / "train.py"
    script.write_text(f"import torch\n{binds}\nclass Net(torch.nn.Module):\n"
                      "    def __init__(self, w=WIDTH, c=CONFIG):\n        super().__init__()\n")
    # WHEN the Guard asks what a replay of Net would lack
    # THEN it says nothing
    assert _names.replay_problem(f"{script}:Net", "model factory") is None


def test_a_loss_the_guard_learns_later_from_the_script_records_how_the_script_was_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a Guard made, in a script started with arguments, on a torch.nn model and optimizer (nothing of the
    # script's to record yet)
    script = tmp_path / "train.py"
    script.write_text("import torch.nn.functional as F\ndef my_loss(out, y):\n    return F.mse_loss(out, y)\n")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script))
    monkeypatch.setattr(sys, "argv", [str(script), "--lr", "0.1"])
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 1)
    guard = nanhunt.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), dump_dir=tmp_path / "nan")
    assert guard._capture.script_run is None

    def my_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, y)

    my_loss.__module__, my_loss.__qualname__ = "__main__", "my_loss"  # as the script defines it
    # WHEN it learns the script's loss (nanhunt run does in the first step)
    guard._capture.set_loss_fn(my_loss)
    # THEN its captures record the script's path, argv, working directory and text
    digest = hashlib.sha256(script.read_bytes()).hexdigest()
    assert guard._capture.script_run == {"path": str(script), "argv": [str(script), "--lr", "0.1"],
                                         "cwd": str(tmp_path), "sha256": digest}
    guard.close()


_WRITES_LOG = """
    import argparse, os
    import torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", default="log.txt")
    args = parser.parse_args()
    LOG = os.path.abspath(args.log)
    WHERE = os.getcwd()
    class Net(torch.nn.Module):
        def __init__(self, log=LOG, where=WHERE):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)
            self.log, self.where = log, where
"""


def _capture_of(script: Path, tmp_path: Path, *, argv: list[str], cwd: str, loss: str | None) -> list[str]:
    """A capture whose model is ``script``'s Net (and loss ``loss``), recorded as run with ``argv`` in ``cwd``."""
    files = [str(tmp_path / "ck.pt"), str(tmp_path / "bt.pt")]
    save_capture(files[0], files[1], model=torch.nn.Linear(2, 2), batch=(torch.ones(1, 2), torch.ones(1, 2)),
                 loss_fn=torch.nn.MSELoss())
    ck = torch.load(files[0], weights_only=True)
    ck.update(model_factory=f"{script}:Net", loss_fn=loss or ck["loss_fn"],
              script={"path": str(script), "argv": argv, "cwd": cwd, "sha256": None})
    torch.save(ck, files[0])
    return files


@pytest.mark.parametrize("with_loss", [False, True])
def test_confirming_a_script_name_shows_the_argv_and_directory_it_runs_with(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], with_loss: bool) -> None:
    # GIVEN a capture naming a script's Net (and its loss), recorded as run with an argv of the capture author's
    # choosing, with a terminal escape in it, in another directory
    script = tmp_path / "proj" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(_WRITES_LOG))
    files = _capture_of(script, tmp_path, argv=["train.py", "--log", "/tmp/x\x1b[2J.txt"], cwd=str(tmp_path),
                        loss=f"{script}:my_loss" if with_loss else None)
    # WHEN it is replayed unconfirmed
    code = cli_main(["replay", *files, "--no-bisect"])
    # THEN the one error line asking for the confirmations shows that argv (escaped) and the directory the script
    # will run in
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    asked = (f"the file names model factory '{script}:Net' and loss function '{script}:my_loss', which nanhunt "
             "imports and calls only if you confirm them (your own code or another library's, not torch's own); if "
             f"you trust them, pass --model {script}:Net --loss {script}:my_loss" if with_loss else
             f"the file names model factory '{script}:Net', defined in a script: nanhunt runs the script's imports "
             "and definitions (never its loops or main block) only if you trust it; pass --model "
             f"{script}:Net to confirm")
    assert err == [f"nanhunt: error: {asked}; confirmed, it runs with the argv its capture recorded (train.py --log "
                   f"'/tmp/x\\x1b[2J.txt') in its own directory {script.parent}, not in {tmp_path} where the capture "
                   "says it was started"], err


def test_a_confirmed_script_runs_in_its_own_directory_with_the_recorded_argv_said(tmp_path: Path) -> None:
    # GIVEN a script whose Net's defaults read its --log argument and the working directory, and a capture that
    # records it run with --log in another directory
    script = tmp_path / "proj" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(_WRITES_LOG))
    record = {"path": str(script), "argv": ["train.py", "--log", "out.txt"], "cwd": str(tmp_path), "sha256": None}
    notes: list[str] = []
    # WHEN the replay loads Net, confirmed
    with _names.recorded({"script": record}, "checkpoint 'ck.pt'", notes):
        module = _names.load_script(str(script), "Net")
    # THEN Net read that argv in the script's own directory, and the notes say both
    assert module.Net().where == str(script.parent)
    assert module.Net().log == str(script.parent / "out.txt")
    assert notes == [f"script {script}'s definitions ran with the argv its capture recorded (train.py --log out.txt) "
                     f"in its own directory {script.parent}, not in {tmp_path} where the capture says it was started"]
