"""A checkpoint's entry names are the file's: a key may be megabytes long, hold a line break, an escape
sequence, a bidi control, or millions of dots. Each message that names one (the note about ignored entries, the
error about keys that do not fit) shows it escaped, on one line, cut at 200 characters with its length said; and
matching keys to the model takes time linear in a key's length."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from nanhunt._util._errors import InputError
from nanhunt.capture.capture import map_state_dict
from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "fixtures.models:MLP", "--loss", "torch.nn.functional:mse_loss", "--no-bisect"]
HUGE = "criterion." + "A" * 5_000_000
FORGED = "evil\nnanhunt: error: forged\x1b[2J\u202e"
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # fixtures.models imports from the repository root


def _model() -> torch.nn.Module:
    from fixtures.models import MLP

    torch.manual_seed(0)
    return MLP()


def test_a_huge_ignored_entry_is_named_cut_and_escaped_in_the_note() -> None:
    # GIVEN a checkpoint holding the model's weights and, beside them, entries named by a 5 MB string and by a
    # string that forges a line
    m = _model()
    sd = {**m.state_dict(), HUGE: torch.zeros(1), FORGED: torch.zeros(1)}
    # WHEN it is mapped onto the model
    notes: list[str] = []
    map_state_dict(sd, m, notes=notes)
    # THEN the note names both, the huge one by its first 200 characters and its length, the other escaped
    assert len(notes) == 1
    note = notes[0]
    assert note.startswith("checkpoint entries that are not the model's were ignored: ")
    assert f"{HUGE[:200]}... (5,000,010 characters)" in note
    assert "evil\\nnanhunt: error: forged\\x1b[2J\\u202e" in note
    assert not CONTROL.search(note) and len(note) < 1000


def test_a_key_that_does_not_fit_is_named_cut_and_escaped_in_the_error() -> None:
    # GIVEN a checkpoint missing a weight, with a huge and a forging key beside the others
    m = _model()
    sd = {k: v for k, v in m.state_dict().items() if k != "fc2.bias"}
    sd.update({HUGE: torch.zeros(1), "fc2." + FORGED: torch.zeros(1)})
    # WHEN it is mapped onto the model THEN the error is one line naming each key escaped and cut
    with pytest.raises(InputError) as e:
        map_state_dict(sd, m)
    msg = str(e.value)
    assert "missing fc2.bias" in msg
    assert f"{HUGE[:200]}... (5,000,010 characters)" in msg
    assert "fc2.evil\\nnanhunt: error: forged\\x1b[2J\\u202e" in msg
    assert not CONTROL.search(msg) and len(msg) < 1000


@pytest.mark.parametrize("key", ["module." * 200_000 + "fc1.weight", "a." * 200_000 + "x"],
                         ids=["many-ddp-prefixes", "many-components"])
def test_a_key_of_many_components_is_matched_in_one_pass(key: str) -> None:
    # GIVEN a key of 200,001 components (1.4 MB and 0.4 MB): each of its shorter forms joined anew made this
    # quadratic, minutes of CPU for a key, hours for a 5 MB one
    m = _model()
    notes: list[str] = []
    # WHEN mapped beside the model's own weights THEN it is ignored, said in a note, and the weights are the model's
    out = map_state_dict({**m.state_dict(), key: torch.zeros(1)}, m, notes=notes)
    assert set(out) == set(m.state_dict())
    assert len(notes) == 1 and f"... ({len(key):,} characters)" in notes[0]


def test_replay_of_a_checkpoint_with_a_huge_entry_prints_a_bounded_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a finite step whose checkpoint holds a 5 MB-named entry beside the model's weights
    m = _model()
    torch.save({**m.state_dict(), HUGE: torch.zeros(1), FORGED: torch.zeros(1)}, tmp_path / "checkpoint.pt")
    torch.save((torch.randn(4, 16), torch.randn(4, 4)), tmp_path / "batch.pt")
    # WHEN replayed
    code = main(["replay", str(tmp_path / "checkpoint.pt"), str(tmp_path / "batch.pt"), *ARGS,
                 "--report", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    # THEN it runs (exit 0: the step is finite), the warning names the entry cut, and the whole output, the
    # report too, is kilobytes, not the 10 MB of the name printed twice
    assert code == 0, err
    assert "(5,000,010 characters)" in err
    assert not CONTROL.search(err.replace("\n", "")) and "\nnanhunt: error: forged" not in err + out
    assert len(out) + len(err) < 20_000
    assert (tmp_path / "r.json").stat().st_size < 100_000
