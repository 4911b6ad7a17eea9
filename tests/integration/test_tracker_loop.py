"""The Guard's headroom history in a hand-written loop's tracker (``tracker=``): a TensorBoard ``SummaryWriter``
read back from its event files, a plain callable, and a model of 200 modules of which only the few nearest their
limit are logged."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.guard._headroom import PICTURED, READ_STEPS
from nanhunt.guard.guard import GuardWarning

from tests._support.guard import batch, guard_for, mlp_setup, train_step

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

STEPS = 128  # two windows of READ_STEPS at headroom_every=1: read at steps 63 and 127
FP16_BITS = math.log2(65504.0)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # tiny ops: intra-op threads only wait on each other (on a busy 2-core machine, 3 ms a 4x4 Linear)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _events(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_a_summary_writer_holds_the_headroom_series_and_the_detection(tmp_path: Path) -> None:
    # GIVEN a float16 loop with a GradScaler under a Guard given a SummaryWriter, sampling every step, whose last
    # step overflows (on_fail="dump": the run goes on after its capture)
    model, opt, scaler = mlp_setup()
    writer = SummaryWriter(str(tmp_path / "tb"))
    guard = guard_for(model, opt, scaler, tmp_path / "caps", headroom_every=1, on_fail="dump", tracker=writer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GuardWarning)
        for i in range(STEPS):
            train_step(guard, model, opt, scaler, batch(i % 16, big_input=i == STEPS - 1))
    guard.close()
    writer.close()
    assert READ_STEPS == 64 and [e.kind for e in guard.events] == ["loss"]
    # WHEN the event files are read back
    acc = _events(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    # THEN each window's read logged the modules' headroom (in bits), their maxima, the loss and the scale
    for name in ("fc1/output", "act/output", "fc2/output", "_model_/output", "fc2/output_grad"):
        head = [(e.step, e.value) for e in acc.Scalars(f"nanhunt/headroom/{name}")]
        top = [(e.step, e.value) for e in acc.Scalars(f"nanhunt/max/{name}")]
        assert [s for s, _ in head] == [s for s, _ in top] == [63]  # step 127's window never read: it failed
        (_, bits), (_, biggest) = head[0], top[0]
        assert bits == pytest.approx(FP16_BITS - math.log2(biggest), abs=1e-3) and 8 < bits < 24
    assert [e.step for e in acc.Scalars("nanhunt/loss")] == [e.step for e in acc.Scalars("nanhunt/scale")] == [63]
    assert acc.Scalars("nanhunt/scale")[0].value == 1024.0
    assert {t.split("/")[1] for t in tags} == {"headroom", "max", "loss", "scale", "detections"}
    # AND the detection: its count at its step, and its text (what guard.events[0] says)
    assert [(e.step, e.value) for e in acc.Scalars("nanhunt/detections")] == [(STEPS - 1, 1.0)]
    texts = acc.Tensors("nanhunt/events/text_summary")
    assert [t.step for t in texts] == [STEPS - 1]
    assert texts[0].tensor_proto.string_val[0].decode() == guard.events[0].describe()


def test_a_callable_gets_the_numbers_at_the_window_reads_and_the_event_text(tmp_path: Path) -> None:
    # GIVEN a Guard given a plain callable, a loop that hands the gradient norm over, and a detection at its end
    model, opt, scaler = mlp_setup()
    got: list[tuple[int, dict[str, Any]]] = []
    guard = guard_for(model, opt, scaler, tmp_path, headroom_every=2, on_fail="dump",
                      tracker=lambda values, step: got.append((step, values)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GuardWarning)
        for i in range(STEPS + 1):
            x, y = batch(i % 16, big_input=i == STEPS)
            with guard.step((x, y)):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = guard.loss(F.mse_loss(model(x), y))
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                guard.check_grads(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0))
                scaler.step(opt)
                scaler.update()
    # THEN one call per window read (every 64 steps: 32 samples of 1 in 2), then the detection's count and text
    assert [step for step, _ in got] == [62, 126, STEPS, STEPS]
    first = got[0][1]
    assert {"nanhunt/loss", "nanhunt/grad_norm", "nanhunt/scale", "nanhunt/headroom/fc1/output"} <= set(first)
    assert all(isinstance(v, float) for v in first.values())
    assert got[2][1] == {"nanhunt/detections": 1.0}
    assert got[3][1] == {"nanhunt/event": guard.events[0].describe()}


class Wide(nn.Module):
    """200 small Linear layers side by side, their outputs summed: three of them with weights 1000x larger."""

    BIG = (3, 77, 150)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(200))
        with torch.no_grad():
            for i in self.BIG:
                self.layers[i].weight.mul_(1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([layer(x) for layer in self.layers]).sum(0)


def test_a_model_of_200_modules_logs_only_the_few_nearest_their_limit(tmp_path: Path) -> None:
    # GIVEN a Guard on a 200-layer model (402 series: each layer's and the model's output and output gradient),
    # sampling every step, its loss the mean output (the output gradients tiny)
    torch.manual_seed(0)
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    got: list[tuple[int, dict[str, float]]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GuardWarning)  # the test's model: its replay is not the point here
        guard = nanhunt.Guard(model, opt, dump_dir=tmp_path, headroom_every=1,
                              tracker=lambda values, step: got.append((step, values)))
    for i in range(STEPS):
        with guard.step(i):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = guard.loss(model(torch.randn(2, 4)).float().mean())
            loss.backward()
            guard.check_grads()
            opt.step()
    guard.close()
    # THEN each window logged PICTURED series: the three big layers' outputs and the model's among them, no more
    assert [step for step, _ in got] == [63, 127]
    for _, values in got:
        logged = {k[len("nanhunt/headroom/"):] for k in values if k.startswith("nanhunt/headroom/")}
        assert len(logged) == PICTURED == 6
        assert {f"layers.{i}/output" for i in Wide.BIG} | {"_model_/output"} <= logged
        assert len(values) == 2 * PICTURED + 1  # the headroom and the max of each, and the loss
