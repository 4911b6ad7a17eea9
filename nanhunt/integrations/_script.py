"""A training script run as Python runs it, with nanhunt attached (:mod:`._attach`): what ``nanhunt run`` does,
and the lines it says at the end (:func:`summary`)."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

from .._util._errors import InputError, GuardError
from ._attach import Attached, AttachOptions, RunRefused

__all__ = ["Script", "Outcome", "script_of", "run_script", "summary", "EXIT_STOPPED"]

EXIT_STOPPED = 1  # the run stopped at a bad step (a capture was written)


@dataclass(frozen=True)
class Script:
    """What runs: a script's absolute path (``module`` None) or a module's file and name, with its arguments."""

    path: str
    argv: tuple[str, ...]
    module: str | None = None


@dataclass
class Outcome:
    """How the run ended: the script's exit code, the Guard's detection that stopped it, the script's own
    exception, and what was attached."""

    attached: Attached
    code: int = 0
    stopped: GuardError | None = None
    failure: BaseException | None = None
    lines: list[str] = field(default_factory=list)
    mid_line: bool = False  # the script's last output (stdout or stderr) did not end its line (a progress bar)


class _LineEnd:
    """``sys.stdout`` / ``sys.stderr`` as the script sees them, noting whether the last text written through
    either ended its line: a progress bar (tqdm's ``\r...``) leaves the cursor after itself, and nanhunt's own
    lines must then start on a line of their own. Everything else is the stream's own."""

    def __init__(self, stream: Any, outcome: Outcome) -> None:
        self._stream = stream
        self._outcome = outcome

    def write(self, text: str) -> int:
        n: int = self._stream.write(text)
        if text:
            self._outcome.mid_line = not text.endswith("\n")
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def script_of(script: str | None, module: list[str] | None, argv: list[str]) -> Script:
    """The :class:`Script` of ``nanhunt run``'s arguments (``module``: ``-m``'s name and its arguments)."""
    if module is not None:
        if script is not None:
            raise InputError("give a script or -m MODULE, not both: nanhunt run [options] -m MODULE [ARGS]")
        if not module:
            raise InputError("-m needs a module name: nanhunt run -m package.module [ARGS]")
        name = module[0]
        saved = sys.path
        sys.path = [os.getcwd(), *saved]  # as `python -m` looks for it (python -m nanhunt left it out)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        finally:
            sys.path = saved
        if spec is None:
            raise InputError(f"no module named {name!r} on the import path; run from the project's folder or "
                               "install it")
        return Script(spec.origin or name, tuple(module[1:]), name)
    if script is None:
        raise InputError("nothing to run: nanhunt run [options] train.py [ARGS] (or -m MODULE)")
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise InputError(f"script {script!r} does not exist; give the path of the training script")
    return Script(path, tuple(argv))


def run_script(script: Script, options: AttachOptions) -> Outcome:
    """Run ``script`` as ``python SCRIPT ARGS`` (or ``python -m``) runs it: as ``__main__``, with ``sys.argv`` its
    own and its folder (the current one for a module) first on the import path; nanhunt attached for the run.
    ``sys.argv``, ``sys.path`` (the lists themselves) and everything attached are put back after, also on Ctrl-C
    or a failure while attaching. The script's exception is handed back (:attr:`Outcome.failure`), not raised;
    Ctrl-C and SIGTERM are raised, the step they cut short left unchecked."""
    attached = Attached(options)
    outcome = Outcome(attached)
    argv, path, streams = sys.argv, sys.path, (sys.stdout, sys.stderr)
    cut: BaseException | None = None  # what ended the run before the script did (Ctrl-C, SIGTERM, nanhunt's)
    try:
        attached.install()
        sys.stdout, sys.stderr = _LineEnd(streams[0], outcome), _LineEnd(streams[1], outcome)
        sys.argv = [script.path, *script.argv]
        sys.path = [os.path.dirname(script.path) if script.module is None else os.getcwd(), *path]
        try:
            if script.module is None:
                runpy.run_path(script.path, run_name="__main__")
            else:
                runpy.run_module(script.module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            outcome.code = _exit_code(e)
        except BaseException as e:
            outcome.stopped = _guard_error(e)
            if outcome.stopped is None:
                if not isinstance(e, Exception) or isinstance(e, RunRefused):
                    raise  # Ctrl-C, SIGTERM, nanhunt run's refusal: the CLI's own lines and exit codes
                outcome.failure = e
    except BaseException as e:
        cut = e
        raise
    finally:
        sys.argv, sys.path = argv, path
        sys.stdout, sys.stderr = streams
        attached.close(outcome.failure or cut)  # a step that raised is ended as failed: no checks after Ctrl-C
    return outcome


def _exit_code(e: SystemExit) -> int:
    """The exit code ``sys.exit(code)`` gives, as Python sets it."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
    return 1


def _guard_error(e: BaseException) -> GuardError | None:
    """The Guard's detection, also when a framework wrapped it in its own exception."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, GuardError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def print_script_error(e: BaseException, target: str) -> None:
    """The script's own exception, as Python prints it: from the script's frames on."""
    tb = e.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != os.path.abspath(target):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)


def summary(outcome: Outcome, script: Script) -> tuple[int, list[str]]:
    """The exit code of ``nanhunt run`` and the lines it says: what was watched, each detection, what could not
    be seen. The script's own exception is printed as Python prints it."""
    attached, code, stopped, failure, target = (outcome.attached, outcome.code, outcome.stopped, outcome.failure,
                                                script.path)
    lines: list[str] = []
    say = lines.append
    name = os.path.basename(target)
    note = attached.loop.loss_note
    if attached.loop.gave_up:
        say(f"{attached.loop.gave_up}: steps after it were not checked")
    if attached.gave_up:
        say(attached.gave_up)
    if attached.loop.skipped_calls:
        say(f"{attached.loop.skipped_calls} training forward(s) called the model with positional and keyword "
             "arguments together, which no batch file holds: those steps were not checked")
    if failure is not None:
        print_script_error(failure, target)
        code = 1
    for event in attached.events:
        if event.kind == "change" or (stopped is not None and event is stopped.event):
            continue
        say(event.describe())
    if stopped is not None:
        say(f"stopped {name}: {stopped.event.describe()}")
        world = max((g._detect.world for g in attached.guards), default=1)
        command = stopped.event.replay_command()
        if command and stopped.event.batch is None and world > 1:
            say(f"replay every rank's part with: torchrun --nproc-per-node {world} -m {command}")
        if note:
            say(note)
        return EXIT_STOPPED, lines
    if attached.loop.gave_up or attached.gave_up:
        return code, lines  # said above
    watched = attached.framework or ("a training loop" if attached.loop.guards else None)
    steps = sum(g.iterations for g in attached.guards)
    if watched is None:
        say(f"watched nothing in {name}: no transformers or Lightning Trainer was made, and no torch.optim optimizer "
             "whose model the script called in training mode; nothing was checked")
    elif steps == 0:
        say(f"watched nothing in {name}: {watched} was made but no training step ran; nothing was checked")
    elif not any(e.is_detection() for e in attached.events) and failure is None:
        say(f"{name} finished; {watched} was watched: {_steps(steps)} checked and no non-finite value was seen")
    elif note:
        say(note)
    return code, lines


def _steps(n: int) -> str:
    return "1 step was" if n == 1 else f"{n} steps were"
