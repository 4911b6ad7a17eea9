"""The GPT training pattern people copy most (tests/user_scripts/nanogpt/): ``GPT(GPTConfig(**model_args))`` from a
sibling model.py (whose block comes from its own sibling layers.py), ``logits, loss = model(X, Y)``, settings as
module globals overridden by ``--key=value`` through ``exec(open('configurator.py').read())``, run from the
project's folder. Under ``nanhunt run`` with a learning rate far too high it stops where plain python first prints
a NaN loss, and the command it prints, pasted into a shell in another directory, names the module that overflowed."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tests" / "user_scripts" / "nanogpt"


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NANHUNT_TRUST_NAMES"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """The project as a user has it: cloned into a folder of its own, run from there."""
    where = tmp_path / "nanogpt"
    shutil.copytree(PROJECT, where, ignore=shutil.ignore_patterns("__pycache__"))
    return where


def _paste(command: str, cwd: Path, report: Path) -> tuple[int, dict[str, object], str]:
    argv = shlex.split(command)
    assert argv[:2] == ["nanhunt", "replay"]
    done = _python(["-m", "nanhunt", *argv[1:], "--report", str(report)], cwd)
    assert report.exists(), done.stderr[-3000:]
    return done.returncode, json.loads(report.read_text()), done.stderr


def test_nanogpt_run_stops_where_python_fails_and_its_command_works_from_elsewhere(project: Path,
                                                                                   tmp_path: Path) -> None:
    # GIVEN the plain run with a learning rate of 1e5: its first NaN loss is at iteration 2
    args = ["train.py", "--learning_rate=1e5", "--max_iters=6"]
    plain = _python(args, project)
    assert plain.returncode == 0, plain.stderr[-3000:]
    losses = [line for line in plain.stdout.splitlines() if line.startswith("iter ")]
    first_nan = next(i for i, line in enumerate(losses) if line.endswith(" nan"))
    assert first_nan == 2
    # WHEN it runs under nanhunt run
    done = _python(["-m", "nanhunt", "run", *args], project)
    # THEN it stops at that step, having printed the same losses before it
    assert done.returncode == 1, done.stderr[-3000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("iter ")] == losses[:first_nan]
    assert "nanhunt run: stopped train.py: nanhunt.Guard: non-finite loss at step 2" in done.stderr
    # AND the loss is known to be the model's own (the second element of what it returns), not unnameable code
    assert "cannot name" not in done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("nanhunt run: stopped"))
    command = "nanhunt replay " + line.split("nanhunt replay ", 1)[1]
    assert command.endswith(f"--model {project / 'model.py'}:GPT")
    ckpt = torch.load(shlex.split(command)[2], weights_only=True)
    assert ckpt["loss_at"] == [1]
    assert ckpt["model_init"] == {"args": [], "kwargs": {"config": {"dataclass": "model:GPTConfig", "fields": {
        "block_size": 32, "vocab_size": 96, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.1,
        "bias": True}}}, "how": "recorded when it was built"}
    # WHEN the printed command is pasted into a shell in another directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rc, report, _ = _paste(command, elsewhere, tmp_path / "r.json")
    # THEN it replays the step and names the attention whose scores overflowed, in the sibling layers.py
    assert rc == 1
    first = report["first"]
    assert isinstance(first, dict)
    assert (first["phase"], first["module"], first["module_class"]) == ("forward", "transformer.h.0.attn",
                                                                       "SelfAttention")
    assert str(first["source"]).startswith(f"{project / 'layers.py'}:")


GUARDED = '''
import torch
import nanhunt
from model import GPT, GPTConfig

torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8, dropout=0.1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e5)
guard = nanhunt.Guard(model, optimizer, dump_dir="caps")
data = torch.randint(0, 96, (512,), generator=torch.Generator().manual_seed(0))
for it in range(8):
    ix = torch.randint(len(data) - 8, (4,))
    x = torch.stack([data[i:i + 8] for i in ix])
    y = torch.stack([data[i + 1:i + 9] for i in ix])
    with guard.step((x, y)):
        logits, loss = model(x, y)
        guard.loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
'''


def test_a_guard_in_the_loop_records_the_config_and_its_command_replays_elsewhere(project: Path,
                                                                                  tmp_path: Path) -> None:
    # GIVEN a loop of the user's own beside model.py, with a Guard and no loss_fn or model_kwargs
    (project / "loop.py").write_text(GUARDED)
    done = _python(["loop.py"], project)
    # THEN no warning says the replay would fail, and the Guard stops the run with a command
    assert "GuardWarning" not in done.stderr, done.stderr[-3000:]
    assert "nanhunt.GuardError" in done.stderr or "GuardError" in done.stderr, done.stderr[-3000:]
    ckpt_path = next((project / "caps").glob("*-checkpoint.pt"))
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert ckpt["model_init"]["how"] == "read back from the model's attributes"
    assert ckpt["model_init"]["kwargs"]["config"]["fields"]["n_embd"] == 16
    event = json.loads(Path(str(ckpt_path)[: -len("checkpoint.pt")] + "event.json").read_text())
    command = shlex.join(["nanhunt", "replay", str(ckpt_path), str(ckpt_path).replace("checkpoint", "batch"),
                          *event["replay_args"]])
    assert event["replay_args"] == ["--model", f"{project / 'model.py'}:GPT"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # AND its command, pasted elsewhere, takes the loss from the model's (logits, loss) and replays the failure
    rc, report, _ = _paste(command, elsewhere, tmp_path / "r.json")
    assert rc == 1
    first = report["first"]
    assert isinstance(first, dict) and str(first["source"]).startswith(str(project))
