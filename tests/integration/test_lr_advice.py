"""When it is not precision, the report says what it is: a learning rate far too high, measured from the capture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nanhunt
from nanhunt.capture._options import LoadOptions
from nanhunt.capture.capture import load_replay, load_step
from nanhunt.hunt.pipeline import hunt
from nanhunt.records import Status, VerdictKind
from nanhunt.report import markdown
from tests._support.guard import batch, guard_for, mlp_setup, train_step


def _diverged(tmp_path: Path, lr: float) -> nanhunt.GuardEvent:
    """A float32 MLP loop with SGD (momentum 0.9) at ``lr`` until its loss goes non-finite, its headroom history
    sampled every step."""
    model, opt, _ = mlp_setup(scaler=False, lr=lr, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path, on_fail="raise", headroom_every=1)
    with pytest.raises(nanhunt.GuardError):
        for i in range(200):
            train_step(guard, model, opt, None, batch(i), dtype=torch.float32)
    return guard.events[-1]


def test_a_learning_rate_failure_names_the_learning_rate_and_the_update_it_measured(tmp_path: Path) -> None:
    # GIVEN the capture of a float32 run whose SGD learning rate (10) blew the weights up within a few steps
    ev = _diverged(tmp_path, lr=10.0)
    loaded = load_replay(str(ev.checkpoint), str(ev.batch), LoadOptions(model_factory="fixtures.models:MLP"))
    # WHEN it is replayed and bisected, with the Guard's event beside the capture
    report = hunt(loaded.step, prove=True, event=loaded.event)
    # THEN it fails in float32 too (no precision change fixes it), and the report holds what explains it instead:
    # the learning rate and the last update, which moved some weight by far more than its own norm
    assert report.status == Status.NONFINITE
    assert report.verdict is not None and report.verdict.kind == VerdictKind.NOT_PRECISION
    assert report.config["optimizer_settings"]["hyper"]["lr"] == 10.0
    update = report.config["last_update"]
    assert update["how"] == "SGD's momentum buffer" and update["ratio"] > 1e3 and update["params"] == 4
    advice = {a.pattern: a for a in report.advice}
    lr = advice["learning-rate"]
    assert "at lr=10 " in lr.because and f"moved {update['at']} by " in lr.because
    assert "the step fails in float32 too" in lr.because
    assert "group['lr'] = 1  #" in lr.fix  # a tenth of the one it ran at
    # the report a ticket reader gets says it too
    text = markdown.render(report)
    assert "learning rate" in text.lower() and "lr=10" in text


def test_the_advice_quotes_the_runs_own_loss_and_gradient_norm_where_the_guard_kept_them(tmp_path: Path) -> None:
    # GIVEN a run at lr=0.11 that diverges more slowly (non-finite at step 105), its history read back at step 64
    ev = _diverged(tmp_path, lr=0.11)
    assert ev.step == 105
    loaded = load_replay(str(ev.checkpoint), str(ev.batch), LoadOptions(model_factory="fixtures.models:MLP"))
    report = hunt(loaded.step, event=loaded.event)
    # THEN the learning-rate advice says the update's size (its momentum buffer already overflowed) and quotes the
    # loss before the failure against its median, from the Guard's history
    lr = {a.pattern: a for a in report.advice}["learning-rate"]
    assert "by a non-finite amount (its state holds Inf or NaN) at lr=0.11 " in lr.because
    assert "; the loss before it, as the Guard kept it: " in lr.because and " at step 104, against a median of " in \
        lr.because


def test_a_healthy_learning_rate_gets_no_such_advice(tmp_path: Path) -> None:
    # GIVEN a capture of the same loop at a sane learning rate, taken with a fault of another kind (a huge input)
    model, opt, _ = mlp_setup(scaler=False, lr=1e-3, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path, on_fail="raise", headroom_every=None)
    with pytest.raises(nanhunt.GuardError):
        for i in range(3):
            x, y = batch(i)
            if i == 2:
                x = torch.full_like(x, float("inf"))
            train_step(guard, model, opt, None, (x, y), dtype=torch.float32)
    ev = guard.events[-1]
    report = hunt(load_step(str(ev.checkpoint), str(ev.batch), model_factory="fixtures.models:MLP"))
    # THEN the last update is measured, small, and no learning-rate advice is given
    assert report.config["last_update"]["ratio"] < 0.1
    assert "learning-rate" not in {a.pattern for a in report.advice}
