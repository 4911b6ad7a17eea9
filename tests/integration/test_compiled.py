"""A torch.compile'd model's step replayed the way it ran: eager, aot_eager, then its own backend; a NaN that
only the compiled step makes is compile-induced, located at its graph node with the user's module and line."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import nanhunt
from nanhunt.records import Report
from nanhunt.report._common import sentence, verdict_text

pytestmark = pytest.mark.slow


def miscompile_exp(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A dynamo backend that miscompiles one op: every exp computes exp(x + 100), which overflows float32."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.exp:
            with gm.graph.inserting_before(n):
                shifted = gm.graph.call_function(torch.add, (n.args[0], 100.0))
            n.args = (shifted,)
    gm.recompile()
    return gm.forward


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.fc(x))  # the op miscompile_exp breaks


class Net(nn.Module):
    def __init__(self, hot: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = Gate()
        self.out = nn.Linear(4, 2)
        if hot:  # log of a negative number: NaN in eager too
            with torch.no_grad():
                self.inp.bias.fill_(-10.0)
        self.hot = hot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.log(self.inp(x)) if self.hot else torch.tanh(self.inp(x))
        return self.out(h * self.gate(x).mean())


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _replay(model: nn.Module) -> Report:
    torch.manual_seed(0)
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return nanhunt.replay(model, (x, y), loss_fn=F.cross_entropy, dtype=torch.float32, optimizer=opt, bisect=True)


def _gate_line() -> str:
    lines, start = inspect.getsourcelines(Gate.forward)
    return f"{__file__}:{start + 1} in forward"


def test_a_nan_only_the_compiled_step_makes_is_compile_induced_at_its_node_module_and_line() -> None:
    # GIVEN a model compiled by a backend that breaks its exp
    torch.manual_seed(0)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rep = _replay(torch.compile(net, backend=miscompile_exp))
    # THEN the eager replay and aot_eager are finite, the model's own backend is not: compile-induced
    v = rep.verdict
    assert rep.status == "compile-induced" and v is not None and v.kind == "compile-induced"
    assert [(r.backend, r.runs, r.nonfinite) for r in v.rungs] == [
        ("eager", 1, 0), ("aot_eager", 1, 0), (f"{__name__}:miscompile_exp", 1, 1)]
    # AND the first non-finite node of the compiled forward is the exp, in module gate, on Gate.forward's line
    n = v.graph_node
    assert n is not None
    assert (n.node, n.target, n.module, n.module_class, n.kind) == ("exp", "torch.exp", "gate", "Gate", "inf")
    assert n.source == _gate_line() and n.source_text == "return torch.exp(self.fc(x))  # the op miscompile_exp breaks"
    assert (n.graph, n.graphs) == (1, 1) and n.compiles >= 2
    # AND running that module in float32 does not help (the backend breaks it in any dtype)
    assert v.alternatives == {"gate in float32": False}
    # AND the report says it in words, and the model's state is as it was
    assert "".join(s.text for s in sentence(rep)) == (
        "Inf born only when compiled (tests.integration.test_compiled:miscompile_exp), in gate at graph node exp "
        "(torch.exp).")
    text = "".join(s.text for s in verdict_text(rep))
    assert text.startswith("Compile-induced: the eager step is finite, a compiled one is not (eager 0/1 non-finite, "
                           "aot_eager 0/1 non-finite, tests.integration.test_compiled:miscompile_exp 1/1 non-finite).")
    assert f"exp (torch.exp) at {_gate_line()}: return torch.exp" in text
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    # AND the verdict survives the report's JSON
    assert Report.from_json(rep.to_json()).verdict == v


def test_an_eager_nan_in_a_compiled_model_keeps_the_eager_answer() -> None:
    # GIVEN a compiled model whose eager step already makes a NaN (log of a negative number)
    rep = _replay(torch.compile(Net(hot=True), backend=miscompile_exp))
    # THEN the eager replay finds it first: the origin op, no ladder
    assert rep.status == "nonfinite"
    assert rep.first is not None and (rep.first.op, rep.first.module) == ("aten::log", "")
    assert rep.verdict is not None and rep.verdict.kind == "not-precision" and not rep.verdict.rungs
    assert "compiled_rungs" not in rep.config


def test_a_clean_compiled_step_stays_clean() -> None:
    # GIVEN a model compiled by aot_eager, whose step is finite
    rep = _replay(torch.compile(Net(), backend="aot_eager"))
    # THEN it is clean, and the report says the compiled rung ran finite
    assert rep.status == "clean" and rep.verdict is not None and rep.verdict.kind == "clean"
    assert rep.config["compiled_rungs"] == {"eager": "0/1 non-finite", "aot_eager": "0/1 non-finite"}
