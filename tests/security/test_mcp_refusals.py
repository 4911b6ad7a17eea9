"""A capture attached to a ticket, replayed by a coding agent through ``nanhunt mcp``: whatever names it records,
the refusal is one line of visible text, bounded, naming the tool's argument that confirms; nothing is imported."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt

pytest.importorskip("mcp")

from nanhunt.integrations import _mcp  # noqa: E402  (after the skip: the SDK is an optional extra)

# What a terminal or a log would act on: any C0 control, DEL, C1 and the bidi controls.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _capture(tmp_path: Path, factory: str) -> tuple[str, str]:
    """A capture of ``nn.Linear(4, 4)``'s weights whose model factory is renamed as a hostile file names it."""
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4))
    nanhunt.save_capture(ck, bt, model=model, batch=(torch.ones(2, 4), torch.zeros(2, 4)), loss_fn=F.mse_loss)
    c = torch.load(ck, weights_only=True)
    c.update(model_factory=factory, model_kwargs={"d": 4})
    torch.save(c, ck)
    return str(ck), str(bt)


@pytest.mark.parametrize("factory, shown", [
    ("nhsec_mcp.nets\nnanhunt: error: forged\x1b[31m:Net", "'nhsec_mcp.nets\\nnanhunt: error: forged\\x1b[31m:Net'"),
    ("nhsec_mcp.nets:Net\u202e", "'nhsec_mcp.nets:Net\\u202e'"),
])
def test_a_forged_name_is_one_visible_line(tmp_path: Path, factory: str, shown: str) -> None:
    # GIVEN a capture whose model factory holds a line break and a forged error line, or a bidi override
    ck, bt = _capture(tmp_path, factory)
    # WHEN the agent replays it
    result = _mcp.replay(ck, bt)
    # THEN an error result of one line of visible text quoting the name escaped; nothing imported
    assert result.is_error and len(result.content) == 1
    text = result.content[0].text
    assert text.startswith("nanhunt: error: ") and shown in text, text
    assert not CONTROL.search(text), repr(text)
    assert "nhsec_mcp" not in sys.modules


def test_a_name_megabytes_long_is_cut(tmp_path: Path) -> None:
    # GIVEN a capture naming a model factory of 100,000 characters, longer than any importable name
    ck, bt = _capture(tmp_path, "nhsec_mcp." + "a" * 100_000 + ":Net")
    # WHEN the agent replays it THEN the refusal is one short line saying its length, not 200 kB of an agent's
    # context, and offers no confirmation of it
    text = _mcp.replay(ck, bt).content[0].text
    assert len(text) < 400 and text.endswith("... of 100,014 characters, longer than any name Python imports or path "
                                             "a file has: the capture is damaged or forged"), text[-200:]
    assert text.startswith("nanhunt: error: the file names model factory 'nhsec_mcp.aaaa")
