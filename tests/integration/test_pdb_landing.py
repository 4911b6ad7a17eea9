"""``trace(stop_at_first=True)`` in a debugger: a post-mortem (``python -m pdb``, ``%debug``,
``pdb.post_mortem``) starts at the traceback's last frame, which is the user's line that ran the
culprit op (in backward: the line that ran the backward), with the op's tensors in ``nanhunt.last``
and on the error. Driven without a terminal: ``python -m pdb`` with commands on stdin, or a
``pdb.Pdb`` reading from a string."""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import pdb
import re
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nanhunt
from nanhunt import NonFiniteError, Phase
from nanhunt.tracing._watch import land

ROOT = Path(__file__).resolve().parents[2]
# nanhunt's own frames, by the package's real location (a checkout folder may be named nanhunt too)
PACKAGE = os.path.dirname(os.path.abspath(nanhunt.__file__)) + os.sep

# A script's module globals: the hook count of its model `m` (module hooks, parameter grad hooks).
_HOOKS = '''
def hooks():
    mods = sum(len(getattr(mm, a) or {}) for mm in m.modules()
               for a in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_always_called"))
    return mods + sum(len(p._post_accumulate_grad_hooks or {}) for p in m.parameters())
'''

FORWARD_SCRIPT = '''\
import torch
from torch import nn

import nanhunt


class Act(nn.Module):
    def forward(self, x):
        y = x * 100.0
        return torch.exp(y)  # LAND


m = nn.Sequential(nn.Linear(4, 4), Act(), nn.Linear(4, 1))
with torch.no_grad():
    for p in m.parameters():
        p.fill_(0.5)  # the first linear gives 4 * 0.5 + 0.5 = 2.5, y = 250, exp(250) = inf
x = torch.ones(2, 4)
''' + _HOOKS + '''
with nanhunt.trace(m, stop_at_first=True) as t:
    m(x).sum().backward()
'''

BACKWARD_SCRIPT = '''\
import torch
from torch import nn

import nanhunt


class Norm(nn.Module):
    def forward(self, x):
        z = x * 0.0
        return torch.sqrt(z)  # FORWARD


m = nn.Sequential(nn.Linear(4, 4), Norm())
x = torch.ones(2, 4)
''' + _HOOKS + '''

def step():
    loss = m(x).sum()
    loss.backward()  # LAND


with nanhunt.trace(m, stop_at_first=True) as t:
    step()
'''


def _line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if f"# {marker}" in line)


def _under_pdb(tmp_path: Path, script: str, commands: list[str]) -> tuple[tuple[str, int, str], str, list[str]]:
    """Run ``script`` under ``python -m pdb``: continue, then at the post-mortem run ``commands``.
    The landing frame (file, line, function), the output of ``where`` and each command's answer."""
    path = tmp_path / "step.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    stdin = "\n".join(["c", "where", *commands, "quit"]) + "\n"
    p = subprocess.run([sys.executable, "-m", "pdb", str(path)], input=stdin, capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert "Entering post mortem debugging" in p.stdout, p.stdout + p.stderr
    post = p.stdout.split("Entering post mortem debugging", 1)[1]
    m = re.search(r"^> (.*)\((\d+)\)(\S+)\(\)$", post, re.M)
    assert m is not None, post
    answers = [a.strip() for a in post.split("(Pdb) ")[1:3 + len(commands)]]
    return (m.group(1), int(m.group(2)), m.group(3)), answers[0], answers[1:1 + len(commands)]


def _last_frame(tb: TracebackType | None) -> tuple[str, int, str]:
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name


# ---------------------------------------------------------------- python -m pdb


@pytest.mark.subprocess
def test_pdb_lands_on_the_line_that_ran_the_forward_op(tmp_path: Path) -> None:
    # GIVEN a script whose exp overflows in its own Act.forward, traced with stop_at_first
    # WHEN it runs under python -m pdb and the post-mortem is asked where it is and what it sees
    (file, line, func), where, answers = _under_pdb(tmp_path, FORWARD_SCRIPT, [
        "p __file__", "p y.shape", "p nanhunt.last.op", "p nanhunt.last.inputs[0].max().item()",
        "p nanhunt.last.output.isinf().sum().item()", "p nanhunt.last.source == nanhunt.last.landing",
        "p hooks()", "p torch.utils._python_dispatch._get_current_dispatch_mode()", "p t.first.op",
    ])
    script = str(tmp_path / "step.py")
    # THEN it lands on the exp line of Act.forward, not in nanhunt's or torch's frames
    assert (file, line, func) == (script, _line(FORWARD_SCRIPT, "LAND"), "forward")
    assert where.splitlines()[-2:] == [f"> {script}({line})forward()", "-> return torch.exp(y)  # LAND"]
    assert PACKAGE not in where and "_python_dispatch" not in where
    # ... with the user's locals, the op and its tensors at hand, and the trace already undone
    assert answers == [repr(script), "torch.Size([2, 4])", "'aten::exp'", "250.0", "8", "True", "0", "None",
                       "'aten::exp'"]


@pytest.mark.subprocess
def test_pdb_lands_on_the_backward_call_for_a_backward_op(tmp_path: Path) -> None:
    # GIVEN sqrt(0) in forward, whose backward divides by zero
    # WHEN the script runs under python -m pdb
    (file, line, func), where, answers = _under_pdb(tmp_path, BACKWARD_SCRIPT, [
        "p loss.item()", "p nanhunt.last.op", "p nanhunt.last.record.phase.value", "p nanhunt.last.source",
        "p nanhunt.last.output.isinf().sum().item()", "p [tuple(i.shape) for i in nanhunt.last.inputs]",
        "p hooks()", "p torch.utils._python_dispatch._get_current_dispatch_mode()",
    ])
    script = str(tmp_path / "step.py")
    # THEN the forward line is gone by then: it lands on the loss.backward() line of step()
    assert (file, line, func) == (script, _line(BACKWARD_SCRIPT, "LAND"), "step")
    assert PACKAGE not in where
    # ... and nanhunt.last names the backward's div, its forward line, and holds its tensors
    forward = f"{script}:{_line(BACKWARD_SCRIPT, 'FORWARD')} in forward"
    assert answers == ["0.0", "'aten::div'", "'backward'", repr(forward), "8", "[(2, 4), (2, 4)]", "0", "None"]


# ---------------------------------------------------------------- in process


class Act(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x * 100.0)  # OP


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = Act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.fc(x)
        h = self.act(h)  # CALL
        return h.sum()


def _net() -> Net:
    m = Net()
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(0.5)  # fc gives 2.5, exp(250) = inf
    return m


def _here(marker: str, obj: object) -> int:
    lines, start = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    return start + next(i for i, text in enumerate(lines) if f"# {marker}" in text)


def _post_mortem(tb: TracebackType | None, commands: list[str]) -> list[str]:
    """``pdb.post_mortem(tb)`` reading ``commands``: each one's answer."""
    out = io.StringIO()
    debugger = pdb.Pdb(stdin=io.StringIO("\n".join([*commands, "quit"]) + "\n"), stdout=out)
    debugger.use_rawinput = False
    debugger.reset()
    debugger.interaction(None, tb)
    return [a.strip() for a in out.getvalue().split("(Pdb) ")[1:1 + len(commands)]]


def test_the_error_and_nanhunt_last_carry_the_ops_tensors_and_say_what_to_type() -> None:
    # GIVEN the exp overflow WHEN traced with stop_at_first
    m = _net()
    with pytest.raises(NonFiniteError) as info, nanhunt.trace(m, stop_at_first=True) as t:
        m(torch.ones(2, 4)).backward()
    e = info.value
    source = f"{__file__}:{_here('OP', Act.forward)} in forward"
    # THEN the error names the op, its record and its tensors: the input 250 that exp overflowed
    assert (e.op, e.record) == ("aten::exp", e.occurrence.output)
    assert [t_.tolist() for t_ in e.inputs] == [[[250.0] * 4] * 2]
    assert [t_.tolist() for t_ in e.outputs] == [[[float("inf")] * 4] * 2]
    assert all(not t_.requires_grad for t_ in (*e.inputs, *e.outputs))  # detached: no graph kept alive
    # ... nanhunt.last is the same stop
    last = nanhunt.last
    assert last is e.stop and last is not None
    assert (last.op, last.record, last.source, last.landing) == ("aten::exp", e.record, source, source)
    assert last.output is not None and last.output.isinf().all().item()
    # ... the message says where a debugger lands and what to type there
    assert str(e) == (f"Inf born in phase forward, module act (Act, call 0), op aten::exp at {source}; "
                      "post-mortem (python -m pdb, %debug) lands on that line: "
                      "`import nanhunt`, then `p nanhunt.last.inputs[0].abs().max()`, `p nanhunt.last.output`, `p nanhunt.last.record`")
    # ... the traceback ends there, and the trace is undone
    assert _last_frame(info.tb) == (__file__, _here("OP", Act.forward), "forward")
    assert t.first is e.occurrence
    assert _get_current_dispatch_mode() is None
    assert all(not mm._forward_hooks and not mm._forward_pre_hooks for mm in m.modules())


def test_post_mortem_of_a_module_level_stop_lands_on_the_module_call() -> None:
    # GIVEN the same overflow, traced at module level (no op seen: the act module's output is the origin)
    m = _net()
    with pytest.raises(NonFiniteError) as info, nanhunt.trace(m, level="module", stop_at_first=True):
        m(torch.ones(2, 4)).backward()
    call = _here("CALL", Net.forward)
    # WHEN a post-mortem debugger opens the traceback
    answers = _post_mortem(info.tb, ["p h.tolist()", "p nanhunt.last.record.module",
                                     "p nanhunt.last.inputs[0].max().item()", "p nanhunt.last.output.isinf().all().item()"])
    # THEN it starts on the line that called the module, with its argument and result in nanhunt.last
    assert _last_frame(info.tb) == (__file__, call, "forward")
    assert answers == [repr([[2.5] * 4] * 2), "'act'", "2.5", "True"]
    assert str(info.value) == (
        f"Inf born in phase forward, module act (Act, call 0), role output; post-mortem (python -m pdb, %debug) "
        f"lands on {__file__}:{call} in forward, which called that module: "
        "`import nanhunt`, then `p nanhunt.last.inputs[0].abs().max()`, `p nanhunt.last.output`, `p nanhunt.last.record`")
    assert all(not mm._forward_hooks and not mm._forward_pre_hooks for mm in m.modules())


def test_backward_stop_in_process_names_the_forward_line_and_lands_on_backward() -> None:
    # GIVEN sqrt(0) whose backward divides by zero
    class Norm(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x * 0.0)  # FWD

    m = nn.Sequential(nn.Linear(4, 4), Norm())
    # WHEN traced with stop_at_first and backward runs
    with pytest.raises(NonFiniteError) as info, nanhunt.trace(m, stop_at_first=True):
        loss = m(torch.ones(2, 4)).sum()
        loss.backward()  # BWD
    e = info.value
    here = _here("BWD", test_backward_stop_in_process_names_the_forward_line_and_lands_on_backward)
    forward = f"{__file__}:{_here('FWD', Norm.forward)} in forward"
    landing = f"{__file__}:{here} in test_backward_stop_in_process_names_the_forward_line_and_lands_on_backward"
    # THEN it lands on the backward() line, and the message names the forward line that built the node
    assert _last_frame(info.tb)[:2] == (__file__, here)
    assert (e.op, e.record.phase, e.stop.source if e.stop else None) == ("aten::div", Phase.BACKWARD, forward)
    assert str(e) == (f"Inf born in phase backward, module 1 (Norm, call 0), op aten::div, in the backward of "
                      f"{forward}; post-mortem (python -m pdb, %debug) lands on {landing}, which ran that backward: "
                      "`import nanhunt`, then `p nanhunt.last.inputs[0].abs().max()`, `p nanhunt.last.output`, `p nanhunt.last.record`")
    assert _get_current_dispatch_mode() is None


def test_a_transformers_overflow_lands_in_the_library_line_that_ran_it() -> None:
    # GIVEN a tiny GPT-2 (built in code) whose first attention projection overflows float16 under autocast
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                                                 n_positions=8))
    with torch.no_grad():
        model.transformer.h[0].ln_1.bias.fill_(10.0)  # ln_1's output is about 10 everywhere
        model.transformer.h[0].attn.c_attn.weight.fill_(1e4)  # 8 * 10 * 1e4 = 8e5 per output: beyond 65504
    ids = torch.arange(6).reshape(1, 6)
    # WHEN traced with stop_at_first
    with pytest.raises(NonFiniteError) as info, nanhunt.trace(model, stop_at_first=True):
        with torch.autocast("cpu", dtype=torch.float16):
            model(ids, labels=ids).loss.backward()
    # THEN the post-mortem starts on Conv1D.forward's addmm line, in transformers' own file
    lines, start = inspect.getsourcelines(Conv1D.forward)
    addmm = start + next(i for i, text in enumerate(lines) if "torch.addmm" in text)
    assert _last_frame(info.tb) == (inspect.getsourcefile(Conv1D), addmm, "forward")
    # ... a file that never imported nanhunt: the message's `import nanhunt` first, then nanhunt.last
    answers = _post_mortem(info.tb, ["p x.shape", "p nanhunt.last.op", "import nanhunt", "p nanhunt.last.op"])
    assert answers == ["torch.Size([1, 6, 8])", "*** NameError: name 'nanhunt' is not defined", "", "'aten::addmm'"]
    e = info.value
    assert (e.op, e.record.module, e.record.dtype) == ("aten::addmm", "transformer.h.0.attn.c_attn", "float16")
    assert [tuple(t.shape) for t in e.inputs] == [(24,), (6, 8), (8, 24)]
    assert e.outputs[0].dtype == torch.float16 and e.outputs[0].isinf().any().item()
    assert _get_current_dispatch_mode() is None


def test_a_watch_outside_a_trace_leaves_its_traceback_whole() -> None:
    # GIVEN a NonFiniteError raised by a watch outside a trace's with block (unit use of the watch)
    from nanhunt.tracing._records_store import Raw, RecordStore
    from nanhunt.tracing._watch import OriginWatch
    from nanhunt.records import Role

    store = RecordStore()
    watch = OriginWatch(store, stop_at_first=True, keep_tensors=True)
    x = torch.tensor([0.0, 4.0])
    i = store.add(Raw(Phase.INPUT, "fc", 0, None, Role.INPUT, x, (), None), x)
    store.known[x] = (i, x._version)
    y = torch.log(x)
    j = store.add(Raw(Phase.FORWARD, "fc", 0, "aten::log", Role.OUTPUT, y, (i,), None), y)
    # WHEN it raises
    with pytest.raises(NonFiniteError) as info:
        watch.hold([j], (x,), {}, [y], None)
    # THEN nothing cut it (only a trace's exit lands it), and nanhunt.last still holds the op's tensors
    assert _last_frame(info.tb)[2] == "check"
    assert nanhunt.last is not None and nanhunt.last.inputs[0].tolist() == [0.0, 4.0]
    assert nanhunt.last.output is not None and nanhunt.last.output.tolist()[0] == float("-inf")



def test_a_stop_raised_where_no_frame_is_the_users_learns_its_landing_when_it_lands() -> None:
    # GIVEN a stop whose raise saw no frame of the user's (a CUDA backward runs on autograd's device thread)
    m = _net()
    with pytest.raises(NonFiniteError) as info, nanhunt.trace(m, stop_at_first=True):
        m(torch.ones(2, 4)).backward()
    assert info.value.stop is not None
    stop = dataclasses.replace(info.value.stop, landing=None)
    err = NonFiniteError(info.value.occurrence, stop)
    nanhunt.last = stop
    assert "post-mortem" not in str(err)

    def run_backward() -> None:
        raise err  # LAND

    # WHEN it reaches the user's frame and the trace's exit lands it
    with pytest.raises(NonFiniteError):
        run_backward()
    land(err)
    # THEN the message and nanhunt.last name that frame
    landing = f"{__file__}:{_here('LAND', run_backward)} in run_backward"
    assert err.stop is not None and err.stop.landing == landing and nanhunt.last is err.stop
    assert f"lands on {landing}: `import nanhunt`" in str(err)


@pytest.mark.parametrize("level", ["op", "module"])
def test_a_batch_entering_non_finite_stops_where_it_is_first_read(level: str) -> None:
    # GIVEN a batch holding one NaN
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.ones(2, 4)
    x[0, 0] = float("nan")
    # WHEN traced with stop_at_first
    with pytest.raises(NonFiniteError) as info, nanhunt.trace(m, level=level, stop_at_first=True):
        m(x).sum().backward()  # READ
    e = info.value
    line = _here("READ", test_a_batch_entering_non_finite_stops_where_it_is_first_read)
    landing = f"{__file__}:{line} in test_a_batch_entering_non_finite_stops_where_it_is_first_read"
    # THEN the stop is the batch itself (no op made it), found on the model call's line
    assert (e.record.phase, e.op, e.inputs) == (Phase.INPUT, None, ())
    assert [t.isnan().sum().item() for t in e.outputs] == [1]
    assert _last_frame(info.tb)[:2] == (__file__, line)
    assert str(e) == ("NaN born in phase input, outside the model, role input; post-mortem (python -m pdb, %debug) "
                      f"lands on {landing}, where it was first read: `import nanhunt`, then "
                      "`p nanhunt.last.output.isnan().sum()`, `p nanhunt.last.output`, `p nanhunt.last.record`")
