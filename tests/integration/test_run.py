"""``nanhunt run SCRIPT``: real training scripts nanhunt never edits (tests/user_scripts/), each with a known bad
step, run as a user runs them; the replay command each prints is pasted into a shell in another directory and
must name the culprit. A clean run under ``nanhunt run`` gives the same losses, bit for bit, as without it, and
the process is left as it was (every patch taken out, ``sys.argv`` and ``sys.path`` back)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanhunt.cli import main as cli_main

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "user_scripts"
ENV_DROP = ("NANHUNT_TRUST_NAMES",)  # a user's shell: nothing trusted beforehand


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _python(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _nanhunt_run(script: str, *args: str, cwd: Path, options: tuple[str, ...] = ()
                 ) -> subprocess.CompletedProcess[str]:
    return _python(["-m", "nanhunt", "run", *options, str(SCRIPTS / script), *args], cwd)


def _printed_command(stderr: str) -> str:
    """The replay command of the line ``nanhunt run: stopped ...``."""
    line = next(x for x in stderr.splitlines() if x.startswith("nanhunt run: stopped"))
    return "nanhunt replay " + line.split("nanhunt replay ", 1)[1]


def _paste(command: str, cwd: Path, report: Path) -> tuple[int, dict[str, object]]:
    """Run a printed ``nanhunt ...`` or ``torchrun ... -m nanhunt ...`` line from ``cwd``; its JSON report."""
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        argv = ["-m", "torch.distributed.run", "--standalone", *argv[1:]]
    else:
        assert argv[0] == "nanhunt"
        argv = ["-m", "nanhunt", *argv[1:]]
    done = _python([*argv, "--report", str(report)], cwd)
    assert report.exists(), done.stderr[-3000:]
    return done.returncode, json.loads(report.read_text())


def _first(report: dict[str, object]) -> tuple[str, str, str]:
    first = report["first"]
    assert isinstance(first, dict)
    return first["phase"], first["module"], first["op"]


@pytest.fixture()
def elsewhere(tmp_path: Path) -> Path:
    where = tmp_path / "elsewhere"
    where.mkdir()
    return where


def test_plain_float16_loop_stops_at_the_bad_step_and_its_command_names_fc1(tmp_path: Path, elsewhere: Path) -> None:
    # GIVEN a float16 + GradScaler loop with module-level argparse whose batch 3 overflows float16 in fc1
    # WHEN it runs under nanhunt run
    done = _nanhunt_run("plain_loop.py", "--bad-step", "3", cwd=tmp_path)
    # THEN the run stops at step 3 (steps 0-2 printed their losses), with exit 1 and the capture's command
    assert done.returncode == 1, done.stderr[-3000:]
    assert [line.split()[1] for line in done.stdout.splitlines()] == ["0", "1", "2"]
    assert "nanhunt run: stopped plain_loop.py: nanhunt.Guard: non-finite loss at step 3" in done.stderr
    command = _printed_command(done.stderr)
    assert f"--model {SCRIPTS / 'plain_loop.py'}:Net" in command
    # AND the command pasted in another directory names fc1's float16 cast of the input
    rc, report = _paste(command, elsewhere, tmp_path / "r.json")
    assert rc == 1
    phase, module, op = _first(report)
    assert (phase, module) == ("forward", "fc1")
    assert op in ("aten::addmm", "aten::_to_copy")


def test_a_clean_run_gives_the_same_losses_bit_for_bit(tmp_path: Path) -> None:
    # GIVEN the float16 loop with no bad batch, run with python and under nanhunt run
    plain = _python([str(SCRIPTS / "plain_loop.py"), "--steps", "8"], tmp_path)
    watched = _nanhunt_run("plain_loop.py", "--steps", "8", cwd=tmp_path)
    # THEN both finish with exit 0 and print the same losses (full float repr), and nanhunt says it watched
    assert plain.returncode == 0 and watched.returncode == 0, watched.stderr[-3000:]
    assert watched.stdout == plain.stdout and len(plain.stdout.splitlines()) == 8
    assert "a training loop was watched: 8 steps were checked and no non-finite value was seen" in watched.stderr
    assert not (tmp_path / "nan-captures").exists()


def test_transformers_trainer_script_replays_with_no_argument(tmp_path: Path, elsewhere: Path) -> None:
    # GIVEN a Trainer script whose own callback turns a weight of h.0.mlp.c_fc Inf at optimizer step 3
    done = _nanhunt_run("hf_trainer.py", "--bad-step", "3", "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    # THEN nanhunt's callback was attached to the unchanged Trainer: it stops at step 3
    assert done.returncode == 1, done.stderr[-3000:]
    assert "transformer.h.0.mlp.c_fc.weight holds 1 Inf" in done.stderr
    command = _printed_command(done.stderr)
    assert "--model" not in command  # a transformers model: rebuilt from its config
    # AND the command, pasted elsewhere, names the layer whose weights were already non-finite
    rc, report = _paste(command, elsewhere, tmp_path / "r.json")
    assert rc == 1
    phase, module, _ = _first(report)
    assert (phase, module) == ("weights", "transformer.h.0.mlp.c_fc")


@pytest.mark.parametrize("package", [(), ("--pytorch-lightning",)], ids=["lightning", "pytorch_lightning"])
def test_lightning_script_stops_and_its_command_names_the_exp(tmp_path: Path, elsewhere: Path,
                                                              package: tuple[str, ...]) -> None:
    done = _nanhunt_run("lightning_fit.py", "--bad-step", "3", *package, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "nanhunt run: stopped lightning_fit.py: nanhunt.Guard: non-finite loss at step 3" in done.stderr
    command = _printed_command(done.stderr)
    assert f"--model {SCRIPTS / 'lightning_fit.py'}:ExpNet" in command
    rc, report = _paste(command, elsewhere, tmp_path / "r.json")
    assert rc == 1
    assert _first(report) == ("forward", "", "aten::exp")  # "": the root module


def test_accelerate_loop_with_a_functional_loss(tmp_path: Path, elsewhere: Path) -> None:
    # GIVEN an accelerate loop: accelerator.backward divides the loss; the loss is F.cross_entropy(model(x), y)
    done = _nanhunt_run("accelerate_loop.py", "--bad-step", "3", cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "cannot name" not in done.stderr  # the loss was read from its autograd node
    rc, report = _paste(_printed_command(done.stderr), elsewhere, tmp_path / "r.json")
    assert rc == 1
    assert _first(report) == ("forward", "", "aten::exp")  # "": the root module
    config = report["config"]
    assert isinstance(config, dict) and config["loss_fn"] == "cross_entropy"


@pytest.mark.distributed
def test_torchrun_ddp_loop_stops_every_rank_and_replays_under_torchrun(tmp_path: Path, elsewhere: Path) -> None:
    # GIVEN a DDP loop under torchrun (2 gloo ranks) whose rank 1 overflows exp at step 2
    from tests._support.dist import torchrun

    done = torchrun(["-m", "nanhunt", "run", str(SCRIPTS / "ddp_loop.py"), "--bad-step", "2"], cwd=tmp_path)
    # THEN both ranks stop at step 2 (rank 1 saw it) and print the torchrun replay line
    assert done.returncode != 0
    assert done.stderr.count("non-finite loss at step 2") == 2, done.stderr[-3000:]
    line = next(x for x in done.stderr.splitlines() if "replay every rank's part with: " in x)
    command = line.split("replay every rank's part with: ", 1)[1]
    assert command.startswith("torchrun --nproc-per-node 2 -m nanhunt replay ")
    rc, report = _paste(command, elsewhere, tmp_path / "r.json")
    assert _first(report) == ("forward", "", "aten::exp")  # "": the root module


def test_continue_records_and_finishes(tmp_path: Path) -> None:
    done = _nanhunt_run("plain_loop.py", "--bad-step", "2", cwd=tmp_path, options=("--on-fail", "continue"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == 6
    assert (tmp_path / "nan-captures" / "step000002-checkpoint.pt").exists()
    assert "non-finite loss at step 2" in done.stderr


def test_rollback_is_refused_for_a_trainer_in_one_line(tmp_path: Path) -> None:
    done = _nanhunt_run("hf_trainer.py", "--output_dir", str(tmp_path / "out"), cwd=tmp_path,
                        options=("--on-fail", "rollback"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "nanhunt: error: --on-fail rollback is for plain training loops: a transformers.Trainer owns its loop, so "
        "nanhunt cannot skip a batch and go on; use --on-fail stop or continue")
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------- in this process


def _patched_state() -> tuple[object, ...]:
    return (torch.optim.Optimizer.__dict__["__init__"], torch.amp.GradScaler.__dict__["scale"],
            torch.amp.GradScaler.__dict__["step"], torch.amp.GradScaler.__dict__["update"],
            torch.Tensor.__dict__["backward"], tuple(sys.meta_path), tuple(sys.argv), tuple(sys.path))


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(body)
    return path


LOOP = """
import torch
from torch import nn
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(5, 4)
    opt.zero_grad()
    loss = {loss}
    loss.backward()
    opt.step()
{tail}
"""


@pytest.mark.parametrize("tail,code", [("", 0), ("raise SystemExit(3)", 3), ("raise ValueError('boom')", 1)])
def test_the_process_is_left_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str], tail: str, code: int) -> None:
    # GIVEN a script that trains and then ends normally, exits 3, or raises
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, LOOP.format(loss="model(x).pow(2).mean()", tail=tail))
    before = _patched_state()
    # WHEN it runs under nanhunt run in this process
    rc = cli_main(["run", str(script), "--an-argument"])
    # THEN its exit code is the script's; every patch is out; argv and path are back
    assert rc == code
    assert _patched_state() == before
    err = capsys.readouterr().err
    if code == 1:
        assert "ValueError: boom" in err and "Traceback" in err  # the script's own error, as Python prints it
        assert "nanhunt: error" not in err


def test_a_loss_nanhunt_cannot_name_is_said_at_the_detection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a loop whose loss is computed by the script's own expression, NaN at the first step
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, LOOP.format(loss="model(x).pow(2).mean() * float('nan')", tail=""))
    rc = cli_main(["run", str(script)])
    err = capsys.readouterr().err
    # THEN it stops at step 0 and says the capture holds the model's inputs only, and why
    assert rc == 1
    assert "non-finite loss at step 0" in err
    assert "the loss is computed from the model's output by code nanhunt cannot name (MeanBackward0)" in err


WARMUP = """
import contextlib
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
        self.m = nn.Linear(2, 1)

    def forward(self, x):
        return self.m(self.l(x))


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), 0.1)
x, y = torch.randn(4, 2), torch.randn(4, 1)
for i in range(3):
    # a float32 warm-up step, then bfloat16 autocast; step 2 overflows
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if i >= 1 else contextlib.nullcontext()
    with amp:
        out = model(x * (1e38 if i == 2 else 1.0))
    loss = torch.nn.functional.mse_loss(out.float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_the_capture_holds_the_autocast_dtype_of_its_own_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a loop whose first step runs in float32 and the later ones under bfloat16 autocast
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, WARMUP)
    # WHEN it runs under nanhunt run and stops at step 2
    rc = cli_main(["run", "--dump-dir", str(tmp_path / "caps"), str(script)])
    err = capsys.readouterr().err
    # THEN the capture of step 2 records the dtype step 2 ran in, not the warm-up's
    assert rc == 1, err
    [checkpoint] = (tmp_path / "caps").glob("*checkpoint.pt")
    assert torch.load(checkpoint, weights_only=True)["autocast"]["dtype"] == "bfloat16"


def test_a_script_with_no_training_is_said_to_be_unwatched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, "import sys\nprint(sys.argv[1:])\n")
    assert cli_main(["run", str(script), "a", "--b"]) == 0
    out, err = capsys.readouterr()
    assert out == "['a', '--b']\n"
    assert "nanhunt run: watched nothing in train.py" in err


def test_the_stop_line_starts_on_a_line_of_its_own_after_a_progress_bar(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a loop that draws a progress bar (tqdm's way: \r and no newline) and goes NaN at its first step
    monkeypatch.chdir(tmp_path)
    loop = LOOP.format(loss="model(x).pow(2).mean() * float('nan')", tail="")
    loop = loop.replace("    opt.zero_grad()", "    sys.stderr.write('\\r 50%|#####     | 1/2')\n    opt.zero_grad()")
    script = _script(tmp_path, "import sys\n" + loop)
    # WHEN it runs under nanhunt run and is stopped
    assert cli_main(["run", str(script)]) == 1
    err = capsys.readouterr().err
    # THEN the bar keeps its own line and nanhunt's stop line begins a new one
    assert "1/2\nnanhunt run: stopped train.py" in err, err
    # AND the process's streams are its own again
    assert type(sys.stderr).__name__ != "_LineEnd" and type(sys.stdout).__name__ != "_LineEnd"


def test_a_missing_script_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", str(tmp_path / "nope.py")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"nanhunt: error: script {str(tmp_path / 'nope.py')!r} does not exist; give the path of the training script")


LOCAL = """
import torch
from torch import nn

def main():
    class Local(nn.Module):  # a class nanhunt cannot name: no capture could rebuild it
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    model = Local()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        loss = model(torch.randn(5, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        print("step", step)

main()
"""


def test_nanhunt_failing_to_watch_never_breaks_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a loop whose model class is local to a function (the Guard cannot name it for a capture)
    monkeypatch.chdir(tmp_path)
    before = _patched_state()
    rc = cli_main(["run", str(_script(tmp_path, LOCAL))])
    out, err = capsys.readouterr()
    # THEN the script runs to its end as without nanhunt, which says once why it stopped watching
    assert rc == 0 and out == "step 0\nstep 1\nstep 2\n"
    assert err.count("nanhunt run: nanhunt stopped watching the loop (ValueError: cannot name the model's class") == 2
    assert _patched_state() == before


def test_rollback_skips_the_bad_batch_and_the_loop_goes_on(tmp_path: Path) -> None:
    # GIVEN the float16 loop whose batch 2 overflows, under --on-fail rollback
    done = _nanhunt_run("plain_loop.py", "--bad-step", "2", cwd=tmp_path, options=("--on-fail", "rollback"))
    # THEN it runs to its end (the bad step rolled back), the later losses finite, with the capture written
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line.split()[3]) for line in done.stdout.splitlines()]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses[3:])))
    assert "rolled back (#1) to the state step 2 began with" in done.stderr
    assert (tmp_path / "nan-captures" / "step000002-checkpoint.pt").exists()


MANUAL = """
import lightning as L, torch
from torch import nn

class Manual(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.fc = nn.Linear(4, 2)

    def training_step(self, batch, i):
        opt = self.optimizers()
        loss = self.fc(batch[0]).pow(2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False).fit(Manual(), data)
print("fit done")
"""


def test_a_framework_run_nanhunt_cannot_watch_goes_on_unwatched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a Lightning module with manual optimization, which nanhunt's callback does not watch
    monkeypatch.chdir(tmp_path)
    rc = cli_main(["run", str(_script(tmp_path, MANUAL))])
    out, err = capsys.readouterr()
    # THEN the fit runs to its end and nanhunt says why it did not watch it
    assert rc == 0 and out.endswith("fit done\n")
    assert ("nanhunt run: nanhunt did not watch the Lightning run: NanhuntCallback supports automatic "
            "optimization") in err


def test_resuming_from_a_trainer_checkpoint_reaches_the_bad_step(tmp_path: Path) -> None:
    # GIVEN a Trainer run (no nanhunt) that saved checkpoint-2 and checkpoint-4
    out = tmp_path / "out"
    first = _python([str(SCRIPTS / "hf_trainer.py"), "--output_dir", str(out), "--save_steps", "2", "--max_steps",
                     "4"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    plain_losses = json.loads(first.stdout.strip().splitlines()[-1].removeprefix("losses ").replace("'", '"'))
    # WHEN the script is run again under nanhunt, resumed with its own flag from checkpoint-2, step 3 going bad
    done = _nanhunt_run("hf_trainer.py", "--output_dir", str(out), "--resume_from_checkpoint",
                        str(out / "checkpoint-2"), "--bad-step", "3", cwd=tmp_path)
    # THEN the resumed step 2 logs the loss the first run had, and the run stops at step 3 with its capture
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"'loss': '{plain_losses[2]:.4g}'" in done.stdout
    assert "nanhunt did not see what wrote them at step 3" in done.stderr
    assert (tmp_path / "nan-captures" / "step000003-checkpoint.pt").exists()


OWN_CALLBACK = """
import sys
import torch
sys.path.insert(0, {scripts!r})
from hf_trainer import BreakWeight, data
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from nanhunt.integrations.transformers import NanhuntCallback

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
args = TrainingArguments(output_dir="out", max_steps=4, per_device_train_batch_size=4, report_to=[],
                         save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
Trainer(model=model, args=args, train_dataset=data(),
        callbacks=[BreakWeight(1), NanhuntCallback(dump_dir="mine", on_fail="dump")]).train()
"""


def test_a_script_with_its_own_callback_is_watched_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a Trainer script that gives the Trainer nanhunt's callback itself
    monkeypatch.chdir(tmp_path)
    rc = cli_main(["run", str(_script(tmp_path, OWN_CALLBACK.format(scripts=str(SCRIPTS))))])
    err = capsys.readouterr().err
    # THEN its callback records step 1 (on_fail="dump": the run goes on), and nanhunt run added no second one:
    # one capture, in the script's directory
    assert rc == 0
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == [
        "step000001-batch.pt", "step000001-checkpoint.pt", "step000001-event.json"]
    assert not (tmp_path / "nan-captures").exists()


def test_a_module_runs_with_dash_m_from_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN trainmod.py in the current directory (python -m trainmod finds it there)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trainmod.py").write_text(LOOP.format(loss="model(x).pow(2).mean()", tail="import sys; print(sys.argv[1:])"))
    before = _patched_state()
    # WHEN nanhunt run -m trainmod runs it with its arguments
    rc = cli_main(["run", "-m", "trainmod", "--lr", "3"])
    out, err = capsys.readouterr()
    # THEN it ran as __main__ with its own arguments, watched, and the process is as it was
    assert rc == 0 and out == "['--lr', '3']\n"
    assert ("nanhunt run: trainmod.py finished; a training loop was watched: 3 steps were checked and no non-finite "
            "value was seen") in err
    assert _patched_state() == before
    sys.modules.pop("trainmod", None)


# ---------------------------------------------------------------------- how a run ends, and what is said then

NAN_AT_1 = """
import torch
from torch import nn
model = nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(4, 2), torch.randn(4, 1)
for step in range(3):
    loss = torch.nn.functional.mse_loss(model(x), y) * (float("nan") if step == 1 else 1.0)
    loss.backward()
    {at_1}
    opt.step()
    opt.zero_grad()
    print("step", step)
"""


def test_ctrl_c_in_an_open_step_is_an_interrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a loop whose step 1 has a NaN loss and is interrupted (Ctrl-C) after its backward
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, NAN_AT_1.format(at_1="if step == 1: raise KeyboardInterrupt"))
    before, argv, path = _patched_state(), sys.argv, sys.path
    # WHEN it runs under nanhunt run
    rc = cli_main(["run", str(script)])
    out, err = capsys.readouterr()
    # THEN it ends as an interrupt (130), not as a detection: the open step was not checked, nothing was written
    assert rc == 130
    assert out == "step 0\n"
    assert err.strip().splitlines()[-1] == "nanhunt: interrupted; the model and files were left as they were"
    assert "nanhunt: error" not in err and "non-finite" not in err
    assert not (tmp_path / "nan-captures").exists()
    # AND the process is as it was: every patch out, the very argv and path lists back
    assert _patched_state() == before and sys.argv is argv and sys.path is path


def test_the_scripts_own_argv_and_path_lists_are_not_written_back_into(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a script that keeps its sys.argv and sys.path lists
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, "import sys, builtins\nbuiltins.kept = (sys.argv, sys.path)\n")
    argv, path = sys.argv, sys.path
    try:
        assert cli_main(["run", str(script), "--lr", "3"]) == 0
        import builtins

        kept_argv, kept_path = builtins.kept  # type: ignore[attr-defined]
        del builtins.kept  # type: ignore[attr-defined]
    finally:
        capsys.readouterr()
    # THEN the process has its own lists back, and the script's still hold what it was given
    assert sys.argv is argv and sys.path is path
    assert kept_argv == [str(script), "--lr", "3"] and kept_path[0] == str(tmp_path)


def test_a_failure_while_attaching_leaves_nothing_attached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a torch whose GradScaler has no `update` of its own: attaching fails after some patches were made
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, "print('ran')\n")
    before = _patched_state()
    monkeypatch.delattr(torch.amp.GradScaler, "update")
    # WHEN nanhunt run attaches
    with pytest.raises(KeyError):
        cli_main(["run", str(script)])
    monkeypatch.undo()
    # THEN the patches made before the failure are taken out again
    assert _patched_state() == before


def test_detections_whose_capture_failed_are_not_said_to_be_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a loop with a NaN loss at step 1, recorded only (--on-fail continue), and a dump dir that is a file
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    script = _script(tmp_path, NAN_AT_1.format(at_1="pass"))
    rc = cli_main(["run", "--on-fail", "continue", "--dump-dir", str(tmp_path / "a-file"), str(script)])
    err = capsys.readouterr().err
    # THEN the detection is said, with why there is no capture, and never that nothing non-finite was seen
    assert rc == 0
    assert "nanhunt run: nanhunt.Guard: non-finite loss at step 1; no capture: " in err
    assert "no non-finite value was seen" not in err


TRAINER = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
data = [{{"input_ids": torch.arange(8), "labels": torch.arange(8)}} for _ in range(8)]
args = TrainingArguments(output_dir="out", report_to=[], use_cpu=True, max_steps=2, per_device_train_batch_size=4,
                         save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
{train}
"""


@pytest.mark.parametrize("train,said", [
    ("", "watched nothing in train.py: transformers.Trainer was made but no training step ran; nothing was checked"),
    ("trainer.train()", "train.py finished; transformers.Trainer was watched: 2 steps were checked and no "
                        "non-finite value was seen"),
], ids=["never_trained", "trained"])
def test_what_a_trainer_run_checked_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str], train: str, said: str) -> None:
    # GIVEN a script that makes a Trainer and trains it for 2 steps, or never trains it
    monkeypatch.chdir(tmp_path)
    assert cli_main(["run", str(_script(tmp_path, TRAINER.format(train=train)))]) == 0
    # THEN what nanhunt checked is said: the steps the Trainer's run took, or nothing
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"nanhunt run: {said}"


@pytest.mark.parametrize("option,message", [
    (("--max-consecutive-skips", "0"), "--max-consecutive-skips must be >= 1"),
    (("--snapshot-every", "0"), "--snapshot-every must be >= 1"),
])
def test_a_bad_option_is_refused_before_the_script_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str], option: tuple[str, ...],
                                                       message: str) -> None:
    # GIVEN a loop with a NaN loss at step 1, and an option value nanhunt.Guard does not take
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, NAN_AT_1.format(at_1="pass"))
    rc = cli_main(["run", *option, str(script)])
    out, err = capsys.readouterr()
    # THEN nanhunt refuses it in one line with exit 2, and the script never ran unwatched
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"nanhunt: error: bad option for nanhunt run: {message}"]


AUTOMATIC = """
import lightning as L, torch
from torch import nn

class Auto(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def training_step(self, batch, i):
        return self.fc(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False).fit(Auto(), data)
"""


def test_only_the_callbacks_refusals_leave_a_run_unwatched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a Lightning callback whose start fails with a ValueError that is no refusal (a bug of nanhunt's)
    import nanhunt.integrations.lightning as nl

    def broken(module: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(nl, "_hyperparameters", broken)
    monkeypatch.chdir(tmp_path)
    rc = cli_main(["run", str(_script(tmp_path, AUTOMATIC))])
    err = capsys.readouterr().err
    # THEN it is not said as a run nanhunt cannot watch: it surfaces
    assert rc == 1
    assert "ValueError: a bug" in err
    assert "did not watch" not in err


def test_an_input_error_of_the_script_is_the_scripts_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a script, in a folder named like nanhunt's own, that raises nanhunt.InputError itself
    folder = tmp_path / "nanhunt" / "integrations"
    folder.mkdir(parents=True)
    script = folder / "train.py"
    script.write_text("import nanhunt\nraise nanhunt.InputError('the script says no')\n")
    monkeypatch.chdir(tmp_path)
    rc = cli_main(["run", str(script)])
    err = capsys.readouterr().err
    # THEN it is the script's failure, printed as Python prints it, not nanhunt's one line
    assert rc == 1
    assert "Traceback" in err and "InputError: the script says no" in err
    assert "nanhunt: error" not in err
