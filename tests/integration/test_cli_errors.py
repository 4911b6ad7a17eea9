"""The CLI on bad input: one error line, no unpickling of untrusted files, input files left untouched, Ctrl-C."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures"
CLEAN = [str(FIX / "clean" / "checkpoint.pt"), str(FIX / "clean" / "batch.pt")]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # Model factories named as fixtures.models:... / tests._support.cli:... import from the repository root.
    monkeypatch.chdir(ROOT)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _one_error_line(code: int, err: str, *words: str) -> str:
    """Exit 2, no traceback, and exactly one ``nanhunt: error:`` line (warnings aside) naming ``words``."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("nanhunt: error:"), err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _files_state(paths: list[str]) -> list[tuple[bytes, int]]:
    return [(Path(p).read_bytes(), os.stat(p).st_mtime_ns) for p in paths]


class _Marker:
    """Unpickling this creates ``path`` (the harmless stand-in for running an attacker's code)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


# ============================================================== bad input


@pytest.mark.parametrize("command, where, fmt", [
    ("replay", "batch", "zip"),
    ("replay", "checkpoint", "raw-pickle"),
    ("replay", "batch", "legacy-torch"),
    ("inspect", "checkpoint", "legacy-torch"),
    ("compare", "batch", "zip"),
])
def test_hostile_pickle_is_never_unpickled(command: str, where: str, fmt: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a file whose unpickling would create a marker file, in any position and serialisation
    marker = tmp_path / "PWNED"
    bad = tmp_path / "hostile.pt"
    payload = {"inputs": _Marker(marker), "model": _Marker(marker)}
    if fmt == "raw-pickle":
        with open(bad, "wb") as f:
            pickle.dump(payload, f)
    else:
        torch.save(payload, bad, _use_new_zipfile_serialization=fmt == "zip")
    before = _files_state([str(bad)])
    files = [str(bad)] if command == "inspect" else ([CLEAN[0], str(bad)] if where == "batch" else [str(bad), CLEAN[1]])
    # WHEN it is given without --trust-pickle
    code, _, err = _cli([command, *files], capsys)
    # THEN refused in one line that names the flag (a plain pickle is no torch file: no flag loads it), and
    # nothing ran
    _one_error_line(code, err, "torch.save" if fmt == "raw-pickle" else "--trust-pickle", str(bad))
    assert not marker.exists()
    assert _files_state([str(bad)]) == before


@pytest.mark.parametrize("argv", [
    ["replay", *CLEAN, "--no-bisect", "--report", "{blocker}/r.json"],
    ["compare", *CLEAN, "--report", "{blocker}/r.md"],
])
def test_unwritable_report_path_is_one_line(argv: list[str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a report path whose parent is a file (root ignores chmod, so this is what is unwritable here)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    argv = [a.replace("{blocker}", str(blocker)) for a in argv]
    code, _, err = _cli(argv, capsys)
    _one_error_line(code, err, "cannot write", str(blocker))
    assert blocker.read_text() == "x"


def test_factory_returning_a_non_module_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fixtures.models import MLP

    ck = tmp_path / "sd.pt"
    torch.save(MLP().state_dict(), ck)
    code, _, err = _cli(["replay", str(ck), CLEAN[1], "--model", "collections:OrderedDict",
                         "--loss", "torch.nn.functional:mse_loss"], capsys)
    _one_error_line(code, err, "not an nn.Module")


def _capture_with(tmp_path: Path, **changes: Any) -> str:
    ck = torch.load(CLEAN[0], weights_only=True)
    for k, v in changes.items():
        if v is _DELETE:
            del ck[k]
        else:
            ck[k] = v
    path = tmp_path / "checkpoint.pt"
    torch.save(ck, path)
    return str(path)


_DELETE = object()


@pytest.mark.parametrize("changes", [
    {"model": _DELETE},              # KeyError: 'model'
    {"model": 5},                    # AttributeError: 'int' object has no attribute 'items'
    {"model_factory": None},         # AttributeError: 'NoneType' object has no attribute 'partition'
    {"autocast": "float16"},         # AttributeError: 'str' object has no attribute 'get'
], ids=["no-model", "model-not-a-dict", "factory-none", "autocast-not-a-dict"])
def test_malformed_capture_is_one_line(changes: dict[str, Any], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a nanhunt capture (the 'nanhunt_capture' key) with one field damaged
    ck = _capture_with(tmp_path, **changes)
    # WHEN replayed THEN one error line, exit 2, not a traceback
    code, _, err = _cli(["replay", ck, CLEAN[1], "--no-bisect"], capsys)
    _one_error_line(code, err)


def test_checkpoint_with_disabled_scaler_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a plain checkpoint saved by a loop whose GradScaler was disabled (its state_dict() is {})
    from fixtures.models import MLP

    ck = tmp_path / "ckpt.pt"
    torch.save({"model": MLP().state_dict(), "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict()}, ck)
    code, _, err = _cli(["replay", str(ck), CLEAN[1], "--model", "fixtures.models:MLP",
                         "--loss", "torch.nn.functional:mse_loss", "--no-bisect"], capsys)
    # THEN replayed without a scaler, with a note saying so, never a traceback
    assert "Traceback" not in err
    assert code == 0, err
    assert "GradScaler was disabled" in err, err


@pytest.mark.parametrize("device", [
    "bogus",
    pytest.param("mps", marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="mps exists here")),
])
def test_bad_device_is_one_line(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["replay", *CLEAN, "--device", device, "--no-bisect"], capsys)
    _one_error_line(code, err, device)


def test_loss_class_needing_arguments_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN --loss naming an nn.Module class whose constructor needs arguments (a FocalLoss(gamma) ...)
    code, _, err = _cli(["replay", *CLEAN, "--loss", "torch.nn:Bilinear", "--no-bisect"], capsys)
    _one_error_line(code, err, "torch.nn:Bilinear")


def test_report_of_a_binary_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the easy mistake: `nanhunt report checkpoint.pt` instead of the JSON report
    before = _files_state([CLEAN[0]])
    code, _, err = _cli(["report", CLEAN[0]], capsys)
    _one_error_line(code, err, "checkpoint.pt")
    assert _files_state([CLEAN[0]]) == before


@pytest.mark.parametrize("fmt", ["console", "md"])
def test_report_with_a_wrongly_typed_field_is_one_line(fmt: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a real report (overflow under float16, with a GradScaler), then one field hand-edited to a string
    from fixtures.models import MLP

    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc2.weight.mul_(3e4)
    rep = nanhunt.replay(m, (torch.randn(4, 16) * 10, torch.randn(4, 4)), loss_fn=F.mse_loss,
                         scaler=torch.amp.GradScaler("cpu"))
    data = json.loads(rep.to_json())
    assert data["config"]["scaler_scale"] is not None
    data["config"]["scaler_scale"] = "65536 (edited)"
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    code, _, err = _cli(["report", str(path), "--format", fmt], capsys)
    _one_error_line(code, err, "report.json")


@pytest.mark.subprocess
def test_untrusted_capture_does_not_import_code_from_cwd(tmp_path: Path) -> None:
    # GIVEN a ticket attachment unpacked into one directory: a capture naming `model:Net`, and a model.py
    marker = tmp_path / "IMPORTED"
    (tmp_path / "model.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nimport torch\nclass Net(torch.nn.Linear):\n"
        "    def __init__(self):\n        super().__init__(16, 4)\n")
    ck = torch.load(CLEAN[0], weights_only=True)
    ck["model_factory"] = "model:Net"
    torch.save(ck, tmp_path / "checkpoint.pt")
    (tmp_path / "batch.pt").write_bytes(Path(CLEAN[1]).read_bytes())
    # WHEN `nanhunt replay checkpoint.pt batch.pt` is run there, with no flag confirming anything
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "nanhunt", "replay", "checkpoint.pt", "batch.pt", "--no-bisect"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    # THEN the file's code did not run: refused until --model confirms the factory
    assert not marker.exists(), "model.py named by the untrusted checkpoint was imported"
    assert p.returncode == 2, p.stderr


# ============================================================== input files untouched


def _overflow_capture(directory: Path) -> list[str]:
    from fixtures.models import MLP

    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc2.weight.mul_(3e4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    files = [str(directory / "checkpoint.pt"), str(directory / "batch.pt")]
    nanhunt.save_capture(*files, model=m, batch=(torch.randn(4, 16) * 10, torch.randn(4, 4)), loss_fn=F.mse_loss,
                         optimizer=opt, scaler=torch.amp.GradScaler("cpu"), model_factory="fixtures.models:MLP")
    return files


@pytest.mark.subprocess
def test_input_files_untouched_by_replay_bundle_compare_inspect(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture, with the reports written into the capture's own directory and the bundle beside them (the
    # capture's directory itself holds files nanhunt did not write: refused as a bundle, tests/security/test_bundle.py)
    files = _overflow_capture(tmp_path)
    before = _files_state(files)
    assert main(["replay", *files, "--report", str(tmp_path / "r.json"), "--bundle", str(tmp_path / "bundle")]) == 1
    assert main(["compare", *files, "--report", str(tmp_path / "c.md")]) in (0, 1)
    assert main(["inspect", files[0]]) in (0, 1)
    assert "bundle:" in capsys.readouterr().err
    # THEN the inputs are byte for byte and mtime for mtime what they were
    assert _files_state(files) == before


def test_ctrl_c_in_cli_replay_exits_130_and_leaves_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a plain state_dict replayed with a model whose forward is interrupted (Ctrl-C)
    from fixtures.models import MLP

    ck, b = tmp_path / "ckpt.pt", tmp_path / "batch.pt"
    torch.save(MLP().state_dict(), ck)
    torch.save((torch.randn(4, 16), torch.randn(4, 4)), b)
    before = _files_state([str(ck), str(b)])
    code, out, err = _cli(["replay", str(ck), str(b), "--model", "tests._support.cli:InterruptingMLP",
                           "--loss", "torch.nn.functional:mse_loss", "--report", str(tmp_path / "r.json")], capsys)
    # THEN exit 130, one line saying so, no traceback, no report, files unchanged
    assert code == 130
    assert "Traceback" not in err and "interrupted" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists()
    assert _files_state([str(ck), str(b)]) == before


def test_swapped_arguments_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture's two files given in the wrong order
    fix = Path(__file__).resolve().parents[2] / "fixtures" / "nan_weight"
    # WHEN replayed  THEN one line says they look swapped and gives the right order; inspect says it is a batch
    assert main(["replay", str(fix / "batch.pt"), str(fix / "checkpoint.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "look swapped" in err[0] and err[0].endswith(f"{fix / 'checkpoint.pt'} {fix / 'batch.pt'}")
    assert main(["inspect", str(fix / "batch.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "batch file, not a checkpoint" in err[0]
