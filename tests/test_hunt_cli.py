"""Review of nanhunt's promises: bad input fails in one clear line, nothing of the user's state is
lost, input files are never modified. Complements tests/test_cli.py, test_replay.py, test_bisect.py.

Tests marked ``xfail(strict=True)`` document bugs found in this review.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nanhunt
from nanhunt.bisect import bisect
from nanhunt.step import Step
from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
CLEAN = [str(FIX / "clean" / "checkpoint.pt"), str(FIX / "clean" / "batch.pt")]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # Model factories named as fixtures.models:... / tests.test_hunt_cli:... import from the repository root.
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


# Importable by the CLI as --model tests.test_hunt_cli:InterruptingMLP
class InterruptingMLP(nn.Module):
    """fixtures.models.MLP's layout; its forward is Ctrl-C'd (as if the user pressed it mid-replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt


# ============================================================== (1) bad input


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
    # THEN either replayed without a scaler (a note) or refused in one line, never a traceback
    assert "Traceback" not in err
    if code == 2:
        _one_error_line(code, err, "scaler")
    else:
        assert code == 0, err


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


# ============================================================== (2) nothing lost


class _Net(nn.Module):
    """Mixed training flags, a frozen bias, dropout, BatchNorm; forward N raises (``_Net.stop``)."""

    calls = 0
    stop = -1
    error: type[BaseException] = KeyboardInterrupt

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 8)
        self.fc3 = nn.Linear(8, 4)
        self.bn.eval()
        self.fc3.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        if type(self).calls == type(self).stop:
            raise type(self).error("stop")
        return self.fc3(self.fc2(self.drop(self.bn(self.fc1(x)))))


def _trained() -> tuple[_Net, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor, torch.Tensor]:
    """Mid-training: Adam moments, BN stats, scaler grown, grads set, user hooks; fc2 overflows float16."""
    torch.manual_seed(0)
    m = _Net()
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    with torch.no_grad():
        m.fc2.weight.zero_()
        m.fc2.weight[0, :] = 3e4
    m.fc1.register_forward_hook(lambda *a: None)
    m.fc2.weight.register_hook(lambda g: g)
    _Net.calls, _Net.stop = 0, -1
    return m, opt, scaler, x, y


def _state(m: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict[str, Any]:
    return {
        "sd": {k: v.clone() for k, v in m.state_dict().items()},
        "param_ids": [id(p) for p in m.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in m.parameters()],
        "opt": repr(copy.deepcopy(opt.state_dict())),
        "scaler": scaler.state_dict(),
        "scale": scaler.get_scale(),
        "growth_tracker": int(scaler._growth_tracker),  # type: ignore[arg-type]
        "rng": torch.get_rng_state(),
        "training": [mm.training for mm in m.modules()],
        "requires_grad": [p.requires_grad for p in m.parameters()],
        "hooks": [(len(mm._forward_hooks), len(mm._forward_pre_hooks), len(mm._backward_hooks)) for mm in m.modules()],
        "param_hooks": [len(p._backward_hooks or {}) for p in m.parameters()],
        "forward_overrides": ["forward" in mm.__dict__ for mm in m.modules()],
        "grad_enabled": torch.is_grad_enabled(),
        "dispatch_mode": _get_current_dispatch_mode(),
        "autocast": torch.is_autocast_enabled("cpu"),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["sd"].keys() == b["sd"].keys()
    for k in a["sd"]:
        assert torch.equal(a["sd"][k], b["sd"][k]), k
    for g, h in zip(a["grads"], b["grads"]):
        assert (g is None and h is None) or (g is not None and h is not None and torch.equal(g, h))
    assert torch.equal(a["rng"], b["rng"])
    for k in a:
        if k not in ("sd", "grads", "rng"):
            assert a[k] == b[k], k


@pytest.mark.parametrize("api, stop, error", [
    ("replay", 1, KeyboardInterrupt),      # first traced run
    ("replay", 2, KeyboardInterrupt),      # second traced run
    ("replay", 4, KeyboardInterrupt),      # a bisection trial: partial verdict
    ("replay", 4, RuntimeError),           # the model fails in a bisection trial
    ("bisect", 3, KeyboardInterrupt),      # nanhunt.bisect.bisect called directly
])
def test_exception_from_forward_leaves_everything(api: str, stop: int, error: type[BaseException]) -> None:
    # GIVEN a model mid-training whose forward raises at its `stop`-th call
    m, opt, scaler, x, y = _trained()
    before = _state(m, opt, scaler)
    _Net.stop, _Net.error = stop, error
    try:
        # WHEN replayed / bisected with the update phase
        if api == "replay":
            rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, optimizer=opt, scaler=scaler, bisect=True)
            assert rep.verdict is not None and rep.verdict.interrupted
        else:
            v = bisect(Step.of(m, (x, y), loss_fn=F.mse_loss, optimizer=opt, scaler=scaler), origin=None)
            assert v.interrupted
    except error:
        assert stop <= 2 or error is not KeyboardInterrupt
    finally:
        _Net.stop, _Net.error = -1, KeyboardInterrupt
    assert _Net.calls == stop
    # THEN weights, BN stats, grads, Adam state, scale and growth tracker, RNG, flags and hooks are as before
    _assert_same(before, _state(m, opt, scaler))


def test_interrupted_bisection_that_found_nothing_says_interrupted() -> None:
    # GIVEN a non-finite step whose first bisection trial is interrupted (Ctrl-C)
    from nanhunt.records import Report
    from nanhunt.report import render_for_format

    m, opt, scaler, x, y = _trained()
    _Net.stop = 3  # the two traced replays, then the first trial
    try:
        rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, optimizer=opt, scaler=scaler, bisect=True)
    finally:
        _Net.stop = -1
    # THEN the verdict is 'interrupted' (not 'clean' on a non-finite step), also read back from JSON
    assert rep.status == "nonfinite"
    v = rep.verdict
    assert v is not None and v.kind == "interrupted" and v.interrupted and v.culprits == () and v.replays == 1
    back = Report.from_json(rep.to_json()).verdict
    assert back is not None and back.kind == "interrupted"
    # AND every report says so
    for fmt in ("console", "md", "html"):
        text = render_for_format(fmt)(rep)
        assert "Interrupted after 1 replays" in text and "nothing to bisect" not in text, fmt


class _PyRandomNet(nn.Module):
    """Uses Python's and NumPy's generators in forward (stochastic depth, augmentation done in the model)."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = random.random() if self.source == "random" else float(np.random.rand())
        return self.fc(x) * (3e4 * k)


@pytest.mark.parametrize("source", ["random", "numpy"])
def test_replay_and_bisect_restore_python_and_numpy_rng(source: str) -> None:
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(1)
    m = _PyRandomNet(source)
    py, npy = random.getstate(), np.random.get_state()
    rep = nanhunt.replay(m, (torch.ones(2, 4), torch.zeros(2, 4)), loss_fn=F.mse_loss, dtype=torch.float16,
                         bisect=True)
    assert rep.status != "clean"  # bisection ran
    assert random.getstate() == py
    now = np.random.get_state()
    assert now[2] == npy[2] and np.array_equal(now[1], npy[1])  # type: ignore[arg-type]


def test_replay_restores_parameters_the_optimizer_holds_outside_the_model() -> None:
    # GIVEN a loss module with its own learnable weights (ArcFace/uncertainty weighting), optimized with the model
    class WeightedLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((out - y) ** 2 * self.w).mean()

    torch.manual_seed(0)
    model, loss_fn = nn.Linear(4, 4), WeightedLoss()
    opt = torch.optim.SGD([*model.parameters(), *loss_fn.parameters()], lr=0.1)
    w = loss_fn.w.detach().clone()
    # WHEN the step is replayed with its update
    rep = nanhunt.replay(model, (torch.randn(2, 4), torch.randn(2, 4)), loss_fn=loss_fn, dtype=torch.float32,
                         optimizer=opt)
    assert rep.status == "clean"
    # THEN the optimizer's other parameters are as they were
    assert loss_fn.w.grad is None
    assert torch.equal(loss_fn.w.detach(), w)


# ============================================================== (3) input files untouched


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


def test_input_files_untouched_by_replay_bundle_compare_inspect(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture, with the bundle and the reports written into the capture's own directory
    files = _overflow_capture(tmp_path)
    before = _files_state(files)
    assert main(["replay", *files, "--report", str(tmp_path / "r.json"), "--bundle", str(tmp_path)]) == 1
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
    code, out, err = _cli(["replay", str(ck), str(b), "--model", "tests.test_hunt_cli:InterruptingMLP",
                           "--loss", "torch.nn.functional:mse_loss", "--report", str(tmp_path / "r.json")], capsys)
    # THEN exit 130, one line saying so, no traceback, no report, files unchanged
    assert code == 130
    assert "Traceback" not in err and "interrupted" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists()
    assert _files_state([str(ck), str(b)]) == before
