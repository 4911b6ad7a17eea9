"""``nanhunt mcp``: an MCP client (the SDK's stdio client) starts the server as an agent's host does, lists its
tools, replays a Guard's capture and gets the culprit, and is refused, in one line naming the argument, a capture
whose names it did not confirm (nothing imported, nothing built); the server goes on after a refusal, and its
stdout carries the protocol alone while the model prints. Without the SDK the command says how to install it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nanhunt
from nanhunt.cli import main as cli_main
from nanhunt.records import SCHEMA_VERSION
from tests._support.guard import D_IN, batch, train_step

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests._support.mcp_models:MarkedMLP"
REFUSAL = (f"nanhunt: error: the file names model factory '{FACTORY}', which is not torch's own: nanhunt imports it "
           f"and calls it with the file's arguments only if you trust it; pass --model {FACTORY} to confirm (in this "
           "tool: --model is the argument model)")
HEADLINE = "status: nonfinite; phase: forward; module: fc1; op: aten::addmm; verdict: precision"


def _guard_capture(dump_dir: Path) -> nanhunt.GuardEvent:
    """A Guard's capture of a float16 step whose batch overflows fc1 (step 2), its model recorded by FACTORY."""
    from tests._support.mcp_models import MarkedMLP

    torch.manual_seed(0)
    model = MarkedMLP(d_in=D_IN)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=dump_dir, loss_fn=torch.nn.functional.mse_loss,
                          model_kwargs={"d_in": D_IN})
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(4):
            train_step(guard, model, opt, scaler, batch(i, big_input=i == 2))
    guard.close()
    assert info.value.event.step == 2
    return info.value.event


async def _session(tmp_path: Path, calls: list[tuple[str, dict[str, Any]]]) -> tuple[Any, list[Any]]:
    """Start ``python -m nanhunt mcp`` as a host does, list its tools and make ``calls`` in one session."""
    from mcp import ClientSession, StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "nanhunt", "mcp"], cwd=str(ROOT),
                                   env={"PYTHONPATH": str(ROOT), "NANHUNT_TEST_MARKS": str(tmp_path / "marks")})
    with open(tmp_path / "server.err", "w") as errlog:
        async with stdio_client(params, errlog=errlog) as streams, ClientSession(*streams) as session:
            await session.initialize()
            tools = await session.list_tools()
            results = [await session.call_tool(name, args) for name, args in calls]
    return tools, results


@pytest.mark.subprocess
def test_an_agent_lists_the_tools_replays_a_guard_capture_and_is_refused_unconfirmed_names(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("mcp")
    import anyio

    # GIVEN the Guard's capture of a failed float16 step, its model recorded by a name that is not torch's
    ev = _guard_capture(tmp_path / "nan")
    files = {"checkpoint": str(ev.checkpoint), "batch": str(ev.batch)}
    report = tmp_path / "report.json"
    # WHEN an MCP client replays it without confirming the model, then confirming it, then inspects the checkpoint
    # and renders the report the replay wrote
    calls = [("replay", files), ("replay", {**files, "model": FACTORY, "report": str(report)}),
             ("inspect", {"checkpoint": files["checkpoint"]}), ("report", {"path": str(report), "format": "md"})]
    with caplog.at_level(logging.WARNING):
        tools, (refused, found, inspected, rendered) = anyio.run(_session, tmp_path, calls)
    # THEN the four tools are listed with their required arguments, and nothing that confirms code is on by default
    schemas = {t.name: t.input_schema for t in tools.tools}
    assert {n: s.get("required") for n, s in schemas.items()} == {
        "inspect": ["checkpoint"], "replay": ["checkpoint"], "report": ["path"], "compare": ["checkpoint", "batches"]}
    replay_args = schemas["replay"]["properties"]
    assert {k: replay_args[k]["default"] for k in ("model", "loss", "optimizer", "trust_names", "trust_pickle",
                                                   "trust_compile_options", "bisect", "level")} == {
        "model": None, "loss": None, "optimizer": None, "trust_names": [], "trust_pickle": False,
        "trust_compile_options": False, "bisect": True, "level": "op"}
    # AND unconfirmed, the replay is an error result of one line naming the argument; nothing was imported or built
    assert refused.is_error and [c.text for c in refused.content] == [REFUSAL]
    marks = tmp_path / "marks"
    # AND the server went on: confirmed, the replay names the culprit in its text and its JSON report
    assert not found.is_error, found.content[0].text
    text = found.content[0].text.splitlines()
    assert text[0].startswith("Inf born in phase forward, in fc1 (Linear, call 0) at aten::addmm; running fc1"), text
    assert text[1].startswith(HEADLINE + "; float32 fix: fc1"), text
    data = found.structured_content
    assert json.loads(found.content[1].text) == data
    assert data["schema_version"] == SCHEMA_VERSION and data["status"] == "nonfinite"
    assert (data["first"]["phase"], data["first"]["module"], data["first"]["op"]) == ("forward", "fc1", "aten::addmm")
    assert data["verdict"]["kind"] == "precision" and "fc1" in data["verdict"]["culprits"]
    assert data["guard_event"]["step"] == 2
    assert data["command"].startswith(f"nanhunt replay {ev.checkpoint} {ev.batch} --model {FACTORY} --report ")
    assert marks.read_text().splitlines() == ["imported", "built"]  # by the confirmed replay alone
    assert json.loads(report.read_text())["first"]["module"] == "fc1"
    # AND inspect answers what nanhunt inspect prints, with its JSON; report renders the saved report
    assert not inspected.is_error and inspected.structured_content["nonfinite"] is False
    assert inspected.content[0].text.splitlines()[0].endswith("0 non-finite, 0 within 16x of the float16 max")
    assert not rendered.is_error and rendered.structured_content is None
    assert "aten::addmm" in rendered.content[0].text and "fc1" in rendered.content[0].text
    # AND what the model printed went to the server's stderr, never onto the protocol's stdout
    err = (tmp_path / "server.err").read_text()
    assert "forward of MarkedMLP\n" in err and "forward of MarkedMLP (fd 1)\n" in err
    assert not [r for r in caplog.records if "JSONRPC" in r.getMessage()], caplog.text


@pytest.mark.subprocess
def test_compare_answers_the_verdict_and_its_report(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    import anyio

    # GIVEN the same capture; WHEN an agent compares autocast against float32 on its batch, the model confirmed
    ev = _guard_capture(tmp_path / "nan")
    calls = [("compare", {"checkpoint": str(ev.checkpoint), "batches": [str(ev.batch)], "model": FACTORY,
                          "dtype": ["float16", "float16"]}),
             ("compare", {"checkpoint": str(ev.checkpoint), "batches": [str(ev.batch)], "model": FACTORY})]
    _, (twice, compared) = anyio.run(_session, tmp_path, calls)
    # THEN a dtype given twice is refused in one line; the comparison says the rule did not hold (float16
    # overflows), with the comparison's report
    assert twice.is_error and twice.content[0].text == (
        "nanhunt: error: dtype ['float16', 'float16']: give float16, bfloat16, float8 (the model's float8 layers as they "
        "ran) or several, each once")
    assert not compared.is_error, compared.content[0].text
    lines = compared.content[0].text.splitlines()
    assert lines[0].startswith("REJECTED: autocast float16 against the float32 reference"), lines
    assert lines[1] == "violated: the rule did not hold"
    data = compared.structured_content
    assert data["schema_version"] == SCHEMA_VERSION and data["comparison"]["accepted"] is False
    assert data["comparison"]["dtype"] == "float16" and data["comparison"]["amp_finite"] is False


def test_without_the_sdk_the_command_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN no MCP SDK: an import of it, or of any of its modules an earlier test imported, fails as where it is
    # not installed
    for name in [m for m in sys.modules if m.partition(".")[0] in ("mcp", "mcp_types")] + ["mcp"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "nanhunt.integrations._mcp", raising=False)
    # WHEN `nanhunt mcp` runs THEN one line, exit 2, with the install command
    assert cli_main(["mcp"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("nanhunt: error: nanhunt mcp needs the MCP SDK, which is not installed here; install it with: "
                   "pip install \"nanhunt[mcp]\"\n")


@pytest.mark.subprocess
def test_importing_nanhunt_and_its_command_line_imports_no_mcp() -> None:
    code = ("import sys, nanhunt, nanhunt.cli, nanhunt.integrations; "
            "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('mcp', 'mcp_types')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "[]\n"
