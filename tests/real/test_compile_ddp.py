"""Wrapped models: torch.compile (backends "eager" and "aot_eager") and DistributedDataParallel in one process
(gloo, world size 1). The fault is NormMLP's fc2 overflowing float16 (LayerNorm after it), whose minimal float32
fix is fc2 alone."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanhunt import Phase

from . import builders as B
from .builders import where

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:.*compile.*:UserWarning")


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = B.NormMLP().train()
    B.scale_weight(m, "fc2", 1.5e5)
    return m


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = B.gen()
    return torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu")


def test_premise_fc2_overflows_only_in_float16() -> None:
    # GIVEN the planted model WHEN run in float32 THEN fc2's weight and input fit float16, its output does not
    B.assert_overflows_only_in_fp16(_model(), "fc2", _batch()[0])


# ---------------------------------------------------------------- torch.compile


@pytest.fixture
def dynamo_reset() -> Iterator[None]:
    import torch._dynamo

    yield
    torch._dynamo.reset()




@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_trace_names_the_original_modules(backend: str, dynamo_reset: None) -> None:
    # GIVEN the model compiled
    cm = torch.compile(_model(), backend=backend)
    x, y = _batch()
    # WHEN a float16 step of the compiled model is traced (nanhunt traces its eager original)
    with pytest.warns(UserWarning, match="compile"):
        t = B.traced(cm, x, y, loss_fn=F.cross_entropy, scaler=_scaler())
    # THEN fc2's addmm, named as in the user's model (no _orig_mod. prefix)
    assert t.compiled
    assert where(t.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_replay_proves_fc2(backend: str, dynamo_reset: None) -> None:
    # GIVEN the compiled model WHEN replayed and bisected
    cm = torch.compile(_model(), backend=backend)
    x, y = _batch()
    r = B.replayed(cm, x, y, loss_fn=F.cross_entropy, scaler=_scaler(),
                   optimizer=torch.optim.AdamW(cm.parameters(), lr=1e-3))
    # THEN the origin, the culprits and the trial of the origin alone all use the same names
    assert where(r.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", ("fc2",), True)


# ---------------------------------------------------------------- DDP, one process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp() -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(_model())


def test_ddp_trace_names_modules_as_the_user_wrote_them(process_group: None) -> None:
    # GIVEN the model wrapped by DDP (its modules are `module.*` in the wrapper, `fc2` in the user's model)
    d = _ddp()
    x, y = _batch()
    # WHEN a step with the update is traced
    t = B.traced(d, x, y, loss_fn=F.cross_entropy, scaler=_scaler(), optimizer=torch.optim.AdamW(d.parameters()))
    # THEN fc2's addmm, named as in the user's model (the name the replay of its capture gives too)
    assert where(t.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")


def test_ddp_replay_is_reproducible_and_proves_fc2(process_group: None) -> None:
    # GIVEN the DDP model (its first forward call syncs buffers and records more ops than the second)
    d = _ddp()
    x, y = _batch()
    # WHEN replayed twice and bisected
    r = B.replayed(d, x, y, loss_fn=F.cross_entropy, scaler=_scaler(), optimizer=torch.optim.AdamW(d.parameters()))
    # THEN both runs agree, and the culprit carries the name the origin has
    assert r.status == "nonfinite"
    assert where(r.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", ("fc2",), True)


# ---------------------------------------------------------------- captures of wrapped models


@pytest.mark.parametrize("wrapper", ["compile", "ddp"])
def test_wrapped_model_capture_replayed_by_the_cli(wrapper: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   request: pytest.FixtureRequest) -> None:
    # GIVEN a capture saved from the wrapped model the user holds
    if wrapper == "compile":
        request.getfixturevalue("dynamo_reset")
        wrapped = torch.compile(_model(), backend="eager")
    else:
        request.getfixturevalue("process_group")
        wrapped = _ddp()
    # WHEN `nanhunt replay checkpoint.pt batch.pt` runs
    rc, r = B.cli_replay(tmp_path, monkeypatch, model=wrapped, batch=_batch(), loss_fn=F.cross_entropy,
                         scaler=_scaler())
    # THEN the user's model is rebuilt (its own names, no wrapper prefix) and the answer is the API's
    assert rc == 1
    assert where(r.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", ("fc2",), True)
