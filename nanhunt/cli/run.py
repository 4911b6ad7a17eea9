"""``nanhunt run train.py [args...]``: the user's script, unchanged, with the Guard attached to the training it
finds (:mod:`nanhunt.integrations._attach`); at the first bad step, the capture and the command that replays it."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from typing import Any

from .._util._errors import CommandError, GuardError, visible

EXIT_STOPPED = 1  # the run stopped at a bad step (a capture was written)

_HELP = ("run a training script unchanged, with nanhunt watching its steps; at the first non-finite loss, gradient "
         "or update, write a capture and print the command that replays it")


class RunCommand:
    name = "run"
    help = _HELP
    runs_user_code = True

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.usage = "nanhunt run [options] (SCRIPT | -m MODULE) [ARGS ...]"
        p.epilog = ("Exit codes: the script's own; 1 when nanhunt stopped the run at a bad step (--on-fail stop); "
                    "2 for bad nanhunt options. Under torchrun: torchrun --nproc-per-node N -m nanhunt run SCRIPT")
        p.add_argument("--dump-dir", default="nan-captures", metavar="DIR",
                       help="where captures go (default: nan-captures, created at the first one)")
        p.add_argument("--on-fail", choices=("stop", "rollback", "continue"), default="stop",
                       help="at a bad step: stop the run (default), roll back to the last good state and skip the "
                            "batch (plain loops), or continue, only recording")
        p.add_argument("--snapshot-every", type=int, metavar="N",
                       help="keep a CPU copy of the state every N steps (needed to roll back an update that wrote "
                            "non-finite weights)")
        p.add_argument("--max-consecutive-skips", type=int, default=10, metavar="N",
                       help="GradScaler skips in a row that count as a bad step (default 10)")
        p.add_argument("--check-params", action="store_true", help="check the weights after every update")
        p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE",
                       help="run a module as `python -m MODULE` does (the rest of the line is its arguments)")
        p.add_argument("script", nargs="?", help="the training script (as `python SCRIPT ARGS` runs it)")
        p.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        from ..integrations._attach import Attached, AttachOptions

        target, argv, module = _target(args)
        options = {"max_consecutive_skips": args.max_consecutive_skips, "check_params": args.check_params}
        if args.snapshot_every is not None:
            if args.snapshot_every < 1:
                raise CommandError("--snapshot-every must be at least 1")
            options["snapshot_every"] = args.snapshot_every
        attached = Attached(AttachOptions(os.path.abspath(args.dump_dir), args.on_fail, options))
        saved_argv, saved_path = list(sys.argv), list(sys.path)
        code, stopped, failure = 0, None, None
        attached.install()
        try:
            sys.argv = [target, *argv] if module is None else [target, *argv]
            sys.path.insert(0, os.path.dirname(target) if module is None else os.getcwd())
            try:
                if module is None:
                    runpy.run_path(target, run_name="__main__")
                else:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = _exit_code(e)
            except BaseException as e:
                stopped = _guard_error(e)
                if stopped is None:
                    if not isinstance(e, Exception):
                        raise  # Ctrl-C, SIGTERM: the CLI's own lines and exit codes
                    if isinstance(e, CommandError) and _ours(e):
                        raise
                    failure = e
        finally:
            sys.argv[:], sys.path[:] = saved_argv, saved_path
            attached.close(failure)
        return _summary(attached, target, code, stopped, failure)


def _target(args: argparse.Namespace) -> tuple[str, list[str], str | None]:
    """(the path or module run, its arguments, the module name or None)."""
    if args.module is not None:
        rest = list(args.module)
        if args.script is not None:
            raise CommandError("give a script or -m MODULE, not both: nanhunt run [options] -m MODULE [ARGS]")
        if not rest:
            raise CommandError("-m needs a module name: nanhunt run -m package.module [ARGS]")
        name = rest[0]
        import importlib.util

        saved = list(sys.path)
        sys.path.insert(0, os.getcwd())  # as `python -m` looks for it (python -m nanhunt left it out)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        finally:
            sys.path[:] = saved
        if spec is None:
            raise CommandError(f"no module named {name!r} on the import path; run from the project's folder or "
                               "install it")
        return spec.origin or name, rest[1:], name
    if args.script is None:
        raise CommandError("nothing to run: nanhunt run [options] train.py [ARGS] (or -m MODULE)")
    path = os.path.abspath(args.script)
    if not os.path.isfile(path):
        raise CommandError(f"script {args.script!r} does not exist; give the path of the training script")
    return path, list(args.script_args), None


def _exit_code(e: SystemExit) -> int:
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


def _ours(e: BaseException) -> bool:
    """Raised by nanhunt run itself (a Trainer with --on-fail rollback), not by the script."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}nanhunt{os.sep}integrations{os.sep}" in tb.tb_frame.f_code.co_filename


def _print_script_error(e: BaseException, target: str) -> None:
    """The script's own exception, as Python prints it: from the script's frames on."""
    tb = e.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != os.path.abspath(target):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)


def _summary(attached: Any, target: str, code: int, stopped: GuardError | None, failure: BaseException | None) -> int:
    name = os.path.basename(target)
    note = attached.loop.loss_note
    if attached.loop.gave_up:
        _say(f"{attached.loop.gave_up}: steps after it were not checked")
    if attached.gave_up:
        _say(attached.gave_up)
    if attached.loop.skipped_calls:
        _say(f"{attached.loop.skipped_calls} training forward(s) called the model with positional and keyword "
             "arguments together, which no batch file holds: those steps were not checked")
    if failure is not None:
        _print_script_error(failure, target)
        code = 1
    for event in attached.events:
        if event.kind == "change" or (stopped is not None and event is stopped.event):
            continue
        _say(event.describe())
    if stopped is not None:
        _say(f"stopped {name}: {stopped.event.describe()}")
        world = os.environ.get("WORLD_SIZE", "1")
        command = stopped.event.replay_command()
        if command and stopped.event.batch is None and world != "1":
            _say(f"replay every rank's part with: torchrun --nproc-per-node {world} -m {command}")
        if note:
            _say(note)
        return EXIT_STOPPED
    if attached.loop.gave_up or attached.gave_up:
        return code  # said above
    watched = attached.framework or ("a training loop" if attached.loop.guards else None)
    if watched is None:
        _say(f"watched nothing in {name}: no transformers or Lightning Trainer was made, and no torch.optim optimizer "
             "whose model the script called in training mode; nothing was checked")
    elif not any(e.checkpoint for e in attached.events) and failure is None:
        _say(f"{name} finished; {watched} was watched and no non-finite value was seen")
    elif note:
        _say(note)
    return code


def _say(text: str) -> None:
    print("nanhunt run: " + visible(text), file=sys.stderr)
