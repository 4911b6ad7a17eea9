"""The verified minimal repro: catch the origin op, save its inputs, run ``repro.py`` in a fresh process."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.records import Occurrence, Phase, Record, Repro, Role
from nanhunt.hunt.repro import INPUTS, SCRIPT, capture_origin_call, make_repro, verify_repro, write_repro
from nanhunt.step.step import Step

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ faults of our own


class ExpAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)  # FAULT: exp(200) overflows float32


class ExpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 16)
        self.act = ExpAct()
        self.head = nn.Linear(16, 2)
        with torch.no_grad():
            self.fc.weight.fill_(50.0)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


class ZeroOverZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x - x
        return d / d  # FAULT: 0/0


class DivNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = ZeroOverZero()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class SqrtNet(nn.Module):
    """sqrt(x*x) at x = 0: finite forward, an Inf born in backward (aten::div of the sqrt's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight[0].zero_()
            self.fc.bias[0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.sqrt(h * h)


class InplaceExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(40.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 1.0
        return h.exp_()  # FAULT, in place


def _log_zero(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -torch.log(torch.relu(out - 1e6)).mean()  # FAULT in the loss: log(0)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _step(model: nn.Module, dtype: torch.dtype, loss_fn: Any = _mse, d_out: int = 2, target: float = 0.0) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.ones(3, 4)
    y = torch.full((3, d_out), target)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return dict(model=model, batch=(x, y), loss_fn=loss_fn, dtype=dtype, device_type="cpu", optimizer=opt)


def _as_step(kw: dict[str, Any], **more: Any) -> Step:
    return Step.of(kw["model"], kw["batch"], loss_fn=kw["loss_fn"], dtype=kw["dtype"], device_type=kw["device_type"],
                   optimizer=kw["optimizer"], **more)


def _first(kw: dict[str, Any]) -> Occurrence:
    report = nanhunt.replay(kw["model"], kw["batch"], loss_fn=kw["loss_fn"], dtype=kw["dtype"],
                            device_type=kw["device_type"], optimizer=kw["optimizer"])
    assert report.first is not None
    return report.first


# ------------------------------------------------------------------ three faults, each verified in a fresh process


@pytest.mark.subprocess
@pytest.mark.parametrize("case", ["exp-overflow", "zero-over-zero", "sqrt-backward"])
def test_repro_reproduces_in_a_fresh_process(case: str, tmp_path: Path) -> None:
    # GIVEN a step with a known fault, and where the replay says it was born
    kw = {
        "exp-overflow": lambda: _step(ExpNet(), torch.float32),
        "zero-over-zero": lambda: _step(DivNet(), torch.bfloat16, d_out=4),
        "sqrt-backward": lambda: _step(SqrtNet(), torch.float32, d_out=4, target=1.0),
    }[case]()
    occ = _first(kw)
    expected = {"exp-overflow": ("aten::exp", "inf", Phase.FORWARD, "act"),
                "zero-over-zero": ("aten::div", "nan", Phase.FORWARD, "norm"),
                "sqrt-backward": ("aten::div", "inf", Phase.BACKWARD, None)}[case]
    assert (occ.op, occ.kind, occ.phase) == expected[:3]
    if expected[3] is not None:
        assert occ.module == expected[3]
    # WHEN the repro is made (exp-overflow with a cap that forces the smallest slice)
    cap = 16 if case == "exp-overflow" else 1 << 20
    rp = make_repro(_as_step(kw), occ, str(tmp_path), cap_bytes=cap)
    # THEN a fresh Python process ran repro.py and got the same kind of value
    assert rp is not None
    assert rp.verified, rp.result
    assert rp.result == occ.kind and rp.op == occ.op and set(rp.files) == {SCRIPT, INPUTS}
    assert (tmp_path / SCRIPT).exists() and (tmp_path / INPUTS).exists()
    assert rp.autocast_dtype == ("bfloat16" if case == "zero-over-zero" else None)
    if case == "exp-overflow":
        assert rp.sliced and rp.original_shapes == ((3, 16),) and rp.inputs == (("float32", (1, 1)),)
        assert rp.nbytes <= cap


@pytest.mark.slow
@pytest.mark.subprocess
def test_overflow_fixture_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the bundled capture whose blocks.1.ff.wo overflows float16
    from nanhunt.cli import main

    monkeypatch.chdir(ROOT)  # its model factory (fixtures.models) imports from the repository root, on PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "out"
    fix = ROOT / "fixtures" / "overflow"
    # WHEN replayed with --bundle
    code = main(["replay", str(fix / "checkpoint.pt"), str(fix / "batch.pt"), "--no-bisect", "--bundle", str(out)])
    # THEN every format, the picture and a verified repro of aten::addmm under float16 autocast
    assert code == 1
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([".nanhunt-bundle", "report.html", "report.json", "report.md", "report.png", INPUTS, SCRIPT])
    data = json.loads((out / "report.json").read_text())
    assert data["schema_version"] == 2
    rp = data["repro"]
    assert rp["verified"] is True and rp["op"] == "aten::addmm" and rp["autocast_dtype"] == "float16"
    assert rp["inputs"] == [["float16", [32]], ["float16", [32, 64]], ["float16", [64, 32]]]
    assert "**Repro verified**" in (out / "report.md").read_text()
    assert "repro verified" in (out / "report.html").read_text()
    assert "repro verified" in capsys.readouterr().err
    # and the script needs only torch and the standard library
    tree = ast.parse((out / SCRIPT).read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}  # type: ignore[misc]
    assert mods == {"argparse", "os", "sys", "torch"}


# ------------------------------------------------------------------ other phases, in process


def test_loss_phase_and_inplace_ops_are_caught(tmp_path: Path) -> None:
    # the loss, outside every module (phase loss, module None)
    kw = _step(ExpNet(), torch.float32, loss_fn=_log_zero)
    kw["model"].fc.weight.data.fill_(0.01)
    occ = _first(kw)
    assert (occ.op, occ.phase, occ.module) == ("aten::log", Phase.LOSS, None)
    call = capture_origin_call(_as_step(kw), occ)
    assert call is not None and call.phase is Phase.LOSS
    assert bool(call.run()[0].isinf().any())
    # an in-place op: the written argument is the output, saved as it was *before* the op
    kw = _step(InplaceExp(), torch.float16, d_out=4)
    occ = _first(kw)
    assert occ.op == "aten::exp_" and occ.module == ""
    call = capture_origin_call(_as_step(kw), occ)
    assert call is not None and call.autocast_dtype == torch.float16
    assert bool(call.args[0].isfinite().all())
    assert bool(call.run()[0].isinf().any())
    rp = write_repro(call, occ, str(tmp_path))
    assert "t[0]" in rp.call and "[out, t[0]]" in (tmp_path / SCRIPT).read_text()


def test_capture_leaves_the_step_as_it_was() -> None:
    kw = _step(ExpNet(), torch.float16)
    model, opt = kw["model"], kw["optimizer"]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    occ = _first(dict(kw))
    call = capture_origin_call(_as_step(kw, scaler=scaler), occ)
    assert call is not None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert scaler.get_scale() == 256.0 and torch.equal(rng, torch.get_rng_state())
    assert not model._forward_hooks and not model.fc._forward_pre_hooks


def test_no_op_means_no_repro(tmp_path: Path) -> None:
    rec = Record(index=0, phase=Phase.WEIGHTS, module="fc", call_index=0, op=None, role=Role.PARAM, dtype="float32",
                 shape=(2,), min=float("nan"), max=float("nan"))
    occ = Occurrence(phase=Phase.WEIGHTS, module="fc", module_class="Linear", call_index=0, op=None, kind="nan",
                     source=None, output=rec)
    assert make_repro(Step.of(nn.Linear(2, 2), (torch.ones(1, 2), None)), occ, str(tmp_path)) is None
    assert make_repro(Step.of(nn.Linear(2, 2), (torch.ones(1, 2), None)), None, str(tmp_path)) is None
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ verification reads the script's verdict


@pytest.mark.subprocess
@pytest.mark.parametrize("body,kind,verified,says", [
    ("print('nanhunt-repro: REPRODUCED inf'); raise SystemExit(1)", "inf", True, "inf"),
    ("print('nanhunt-repro: REPRODUCED nan'); raise SystemExit(1)", "inf", False, "got nan"),
    ("print('nanhunt-repro: NOT REPRODUCED'); raise SystemExit(0)", "inf", False, "finite"),
    ("raise SystemExit(1)", "inf", False, "exit 1"),  # a crash is never a reproduction
    ("import sys; print('boom', file=sys.stderr); raise SystemExit(2)", "nan", False, "boom"),
])
def test_verify_reads_exit_status_and_marker(tmp_path: Path, body: str, kind: str, verified: bool, says: str) -> None:
    (tmp_path / SCRIPT).write_text(body + "\n")
    rp = verify_repro(str(tmp_path), Repro(op="aten::exp", files=(SCRIPT, INPUTS)), kind)
    assert rp.verified is verified and says in rp.result


@pytest.mark.subprocess
def test_verify_times_out(tmp_path: Path) -> None:
    (tmp_path / SCRIPT).write_text("import time; time.sleep(30)\n")
    rp = verify_repro(str(tmp_path), Repro(op="aten::exp", files=(SCRIPT,)), "inf", timeout=0.5)
    assert not rp.verified and "ran past" in rp.result


@pytest.mark.subprocess
def test_script_with_finite_inputs_exits_zero(tmp_path: Path) -> None:
    # GIVEN a real repro whose saved inputs are replaced by small values
    kw = _step(ExpNet(), torch.float32)
    occ = _first(kw)
    call = capture_origin_call(_as_step(kw), occ)
    assert call is not None
    write_repro(call, occ, str(tmp_path))
    torch.save([torch.zeros(3, 16)], tmp_path / INPUTS)
    # WHEN run as a user would THEN exit 0 and it says so
    proc = subprocess.run([sys.executable, SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "NOT REPRODUCED" in proc.stdout


@pytest.mark.subprocess
def test_the_bundle_repro_comes_from_the_replay_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a step whose exp overflows, replayed with a bundle and no bisection
    from nanhunt.hunt.pipeline import hunt

    kw = _step(ExpNet(), torch.float32)
    runs: list[int] = []
    real_run = Step.run

    def counted(self: Step, **options: Any) -> torch.Tensor:
        runs.append(1)
        return real_run(self, **options)

    monkeypatch.setattr(Step, "run", counted)
    report = hunt(_as_step(kw), bundle=str(tmp_path))
    # THEN the repro is verified, and its inputs came from the replay's second run: two runs of the step, no third
    assert report.repro is not None and report.repro.verified, report.repro
    assert len(runs) == 2
