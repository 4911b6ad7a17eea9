"""Module names as the user wrote them, whatever torch wraps around the model: DDP's ``module.``, DataParallel's,
torch.compile's ``_orig_mod.`` and activation checkpointing's ``_checkpoint_wrapped_module.`` are left out, so a
live trace names the modules a capture's replay (on the unwrapped model) names. The DDP runs are two gloo
processes on the CPU, bounded in time, a stuck rank killed."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fixtures.models  # noqa: F401  the capture's model class, imported as a replay of it would find it
import nanhunt
from nanhunt.cli import main
from nanhunt.records import Report

from .dist_more_worker import trace_run, two_ranks

ROOT = Path(__file__).resolve().parents[2]
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    out = tmp_path_factory.mktemp("ddp-names")
    return out, two_ranks(trace_run, out, "ddp", timeout=90)


@pytest.mark.distributed
@needs_gloo
def test_ddp_trace_names_modules_as_written(ddp_run: tuple[Path, dict[int, Any]]) -> None:
    # GIVEN DDP(model), whose named_modules() say module.fc1, and only rank 1's batch overflowing fc1
    _, res = ddp_run
    assert res[0]["wrapped_names"] == ["", "module", "module.fc1", "module.act", "module.fc2"]
    # WHEN each rank traces the step THEN rank 1 names fc1, as the user wrote it
    assert res[1]["first"] == ["forward", "fc1", "Linear", "aten::addmm", "inf"]
    # AND no record and no module class carries the wrapper's name
    for r in (0, 1):
        assert res[r]["classes"] == {"": "MLP", "fc1": "Linear", "act": "GELU", "fc2": "Linear"}
        assert set(res[r]["modules"]) <= {"", "fc1", "act", "fc2"}
        assert res[r]["summary"] == ("rank 1: Inf born in phase forward, module fc1 (Linear, call 0), op aten::addmm; "
                                     "rank 0 received it through the gradient all-reduce")
    # AND rank 0 still received it through DDP's all-reduce
    assert (res[0]["first"], res[0]["received"]) == (None, ["c10d::allreduce_", "backward"])


@pytest.mark.distributed
@needs_gloo
def test_ddp_live_trace_and_replay_of_its_capture_agree(ddp_run: tuple[Path, dict[int, Any]], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    # GIVEN the Guard's capture directory of the step under DDP, and the replay command it printed
    _, res = ddp_run
    command = res[1]["describe"].rpartition(": ")[2]
    assert command.startswith("nanhunt replay ") and shlex.split(command)[2].endswith("step000000")  # a directory
    # WHEN it is replayed as printed (on the unwrapped model, rank 1's batch: the rank that saw it)
    report = tmp_path / "r.json"
    assert main([*shlex.split(command)[1:], "--report", str(report)]) == 1
    capsys.readouterr()
    first = Report.from_json(report.read_text()).first
    # THEN the replay names the module the live trace named
    assert first is not None
    assert [first.phase.value, first.module, first.module_class, first.op, first.kind] == res[1]["first"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(x)))


def _data_parallel(net: Net) -> nn.Module:
    return nn.DataParallel(net)  # no GPU: it calls the module it wraps


def _compiled_block(net: Net) -> nn.Module:
    net.block = torch.compile(net.block)  # type: ignore[assignment]  # block._orig_mod.fc
    return net


def _checkpointed_block(net: Net) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net.block = checkpoint_wrapper(net.block)  # type: ignore[assignment]  # block._checkpoint_wrapped_module.fc
    return net


@pytest.mark.parametrize("wrap, wrapped_name", [
    (_data_parallel, "module.block.fc"),
    (_compiled_block, "block._orig_mod.fc"),
    (_checkpointed_block, "block._checkpoint_wrapped_module.fc"),
])
def test_wrapper_names_are_left_out(wrap: Callable[[Net], nn.Module], wrapped_name: str) -> None:
    # GIVEN a model whose block's Linear overflows float16, wrapped so that torch names it differently
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.block.fc.weight.fill_(1.0)
    model = wrap(net)
    assert wrapped_name in dict(model.named_modules())
    x = torch.full((2, 8), 1e4)  # 8 * 1e4 > 65504
    # WHEN it is traced
    with nanhunt.trace(model) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        out.float().sum().backward()
    # THEN the culprit and every record carry the names the user wrote
    f = t.first
    assert f is not None
    assert (f.phase.value, f.module, f.module_class, f.op, f.kind) == ("forward", "block.fc", "Linear",
                                                                        "aten::addmm", "inf")
    assert t.module_classes() == {"": "Net", "block": "Block", "block.fc": "Linear", "head": "Linear"}
    assert {r.module for r in t.records} <= {None, "", "block", "block.fc", "head"}

