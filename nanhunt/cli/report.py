"""``nanhunt report``: a saved JSON report rendered again (Markdown, HTML with its picture, console text)."""

from __future__ import annotations

import argparse
import os
import sys

from .._util._errors import InputError, NanhuntError, first_line
from ._common import EXIT_CLEAN, check_writable, print_rich


class ReportCommand:
    name = "report"
    help = "render a saved JSON report again: Markdown, HTML (with its picture) or console text"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("input", metavar="IN.json", help="a report written by nanhunt replay --report x.json or --bundle")
        p.add_argument("--format", choices=("md", "html", "console", "json"),
                       help="default: from the suffix of -o, else console")
        p.add_argument("-o", "--output", metavar="PATH", help="write here instead of stdout (beside an .html: its .png)")

    def run(self, args: argparse.Namespace) -> int:
        from .._util._json import read_json
        from ..records import Report
        from ..report import FORMATS, render_for_format, write
        from ..report.console import render

        # bounded in size and depth: a report is tens of kB, a file from a ticket may be anything
        data = read_json(args.input, what="a nanhunt JSON report",
                         fix="write it again with nanhunt replay --report x.json")
        fmt = args.format
        if fmt is None:
            fmt = FORMATS.get(os.path.splitext(args.output)[1].lower(), "console") if args.output else "console"
        if args.output:
            check_writable(args.output, fmt)
        # A hand-edited file can hold any type in any field: the renderers trust a Report, so whatever
        # loading or rendering it raises means the file is not a valid report.
        try:
            report = Report.from_dict(data)
            if args.output:
                write(report, args.output, fmt)
            elif fmt == "console":
                print_rich(render(report))
            else:
                sys.stdout.write(render_for_format(fmt)(report))
        except NanhuntError:
            raise
        except Exception as e:
            raise InputError(f"{args.input!r} is not a nanhunt JSON report ({first_line(e)}); write it again "
                               "with nanhunt replay --report x.json") from e
        return EXIT_CLEAN
