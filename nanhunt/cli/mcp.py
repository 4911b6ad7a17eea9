"""``nanhunt mcp``: nanhunt as a Model Context Protocol server over stdio, for a coding agent
(:mod:`nanhunt.integrations._mcp`); needs the optional MCP SDK, ``pip install "nanhunt[mcp]"``."""

from __future__ import annotations

import argparse

from .._util._errors import InputError
from ._common import EXIT_CLEAN


class McpCommand:
    name = "mcp"
    help = ("serve nanhunt's inspect, replay, report and compare as tools to a coding agent (Model Context "
            "Protocol over stdio; needs the extra: pip install \"nanhunt[mcp]\")")

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        pass  # every option is a tool's argument, given per call

    def run(self, args: argparse.Namespace) -> int:
        try:
            from ..integrations._mcp import serve
        except ModuleNotFoundError as e:
            if e.name is None or e.name.partition(".")[0] not in ("mcp", "mcp_types", "pydantic"):
                raise
            raise InputError("nanhunt mcp needs the MCP SDK, which is not installed here; install it with: "
                             "pip install \"nanhunt[mcp]\"") from None
        serve()
        return EXIT_CLEAN
