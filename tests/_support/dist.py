"""Two-process (gloo) tests: start the ranks in spawned processes, bound them in time, read what each wrote."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(target: Callable[..., None], args: Callable[[int, int], tuple[Any, ...]], *, timeout: float,
              world: int = 2) -> None:
    """``target(*args(rank, port))`` in ``world`` spawned processes, all bounded by ``timeout``: a rank left
    waiting in a collective would hang, so one still running then is killed and the test fails."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=args(r, port)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not hung, f"rank(s) {hung} still running after {timeout}s: a rank was left in a collective"


def rank_results(out: Path, world: int = 2) -> dict[int, dict[str, Any]]:
    """Each rank's ``rank{R}.json`` in ``out``; fails on a rank that reported an error."""
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}
    for res in results.values():
        assert "error" not in res, res["error"]
    return results


def torchrun(args: list[str], *, cwd: Path, nproc: int = 2, timeout: float = 400,
             launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node N [launcher options] ARGS`` (the repository on PYTHONPATH, one
    thread per rank), bounded: about 20 s on an idle machine, several times that when the 2 cores are shared;
    a rank left waiting in a collective would hang, and a timeout fails with what the ranks said."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           *launcher, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        said = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"torchrun did not finish in {e.timeout} s; its stderr ended with:\n{said[-3000:]}")


def finish_rank(out: str, rank: int, res: dict[str, Any]) -> None:
    """A worker rank's last act (in its ``finally``): its result into ``out/rank{R}.json``, which
    :func:`rank_results` reads, then its process group torn down."""
    import torch.distributed as dist

    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(res, fh)
    if dist.is_initialized():
        dist.destroy_process_group()


def meet_again(res: dict[str, Any]) -> None:
    """A last collective once a rank's loop is over (``res["after"]``: the world size): a rank that had not
    stopped would leave the others waiting here, and the test's bound would fail it."""
    import torch
    import torch.distributed as dist

    flag = torch.ones(1)
    dist.all_reduce(flag)
    res["after"] = float(flag)
