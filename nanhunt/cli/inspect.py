"""``nanhunt inspect``: a checkpoint's non-finite and near-overflow parameters, optimizer moments and GradScaler
state."""

from __future__ import annotations

import argparse

from ._common import EXIT_CLEAN, EXIT_NONFINITE, print_rich, warn_trust_pickle


class InspectCommand:
    name = "inspect"
    help = "non-finite and near-overflow parameters, optimizer moments and GradScaler state of a checkpoint"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint", help="checkpoint.pt: a nanhunt capture, a state_dict, {'model': ...} or Lightning's")
        p.add_argument("--trust-pickle", action="store_true", help="allow weights_only=False loads (runs code from the file!)")

    def run(self, args: argparse.Namespace) -> int:
        from ..capture.inspect_ckpt import inspect_checkpoint
        from ..report.console import render_inspection

        if args.trust_pickle:
            warn_trust_pickle(one_file=True)
        found = inspect_checkpoint(args.checkpoint, trust_pickle=args.trust_pickle)
        print_rich(render_inspection(found))
        return EXIT_NONFINITE if found.nonfinite else EXIT_CLEAN
