"""``nanhunt mcp``: nanhunt as a Model Context Protocol server over stdio, for a coding agent to call as it calls a
linter. Four tools, named after the commands they run: ``inspect``, ``replay``, ``report`` (render a saved report)
and ``compare``, their options typed arguments named after the command's flags. A result holds the short answer
as text, then the JSON (a report's schema, ``schema_version`` first) as text and as structured content.

The safety rules are the command line's: the names a capture records are suggestions, and only an argument
naming them (``model``, ``loss``, ``optimizer``, ``trust_names``, ``metric``), or ``trust_pickle`` and
``trust_compile_options``, confirms them: none has a default that does, and the agent's host shows the user
every argument of a call. A refusal is an error result of one line naming the argument to pass, and the server
goes on. Only the protocol reaches stdout: what a tool call prints (nanhunt's lines, torch's, the user's model's)
goes to stderr, and calls run one at a time (a replay patches the model and torch's dispatch while it runs).

Imports the MCP SDK (``pip install "nanhunt[mcp]"``); nothing but the command imports this module.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, ContentBlock, TextContent, ToolAnnotations
from pydantic import Field

from .._util._errors import NanhuntError, first_line, visible
from .._util._text import cut
from ._agent import Answer

__all__ = ["server", "serve", "inspect", "replay", "report", "compare"]

INSTRUCTIONS = (
    "nanhunt finds where a NaN or Inf is born in a PyTorch training step. replay a capture (the files "
    "nanhunt.Guard wrote when a step failed, or a checkpoint and a batch) to get the op, module and phase where the "
    "first non-finite value appeared and why (the bisection's verdict); inspect a checkpoint without running it; "
    "compare float32 against autocast; report renders a saved JSON report. A capture names the model factory, "
    "loss and optimizer that built it: those are suggestions, never imported or called unless the call confirms "
    "them. Never pass model, loss, optimizer, trust_names, metric, trust_pickle or trust_compile_options without "
    "asking the user first: a refusal says which argument confirms which name, and confirming it runs that code.")

_SHOWN = 4000  # characters of a refusal: a real one is a few hundred
_LOCK = threading.Lock()  # one call at a time: a replay owns the model, torch's dispatch and sys.stdout meanwhile


def _refusal(message: str, arguments: frozenset[str]) -> CallToolResult:
    """One line: the library's message (it names the command's flags), then the tool's arguments those flags are."""
    named = []
    for flag in dict.fromkeys(re.findall(r"(?<![\w-])--[a-z][a-z-]*", message)):
        arg = flag[2:].replace("-", "_")
        if arg in arguments:
            named.append(f"{flag} is the argument {arg}")
        elif arg == "no_bisect" and "bisect" in arguments:
            named.append(f"{flag} is bisect=false")
    # cut: a file may name something megabytes long, which the message quotes, and an agent reads all of it
    text = "nanhunt: error: " + visible(cut(message, _SHOWN))
    if named:
        text += f" (in this tool: {'; '.join(named)})"
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _call(tool: str, arguments: frozenset[str], work: Callable[[], Answer]) -> CallToolResult:
    """Run one tool call with stdout sent to stderr; its answer as text and JSON, or its refusal as one line."""
    with _LOCK, contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # as on the command line without --debug
        try:
            answer = work()
        except NanhuntError as e:
            return _refusal(str(e), arguments)
        except Exception as e:  # a nanhunt bug: the traceback to the server's log, one line to the agent
            traceback.print_exc(file=sys.stderr)
            return _refusal(f"the {tool} tool failed inside nanhunt ({first_line(e)}): a nanhunt bug; run the same "
                            "with the nanhunt command line and --debug, and report the traceback", frozenset())
        finally:
            sys.stderr.flush()
    content: list[ContentBlock] = [TextContent(type="text", text=answer.text)]
    if answer.data is None:
        return CallToolResult(content=content)
    content.append(TextContent(type="text", text=json.dumps(answer.data, indent=2, allow_nan=False)))
    return CallToolResult(content=content, structured_content=answer.data)


def _arguments(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(fn.__code__.co_varnames[: fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount])


# ------------------------------------------------------------------ the arguments, described once

_CONFIRM = " A name you pass confirms it: nanhunt imports and calls it. Ask the user first; never copy it from a file."
_Path = Annotated[str, Field(description="path of a file on the machine running nanhunt (absolute, or relative "
                                         "to the server's directory)")]
_Model = Annotated[str | None, Field(description="PKG.MOD:FACTORY that builds the model (a plain state_dict needs "
                                                 "it; a capture's own name needs it unless it is torch's)." + _CONFIRM)]
_Loss = Annotated[str | None, Field(description="PKG.MOD:FN, the loss called as fn(output, targets)." + _CONFIRM)]
_Optimizer = Annotated[str | None, Field(description="PKG.MOD:CLASS, the optimizer built on the model's parameters "
                                                     "with the file's groups and state." + _CONFIRM)]
_TrustNames = Annotated[tuple[str, ...], Field(description="package prefixes whose model, loss and optimizer names the "
                                                     "file may choose without model/loss/optimizer." + _CONFIRM)]
_TrustPickle = Annotated[bool, Field(description="load the files with weights_only=False, which runs any code they "
                                                 "contain. Only with the user's explicit consent.")]
_Device = Annotated[str | None, Field(description="cpu, cuda, cuda:1 ... (default cpu)")]
_Train = Annotated[bool | None, Field(description="true: train mode, false: eval mode (default: as captured)")]
_Report = Annotated[str | None, Field(description="also write the report here (.json, .md, .html with its .png, "
                                                  ".txt); its directory must exist")]


def inspect(checkpoint: _Path, trust_pickle: _TrustPickle = False) -> CallToolResult:
    """A checkpoint's non-finite and near-overflow parameters, optimizer moments and GradScaler state, without
    running it (nanhunt inspect). Text: what the command prints; JSON: the inspection, "nonfinite" first."""
    from . import _agent

    return _call("inspect", _arguments(inspect), lambda: _agent.inspect(checkpoint, trust_pickle=trust_pickle))


def replay(
    checkpoint: Annotated[str, Field(description="checkpoint.pt (a nanhunt capture, a state_dict, {'model': ...} "
                                                 "or Lightning's, a .safetensors file), a Trainer's checkpoint-N/ "
                                                 "directory, or a capture directory the Guard wrote under FSDP2")],
    batch: Annotated[str | None, Field(description="batch.pt (a nanhunt capture, a tensor, (inputs, targets) or a "
                                                   "dict); leave out with a capture directory")] = None,
    rank: Annotated[int | None, Field(description="with a capture directory: replay this rank's batch")] = None,
    model: _Model = None, loss: _Loss = None, optimizer: _Optimizer = None, trust_names: _TrustNames = (),
    dtype: Annotated[Literal["float16", "bfloat16", "float32"] | None,
                     Field(description="autocast dtype (default: the capture's, else float16)")] = None,
    device: _Device = None,
    level: Annotated[Literal["op", "module"], Field(description="op: the aten op and its source line; module: "
                                                                "only the module, cheaper")] = "op",
    no_scaler: Annotated[bool, Field(description="ignore the GradScaler state: unscaled backward")] = False,
    train: _Train = None,
    allow: Annotated[tuple[str, ...], Field(description="modules or ops whose NaN/Inf is intentional")] = (),
    bisect: Annotated[bool, Field(description="confirm the culprit by float32 replays (the verdict)")] = True,
    repeat: Annotated[int, Field(description="replay up to N times while the step stays finite")] = 1,
    snapshot: Annotated[Literal["auto", "memory", "disk"], Field(description="where the copy of the weights "
                                                                             "restored between runs lives")] = "auto",
    compile: Annotated[str | None, Field(description="when the eager replay is finite, replay compiled by this "
                                                     "backend too (inductor, aot_eager, eager, or PKG.MOD:FN, which "
                                                     "is imported)")] = None,
    trust_compile_options: Annotated[bool, Field(description="use every compile option the capture recorded (they "
                                                             "can name the C++ compiler and its flags, which run). "
                                                             "Only with the user's consent.")] = False,
    trust_pickle: _TrustPickle = False, report: _Report = None,
) -> CallToolResult:
    """Replay one training step from a capture and name where its first NaN/Inf was born (nanhunt replay): text,
    the headline (status, phase, module, op, verdict); JSON, the report (schema_version first)."""
    from ..capture._options import LoadOptions
    from ..hunt._options import ReplayOptions
    from ..records import Level
    from . import _agent

    def work() -> Answer:
        load = LoadOptions(model_factory=model, loss=loss, optimizer=optimizer, trust_names=tuple(trust_names),
                           device=device, dtype=dtype, no_scaler=no_scaler, train=train, trust_pickle=trust_pickle,
                           snapshot=None if snapshot == "auto" else snapshot, compile=compile,
                           trust_compile_options=trust_compile_options)
        options = ReplayOptions(load, level=Level(level), allow=tuple(allow), prove=bisect, repeat=repeat)
        return _agent.replay(checkpoint, batch, options, rank=rank, report=report)

    return _call("replay", _arguments(replay), work)


def report(
    path: Annotated[str, Field(description="a JSON report (nanhunt replay --report x.json, a bundle's report.json, "
                                           "or a replay tool call's report)")],
    format: Annotated[Literal["md", "text", "json", "html"], Field(description="md: Markdown for a ticket; text: "
                                                                               "what the console shows")] = "md",
    output: Annotated[str | None, Field(description="write it here instead of answering it (beside an .html: its "
                                                    ".png); its directory must exist")] = None,
) -> CallToolResult:
    """Render a saved nanhunt JSON report again (nanhunt report): Markdown, console text, JSON or HTML."""
    from . import _agent

    return _call("report", _arguments(report), lambda: _agent.render_report(path, format, output))


def compare(
    checkpoint: Annotated[str, Field(description="checkpoint.pt: a nanhunt capture, a state_dict, {'model': ...} "
                                                 "or Lightning's")],
    batches: Annotated[tuple[str, ...], Field(description="one batch file, or several or a directory of them (a set: "
                                                    "each batch named by its file)")],
    model: _Model = None, loss: _Loss = None, optimizer: _Optimizer = None, trust_names: _TrustNames = (),
    dtype: Annotated[tuple[Literal["float16", "bfloat16"], ...], Field(description="autocast dtypes, each compared "
                                                                             "against float32 (default: the "
                                                                             "capture's, else float16)")] = (),
    task: Annotated[Literal["classify", "regress", "none"] | None, Field(description="decisions to compare")] = None,
    metric: Annotated[str | None, Field(description="accuracy, mse, or PKG.MOD:FN (fn(outputs, targets) -> float), "
                                                    "on both runs." + _CONFIRM)] = None,
    rule: Annotated[str | None, Field(description="the acceptance rule as a JSON file (instead of the clauses "
                                                  "below)")] = None,
    rtol: Annotated[float | None, Field(description="relative tolerance (default: float16 1e-3, bfloat16 "
                                                    "1e-2)")] = None,
    atol: Annotated[float | None, Field(description="absolute tolerance (default 1e-5)")] = None,
    max_flips: Annotated[int | None, Field(description="decision flips allowed (default 0)")] = None,
    fail_on_tolerance: Annotated[bool, Field(description="also fail when the output or the loss is out of "
                                                         "tolerance (default: tolerances only rank)")] = False,
    max_quality_drop: Annotated[float | None, Field(description="autocast's quality may be at most this much "
                                                                "worse than float32's")] = None,
    min_quality: Annotated[float | None, Field(description="autocast's quality must be at least this")] = None,
    allow_nonfinite: Annotated[tuple[str, ...], Field(description="modules whose non-finite values are explained "
                                                                  "if they reach neither loss nor gradient")] = (),
    speed: Annotated[int | None, Field(description="time each passing candidate, N repetitions")] = None,
    device: _Device = None, train: _Train = None, report: _Report = None, trust_pickle: _TrustPickle = False,
) -> CallToolResult:
    """Run a step (or a fixed set of batches) in float32 and under autocast and judge autocast against an
    acceptance rule fixed before the run (nanhunt compare): text, the verdict; JSON, the comparison's report."""
    from ._agent_compare import CompareArgs, compare as run_compare

    def work() -> Answer:
        return run_compare(CompareArgs(
            checkpoint, tuple(batches), model=model, loss=loss, optimizer=optimizer, trust_names=tuple(trust_names),
            dtype=tuple(dtype), task=task, metric=metric, rule=rule, rtol=rtol, atol=atol, max_flips=max_flips,
            fail_on_tolerance=fail_on_tolerance, max_quality_drop=max_quality_drop, min_quality=min_quality,
            allow_nonfinite=tuple(allow_nonfinite), speed=speed, device=device, train=train, report=report,
            trust_pickle=trust_pickle))

    return _call("compare", _arguments(compare), work)


def server() -> MCPServer[Any]:
    """The server with its four tools (not started)."""
    from .._util._version import __version__

    s: MCPServer[Any] = MCPServer("nanhunt", instructions=INSTRUCTIONS, version=__version__, log_level="WARNING")
    reads = ToolAnnotations(read_only_hint=True, open_world_hint=False)
    writes = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
    s.add_tool(inspect, annotations=reads)
    s.add_tool(replay, annotations=writes)  # writes only where `report` says
    s.add_tool(report, annotations=writes)
    s.add_tool(compare, annotations=writes)
    return s


def serve() -> None:
    """Serve over stdin and stdout until the client closes stdin."""
    sys.stdout.flush()  # nothing of ours may reach the protocol's stream after it starts
    server().run("stdio")
