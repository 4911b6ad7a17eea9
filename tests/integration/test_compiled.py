"""A torch.compile'd model's step replayed the way it ran: eager, aot_eager, then its own backend; a NaN that
only the compiled step makes is compile-induced, located at its graph node with the user's module and line."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import nanhunt
from nanhunt._util._compiled import CompileSpec, record_of
from nanhunt._util._errors import InputError
from nanhunt.capture.capture import given_spec
from nanhunt.cli import main
from nanhunt.hunt.pipeline import hunt
from nanhunt.records import Report
from nanhunt.step.step import Step
from nanhunt.report._common import sentence, verdict_text

pytestmark = pytest.mark.slow


def _shift_exp(gm: fx.GraphModule, by: float) -> Callable[..., Any]:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.exp:
            with gm.graph.inserting_before(n):
                shifted = gm.graph.call_function(torch.add, (n.args[0], by))
            n.args = (shifted,)
    gm.recompile()
    return gm.forward


def miscompile_exp(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A dynamo backend that miscompiles one op: every exp computes exp(x + 100), which overflows float32."""
    return _shift_exp(gm, 100.0)


def miscompile_large_exp(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A dynamo backend whose exp computes exp(x + 80): it overflows float32 only where x is above 8.7."""
    return _shift_exp(gm, 80.0)


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
    # THEN the eager replay (its two traced runs) and aot_eager are finite, the model's own backend is not:
    # compile-induced
    v = rep.verdict
    assert rep.status == "compile-induced" and v is not None and v.kind == "compile-induced"
    assert [(r.backend, r.runs, r.nonfinite) for r in v.rungs] == [
        ("eager", 2, 0), ("aot_eager", 1, 0), (f"{__name__}:miscompile_exp", 1, 1)]
    assert v.replays == 4
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
    assert text.startswith("Compile-induced: the eager step is finite, a compiled one is not (eager 0/2 non-finite, "
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
    assert "the model is torch.compile'd: the eager original was replayed" in rep.notes


def test_a_clean_compiled_step_stays_clean() -> None:
    # GIVEN a model compiled by aot_eager, whose step is finite
    rep = _replay(torch.compile(Net(), backend="aot_eager"))
    # THEN it is clean, and the report says the compiled rung ran finite
    assert rep.status == "clean" and rep.verdict is not None and rep.verdict.kind == "clean"
    assert rep.config["compiled_rungs"] == {"eager": "0/2 non-finite", "aot_eager": "0/1 non-finite"}
    assert rep.notes == ("the model is torch.compile'd: its eager original was traced, and the step replayed "
                         "compiled (aot_eager) as well",)


def test_the_eager_rung_counts_the_eager_runs_the_replay_made() -> None:
    # GIVEN a clean compiled step hunted with repeat=2: two replays of two traced runs, then each rung twice
    torch.manual_seed(0)
    net = Net()
    step = Step.of(torch.compile(net, backend="aot_eager"), (torch.randn(3, 4), torch.randint(0, 2, (3,))),
                   loss_fn=F.cross_entropy, dtype=torch.float32, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    rep = hunt(step, repeat=2)
    # THEN the eager rung says the four runs it made
    assert rep.status == "clean"
    assert rep.config["compiled_rungs"] == {"eager": "0/4 non-finite", "aot_eager": "0/2 non-finite"}


def fails_to_compile(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    raise RuntimeError("this backend compiles nothing")


def test_a_backend_that_cannot_compile_the_step_leaves_the_eager_answer_and_says_why() -> None:
    # GIVEN a model whose backend raises when dynamo hands it the graph
    rep = _replay(torch.compile(Net(), backend=fails_to_compile))
    # THEN the replay finishes with the eager answer, and says the compiled replay could not run and why
    assert rep.status == "clean"
    assert rep.config["compiled_rungs"] == {"eager": "0/2 non-finite", "aot_eager": "0/1 non-finite",
                                            f"{__name__}:fails_to_compile": "could not run"}
    assert rep.notes[-1] == (
        f"the step could not be replayed compiled by {__name__}:fails_to_compile (its finding stands for the eager "
        "step only): backend='fails_to_compile' raised: RuntimeError: this backend compiles nothing")


def test_a_capture_of_a_compiled_step_records_its_backend_and_replays_compiled_when_confirmed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture of a model compiled by the test's own backend
    torch.manual_seed(0)
    net = Net()
    ck, bt, out = str(tmp_path / "ck.pt"), str(tmp_path / "bt.pt"), str(tmp_path / "r.json")
    nanhunt.save_capture(ck, bt, model=torch.compile(net, backend=miscompile_exp),
                         batch=(torch.randn(3, 4), torch.randint(0, 2, (3,))), loss_fn=F.cross_entropy,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), dtype=torch.float32)
    backend = f"{__name__}:miscompile_exp"
    # THEN it records the backend by name, as plain data
    assert torch.load(ck, weights_only=True)["compile"] == {"backend": backend, "mode": None, "options": {},
                                                             "dynamic": None}
    # AND a name from the file is not imported unconfirmed: the replay runs eager only, finite, and says how
    model = ["--model", f"{__name__}:Net", "--no-bisect"]
    assert main(["replay", ck, bt, *model]) == 0
    assert (f"the step ran compiled by backend {backend!r}, a name from the file: it is replayed eager only; pass "
            f"--compile {backend} to replay it compiled too (imports it)") in capsys.readouterr().err
    # AND confirmed with --compile, the step replays compiled: compile-induced, exit 1, the node in the report
    assert main(["replay", ck, bt, *model, "--compile", backend, "--report", out]) == 1
    rep = Report.from_json(Path(out).read_text())
    assert rep.status == "compile-induced" and rep.verdict is not None and rep.verdict.graph_node is not None
    assert (rep.verdict.graph_node.module, rep.verdict.graph_node.node) == ("gate", "exp")


def test_compile_names_a_backend_or_a_function() -> None:
    with pytest.raises(InputError, match="^--compile inductr: name one of torch's backends "
                       r"\(inductor, aot_eager, eager\) or your own as package.module:function$"):
        given_spec("inductr", None)
    assert given_spec("aot_eager", None) == CompileSpec("aot_eager")


def test_a_guard_on_a_compiled_model_records_its_backend_and_its_command_replays_it_compiled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a Guard on a model compiled by the test's own backend, whose step goes non-finite
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    net = Net()
    model = torch.compile(net, backend=miscompile_exp)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    guard = nanhunt.Guard(model, opt, dump_dir="nan", loss_fn=F.cross_entropy, model_factory=f"{__name__}:Net")
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    with pytest.raises(nanhunt.GuardError) as caught:
        with guard.step((x, y)):
            opt.zero_grad()
            loss = guard.loss(F.cross_entropy(model(x), y))
            loss.backward()
            opt.step()
    # THEN its printed command confirms the backend, and run as printed it finds the compiled step's node
    command = caught.value.event.replay_command()
    assert command is not None and f"--compile {__name__}:miscompile_exp" in command
    assert main([*command.split()[1:], "--no-bisect", "--report", "r.json"]) == 1
    rep = Report.from_json(Path("r.json").read_text())
    assert rep.status == "compile-induced" and rep.verdict is not None and rep.verdict.graph_node is not None
    assert rep.verdict.graph_node.module == "gate"


class Spread(nn.Module):
    """A difference that eager's rounding makes exactly 0 and inductor's float32 makes negative.

    Under bfloat16 autocast, ``h`` (the linear's output) is bfloat16 and so is every op after it in eager: ``p = h * h``
    is rounded to bfloat16, and ``q = p * (1 + 2**-10)`` rounds back to ``p`` itself (2**-10 is below half of
    bfloat16's relative spacing, 2**-8 to 2**-7), so ``p - q`` is exactly 0 and the square root of ``0 + 1e-6`` is
    finite. Inductor fuses the four element-wise ops into one kernel that loads ``h``, computes in float32 and rounds
    only the kernel's output: there ``p - q = -h**2 * 2**-10``, below -1e-6 for any ``|h| > 0.032``, and its square
    root is NaN. With ``emulate_precision_casts`` inductor rounds each op's result to bfloat16 as eager does, and the
    step is finite again; running the module in float32 does not help (``p - q`` is negative in float32 too).
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        p = h * h
        q = p * (1 + 2 ** -10)
        return torch.sqrt(p - q + 1e-6)


class SpreadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.spread = Spread()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.spread(x))


@pytest.mark.subprocess  # inductor compiles in a pool of Python worker processes
def test_inductors_float32_intermediates_make_a_nan_that_eagers_bfloat16_rounding_hides() -> None:
    # GIVEN a model compiled by inductor (its defaults) and replayed under bfloat16 autocast
    torch.manual_seed(0)
    net = SpreadNet()
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    rep = nanhunt.replay(torch.compile(net), (x, y), loss_fn=F.cross_entropy, dtype=torch.bfloat16,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    # THEN eager and aot_eager are finite, inductor is not: compile-induced, at the square root, in spread, its line
    v = rep.verdict
    assert rep.status == "compile-induced" and v is not None
    assert [(r.backend, r.nonfinite) for r in v.rungs] == [("eager", 0), ("aot_eager", 0), ("inductor", 1)]
    n = v.graph_node
    assert n is not None and (n.node, n.target, n.module, n.kind) == ("sqrt", "torch.sqrt", "spread", "nan")
    assert n.source_text == "return torch.sqrt(p - q + 1e-6)"
    # AND inductor's precision-cast emulation removes it, the module in float32 does not
    assert v.alternatives == {"inductor emulate_precision_casts": True, "spread in float32": False}


def test_a_trace_of_a_compiled_model_whose_eager_step_is_finite_says_what_it_cannot_see() -> None:
    # GIVEN a model compiled by a backend that breaks its exp, traced live: its eager original runs
    torch.manual_seed(0)
    model = torch.compile(Net(), backend=miscompile_exp)
    with pytest.warns(UserWarning) as warned:
        with nanhunt.trace(model) as t:
            F.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 0])).backward()
    # THEN the trace is finite, and it says a NaN of the compiled step alone is not seen, and what finds it
    assert t.first is None and t.compiled
    messages = [str(w.message) for w in warned]
    assert "nanhunt: the model is torch.compile'd; tracing its eager original (compiled kernels can differ)" in messages
    assert ("nanhunt: the eager original of the torch.compile'd model stayed finite; a NaN that only the compiled "
            "step makes is not seen by a trace: nanhunt.replay(compiled_model, batch, ...) replays the step compiled "
            "too and names the first non-finite node of the compiled graph") in messages


@pytest.mark.subprocess  # inductor's compile workers, and the repro verified in a fresh process
def test_the_bundle_of_a_compile_induced_step_holds_the_compiled_graph_up_to_its_node_verified(tmp_path: Path) -> None:
    # GIVEN the bfloat16 model whose square root inductor makes NaN, hunted with a bundle
    torch.manual_seed(0)
    net = SpreadNet()
    step = Step.of(torch.compile(net), (torch.randn(3, 4), torch.randint(0, 2, (3,))), loss_fn=F.cross_entropy,
                   dtype=torch.bfloat16, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    rep = hunt(step, bundle=str(tmp_path))
    # THEN its repro is the graph up to the sqrt compiled by inductor on the step's inputs, and a fresh process
    # made NaN with it
    rp = rep.repro
    assert rep.status == "compile-induced" and rp is not None
    assert rp.op == "torch.sqrt (compiled graph 1 up to node sqrt, inductor)"
    assert (rp.files, rp.command, rp.autocast_dtype, rp.device_type) == (
        ("repro.py", "repro_inputs.pt"), "python repro.py", "bfloat16", "cpu")
    assert rp.verified and rp.result == "nan"
    assert "BACKEND = 'inductor'" in (tmp_path / "repro.py").read_text()


def test_a_lightning_module_the_trainer_took_out_of_its_compiled_wrapper_records_its_backend() -> None:
    # GIVEN a compiled LightningModule as Lightning's Trainer sees it: unwrapped, its compiled forward kept aside
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.compile import from_compiled

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

    module = from_compiled(torch.compile(Module(), backend="aot_eager", dynamic=False))
    # THEN the capture's record names the backend, as for the compiled wrapper itself
    assert record_of(module) == {"backend": "aot_eager", "mode": None, "options": {}, "dynamic": False}


def test_a_capture_compiled_by_torchs_own_backend_replays_compiled_and_a_malformed_record_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture of a model compiled by aot_eager
    torch.manual_seed(0)
    net = Net()
    ck, bt, out = str(tmp_path / "ck.pt"), str(tmp_path / "bt.pt"), str(tmp_path / "r.json")
    nanhunt.save_capture(ck, bt, model=torch.compile(net, backend="aot_eager"),
                         batch=(torch.randn(3, 4), torch.randint(0, 2, (3,))), loss_fn=F.cross_entropy,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), dtype=torch.float32)
    model = ["--model", f"{__name__}:Net", "--no-bisect"]
    # THEN torch's own backend is used as the file says: the step is replayed compiled, with no flag
    assert main(["replay", ck, bt, *model, "--report", out]) == 0
    assert Report.from_json(Path(out).read_text()).config["compiled_rungs"] == {
        "eager": "0/2 non-finite", "aot_eager": "0/1 non-finite"}
    # AND a record that is not one is refused in one line
    saved = torch.load(ck, weights_only=True)
    torch.save({**saved, "compile": {"backend": "inductor", "dynamic": "yes"}}, ck)
    capsys.readouterr()
    assert main(["replay", ck, bt, *model]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"nanhunt: error: checkpoint {ck!r} is not a valid nanhunt capture: its 'compile' holds a mode, options or "
        "dynamic flag of the wrong type; save the capture again (nanhunt.save_capture)")


def test_a_trainer_that_compiles_its_model_records_the_backend_it_compiles_with(tmp_path: Path) -> None:
    # GIVEN a transformers Trainer compiling its model (torch_compile_backend, through accelerate) with the callback
    pytest.importorskip("transformers")
    from nanhunt.integrations.transformers import NanhuntCallback
    from tests.integration.test_transformers_callback import Poison, _trainer

    dump = tmp_path / "nan"
    trainer = _trainer(tmp_path, [Poison(at=1), NanhuntCallback(dump_dir=dump)], steps=2,
                       torch_compile_backend="aot_eager")
    # WHEN a weight goes inf and the Guard stops the run
    with pytest.raises(nanhunt.GuardError) as caught:
        trainer.train()
    # THEN the capture says how the Trainer compiled the model
    checkpoint = caught.value.event.checkpoint
    assert checkpoint is not None
    assert torch.load(checkpoint, weights_only=True)["compile"] == {"backend": "aot_eager", "mode": None,
                                                                    "options": {}, "dynamic": None}


class CausalAttention(nn.Module):
    """nanoGPT's attention: the future masked with -inf on purpose, which the softmax turns into weights of 0."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.register_buffer("bias", torch.tril(torch.ones(3, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(4, dim=-1)
        att = (q @ k.T) * 0.5
        att = att.masked_fill(self.bias == 0, float("-inf"))
        return att.softmax(-1) @ v


class MaskedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = CausalAttention()
        self.gate = Gate()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(x)
        return self.out(h * self.gate(h).mean())


def test_a_causal_masks_minus_inf_before_the_miscompiled_op_is_not_its_first_non_finite_node() -> None:
    # GIVEN a compiled model whose attention masks with -inf (eager makes it too), then an exp the backend breaks
    torch.manual_seed(0)
    rep = _replay(torch.compile(MaskedNet(), backend=miscompile_exp))
    # THEN the node named is the exp, which eager keeps finite and the backend does not: not the mask
    v = rep.verdict
    assert rep.status == "compile-induced" and v is not None and v.graph_node is not None
    n = v.graph_node
    assert (n.node, n.target, n.module, n.kind) == ("exp", "torch.exp", "gate", "inf")
    assert v.alternatives == {"gate in float32": False}


class Block(nn.Module):
    """A block that is a frame of its own (a graph break): blocks called alike run one compiled graph."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(weight)
            self.fc.bias.fill_(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return torch.exp(self.fc(x))  # 1.1 in the first blocks, 10.1 in the last: exp(90.1) overflows compiled


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(0.0), Block(0.0), Block(0.0), Block(2.5)])
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(sum(b(x) for b in self.blocks) / 1e4)


def test_a_graph_that_overflows_only_on_a_later_call_is_searched_on_that_calls_inputs() -> None:
    # GIVEN blocks run by one compiled graph, whose exp the backend makes overflow in the last block alone
    torch.manual_seed(0)
    net = Blocks()
    rep = nanhunt.replay(torch.compile(net, backend=miscompile_large_exp), (torch.ones(3, 4), torch.tensor([0, 1, 0])),
                         loss_fn=F.cross_entropy, dtype=torch.float32,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    # THEN the graph is searched on the inputs of the call that overflowed: its exp, on Block.forward's line
    v = rep.verdict
    assert rep.status == "compile-induced" and v is not None and v.graph_note is None
    n = v.graph_node
    assert n is not None and (n.node, n.target, n.kind) == ("exp", "torch.exp", "inf")
    assert n.source_text == "return torch.exp(self.fc(x))  # 1.1 in the first blocks, 10.1 in the last: exp(90.1) overflows compiled"


class Dropped(nn.Module):
    """An exp behind a dropout: its argument is 9.6 (exp(89.6) overflows when compiled) for one dropout mask only."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 1)
        with torch.no_grad():  # +w where the mask keeps, -w where it drops: any other mask makes it smaller
            self.fc.weight.copy_(torch.where(mask, 4.8, -4.8) / mask.sum())
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.fc(F.dropout(x, 0.5)))


def test_the_graph_search_replays_the_random_draws_of_the_call_it_kept() -> None:
    # GIVEN a graph whose exp the backend makes overflow under the dropout mask of the step's call alone
    from nanhunt._util._compiled import GraphCapture
    from nanhunt._util._compiled import reset as forget
    from nanhunt.tracing._graph_nodes import Found, first_nonfinite_node

    x = torch.ones(1, 16)
    torch.manual_seed(0)
    mask = F.dropout(x, 0.5)[0] > 0
    spec = CompileSpec(f"{__name__}:miscompile_large_exp", fn=miscompile_large_exp)
    capture = GraphCapture("cpu", spec)
    model = torch.compile(Dropped(mask), backend=capture, dynamic=False)
    torch.manual_seed(0)
    assert torch.isinf(model(x)).all()
    # WHEN it is searched, the process's random state moved on since
    torch.manual_seed(1)
    state = torch.get_rng_state()
    found = first_nonfinite_node(capture.graphs, spec, reset=forget)
    # THEN every run of the search drew that call's mask: the exp is found; and the random state is as it was
    assert isinstance(found, Found) and (found.node.node, found.node.kind) == ("exp", "inf")
    assert torch.equal(torch.get_rng_state(), state)


class Branches(nn.Module):
    """The exp the backend breaks, then a longer finite branch, then their product: in graph order the nodes
    after the exp are finite under the backend until the product."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.inp = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        h = self.inp(x)
        for _ in range(6):
            h = torch.tanh(h) * 0.5 + 0.1
        return self.out(g * h)


def test_the_node_named_has_inputs_the_backend_keeps_finite_when_a_finite_branch_comes_between() -> None:
    # GIVEN a compiled model whose broken exp is followed, in graph order, by a finite branch it later meets
    torch.manual_seed(0)
    rep = _replay(torch.compile(Branches(), backend=miscompile_exp))
    # THEN the node named is the exp itself, not the product that only carries its inf
    v = rep.verdict
    assert rep.status == "compile-induced" and v is not None and v.graph_node is not None
    assert (v.graph_node.target, v.graph_node.module, v.graph_node.kind) == ("torch.exp", "gate", "inf")


def breaks_backward(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A backend whose forward is right and whose backward makes every gradient non-finite."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def backward(bw: fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        out = next(n for n in bw.graph.nodes if n.op == "output")
        with bw.graph.inserting_before(out):
            grads = [bw.graph.call_function(torch.mul, (g, math.inf)) if isinstance(g, fx.Node) else g
                     for g in out.args[0]]
        out.args = (tuple(grads),)
        bw.recompile()
        return make_boxed_func(bw.forward)

    compiled: Callable[..., Any] = aot_autograd(fw_compiler=lambda fw, _: make_boxed_func(fw.forward),
                                                bw_compiler=backward)(gm, example_inputs)
    return compiled


def test_a_step_whose_compiled_forward_stays_finite_says_what_was_searched() -> None:
    # GIVEN a backend that breaks only the backward
    rep = _replay(torch.compile(Net(), backend=breaks_backward))
    # THEN the step is compile-induced, and the note claims only what was searched
    v = rep.verdict
    assert rep.status == "compile-induced" and v is not None and v.graph_node is None
    assert v.graph_note == (f"no forward graph's output was non-finite under {__name__}:breaks_backward where "
                            "eager's is finite, on the inputs kept; the backward and the update were not searched")
