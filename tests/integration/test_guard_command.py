"""The replay command a Guard prints works when pasted as printed: names defined in the
training script (``__main__``) are recorded by the script's path, local modules and plain functions are
confirmed in the command, and a replay missing several confirmations lists them all at once."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nanhunt.capture.capture import save_capture
from nanhunt.cli import main as cli_main
ROOT = Path(__file__).resolve().parents[2]

# A training script as users write it: its model and loss live in the script, its loop runs at the top level
# (no `if __name__ == "__main__":`), and every run appends to runs.txt. Step 2's batch overflows float16 entering fc1.
SCRIPT = textwrap.dedent("""
    import json, torch
    from torch import nn
    import nanhunt
    {imports}

    EPS = 1e-6

    {definitions}

    with open("runs.txt", "a") as f:
        f.write("run\\n")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    guard = nanhunt.Guard(model, opt, scaler, dump_dir="nan", loss_fn={loss})
    for i in range(4):
        x = torch.randn(4, 8) * (3e4 if i == 2 else 1.0)
        y = torch.randn(4, 2)
        try:
            with guard.step((x, y)):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = guard.loss({loss}(model(x), y))
                scaler.scale(loss).backward()
                guard.check_grads()
                scaler.step(opt)
                scaler.update()
        except nanhunt.GuardError as e:
            with open("event.txt", "w") as f:
                json.dump({{"command": e.event.replay_command(), "describe": e.event.describe()}}, f)
            break
""")

NET = textwrap.dedent("""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 64)
            self.fc2 = nn.Linear(64, 2)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))
""")

LOSS = textwrap.dedent("""
    def my_loss(out, y):
        return ((out.float() - y) ** 2).mean() + EPS
""")


def _train(where: Path, **parts: str) -> dict[str, str]:
    (where / "train.py").write_text(SCRIPT.format(**parts))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py"], cwd=where, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got: dict[str, str] = json.loads((where / "event.txt").read_text())
    return got


def _run_as_printed(command: str, where: Path) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    assert argv[:2] == ["nanhunt", "replay"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "nanhunt", *argv[1:], "--no-bisect"], cwd=where, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.subprocess
def test_names_defined_in_the_script_replay_with_the_printed_command(tmp_path: Path) -> None:
    # GIVEN a script whose model and loss are defined in it (__main__) and whose loop runs at the top level
    event = _train(tmp_path, imports="", definitions=NET + LOSS, loss="my_loss")
    script = str(tmp_path / "train.py")
    # THEN the printed command confirms both names by the script's path
    assert event["command"] == (f"nanhunt replay nan/step000002-checkpoint.pt nan/step000002-batch.pt "
                                f"--model {script}:Net --loss {script}:my_loss")
    # WHEN it is run as printed, from the directory the script ran in
    proc = _run_as_printed(event["command"], tmp_path)
    # THEN it names the culprit, and the script's training did not run again
    assert proc.returncode == 1, proc.stderr[-2000:]
    # (the batch's 8.9e4 does not fit float16: autocast's cast into fc1 overflows)
    assert proc.stdout.splitlines()[0] == "Inf born in phase forward, in fc1 (Linear, call 0) at aten::_to_copy."
    assert (tmp_path / "runs.txt").read_text() == "run\n"


@pytest.mark.subprocess
def test_a_local_module_and_a_plain_function_are_confirmed_in_the_command(tmp_path: Path) -> None:
    # GIVEN the model class in model.py beside the script (not installed) and the loss a plain function there
    (tmp_path / "model.py").write_text("import torch\nfrom torch import nn\nEPS = 1e-6\n" + NET + LOSS)
    event = _train(tmp_path, imports="from model import Net, my_loss", definitions="", loss="my_loss")
    # THEN both need a confirmation, and the command carries them, the module named by its file (so that the
    # command works pasted in another directory, where `model` is no importable name)
    module = tmp_path / "model.py"
    assert event["command"].endswith(f" --model {module}:Net --loss {module}:my_loss"), event["command"]
    proc = _run_as_printed(event["command"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "Inf born in phase forward, in fc1 (Linear, call 0) at aten::_to_copy."


@pytest.mark.subprocess
def test_a_replay_without_the_confirmations_lists_them_all_at_once(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the capture of the script above, replayed without the confirmations
    event = _train(tmp_path, imports="", definitions=NET + LOSS, loss="my_loss")
    argv = shlex.split(event["command"])[2:4]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = cli_main(["replay", *argv, "--no-bisect"])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err.strip().splitlines()
    # THEN one error line names both missing confirmations, with the flags to pass
    script = str(tmp_path / "train.py")
    assert code == 2
    assert len(err) == 1, err
    assert f"pass --model {script}:Net --loss {script}:my_loss" in err[0]
    assert "model factory" in err[0] and "loss function" in err[0]


def test_a_script_name_is_never_imported_from_the_file_alone(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture whose loss names a script that would write a file if its definitions ran
    hostile = tmp_path / "evil.py"
    hostile.write_text("open(%r, 'w').write('ran')\ndef loss(o, t):\n    return o.sum()\n"
                       % str(tmp_path / "ran.txt"))
    model = torch.nn.Linear(2, 2)
    save_capture(tmp_path / "ck.pt", tmp_path / "bt.pt", model=model, batch=(torch.ones(1, 2), torch.ones(1, 2)),
                 loss_fn=torch.nn.MSELoss())
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    ck["loss_fn"] = f"{hostile}:loss"
    torch.save(ck, tmp_path / "ck.pt")
    # WHEN it is replayed unconfirmed
    code = cli_main(["replay", str(tmp_path / "ck.pt"), str(tmp_path / "bt.pt"), "--no-bisect"])
    err = capsys.readouterr().err
    # THEN it is refused with the confirmation to pass, and nothing of the script ran
    assert code == 2
    assert f"pass --loss {hostile}:loss to confirm" in err
    assert not (tmp_path / "ran.txt").exists()


def test_a_confirmed_script_runs_only_its_definitions(tmp_path: Path) -> None:
    from nanhunt.capture._names import load_script

    # GIVEN a script that trains at its top level in every way a script does, around a loss and a constant
    ran = tmp_path / "ran.txt"
    (tmp_path / "train.py").write_text(textwrap.dedent(f"""
        import os
        try:
            import json
        except ImportError:
            json = None
        EPS = 1e-6
        def mark(what):
            with open({str(ran)!r}, "a") as f:
                f.write(what + "\\n")
            return what
        def my_loss(out, y):
            return ((out - y) ** 2).mean() + EPS
        model = mark("model built")
        history = mark("fit")
        if os.environ.get("NEVER_SET_X") is None:
            mark("if")
        for _ in range(1):
            mark("loop")
        with open(os.devnull) as _f:
            mark("with")
        mark("call")
        if __name__ == "__main__":
            mark("main")
    """))
    # WHEN it is loaded for a confirmed name
    module = load_script(str(tmp_path / "train.py"))
    # THEN its definitions are there, and none of its training ran
    assert module.my_loss(torch.ones(2), torch.zeros(2)).item() == pytest.approx(1.0 + 1e-6)
    assert module.json is not None and not hasattr(module, "model") and not hasattr(module, "history")
    assert not ran.exists()
