"""The command line on the bundled fixtures and on bad input (in-process and as a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanhunt.cli import main
from nanhunt.records import Report

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures"


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fixture model factories (fixtures.models) import from the repository root, on PYTHONPATH, and replay
    # unconfirmed because the suite trusts the package (conftest: NANHUNT_TRUST_NAMES).
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def _pair(name: str) -> list[str]:
    return [str(FIX / name / "checkpoint.pt"), str(FIX / name / "batch.pt")]


def _digest(paths: list[str]) -> list[bytes]:
    return [Path(p).read_bytes() for p in paths]


def test_overflow_fixture_names_module_and_op(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the capture whose blocks.1.ff.wo overflows float16
    files = _pair("overflow")
    before = _digest(files)
    out = tmp_path / "r.json"
    # WHEN it is replayed
    code = main(["replay", *files, "--report", str(out)])
    # THEN exit 1, the report names the module and op, and the files are untouched
    assert code == 1
    rep = Report.from_json(out.read_text())
    assert rep.first is not None
    assert (rep.first.phase.value, rep.first.module, rep.first.op, rep.first.kind) == (
        "forward", "blocks.1.ff.wo", "aten::addmm", "inf")
    assert rep.first.call_index == 0
    assert rep.first.output.full is not None and rep.first.output.full.posinf > 0
    assert "loss" in rep.first.reached and "gradients" in rep.first.reached
    assert rep.config["scaler_would_skip"] is True
    assert "blocks.1.ff.wo" in capsys.readouterr().out
    assert _digest(files) == before


def test_overflow_fixture_is_clean_in_bfloat16() -> None:
    assert main(["replay", *_pair("overflow"), "--dtype", "bfloat16"]) == 0


@pytest.mark.parametrize(
    "name, phase, module, op",
    [("nan_weight", "weights", "fc2", None), ("nan_batch", "input", None, None)],
)
def test_entering_nan_fixtures(name: str, phase: str, module: str | None, op: str | None, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["replay", *_pair(name), "--report", str(out)]) == 1
    first = Report.from_json(out.read_text()).first
    assert first is not None
    assert (first.phase.value, first.module, first.op) == (phase, module, op)


def test_clean_fixture_exit_0() -> None:
    assert main(["replay", *_pair("clean")]) == 0


@pytest.mark.subprocess
def test_subprocess_entry_points() -> None:
    # The capture names fixtures.models: importable from PYTHONPATH, trusted by the suite (conftest)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    exe = Path(sys.executable).with_name("nanhunt")
    for cmd in ([str(exe)], [sys.executable, "-m", "nanhunt"]):
        p = subprocess.run([*cmd, "replay", *_pair("nan_weight")], cwd=ROOT, capture_output=True, text=True, env=env,
                           timeout=120)
        assert p.returncode == 1, p.stderr
        assert "fc2" in p.stdout


def test_inspect_flags_nan_weight(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", _pair("nan_weight")[0]]) == 1
    assert "fc2.weight" in capsys.readouterr().out
    assert main(["inspect", _pair("clean")[0]]) == 0


# ------------------------------------------------------------------ bad input
def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("nanhunt: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["replay", str(tmp_path / "nope.pt"), _pair("clean")[1]]) == 2
    assert "does not exist" in _err(capsys)


@pytest.mark.parametrize("content", [b"", b"\x00garbage" * 50, b"PK\x03\x04truncated"])
def test_corrupt_or_empty_file(content: bytes, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(content)
    assert main(["replay", str(bad), _pair("clean")[1]]) == 2
    msg = _err(capsys)
    assert "empty" in msg or "corrupt or truncated" in msg
    assert bad.read_bytes() == content


def test_truncated_real_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = Path(_pair("clean")[0]).read_bytes()
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(data[: len(data) // 2])
    assert main(["replay", str(bad), _pair("clean")[1]]) == 2
    assert "corrupt or truncated" in _err(capsys)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned > /tmp/nanhunt-pwned",))


def test_pickle_needs_opt_in(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # GIVEN a hostile checkpoint whose unpickling would run a command
    bad = tmp_path / "ckpt.pt"
    torch.save({"model": _Evil()}, bad)
    marker = Path("/tmp/nanhunt-pwned")
    marker.unlink(missing_ok=True)
    # WHEN replayed without --trust-pickle THEN it is refused and nothing ran
    assert main(["replay", str(bad), _pair("clean")[1]]) == 2
    assert "--trust-pickle" in _err(capsys)
    assert not marker.exists()


def test_trust_pickle_loads_a_full_module(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from fixtures.models import MLP

    torch.manual_seed(0)
    m = MLP()
    ck = tmp_path / "model.pt"
    torch.save(m, ck)
    batch = tmp_path / "batch.pt"
    torch.save((torch.randn(4, 16), torch.randn(4, 4)), batch)
    assert main(["replay", str(ck), str(batch), "--loss", "torch.nn.functional:mse_loss"]) == 2
    assert main(["replay", str(ck), str(batch), "--loss", "torch.nn.functional:mse_loss", "--trust-pickle"]) == 0
    assert "trust-pickle" in capsys.readouterr().err


def _plain(tmp_path: Path, sd: dict[str, torch.Tensor], batch: object) -> list[str]:
    ck, b = tmp_path / "ckpt.pt", tmp_path / "batch.pt"
    torch.save(sd, ck)
    torch.save(batch, b)
    return [str(ck), str(b)]


@pytest.mark.parametrize("wrap", ["bare", "model", "lightning", "ddp", "compile"])
def test_plain_checkpoints_map_keys(wrap: str, tmp_path: Path) -> None:
    from fixtures.models import MLP

    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc1.weight[0, 0] = float("inf")
    sd = m.state_dict()
    ck: object = {
        "bare": sd,
        "model": {"model": sd, "epoch": 3},
        "lightning": {"state_dict": {f"model.{k}": v for k, v in sd.items()}, "epoch": 1},
        "ddp": {f"module.{k}": v for k, v in sd.items()},
        "compile": {f"_orig_mod.{k}": v for k, v in sd.items()},
    }[wrap]
    files = _plain(tmp_path, ck, (torch.randn(4, 16), torch.randn(4, 4)))  # type: ignore[arg-type]
    out = tmp_path / "r.json"
    code = main(["replay", *files, "--model", "fixtures.models:MLP", "--loss", "torch.nn.functional:mse_loss",
                 "--dtype", "float32", "--report", str(out)])
    assert code == 1
    first = Report.from_json(out.read_text()).first
    assert first is not None and (first.phase.value, first.module) == ("weights", "fc1")


def test_state_dict_without_model_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from fixtures.models import MLP

    files = _plain(tmp_path, MLP().state_dict(), torch.randn(4, 16))
    assert main(["replay", *files]) == 2
    assert "--model" in _err(capsys)


def test_mismatched_keys_listed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from fixtures.models import MLP

    sd = MLP(d_hidden=8).state_dict()
    sd["extra.weight"] = torch.zeros(1)
    del sd["fc2.bias"]
    files = _plain(tmp_path, sd, (torch.randn(4, 16), torch.randn(4, 4)))
    assert main(["replay", *files, "--model", "fixtures.models:MLP", "--loss", "torch.nn.functional:mse_loss"]) == 2
    msg = _err(capsys)
    assert "missing fc2.bias" in msg and "unexpected extra.weight" in msg and "shape mismatch fc1.weight" in msg


@pytest.mark.parametrize("factory, text", [
    ("nosuchpkg.models:Net", "cannot import"),
    ("fixtures.models:Nope", "has no attribute"),
    ("fixtures.models", "package.module:callable"),
    ("tests._support.cli:raising_factory", "raised"),
])
def test_bad_factory(factory: str, text: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from fixtures.models import MLP

    files = _plain(tmp_path, MLP().state_dict(), (torch.randn(4, 16), torch.randn(4, 4)))
    assert main(["replay", *files, "--model", factory, "--loss", "torch.nn.functional:mse_loss"]) == 2
    assert text in _err(capsys)


def test_untrusted_factory_from_file_needs_confirmation(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # GIVEN a capture that names a plain function (not an nn.Module class) as its factory
    from fixtures.models import MLP

    ck = torch.load(_pair("clean")[0], weights_only=True)
    ck["model_factory"] = "subprocess:getoutput"
    ck["model_kwargs"] = {"cmd": "echo pwned"}
    path = tmp_path / "ckpt.pt"
    torch.save(ck, path)
    assert MLP  # the real factory exists; the file just doesn't name it
    assert main(["replay", str(path), _pair("clean")[1]]) == 2
    assert "--model" in _err(capsys)


@pytest.mark.parametrize("batch, text", [
    ((torch.randn(4, 7), torch.randn(4, 4)), "does the batch fit the model"),
    ({"tokens": torch.randn(4, 16)}, "does not take"),
    ((torch.randn(4, 16), torch.randn(4, 4), torch.randn(1)), "expected (inputs, targets)"),
    ("a string", "expected a tensor"),
])
def test_batch_does_not_fit(batch: object, text: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    b = tmp_path / "batch.pt"
    torch.save(batch, b)
    assert main(["replay", _pair("clean")[0], str(b)]) == 2
    assert text in _err(capsys)


def test_a_failure_inside_nanhunt_is_not_blamed_on_the_batch(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN nanhunt's own code failing after the step ran (here: the module summary of the report)
    import importlib
    import operator

    # a builtin that raises (TypeError: one argument expected): the failing frame is nanhunt's own
    monkeypatch.setattr(importlib.import_module("nanhunt.hunt.pipeline"), "module_status", operator.itemgetter(0))
    # WHEN a good capture is replayed  THEN one line says it is nanhunt's failure, not the batch's
    assert main(["replay", *_pair("clean")]) == 2
    err = _err(capsys)
    assert "inside nanhunt" in err and "does the batch fit" not in err


def test_model_returning_loss_with_dict_batch(tmp_path: Path) -> None:
    # GIVEN an HF-style model taking keyword arguments and returning {"loss": ...}
    from tests._support.cli import DictLossModel

    torch.manual_seed(0)
    m = DictLossModel()
    files = _plain(tmp_path, m.state_dict(), {"x": torch.randn(4, 16), "labels": torch.zeros(4, 4)})
    assert main(["replay", *files, "--model", "tests._support.cli:DictLossModel", "--dtype", "float32"]) == 0
    files = _plain(tmp_path, m.state_dict(), {"x": torch.full((4, 16), float("nan")), "labels": torch.zeros(4, 4)})
    assert main(["replay", *files, "--model", "tests._support.cli:DictLossModel", "--dtype", "float32"]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *_pair("clean"), "--device", "cuda"]) == 2
    assert "no CUDA device" in _err(capsys)


def test_unknown_report_suffix(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["replay", *_pair("clean"), "--report", str(tmp_path / "r.xyz")]) == 2
    assert "report format" in _err(capsys)


def test_cuda_capture_replayed_on_cpu_warns(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ck = torch.load(_pair("clean")[0], weights_only=True)
    ck["device"] = "cuda:0"
    path = tmp_path / "ckpt.pt"
    torch.save(ck, path)
    assert main(["replay", str(path), _pair("clean")[1]]) == 0
    assert "autocast op lists differ" in capsys.readouterr().err


def test_debug_shows_traceback(tmp_path: Path) -> None:
    with pytest.raises(Exception):
        main(["--debug", "replay", str(tmp_path / "nope.pt"), _pair("clean")[1]])


def test_usage_error_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay"]) == 2
    assert main([]) == 2


@pytest.mark.subprocess
def test_help_and_usage_errors_do_not_import_torch() -> None:
    # GIVEN a fresh process  WHEN it prints help or a usage error  THEN torch (seconds to import) stayed out
    code = ("import sys\nfrom nanhunt.cli import main\n"
            "codes = [main(['--help']), main(['replay', '--help']), main(['replay']), main(['nope'])]\n"
            "print(codes, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[0, 0, 2, 2] False", out.stdout + out.stderr


def test_every_option_has_help() -> None:
    import argparse

    from nanhunt.cli import build_parser

    def bare(p: argparse.ArgumentParser, where: str) -> list[str]:
        out = []
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    out += bare(sub, name)
            elif not a.help and a.dest != "help":
                out.append(f"{where} {a.dest}")
        return out

    assert bare(build_parser(), "nanhunt") == []


def test_version_names_nanhunt_torch_and_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nanhunt 0.1.0 (torch ") and "CUDA " in out


def test_the_reproduce_command_is_the_one_main_was_given(tmp_path: Path) -> None:
    # GIVEN main() called from Python (sys.argv is pytest's)  WHEN it replays with --report
    out = tmp_path / "r.json"
    main(["replay", *_pair("nan_weight"), "--no-bisect", "--report", str(out)])
    # THEN the report's command is that replay, not pytest's arguments
    rep = Report.from_json(out.read_text())
    assert rep.command is not None and rep.command.startswith("nanhunt replay ") and "--no-bisect" in rep.command


def test_a_report_in_a_missing_directory_makes_it_as_a_bundle_does(tmp_path: Path) -> None:
    # GIVEN a report path two directories below any that exist
    out = tmp_path / "reports" / "nan" / "r.html"
    # WHEN the replay writes it, and `nanhunt report` another format of it beside
    assert main(["replay", *_pair("nan_weight"), "--no-bisect", "--report", str(out)]) == 1
    json_out = tmp_path / "more" / "r.json"
    assert main(["replay", *_pair("nan_weight"), "--no-bisect", "--report", str(json_out)]) == 1
    assert main(["report", str(json_out), "-o", str(tmp_path / "again" / "r.md")]) == 0
    # THEN the directories are made and hold the report (the HTML page its picture too)
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.html", "r.png"]
    assert Report.from_json(json_out.read_text()).command is not None
    assert (tmp_path / "again" / "r.md").read_text().startswith("#")


@pytest.mark.subprocess
def test_a_bundle_s_replay_command_works_from_the_bundle_directory(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a replay run from a project directory with relative paths, writing a bundle elsewhere
    project = tmp_path / "project"
    project.mkdir()
    for f in ("checkpoint.pt", "batch.pt"):
        (project / f).write_bytes((FIX / "nan_weight" / f).read_bytes())
    monkeypatch.chdir(project)
    main(["replay", "checkpoint.pt", "batch.pt", "--no-bisect", "--report", str(tmp_path / "r.json")])
    rep = Report.from_json((tmp_path / "r.json").read_text())
    # THEN the command says where it ran
    assert rep.command == f"cd {project} && nanhunt replay checkpoint.pt batch.pt --no-bisect --report {tmp_path}/r.json"
    # AND run as written from another directory (the command's nanhunt is this checkout's), it replays the step
    shell = rep.command.replace("nanhunt replay", f"{sys.executable} -m nanhunt replay", 1).replace(
        f"--report {tmp_path}/r.json", "")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(shell, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "NaN born in phase weights, in fc2 (Linear, call 0) (param).", proc.stdout


def test_the_torchrun_command_keeps_the_directory_it_ran_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nanhunt.cli import _common, replay

    # GIVEN a replay under torchrun of a capture directory named by a relative path
    (tmp_path / "caps").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_common, "ARGV", ["replay", "caps"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    # WHEN its command is recorded  THEN it starts torchrun from that directory
    assert _common.command_line(replay._dist_launcher()) == f"cd {tmp_path} && torchrun --nproc-per-node 2 -m nanhunt replay caps"
