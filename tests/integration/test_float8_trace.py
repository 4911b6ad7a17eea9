"""Float8 training (torchao's ``convert_to_float8_training``) under ``nanhunt.trace`` and ``nanhunt.replay``.

Every GEMM operand of a ``Float8Linear`` is a ``Float8TrainingTensor``, which runs only the ops torchao needs and
raises ``NotImplementedError`` on every other one (``aminmax`` first). The trace measures it on what it stands
for (``_data / _scale``), and measures each cast to float8 where it runs: the values sent to zero, those at the
format's maximum, the amax and scale, the operand and recipe. Float8 matmuls are emulated on the CPU; the layers
are tiny, and every value is a power of two times a small integer so that each cast and product is exact.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.records import Occurrence, Phase, Record, Role
from nanhunt.report import console, markdown

torchao_float8 = pytest.importorskip("torchao.float8")
convert_to_float8_training = torchao_float8.convert_to_float8_training
Float8LinearConfig = torchao_float8.Float8LinearConfig

E4M3_MAX = 448.0
OUTLIER = 2.0 ** 15  # one sample's first feature: it sets the tensorwise scale, 448 / 2**15, for the batch
SMALL = 2.0 ** -5  # every other value: 2**-5 * 448 / 2**15 = 7 * 2**-14, under half of e4m3's least (2**-9): 0


class ClipHead(nn.Module):
    """A CLIP-style head: a bias-free projection, then L2 normalisation without an eps (as CLIP's code has it)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        return z / z.norm(dim=-1, keepdim=True)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16, bias=False)
        self.fc2 = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _clip_head(recipe: str = "tensorwise") -> ClipHead:
    torch.manual_seed(0)
    model = ClipHead()
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return model


def _outlier_batch() -> torch.Tensor:
    """16 samples of 32 features: sample 0 is (2**15, 0, ..., 0), every other value 2**-5."""
    x = torch.full((16, 32), SMALL)
    x[0] = 0.0
    x[0, 0] = OUTLIER
    return x


def _mlp() -> Mlp:
    """fc1 doubles, fc2 passes on: 2 * eye and eye, tensorwise scales rounded down to powers of two (torchao's
    option), so that powers of two stay exact through every cast and product."""
    model = Mlp()
    with torch.no_grad():
        model.fc1.weight.copy_(torch.eye(16) * 2)
        model.fc2.weight.copy_(torch.eye(16))
    convert_to_float8_training(model, config=Float8LinearConfig(round_scales_to_power_of_2=True))
    return model


def _casts(records: list[Record]) -> list[Record]:
    return [r for r in records if r.cast is not None]


def _cast_of(records: list[Record], module: str, phase: Phase, operand: str) -> Record:
    found = [r for r in _casts(records) if r.module == module and r.phase is phase and r.cast is not None
             and r.cast.gemm_input == operand]
    assert found, f"no {phase} cast of {module}'s {operand}"
    return found[0]


def _step(model: nn.Module, x: torch.Tensor, loss: Any = None) -> None:
    out = model(x)
    (out.sum() if loss is None else loss(out)).backward()


def test_clip_head_nan_is_named_at_the_div_and_its_story_is_the_zeroing_cast_of_proj_input() -> None:
    # GIVEN the float8 CLIP head and a batch whose one outlier makes every other sample's input to proj 0 in e4m3
    model = _clip_head()
    # WHEN one training step runs under an op-level trace
    with nanhunt.trace(model, level="op") as t:
        _step(model, _outlier_batch())
    # THEN the NaN is born at the div in the root module (0 / 0: 15 samples projected to 0, norms 0)
    first = t.first
    assert first is not None
    assert (first.phase, first.module, first.op, first.kind) == (Phase.FORWARD, "", "aten::div", "nan")
    # AND proj's input cast is measured exactly: 15 samples x 32 values lost to zero, the scale from amax 2**15
    cast = _cast_of(t.records, "proj", Phase.FORWARD, "input")
    c = cast.cast
    assert c is not None
    assert (cast.op, cast.dtype, cast.role, cast.shape) == ("aten::_to_copy", "float8_e4m3fn", Role.OUTPUT, (16, 32))
    assert (c.format, c.numel, c.zeros, c.recipe, c.format_max) == ("float8_e4m3fn", 512, 480, "tensorwise", E4M3_MAX)
    assert c.saturated == 1  # the outlier itself, at 448: dynamic scaling puts the amax at the maximum
    assert (c.amax, c.scale_min, c.scale_max) == (OUTLIER, E4M3_MAX / OUTLIER, E4M3_MAX / OUTLIER)
    assert c.source is not None and t.records[c.source].absmax == OUTLIER
    # AND the origin's story holds that cast, and only that cast (the weight's lost nothing)
    assert [r.index for r in first.casts] == [cast.index]
    weight = _cast_of(t.records, "proj", Phase.FORWARD, "weight").cast
    assert weight is not None and weight.zeros == 0 and weight.recipe == "tensorwise"


def test_clip_head_report_says_proj_input_lost_94_percent_to_zero() -> None:
    # GIVEN the float8 CLIP head and the outlier batch
    model = _clip_head()
    # WHEN it is replayed in float32 (float8 is in the model) and the report rendered
    report = nanhunt.replay(model, (_outlier_batch(), None), loss_fn=lambda out: out.sum(), dtype=torch.float32)
    md = markdown.render(report)
    # THEN the origin is the div in the root, and the report tells the cast that zeroed proj's input
    assert report.first is not None and (report.first.module, report.first.op) == ("", "aten::div")
    story = ("`proj`'s input lost 94% of its values to zero in its float8 cast (float8\\_e4m3fn, tensorwise scale "
             "0.01367 from amax 3.277e+04)")
    assert f"- **float8 cast:** {story}" in md
    assert "#### Float8 casts feeding the op" in md
    assert ("| proj's input | forward | float8\\_e4m3fn | tensorwise | 3.277e+04 | 0.01367 | 480 of 512 (94%) | "
            "1 (0.2%) |") in md
    text = " ".join(console.render_text(report, width=200).split())
    assert "float8 cast proj's input lost 94% of its values to zero in its float8 cast" in text
    assert "proj's input forward float8_e4m3fn tensorwise 3.277e+04 0.01367 480 of 512 (94%) 1 (0.2%)" in text
    # AND the JSON round trip keeps the cast on the origin's story
    again = type(report).from_dict(report.to_dict())
    assert again.first is not None and again.first.casts == report.first.casts


def test_clip_head_module_level_names_the_root_without_raising() -> None:
    # GIVEN the float8 CLIP head (module level sees no op, so no cast either)
    model = _clip_head()
    with nanhunt.trace(model, level="module") as t:
        _step(model, _outlier_batch())
    first = t.first
    assert first is not None
    assert (first.phase, first.module, first.op, first.kind) == (Phase.FORWARD, "", None, "nan")
    assert _casts(t.records) == []


def test_rowwise_recipe_keeps_the_outlier_batch_finite_and_says_so_per_cast() -> None:
    # GIVEN the same head under the rowwise recipe (one scale per sample: the outlier scales only its own row)
    model = _clip_head("rowwise")
    with nanhunt.trace(model) as t:
        _step(model, _outlier_batch())
    # THEN the step is clean, and proj's input cast lost nothing, with a scale per row (2**-7 for the outlier's)
    assert t.first is None
    c = _cast_of(t.records, "proj", Phase.FORWARD, "input").cast
    assert c is not None
    assert (c.recipe, c.zeros, c.saturated, c.amax, c.scale_min) == ("rowwise", 0, 0, OUTLIER, 2.0 ** -7)


def test_float8_mlp_overflow_is_named_exactly_by_trace_and_replay() -> None:
    # GIVEN a float8 MLP whose output reaches 128 in one place (exact through the e4m3 casts), then exp
    model = _mlp()
    x = torch.ones(16, 16)
    x[0, 0] = 64.0

    def loss(out: torch.Tensor) -> torch.Tensor:
        return torch.exp(out).sum()

    # WHEN traced at op level
    with nanhunt.trace(model) as t:
        _step(model, x, loss)
    # THEN exp(128) is the Inf, born in the loss, from fc2's output holding exactly 128
    first = t.first
    assert first is not None
    assert (first.phase, first.module, first.op, first.kind) == (Phase.LOSS, None, "aten::exp", "inf")
    assert (first.inputs[0].op, first.inputs[0].module, first.inputs[0].max) == ("aten::mm", "fc2", 128.0)
    assert first.casts == ()  # nothing was lost on the way: an ordinary overflow
    # AND replay (nanhunt.replay) names the same op, from the same value
    report = nanhunt.replay(model, (x, None), loss_fn=loss, dtype=torch.float32)
    occ = report.first
    assert occ is not None and (occ.phase, occ.op, occ.kind) == (Phase.LOSS, "aten::exp", "inf")
    assert occ.inputs[0].max == 128.0


def test_clean_float8_step_stays_clean_with_every_gemm_operand_measured() -> None:
    # GIVEN a float8 MLP on a batch of ones
    model = _mlp()
    with nanhunt.trace(model) as t:
        _step(model, torch.ones(16, 16))
    # THEN it is clean, and each layer's three GEMMs cast their six operands: forward input and weight, backward
    # the output gradient twice, the weight and the input; e4m3 forward, e5m2 for gradients, tensorwise
    assert t.first is None and t.finite
    for module in ("fc1", "fc2"):
        mine = [r for r in _casts(t.records) if r.module == module]
        got = sorted((r.phase.value, r.cast.gemm_input, r.cast.format) for r in mine if r.cast is not None)
        assert got == [("backward", "grad_output", "float8_e5m2"), ("backward", "grad_output", "float8_e5m2"),
                       ("backward", "input", "float8_e4m3fn"), ("backward", "weight", "float8_e4m3fn"),
                       ("forward", "input", "float8_e4m3fn"), ("forward", "weight", "float8_e4m3fn")]
        assert all(r.cast is not None and r.cast.zeros == 0 and r.cast.recipe == "tensorwise" for r in mine)
    w1 = _cast_of(t.records, "fc1", Phase.FORWARD, "weight").cast
    assert w1 is not None and (w1.amax, w1.scale_min, w1.scale_max) == (2.0, 128.0, 128.0)  # 448 / 2, rounded down


def test_float8_training_tensor_is_measured_on_what_it_stands_for() -> None:
    # GIVEN the float8 MLP: the forward GEMM of fc1 reads two Float8TrainingTensors, made by no op
    model = _mlp()
    x = torch.full((16, 16), 0.5)
    with nanhunt.trace(model) as t:
        _step(model, x)
    mm = next(r for r in t.records if r.op == "aten::mm" and r.module == "fc1" and r.phase is Phase.FORWARD)
    wrappers = [t.records[i] for i in mm.inputs]
    # THEN each operand is a record made from its cast's data and scale, valued as data / scale (0.5 and 2)
    assert [(w.op, w.role, w.dtype, w.max, w.min) for w in wrappers] == [
        (None, Role.OUTPUT, "float32", 0.5, 0.5), (None, Role.OUTPUT, "float32", 2.0, 0.0)]
    for w in wrappers:
        data, scale = (t.records[i] for i in w.inputs)
        assert data.cast is not None and data.dtype == "float8_e4m3fn" and scale.shape == ()


@pytest.mark.subprocess
def test_nanhunt_does_not_import_torchao_unless_the_model_did() -> None:
    # GIVEN a fresh interpreter that traces and replays a plain model
    code = textwrap.dedent("""
        import sys, torch, nanhunt
        m = torch.nn.Linear(4, 4)
        with nanhunt.trace(m) as t:
            m(torch.ones(2, 4)).sum().backward()
        nanhunt.replay(m, (torch.ones(2, 4), None), loss_fn=lambda o: o.sum(), dtype=torch.float32)
        print(sorted(n for n in sys.modules if n.split(".")[0] == "torchao"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # THEN torchao was never imported
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _guarded_run(model: nn.Module, tmp: Any, dim: int, steps: int = 4) -> nanhunt.Guard:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)
    guard = nanhunt.Guard(model, opt, dump_dir=tmp, loss_fn=F.mse_loss, headroom_every=1, check_params=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, dim, generator=g)
        with guard.step((x, None)):
            opt.zero_grad()
            loss = guard.loss(model(x).float().square().mean())
            loss.backward()
            guard.check_grads()
            opt.step()
    return guard


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_guard_and_its_headroom_history_watch_a_float8_loop(tmp_path: Any) -> None:
    # GIVEN a float8 MLP trained four steps under the Guard, its headroom sampled on every step
    model = _mlp()
    guard = _guarded_run(model, tmp_path, 16)
    # THEN no step was taken for a failure, and each module's output has its history
    watch = guard._watch
    watch.read()
    assert [e.kind for e in guard.events if e.kind != "warning"] == []
    assert len(watch.history[("output", watch.names.index("fc1"))]) == 4
