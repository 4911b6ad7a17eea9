"""How the MCP server (``nanhunt mcp``) runs one tool call: what the call prints goes to stderr, never to stdout,
which carries the protocol; a refusal is one line naming the tool's argument for each flag it names; a nanhunt bug
is one line too, its traceback in the server's log."""

from __future__ import annotations

import pytest

pytest.importorskip("mcp")

from nanhunt._util._errors import InputError  # noqa: E402
from nanhunt.integrations import _mcp  # noqa: E402  (after the skip: the SDK is an optional extra)
from nanhunt.integrations._agent import Answer  # noqa: E402

ARGS = frozenset({"model", "loss", "bisect", "trust_pickle"})


def test_what_a_call_prints_goes_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    # GIVEN a call that prints, as the user's model does while it is debugged
    def work() -> Answer:
        print("printed by the model")
        return Answer("the answer\n", {"schema_version": 2})

    # WHEN the server runs it THEN stdout holds nothing; the line is on stderr; the answer is text and JSON
    result = _mcp._call("replay", ARGS, work)
    out, err = capfd.readouterr()
    assert out == "" and err == "printed by the model\n"
    assert [c.text for c in result.content] == ["the answer\n", '{\n  "schema_version": 2\n}']
    assert result.structured_content == {"schema_version": 2} and not result.is_error


def test_a_refusal_names_the_tools_arguments_for_the_flags() -> None:
    # GIVEN the library's refusal, which names the command line's flags
    def work() -> Answer:
        raise InputError("pass --model a.b:Net --loss a.b:fn to confirm; or --no-bisect; --snapshot disk")

    # WHEN the server runs it THEN one line, with the argument of each flag this tool has
    result = _mcp._call("replay", ARGS, work)
    assert result.is_error and [c.text for c in result.content] == [
        "nanhunt: error: pass --model a.b:Net --loss a.b:fn to confirm; or --no-bisect; --snapshot disk (in this "
        "tool: --model is the argument model; --loss is the argument loss; --no-bisect is bisect=false)"]


def test_a_nanhunt_bug_is_one_line_and_its_traceback_goes_to_the_log(capfd: pytest.CaptureFixture[str]) -> None:
    # GIVEN a call that fails inside nanhunt with a multi-line message
    def work() -> Answer:
        raise KeyError("first\nsecond")

    # WHEN the server runs it THEN one line to the agent; the traceback on stderr, the server's log
    result = _mcp._call("inspect", ARGS, work)
    assert result.is_error and [c.text for c in result.content] == [
        "nanhunt: error: the inspect tool failed inside nanhunt (KeyError: 'first\\nsecond'): a nanhunt bug; run "
        "the same with the nanhunt command line and --debug, and report the traceback"]
    out, err = capfd.readouterr()
    assert out == "" and "Traceback (most recent call last)" in err


def test_the_server_lists_four_tools_none_confirming_by_default() -> None:
    import anyio

    # WHEN the server's tools are listed
    tools = {t.name: t for t in anyio.run(_mcp.server().list_tools)}
    # THEN inspect, replay, report and compare; every argument that runs code is off unless given
    assert sorted(tools) == ["compare", "inspect", "replay", "report"]
    for t in tools.values():
        props = t.input_schema["properties"]
        for name in ("model", "loss", "optimizer", "metric", "trust_compile_options", "trust_pickle"):
            if name in props:
                assert props[name]["default"] in (None, False), (t.name, name)
        assert props.get("trust_names", {}).get("default", []) == []
