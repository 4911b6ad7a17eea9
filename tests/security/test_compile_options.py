"""A capture's compile record is untrusted: its options, mode and dynamic flag are suggestions, and its backend a name.

Inductor's options reach the C++ compiler's command line (``cpp.march``, ``cpp.cxx``) and the disk
(``trace.debug_dir``): a replay that passed them on ran what the file chose. Unconfirmed, a replay uses only the
options that change nothing but the numbers (``_compiled.SAFE_OPTIONS``), torch's own modes and the dynamic flag,
says in one line what it left out and which flag confirms it, and goes on; ``--trust-compile-options``
(``trust_compile_options=``) uses the file's settings as recorded. Most tests here replace ``torch.compile`` by a
recorder, to see what reaches it without compiling anything; one runs inductor itself on the hostile options.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import nanhunt
from nanhunt._util._compiled import CompileSpec, read_record, replay_flags
from nanhunt._util._errors import InputError
from nanhunt.capture._options import LoadOptions
from nanhunt.capture.capture import given_spec
from nanhunt.cli import main
from nanhunt.hunt._options import ReplayOptions
from nanhunt.records import Report

MARCH = "native '-wrapper' '/bin/sh,-c,touch {marker};exec \"$0\" \"$@\"'"  # gcc runs /bin/sh first


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.exp(torch.tanh(self.inp(x))))


def _capture(tmp_path: Path, record: dict[str, Any]) -> tuple[str, str]:
    """A capture of Net's step whose 'compile' field is ``record``, as a file may hold it."""
    torch.manual_seed(0)
    net = Net()
    ck, bt = str(tmp_path / "step3-checkpoint.pt"), str(tmp_path / "step3-batch.pt")
    nanhunt.save_capture(ck, bt, model=net, batch=(torch.randn(3, 4), torch.randint(0, 2, (3,))),
                         loss_fn=F.cross_entropy, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         dtype=torch.float32)
    torch.save({**torch.load(ck, weights_only=True), "compile": record}, ck)
    return ck, bt


def _inductor(options: dict[str, Any], mode: str | None = None) -> dict[str, Any]:
    return {"backend": "inductor", "mode": mode, "options": options, "dynamic": None}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """torch.compile replaced by a recorder: each call's keyword arguments but a callable backend, and the module
    returned as it is (eager: the rung is finite, nothing is compiled)."""
    calls: list[dict[str, Any]] = []

    def compile(model: Any, **kw: Any) -> Any:
        if isinstance(kw.get("backend"), str):
            calls.append(kw)
        return model

    monkeypatch.setattr(torch, "compile", compile)
    return calls


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def _left_out(shown: str) -> str:
    return (f"warning: the capture's compile settings {shown} are not used (unconfirmed, only those that change "
            "nothing but the numbers are; others can name a program, a path or a compiler flag): pass "
            "--trust-compile-options to use them as recorded")


PAYLOADS = [
    pytest.param({"cpp.march": MARCH.format(marker="/tmp/x")},
                 "cpp.march=\"native '-wrapper' '/bin/sh,-c,touch /tmp/x;exec \\\"$0\\\" \\\"$@\\\"'\"",
                 id="cpp.march-wrapper"),
    pytest.param({"cpp.cxx": [None, "./cc.sh"]}, 'cpp.cxx=[null, "./cc.sh"]', id="cpp.cxx-beside"),
    pytest.param({"trace.debug_dir": "/tmp/elsewhere"}, 'trace.debug_dir="/tmp/elsewhere"', id="trace.debug_dir"),
]


@pytest.mark.parametrize(("options", "shown"), PAYLOADS)
def test_an_option_that_can_name_a_program_or_a_path_is_left_out_and_named_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles: list[dict[str, Any]], options: dict[str, Any],
        shown: str) -> None:
    # GIVEN a capture of an inductor-compiled step whose record holds the option
    ck, bt = _capture(tmp_path, _inductor(options))
    out = str(tmp_path / "r.json")
    # WHEN it is replayed as a ticket's capture is, no flag given
    code = main(["replay", ck, bt, "--no-bisect", "--report", out])
    # THEN the step is replayed compiled by inductor with none of the file's options, and goes on (finite: exit 0)
    assert code == 0
    assert compiles == [{"backend": "aot_eager", "dynamic": None}, {"backend": "inductor", "dynamic": None}]
    # AND the option is named in one line with the flag that confirms it, also among the report's notes
    assert _warnings(capsys.readouterr().err) == [_left_out(shown)]
    assert _left_out(shown).removeprefix("warning: ") in Report.from_json(Path(out).read_text()).notes


@pytest.mark.parametrize(("options", "shown"), PAYLOADS)
def test_confirmed_the_recorded_options_reach_torch_compile_as_the_file_says(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles: list[dict[str, Any]], options: dict[str, Any],
        shown: str) -> None:
    ck, bt = _capture(tmp_path, _inductor(options))
    assert main(["replay", ck, bt, "--no-bisect", "--trust-compile-options"]) == 0
    assert compiles[-1] == {"backend": "inductor", "dynamic": None, "options": options}
    assert _warnings(capsys.readouterr().err) == []


def test_options_that_change_only_the_numbers_and_torchs_modes_are_used_unconfirmed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles: list[dict[str, Any]]) -> None:
    # GIVEN a record mixing options on the allow list, one of them with a value that is not a bool, and others
    ck, bt = _capture(tmp_path, {"backend": "inductor", "mode": "max-autotune", "dynamic": False, "options": {
        "emulate_precision_casts": True, "split_reductions": False, "max_autotune": "/bin/sh",
        "shape_padding": False, "cpp.simdlen": 512}})
    assert main(["replay", ck, bt, "--no-bisect"]) == 0
    # THEN the allowed ones are used, folded over torch's own table for the mode as torch folds them
    from torch._inductor import list_mode_options

    assert compiles[-1] == {"backend": "inductor", "dynamic": False, "options": {
        **list_mode_options("max-autotune", False), "emulate_precision_casts": True, "split_reductions": False}}
    assert _warnings(capsys.readouterr().err) == [_left_out(
        'max_autotune="/bin/sh", shape_padding=false, cpp.simdlen=512')]


def test_a_mode_that_is_not_one_of_torchs_is_left_out_and_one_of_torchs_is_used(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles: list[dict[str, Any]]) -> None:
    ck, bt = _capture(tmp_path, _inductor({}, mode="-O3 -fplugin=./evil.so"))
    assert main(["replay", ck, bt, "--no-bisect"]) == 0
    assert compiles[-1] == {"backend": "inductor", "dynamic": None}
    assert _warnings(capsys.readouterr().err) == [_left_out('mode="-O3 -fplugin=./evil.so"')]
    ck, bt = _capture(tmp_path, _inductor({}, mode="reduce-overhead"))
    assert main(["replay", ck, bt, "--no-bisect"]) == 0
    assert compiles[-1] == {"backend": "inductor", "dynamic": None, "mode": "reduce-overhead"}
    assert _warnings(capsys.readouterr().err) == []


def test_what_is_left_out_is_escaped_cut_short_and_counted_on_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles: list[dict[str, Any]]) -> None:
    # GIVEN a record whose options are many, one named with terminal escapes and one a megabyte long
    options: dict[str, Any] = {"\x1b[2J\nnanhunt: error: forged": 1, "cpp.march": "x" * 1_000_000}
    options.update({f"opt{i}": i for i in range(10)})
    ck, bt = _capture(tmp_path, _inductor(options))
    assert main(["replay", ck, bt, "--no-bisect"]) == 0
    # THEN the line names the first four, escaped and cut, and counts the rest
    assert _warnings(capsys.readouterr().err) == [_left_out(
        '\\x1b[2J\\nnanhunt: error: forged=1, cpp.march="' + "x" * 99 + '..., opt0=0, opt1=1 (+8 more)')]


def test_the_backend_is_one_of_torchs_three_by_name_and_any_other_name_is_only_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles: list[dict[str, Any]]) -> None:
    # GIVEN records naming a backend torch registers but nanhunt does not take from a file, an import path, and
    # a name a megabyte long
    long = "pkg.mod:" + "b" * 1_000_000
    for name, shown in (("cudagraphs", "cudagraphs"), ("torch:os.system", "torch:os.system"),
                        (long, long[:200] + "...")):
        ck, bt = _capture(tmp_path, {"backend": name, "mode": None, "options": {}, "dynamic": None})
        # THEN nothing is compiled: the step is replayed eager only, and the line says how to confirm the name
        assert main(["replay", ck, bt, "--no-bisect"]) == 0
        assert compiles == []
        assert _warnings(capsys.readouterr().err) == [
            f"warning: the step ran compiled by backend {shown!r}, a name from the file: it is replayed eager only; "
            f"pass --compile {shown} to replay it compiled too (imports it)"]


def test_compile_inductor_typed_by_the_user_means_inductor_with_no_recorded_options(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles: list[dict[str, Any]]) -> None:
    record = _inductor({"cpp.march": "native", "emulate_precision_casts": True}) | {"dynamic": False}
    recorded = read_record(record)
    assert given_spec("inductor", recorded) == CompileSpec("inductor", dynamic=False)
    assert given_spec("inductor", recorded, trusted=True) == recorded
    # on the command line: torch's defaults, and a note says the recorded settings were not used
    ck, bt = _capture(tmp_path, record)
    assert main(["replay", ck, bt, "--no-bisect", "--compile", "inductor"]) == 0
    assert compiles[-1] == {"backend": "inductor", "dynamic": False}
    assert _warnings(capsys.readouterr().err) == [
        "warning: --compile inductor replays with torch's defaults, not the capture's compile settings: pass "
        "--trust-compile-options to use them as recorded"]
    assert main(["replay", ck, bt, "--no-bisect", "--compile", "inductor", "--trust-compile-options"]) == 0
    assert compiles[-1] == {"backend": "inductor", "dynamic": False, "options": record["options"]}


def test_load_capture_takes_the_same_confirmation(tmp_path: Path) -> None:
    options = {"cpp.cxx": [None, "./cc.sh"], "fallback_random": True}
    ck, bt = _capture(tmp_path, _inductor(options))
    step = nanhunt.load_capture(ck, bt)
    assert step.compile_spec == CompileSpec("inductor", options={"fallback_random": True})
    assert step.notes[-1] == _left_out('cpp.cxx=[null, "./cc.sh"]').removeprefix("warning: ")
    assert nanhunt.load_capture(ck, bt, trust_compile_options=True).compile_spec == CompileSpec(
        "inductor", options=options)
    assert nanhunt.load_capture(ck, bt, compile="aot_eager").compile_spec == CompileSpec("aot_eager")


def test_the_guards_command_confirms_what_the_replay_would_leave_out() -> None:
    assert replay_flags(_inductor({"max_autotune": True}, mode="max-autotune")) == []
    assert replay_flags(_inductor({"cpp.march": "native"})) == ["--trust-compile-options"]
    assert replay_flags(_inductor({}, mode="custom")) == ["--trust-compile-options"]
    own = {"backend": "mypkg.backends:fast", "mode": None, "options": {}, "dynamic": None}
    assert replay_flags(own) == ["--compile", "mypkg.backends:fast"]
    assert replay_flags({**own, "options": {"max_autotune": True}}) == [
        "--compile", "mypkg.backends:fast", "--trust-compile-options"]


def test_under_torchrun_the_confirmation_is_refused_as_compile_is() -> None:
    with pytest.raises(InputError, match="^--trust-compile-options applies to a replay in one process; under "
                                         "torchrun leave it out$"):
        ReplayOptions(LoadOptions(trust_compile_options=True)).check_ranks()


def _shift_exp(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A backend whose every exp computes exp(x + 100), which overflows float32: a miscompiled op."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.exp:
            with gm.graph.inserting_before(n):
                n.args = (gm.graph.call_function(torch.add, (n.args[0], 100.0)),)
    gm.recompile()
    return gm.forward


@pytest.mark.slow
def test_the_bundles_repro_holds_only_the_options_the_replay_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a capture whose inductor step goes non-finite compiled only, its record holding an allowed option and
    # one that names a program; inductor stood in for by a backend that miscompiles exp, and the repro not run
    real = torch.compile
    used: list[dict[str, Any]] = []

    def compile(model: Any, **kw: Any) -> Any:
        if kw.get("backend") == "inductor":
            used.append(dict(kw))
            kw = {**kw, "backend": _shift_exp}
            kw.pop("options", None)
        return model if kw.get("backend") == "aot_eager" else real(model, **kw)

    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setattr("nanhunt.hunt._graph_repro.verify_repro", lambda directory, rp, kind: rp)
    options = {"emulate_precision_casts": True, "cpp.march": MARCH.format(marker=tmp_path / "marker")}
    ck, bt = _capture(tmp_path, _inductor(options))
    bundle, out = tmp_path / "bundle", str(tmp_path / "r.json")
    # WHEN it is replayed with a bundle
    assert main(["replay", ck, bt, "--no-bisect", "--bundle", str(bundle), "--report", out]) == 1
    # THEN the step is compile-induced, every compile got the allowed option alone, and so does the repro
    assert Report.from_json(Path(out).read_text()).status == "compile-induced"
    assert used and all(kw["options"] == {"emulate_precision_casts": True} for kw in used)
    script = (bundle / "repro.py").read_text()
    assert "SETTINGS = {'options': {'emulate_precision_casts': True}}" in script
    assert "cpp.march" not in script and "wrapper" not in script


@pytest.mark.slow
@pytest.mark.subprocess  # inductor compiles in a pool of Python worker processes
def test_inductor_replays_a_hostile_record_without_running_or_writing_anything_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture whose record's inductor options would run a shell command through gcc's -wrapper, a script
    # beside the capture as the C++ compiler, and write inductor's traces outside
    monkeypatch.chdir(tmp_path)
    marks = [tmp_path / "wrapper-ran", tmp_path / "cc-ran"]
    script = tmp_path / "cc.sh"
    script.write_text(f'#!/bin/sh\ntouch {marks[1]}\nexec c++ "$@"\n')
    script.chmod(0o755)
    outside = tmp_path / "outside"
    options = {"cpp.march": MARCH.format(marker=marks[0]), "cpp.cxx": [None, "./cc.sh"], "trace.enabled": True,
               "trace.debug_dir": str(outside)}
    ck, bt = _capture(tmp_path, _inductor(options))
    # WHEN it is replayed with inductor for real, no flag given
    assert main(["replay", ck, bt, "--no-bisect"]) == 0
    # THEN nothing the options name ran or was written, and one line says what was left out
    assert [m.exists() for m in marks] == [False, False] and not outside.exists()
    shown = ", ".join(f"{k}={json.dumps(v)[:100] + ('...' if len(json.dumps(v)) > 100 else '')}"
                      for k, v in options.items())
    assert _warnings(capsys.readouterr().err) == [_left_out(shown)]


def test_a_command_that_runs_the_step_eagerly_says_so_and_offers_no_confirmation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles: list[dict[str, Any]]) -> None:
    # GIVEN a compiled capture whose record names a compiler wrapper
    ck, bt = _capture(tmp_path, _inductor({"cpp.march": MARCH.format(marker=str(tmp_path / "ran"))}))
    # WHEN nanhunt compare runs it (float32 against float16, eagerly: compare compiles nothing)
    main(["compare", ck, bt, "--report", str(tmp_path / "c.json")])
    # THEN nothing was compiled, one note says the step ran compiled and is run eagerly, and no flag compare does
    # not have is offered
    err = capsys.readouterr().err
    assert compiles == [] and not (tmp_path / "ran").exists()
    assert "warning: the step ran compiled (backend 'inductor'); it is run eagerly here" in err.splitlines()
    assert "--trust-compile-options" not in err
