"""The options of a replay: one frozen object each for loading the capture and for hunting the step, checked when
made; the loader hands back the Step complete, with the Guard's event beside the capture."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt._util._compiled import CompileSpec
from nanhunt._util._errors import InputError
from nanhunt.capture.capture import LoadOptions, load_replay
from nanhunt.cli import main
from nanhunt.hunt._options import ReplayOptions
from nanhunt.records import Level

from tests._support.models import clean_mlp

FACTORY = "tests._support.models:MLP"


@pytest.mark.parametrize("kw, said", [
    (dict(dtype="float8"), "unknown dtype 'float8'; use float16, bfloat16 or float32"),
    (dict(trust_names=("torch",)), "--trust-names 'torch' would trust torch's functions too"),
    (dict(snapshot="tape"), "snapshot='tape': use memory, host or disk, or None (by size)"),
])
def test_bad_load_options_are_refused_when_made_in_one_line(kw: dict[str, object], said: str) -> None:
    with pytest.raises(InputError) as e:
        LoadOptions(**kw)  # type: ignore[arg-type]
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw, said", [
    (dict(repeat=0), "--repeat 0: replay at least once (--repeat 1, the default)"),
    (dict(level="line"), "--level line: name op or module"),
])
def test_bad_replay_options_are_refused_when_made(kw: dict[str, object], said: str) -> None:
    with pytest.raises(InputError) as e:
        ReplayOptions(LoadOptions(), **kw)  # type: ignore[arg-type]
    assert str(e.value) == said


def test_options_are_frozen_and_hold_tuples() -> None:
    load = LoadOptions(trust_names=["mypkg"])  # type: ignore[arg-type]  # a list, as a caller may pass
    options = ReplayOptions(load, allow=["fc1"])  # type: ignore[arg-type]
    assert (load.trust_names, load.trust[0], options.allow) == (("mypkg",), "mypkg", ("fc1",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.snapshot = "disk"  # type: ignore[misc]


@pytest.mark.parametrize("kw, flag", [
    (dict(load=LoadOptions(snapshot="disk")), "--snapshot"),
    (dict(load=LoadOptions(), repeat=2), "--repeat"),
    (dict(load=LoadOptions(compile="aot_eager")), "--compile"),
])
def test_what_a_replay_under_torchrun_does_not_do_is_refused(kw: dict[str, object], flag: str) -> None:
    with pytest.raises(InputError) as e:
        ReplayOptions(**kw).check_ranks()  # type: ignore[arg-type]
    assert str(e.value) == f"{flag} applies to a replay in one process; under torchrun leave it out"


def test_the_loader_returns_the_step_complete_and_the_guards_event_beside_it(tmp_path: Path) -> None:
    # GIVEN a capture named as the Guard names it, its event beside it
    ck, bt = tmp_path / "step000004-checkpoint.pt", tmp_path / "step000004-batch.pt"
    nanhunt.save_capture(ck, bt, model=clean_mlp(), batch=(torch.randn(4, 4), torch.randn(4, 3)),
                         loss_fn=F.mse_loss, model_factory=FACTORY)
    (tmp_path / "step000004-event.json").write_text(json.dumps({"step": 4, "kind": "loss", "detail": "nan loss"}))
    # WHEN it is loaded with a snapshot mode and a compile backend
    loaded = load_replay(str(ck), str(bt), LoadOptions(model_factory=FACTORY, snapshot="disk",
                                                               compile="aot_eager"))
    # THEN the Step holds them as made (nothing is set on it after loading)
    assert (loaded.step.snapshot, loaded.step.compile_spec) == ("disk", CompileSpec("aot_eager"))
    # AND the Guard's event comes with it
    assert loaded.event is not None and loaded.event.event is not None and loaded.event.note is None
    assert (loaded.event.event.step, loaded.event.event.kind, loaded.event.event.detail) == (4, "loss", "nan loss")


def test_a_capture_without_an_event_loads_with_none(tmp_path: Path) -> None:
    ck, bt = tmp_path / "ck.pt", tmp_path / "b.pt"
    nanhunt.save_capture(ck, bt, model=clean_mlp(), batch=(torch.randn(4, 4), torch.randn(4, 3)),
                         loss_fn=F.mse_loss, model_factory=FACTORY)
    loaded = load_replay(str(ck), str(bt), LoadOptions(model_factory=FACTORY))
    assert loaded.event is None and loaded.step.snapshot is None and loaded.step.compile_spec is None
    with pytest.raises(InputError) as e:
        load_replay(str(ck), str(bt), LoadOptions(), rank=1)
    assert str(e.value) == ("--rank picks a batch of a capture directory; with a checkpoint and a batch file, "
                            "leave it out")


def test_the_level_is_held_as_its_member() -> None:
    assert ReplayOptions(LoadOptions(), level="module").level is Level.MODULE  # type: ignore[arg-type]


def test_the_output_plan_is_judged_before_the_options_and_the_files(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a report path under a file, a repeat count of 0 and checkpoint files that do not exist
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    report = blocker / "r.json"
    # WHEN replayed
    code = main(["replay", str(tmp_path / "no-ck.pt"), str(tmp_path / "no-b.pt"), "--repeat", "0",
                 "--report", str(report)])
    # THEN the one error is where the report would go: it is judged first, before anything is read or replayed
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"nanhunt: error: cannot write {str(report)!r}: {str(blocker)!r} is "
                                               "not a directory; give a path in a directory")
