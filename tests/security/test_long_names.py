"""A name read from a file that no real package or file has (100,000 characters) is refused in one bounded line,
not echoed whole twice (once as the name, once in the flag that would confirm it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.cli import main


@pytest.mark.parametrize("name", ["a" * 100_000 + ".models:Net", "/tmp/" + "d/" * 50_000 + "train.py:Net"])
def test_a_name_longer_than_any_real_one_is_one_short_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           name: str) -> None:
    # GIVEN a capture whose model factory is a name of 100,000 characters
    ck, bt = str(tmp_path / "checkpoint.pt"), str(tmp_path / "batch.pt")
    nanhunt.save_capture(ck, bt, model=nn.Linear(2, 2), batch=(torch.ones(1, 2), torch.ones(1, 2)),
                         loss_fn=F.mse_loss, model_factory="torch.nn:Linear",
                         model_kwargs={"in_features": 2, "out_features": 2})
    torch.save({**torch.load(ck, weights_only=True), "model_factory": name}, ck)
    # WHEN it is replayed
    code = main(["replay", ck, bt, "--no-bisect"])
    err = capsys.readouterr().err
    # THEN one line of bounded length says what it is, exit 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err[:2000]
    assert len(lines[0]) < 400 and f"of {len(name):,} characters" in lines[0]
    assert lines[0].endswith("the capture is damaged or forged")
