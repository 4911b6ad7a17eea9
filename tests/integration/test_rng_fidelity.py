"""The observer changes nothing: under ``nanhunt run`` (and with nanhunt's callbacks and the Guard) a run with
dropout draws the same random numbers as without it, so a clean run gives the same losses bit for bit and the
same saved weights, and a failing run fails at the step it fails at without nanhunt.

In process: torch's generator, Python's ``random`` and NumPy's global generator are where they were across
everything nanhunt does around a live run (making the callbacks and the Guard, its steps with headroom sampling
and snapshots, a detection writing its capture). As subprocesses: three scripts written for these tests
(tests/user_scripts/dropout_*.py: a nanoGPT-style loop, a transformers.Trainer script, a Lightning script), run
with ``python`` and under ``nanhunt run``."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from nanhunt.guard.guard import Guard
from nanhunt.integrations._run import check_values

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "user_scripts"



def _fingerprint() -> dict[str, Any]:
    """Where the script's generators stand: torch's (CPU), Python's ``random``, NumPy's global one."""
    _, keys, pos, *_ = np.random.get_state()
    return {"torch": torch.get_rng_state().numpy().tobytes(), "random": random.getstate(),
            "numpy": (keys.tobytes(), pos)}


def _moved(before: dict[str, Any]) -> list[str]:
    """The generators that moved since ``before``."""
    now = _fingerprint()
    return [k for k in before if now[k] != before[k]]


@pytest.fixture()
def seeded() -> Iterator[None]:
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_checking_a_callbacks_options_draws_no_random_number(seeded: None) -> None:
    # GIVEN seeded generators; WHEN nanhunt judges a callback's Guard options (as NanhuntCallback(...) does)
    before = _fingerprint()
    check_values({"on_fail": "raise", "snapshot_every": 2, "headroom_every": 1})
    # THEN no generator moved
    assert _moved(before) == []


def test_the_callbacks_are_made_without_drawing(seeded: None, tmp_path: Path) -> None:
    # GIVEN seeded generators; WHEN the transformers and the Lightning callbacks are made
    made = 0
    for module in ("nanhunt.integrations.transformers", "nanhunt.integrations.lightning"):
        try:
            callback = __import__(module, fromlist=["NanhuntCallback"]).NanhuntCallback
        except ImportError:
            continue
        before = _fingerprint()
        callback(dump_dir=str(tmp_path))
        # THEN no generator moved
        assert (module, _moved(before)) == (module, [])
        made += 1
    if not made:
        pytest.skip("neither transformers nor Lightning imports here")


@pytest.mark.parametrize("options", [{"headroom_every": 1}, {"snapshot_every": 1, "check_params": True},
                                     {"on_fail": "dump", "headroom_every": 1, "max_captures": 3}],
                         ids=["headroom", "snapshots", "detections"])
def test_the_guard_draws_nothing_around_the_loops_own_draws(seeded: None, tmp_path: Path,
                                                            options: dict[str, Any]) -> None:
    # GIVEN a model with dropout; the loop's own draws (its batches, dropout) come between nanhunt's calls
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    moved: list[str] = []

    def call(what: str, fn: Any, *args: Any) -> Any:
        before = _fingerprint()
        out = fn(*args)
        moved.extend(f"{what}: {name}" for name in _moved(before))
        return out

    # WHEN the Guard is made and watches steps (step 3's batch is NaN: a detection with on_fail="dump")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = call("Guard()", lambda: Guard(model, optimizer, dump_dir=str(tmp_path), loss_fn=nn.CrossEntropyLoss(),
                                              **options))
        for i in range(6):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            if i == 3 and options.get("on_fail") == "dump":
                x[0] = float("nan")
            ctx = guard.step((x, y))
            call(f"step {i} entry", ctx.__enter__)
            loss = nn.functional.cross_entropy(model(x), y)
            call(f"step {i} loss", guard.loss, loss)
            loss.backward()
            random.random(), np.random.random()  # the loop's own host draws
            if call(f"step {i} check_grads", guard.check_grads):  # on_fail="dump": a bad step is not taken
                call(f"step {i} update", optimizer.step)  # the Guard's optimizer hooks run inside it
            optimizer.zero_grad()
            call(f"step {i} exit", ctx.__exit__, None, None, None)
        call("close", guard.close)
    # THEN no call of nanhunt moved any generator
    assert moved == []
    if options.get("on_fail") == "dump":
        assert [e.step for e in guard.events if e.kind != "warning"] == [3]
        assert (tmp_path / "step000003-checkpoint.pt").exists()


# ---------------------------------------------------------------------------------------------- as a user runs it


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NANHUNT_TRUST_NAMES"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _losses(stdout: str) -> list[str]:
    """The script's ``step N loss HEX`` lines (a framework prints its own lines too)."""
    return [line for line in stdout.splitlines() if line.startswith("step ")]


def _first_bad(losses: list[str]) -> int:
    return next(i for i, line in enumerate(losses) if line.endswith((" nan", " inf")))


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert list(wa) == list(wb)
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and wa[k].shape == wb[k].shape, k
        assert wa[k].contiguous().view(torch.uint8).numpy().tobytes() == \
            wb[k].contiguous().view(torch.uint8).numpy().tobytes(), k


# script, its arguments, the argument that sets the learning rate, one that makes it fail, the framework's name
_SCRIPTS = {
    "loop": ("dropout_gpt_loop.py", ["--steps", "5"], "--lr", "1e5", "a training loop", None),
    "trainer": ("dropout_trainer.py", ["--max_steps", "4"], "--learning_rate", "1e10", "transformers.Trainer",
                "transformers"),
    "lightning": ("dropout_lightning.py", ["--max_steps", "5"], "--lr", "1e5", "Lightning", "lightning"),
}


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_SCRIPTS))
def test_a_clean_run_with_dropout_gives_the_same_losses_and_weights(kind: str, tmp_path: Path) -> None:
    script, args, _, _, watched_as, needs = _SCRIPTS[kind]
    if needs is not None:
        pytest.importorskip(needs)
    path = str(SCRIPTS / script)
    # GIVEN a seeded script with dropout, run with python and under nanhunt run, each saving its weights
    plain = _run([path, *args, "--out" if kind == "loop" else "--weights", str(tmp_path / "plain.pt")], tmp_path)
    under = _run(["-m", "nanhunt", "run", path, *args, "--out" if kind == "loop" else "--weights",
                  str(tmp_path / "under.pt")], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert under.returncode == 0, under.stderr[-3000:]
    assert f"{watched_as} was watched" in under.stderr
    # THEN every step's loss is the same to the last bit, and so is every saved weight
    assert _losses(under.stdout) == _losses(plain.stdout) and len(_losses(plain.stdout)) >= 4
    _same_weights(tmp_path / "plain.pt", tmp_path / "under.pt")


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_SCRIPTS))
def test_a_failing_run_stops_at_the_step_python_fails_at(kind: str, tmp_path: Path) -> None:
    script, args, lr, huge, _, needs = _SCRIPTS[kind]
    if needs is not None:
        pytest.importorskip(needs)
    path = str(SCRIPTS / script)
    # GIVEN the script with a learning rate far too high: with python its loss goes non-finite at step `bad`
    plain = _run([path, *args, lr, huge, "--out" if kind == "loop" else "--weights", str(tmp_path / "w.pt")],
                 tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    bad = _first_bad(_losses(plain.stdout))
    # WHEN it runs under nanhunt run
    under = _run(["-m", "nanhunt", "run", path, *args, lr, huge], tmp_path)
    # THEN nanhunt stops it at that step, on its loss, after the same losses as python's before it
    assert under.returncode == 1, under.stderr[-3000:]
    assert f"nanhunt.Guard: non-finite loss at step {bad};" in under.stderr, under.stderr[-3000:]
    assert _losses(under.stdout)[:bad] == _losses(plain.stdout)[:bad]


# ------------------------------------------------------------------------------------------ the second line


def test_a_preserved_block_puts_back_what_it_drew(seeded: None) -> None:
    from nanhunt._util._rng import preserve_rng

    # GIVEN seeded generators; WHEN code inside preserve_rng draws from each of them
    before = _fingerprint()
    with preserve_rng():
        torch.rand(3), random.random(), np.random.random(), nn.Linear(4, 4)
    # THEN all three are where they were
    assert _moved(before) == []
    # AND the per-step form puts back torch's only (Python's and NumPy's are not copied at every step)
    with preserve_rng(host=False):
        torch.rand(3), random.random(), np.random.random()
    assert _moved(before) == ["random", "numpy"]


def test_a_rollback_inside_a_preserved_block_keeps_the_generators_it_set(seeded: None) -> None:
    from nanhunt._util._rng import keep_rng, preserve_rng

    # GIVEN a block inside another; WHEN the inner code sets the generators on purpose (a rollback) and says so
    state = torch.get_rng_state()
    torch.rand(3)
    with preserve_rng():
        with preserve_rng(host=False):
            torch.set_rng_state(state)
            keep_rng()
    # THEN neither block undoes it; and a block opened after it puts back as before
    assert torch.equal(torch.get_rng_state(), state)
    with preserve_rng():
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_second_line_never_initialises_cuda() -> None:
    from nanhunt._util._rng import preserve_rng

    # GIVEN a process that has not initialised CUDA (whether or not it has a GPU)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        pytest.skip("CUDA was initialised earlier in this process")
    # WHEN a preserved block runs; THEN CUDA is still not initialised
    with preserve_rng():
        torch.rand(1)
    assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_inside_a_preserved_block_are_put_back() -> None:
    from nanhunt._util._rng import preserve_rng

    # GIVEN CUDA in use with a seeded generator
    torch.cuda.manual_seed_all(0)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(0)
    # WHEN a preserved block draws on the GPU (dropout on a CUDA tensor)
    with preserve_rng(host=False):
        torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
    # THEN the script's next draw is the one it would have made
    assert torch.equal(torch.rand(4, device="cuda"), expected)
