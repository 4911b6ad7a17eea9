"""nanhunt inspect on a healthy checkpoint: the tensors closest to the dtype limits, the optimizer's
second moments against eps, what the GradScaler state means; a batch file refused with exit 2.

Goldens (``tests/golden/inspect_*.txt``) at width 100; regenerate with NANHUNT_UPDATE_GOLDEN=1 and read the diff.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console

from nanhunt.cli import main
from nanhunt.capture.inspect_ckpt import inspect_checkpoint
from nanhunt.records import Inspection
from nanhunt.report.console import render_inspection
from tests._support.golden import WIDTH, check_golden

ROOT = Path(__file__).resolve().parents[2]


def _text(found: Inspection) -> str:
    buf = io.StringIO()
    Console(file=buf, width=WIDTH, color_system=None, force_terminal=False).print(render_inspection(found))
    return buf.getvalue()


def _healthy(tmp_path: Path, *, moment_dtype: torch.dtype = torch.float32, scale: float = 32768.0) -> str:
    """A finite two-layer checkpoint with Adam state and a GradScaler, every value set by hand (exact in float32)."""
    w1 = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.25 - 1.0  # -1 .. 1.75
    b1 = torch.tensor([1e-6, 0.5, -0.25])  # 1e-6: below float16's smallest normal (6.1e-05)
    w2 = torch.full((2, 3), 0.125)
    w2[1, 2] = 1000.0  # float16 headroom 65504 / 1000 = 65.5x
    b2 = torch.zeros(2)
    v0 = torch.full((3, 4), 1e-4)
    v0[0, 0], v0[0, 1], v0[2, 3] = 1e-20, 0.0, 0.25  # sqrt: 1e-10 and 0 below eps 1e-8; the largest 0.5
    state = {
        i: {"step": torch.tensor(10.0), "exp_avg": torch.full_like(p, 1e-3),
            "exp_avg_sq": (v0 if i == 0 else torch.full_like(p, 4.0 if i == 2 else 1e-6)).to(moment_dtype)}
        for i, p in enumerate((w1, b1, w2, b2))
    }
    ck = {
        "model": {"fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2},
        "optimizer": {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                        "weight_decay": 0.0, "params": [0, 1, 2, 3]}]},
        "scaler": {"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                   "_growth_tracker": 1999},
    }
    path = tmp_path / "healthy.pt"
    torch.save(ck, path)
    return str(path)


def test_healthy_checkpoint_shows_what_is_closest_to_the_limits(tmp_path: Path) -> None:
    # GIVEN a finite checkpoint: one weight of 1000, a bias of 1e-6, Adam moments, a GradScaler at 32768
    found = inspect_checkpoint(_healthy(tmp_path))
    # THEN nothing is flagged, and the largest magnitudes come first with their headroom against both formats
    assert found.flagged == () and not found.nonfinite and found.n_tensors == 16
    top = found.largest[0]
    assert (top.name, top.absmax, top.fp16_headroom) == ("model.fc2.weight", 1000.0, 65.504)
    assert top.bf16_headroom == pytest.approx(3.3895313892515355e35)
    # (the optimizer's step counters are counts, not values: not listed)
    assert [s.name for s in found.largest] == ["model.fc2.weight", "model.fc1.weight", "model.fc1.bias",
                                               *(f"optimizer.state.{i}.exp_avg" for i in range(4)), "model.fc2.bias"]
    # AND the one weight below float16's smallest normal is named; optimizer state is not listed there
    assert [(s.name, s.below_fp16_normal, s.min_nonzero) for s in found.tiniest] == [
        ("model.fc1.bias", 1, pytest.approx(1e-6))]
    # AND the second moments, largest first, with the eps of their group and how many sqrt(v) fall below it
    assert [(m.name, m.absmax, m.eps, m.below_eps) for m in found.moments] == [
        ("optimizer.state.2.exp_avg_sq", 4.0, 1e-8, 0), ("optimizer.state.0.exp_avg_sq", 0.25, 1e-8, 2),
        ("optimizer.state.1.exp_avg_sq", pytest.approx(1e-6), 1e-8, 0),
        ("optimizer.state.3.exp_avg_sq", pytest.approx(1e-6), 1e-8, 0)]
    assert found.moments[1].min_nonzero == pytest.approx(1e-20)
    # AND the scaler: 65504 / 32768 = 1.999; one step from growing to 65536, above float16's max
    assert found.scaler_meaning == (
        "with this scale a float16 gradient overflows once its unscaled magnitude exceeds 1.999 (65504 / 32768)",
        "after 1 more step without inf/NaN gradients (tracker 1999 of 2000) the scale grows x2 to 65536, and that "
        "limit drops to 0.9995; that scale is above float16's max (65504), so any float16 gradient of magnitude "
        "0.9995 or more overflows, and GradScaler skips that step and backs off")
    check_golden("inspect_healthy.txt", _text(found))


def test_cli_healthy_exits_0_and_prints_the_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the healthy checkpoint WHEN inspected from the command line THEN exit 0 with every section
    assert main(["inspect", _healthy(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "16 floating tensors: 0 non-finite, 0 within 16x of the float16 max" in out
    for part in ("closest to the dtype limits", "below float16's smallest normal", "optimizer second moments",
                 "GradScaler: scale=32768.0", "the scale grows x2 to 65536"):
        assert part in out, part


def test_scale_below_one_says_steps_kept_overflowing(tmp_path: Path) -> None:
    # GIVEN a scale of 2**-4: 20 halvings below the default start of 2**16
    found = inspect_checkpoint(_healthy(tmp_path, scale=0.0625))
    assert found.scaler_meaning[0] == ("with this scale a float16 gradient overflows once its unscaled magnitude "
                                       "exceeds 1.048e+06 (65504 / 0.0625)")
    assert found.scaler_meaning[2].startswith("the scale is below 1 (20 halvings below GradScaler's default start")


def test_float16_moments_with_an_eps_that_rounds_to_zero_get_a_note(tmp_path: Path) -> None:
    # GIVEN Adam's second moments kept in float16 with eps 1e-8 (< float16's smallest subnormal, 6e-08)
    found = inspect_checkpoint(_healthy(tmp_path, moment_dtype=torch.float16))
    # THEN one note says eps rounds to 0 there (the other gives the optimizer's settings as saved), and the
    # moments are measured in their own dtype
    assert found.notes == ("optimizer eps 1e-08 is below float16's smallest subnormal (6e-08): in this float16 "
                           "state it rounds to 0, and an update divides by sqrt(v) alone; keep the optimizer state "
                           "in float32",
                           "optimizer: 1 parameter group, lr 0.001, betas (0.9, 0.999), eps 1e-08, weight_decay 0")
    v0 = next(m for m in found.moments if m.name == "optimizer.state.0.exp_avg_sq")
    # 1e-20 underflows to 0 in float16 (with the stored 0: two below eps); 1e-4 rounds to 0.00010001659...
    assert (v0.dtype, v0.below_eps, v0.min_nonzero) == ("float16", 2, 0.00010001659393310547)


def test_bundled_overflow_fixture_golden() -> None:
    # GIVEN the bundled fixture whose blocks.1.ff.wo.weight was scaled by 2e5 (scripts/make_fixtures.py)
    found = inspect_checkpoint(str(ROOT / "fixtures" / "overflow" / "checkpoint.pt"))
    # THEN it is flagged 2.62x from float16's max, the rest listed apart, the scaler read
    assert [(s.name, round(s.fp16_headroom, 2)) for s in found.flagged] == [("model.blocks.1.ff.wo.weight", 2.62)]
    assert all(s.name != "model.blocks.1.ff.wo.weight" for s in found.largest)
    assert found.scaler == {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                            "_growth_tracker": 0}
    check_golden("inspect_overflow.txt", _text(found))


def test_bundled_nan_weight_fixture_golden() -> None:
    found = inspect_checkpoint(str(ROOT / "fixtures" / "nan_weight" / "checkpoint.pt"))
    assert found.nonfinite and [(s.name, s.nan) for s in found.flagged] == [("model.fc2.weight", 1)]
    check_golden("inspect_nan_weight.txt", _text(found))


@pytest.mark.parametrize("what", ["nanhunt batch", "tensor", "pair", "token ids"])
def test_a_batch_is_not_a_checkpoint_exit_2(what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a batch file of each shape a user may pass by mistake
    if what == "nanhunt batch":
        path = str(ROOT / "fixtures" / "clean" / "batch.pt")
    else:
        obj = {"tensor": torch.randn(4, 8), "pair": (torch.randn(4, 8), torch.tensor([0, 1, 0, 1])),
               "token ids": {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[2, 3, 4]])}}[what]
        path = str(tmp_path / "batch.pt")
        torch.save(obj, path)
    # WHEN inspected THEN exit 2 with one line saying it is no checkpoint
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    expected = {"nanhunt batch": "is a nanhunt batch file, not a checkpoint",
                "tensor": "holds one tensor [4, 8], not a checkpoint: it looks like a batch",
                "pair": "holds a tuple of 2 items, not a checkpoint: it looks like a batch (inputs, targets)",
                "token ids": "holds no floating tensor, so no weights: is it a batch?"}[what]
    assert expected in err and err.count("\n") == 1


def test_each_tensor_is_measured_with_one_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN the healthy checkpoint (16 tensors) WHEN inspected THEN one host read per tensor, none per element
    calls = {"tolist": 0}
    real = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> object:
        calls["tolist"] += 1
        return real(self)

    path = _healthy(tmp_path)
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a per-tensor .item()"))
    found = inspect_checkpoint(path)
    assert calls["tolist"] == found.n_tensors == 16
    assert not math.isnan(found.largest[0].absmax)
