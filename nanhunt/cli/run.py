"""``nanhunt run train.py [args...]``: the user's script, unchanged, with the Guard attached to the training it
finds; at the first bad step, the capture and the command that replays it (:mod:`nanhunt.integrations._script`
runs it, :mod:`nanhunt.integrations._attach` attaches nanhunt)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._util._errors import InputError, visible

# --on-fail's words, as the Guard's on_fail
_ON_FAIL = {"stop": "raise", "rollback": "rollback", "continue": "dump"}
_HELP = ("run a training script unchanged, with nanhunt watching its steps; at the first non-finite loss, gradient "
         "or update, write a capture and print the command that replays it")


class RunCommand:
    name = "run"
    help = _HELP
    runs_user_code = True

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.usage = "nanhunt run [options] (SCRIPT | -m MODULE) [ARGS ...]"
        p.epilog = ("Exit codes: the script's own; 1 when nanhunt stopped the run at a bad step (--on-fail stop); "
                    "2 for bad nanhunt options; 130 on Ctrl-C. Under torchrun: torchrun --nproc-per-node N -m nanhunt "
                    "run SCRIPT")
        p.add_argument("--dump-dir", default="nan-captures", metavar="DIR",
                       help="where captures go (default: nan-captures, created at the first one)")
        p.add_argument("--on-fail", choices=tuple(_ON_FAIL), default="stop",
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
        from ..integrations._attach import AttachOptions
        from ..integrations._run import check_values
        from ..integrations._script import run_script, script_of, summary

        script = script_of(args.script, args.module, args.script_args)
        options: dict[str, Any] = {"max_consecutive_skips": args.max_consecutive_skips,
                                   "check_params": args.check_params, "snapshot_every": args.snapshot_every,
                                   "on_fail": _ON_FAIL[args.on_fail]}
        try:
            check_values(options)  # now: a value refused at the first step would leave the run unwatched
        except ValueError as e:
            raise InputError(f"bad option for nanhunt run: {_flags(str(e), options)}") from e
        on_fail = options.pop("on_fail")
        outcome = run_script(script, AttachOptions(os.path.abspath(args.dump_dir), on_fail, options))
        code, lines = summary(outcome, script)
        if outcome.mid_line and lines:
            print(file=sys.stderr)  # after a progress bar's last \r: nanhunt's lines start on their own
        for line in lines:
            _say(line)
        return code


def _flags(message: str, options: dict[str, Any]) -> str:
    """The Guard's message about its options, in the words of the command line (which has no None)."""
    for name in options:
        message = message.replace(name, "--" + name.replace("_", "-"))
    return message.replace(" or None", "")


def _say(text: str) -> None:
    print("nanhunt run: " + visible(text), file=sys.stderr)
