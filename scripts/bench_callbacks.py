#!/usr/bin/env python3
"""What the framework callbacks and ``nanhunt run`` cost on a clean run: a ``transformers.Trainer``, a Lightning
``Trainer`` and a hand-written loop, each with and without nanhunt.

    ./.venv/bin/python scripts/bench_callbacks.py --threads 1              # both frameworks, float32 steps
    ./.venv/bin/python scripts/bench_callbacks.py --only transformers --bf16
    ./.venv/bin/python scripts/bench_callbacks.py --via run --threads 1    # as `nanhunt run` attaches (also the loop)

``--via callback`` (default) passes ``NanhuntCallback`` to the Trainer; ``--via run`` attaches nanhunt as
``nanhunt run train.py`` does (nothing in the script: the import watch adds the callback to every Trainer made, and a
hand-written loop is found from its optimizer), installed for the run's rounds only. The loop workload (``plain``:
the MLP below, Adam, ``zero_grad``/forward/``mse_loss``/backward/``step``) runs with ``--via run`` only.

Workloads: a tiny GPT-2 (config built in code: 2 layers, width 64) under ``transformers.Trainer`` (AdamW), and a
small MLP LightningModule under ``lightning.Trainer`` (Adam). A step is timed from the framework's first per-step
event to its last one (a timing callback placed before and one after ``NanhuntCallback``, so the callback's own
work at both ends is inside the time): forward, backward, the optimizer step and the callback's checks; data
loading and logging are outside. The two runs of a framework (with, without the callback) alternate in rounds of
``--chunk`` steps, so drift and noise from other processes hit both alike; the first ``--skip`` steps of each
round are not counted. The ratio is the median step time with the callback over the median without, with the
p25-p75 of the per-round ratios. Half precision is off by default: on CPUs without native bfloat16 a bf16 step is
many times slower and would hide the callback's cost (``--bf16`` runs it anyway; the printout says which ran).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class _Clock:
    """Per-step times from a start mark and an end mark, in seconds."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.times: list[float] = []

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        self.times.append(time.perf_counter() - self.t0)


def _transformers_run(with_callback: bool, args: argparse.Namespace, dump: str) -> Callable[[], list[float]]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from nanhunt.integrations.transformers import NanhuntCallback

    clock = _Clock()

    class Start(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.start()

    class End(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.stop()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (args.chunk * 8, 32), generator=g)
    data = [{"input_ids": r, "labels": r} for r in ids]
    callbacks: list[Any] = [Start()]
    if with_callback and args.via == "callback":
        callbacks.append(NanhuntCallback(dump_dir=dump))
    targs = TrainingArguments(output_dir=os.path.join(dump, "out"), max_steps=args.chunk, per_device_train_batch_size=8,
                              report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                              bf16=args.bf16, logging_strategy="no", dataloader_num_workers=0)

    def round_() -> list[float]:
        clock.times = []
        with _attached(with_callback and args.via == "run", dump):
            trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
            trainer.add_callback(End())  # after nanhunt's: its work at the step's end is inside the time
            trainer.train()
        return clock.times[args.skip:]

    return round_


def _lightning_run(with_callback: bool, args: argparse.Namespace, dump: str) -> Callable[[], list[float]]:
    import lightning.pytorch as pl

    from nanhunt.integrations.lightning import NanhuntCallback

    clock = _Clock()

    class Start(pl.Callback):
        def on_train_batch_start(self, *a: Any, **k: Any) -> None:
            clock.start()

    class End(pl.Callback):
        def on_train_batch_end(self, *a: Any, **k: Any) -> None:
            clock.stop()

    torch.manual_seed(0)
    module = _lightning_module()
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(args.chunk * 32, 64, generator=g),
                                        torch.randn(args.chunk * 32, 8, generator=g))
    loader = torch.utils.data.DataLoader(ds, batch_size=32)
    callbacks: list[Any] = [Start()]
    if with_callback and args.via == "callback":
        callbacks.append(NanhuntCallback(dump_dir=dump))

    def round_() -> list[float]:
        clock.times = []
        with _attached(with_callback and args.via == "run", dump):
            trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.chunk, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 precision="bf16-mixed" if args.bf16 else "32-true", callbacks=list(callbacks),
                                 default_root_dir=dump)
            trainer.callbacks.append(End())  # after nanhunt's
            trainer.fit(module, loader)
        return clock.times[args.skip:]

    return round_


def _lightning_module() -> Any:
    """The module, of a class defined at module level (the callback's capture names it)."""
    global LitMLP
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch import nn

    class LitMLP(pl.LightningModule):  # type: ignore[no-redef]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    LitMLP.__qualname__ = "LitMLP"
    return LitMLP()


LitMLP: Any = None


class PlainMLP(torch.nn.Module):
    """The hand-written loop's model (module level: a capture names it)."""

    def __init__(self) -> None:
        super().__init__()
        from torch import nn

        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def _plain_run(with_callback: bool, args: argparse.Namespace, dump: str) -> Callable[[], list[float]]:
    """A hand-written loop (bf16 autocast and a GradScaler with --bf16), timed from zero_grad to the update."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = PlainMLP()
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(args.chunk, 32, 64, generator=g), torch.randn(args.chunk, 32, 8, generator=g)

    def round_() -> list[float]:
        times: list[float] = []
        with _attached(with_callback, dump):
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # made under the watch, as in a script
            scaler = torch.amp.GradScaler("cpu", enabled=args.bf16)
            for x, y in zip(xs, ys):
                t0 = time.perf_counter()
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                    loss = F.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                times.append(time.perf_counter() - t0)
        return times[args.skip:]

    return round_


@contextlib.contextmanager
def _attached(on: bool, dump: str) -> Any:
    """nanhunt attached as ``nanhunt run`` attaches it (``on``), for the block only."""
    if not on:
        yield
        return
    from nanhunt.integrations._attach import Attached, AttachOptions

    attached = Attached(AttachOptions(dump)).install()
    try:
        yield
    finally:
        attached.close()


def _bench(name: str, make: Callable[[bool, argparse.Namespace, str], Callable[[], list[float]]],
           args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as dump_plain, tempfile.TemporaryDirectory() as dump_cb:
        runs = {False: make(False, args, dump_plain), True: make(True, args, dump_cb)}
        times: dict[bool, list[float]] = {False: [], True: []}
        per_round: list[float] = []
        for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
            got = {}
            for flag in ((False, True) if r % 2 else (True, False)):
                got[flag] = runs[flag]()
            if r:
                times[False] += got[False]
                times[True] += got[True]
                per_round.append(statistics.median(got[True]) / statistics.median(got[False]))
        if os.path.isdir(os.path.join(dump_cb)) and [f for f in os.listdir(dump_cb) if f.endswith(".pt")]:
            print(f"warning: the callback wrote a capture on a clean {name} run", file=sys.stderr)
    plain, cb = statistics.median(times[False]), statistics.median(times[True])
    q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [per_round[0]] * 3
    return {"plain_ms": plain * 1e3, "callback_ms": cb * 1e3, "ratio": cb / plain, "p25": q[0], "p75": q[2],
            "steps": float(len(times[False]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("transformers", "lightning", "plain"))
    p.add_argument("--via", choices=("callback", "run"), default="callback",
                   help="attach nanhunt as the callback given to the Trainer, or as `nanhunt run` does")
    p.add_argument("--rounds", type=int, default=8, help="counted rounds per run (each alternates the two runs)")
    p.add_argument("--chunk", type=int, default=25, help="steps per round")
    p.add_argument("--skip", type=int, default=3, help="first steps of each round not counted")
    p.add_argument("--bf16", action="store_true", help="bf16 steps (bf16=True / precision='bf16-mixed')")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning", "lightning.pytorch", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    todo = {"transformers": _transformers_run, "lightning": _lightning_run}
    if args.via == "run":
        todo["plain"] = _plain_run
    print(f"{'bf16' if args.bf16 else 'float32'} steps, threads {torch.get_num_threads()}, {args.rounds} rounds of "
          f"{args.chunk} steps (first {args.skip} of each not counted), runs alternated, nanhunt via {args.via}")
    print(f"{'framework':<14} {'plain ms':>9} {'nanhunt ms':>12} {'extra ms':>9} {'ratio':>7} {'p25-p75 of rounds':>18}")
    for name, make in todo.items():
        if args.only and name != args.only:
            continue
        r = _bench(name, make, args)
        # the extra time a step takes is what a larger step pays too: the ratio shrinks as the step grows
        print(f"{name:<14} {r['plain_ms']:>9.3f} {r['callback_ms']:>12.3f} {r['callback_ms'] - r['plain_ms']:>9.3f} "
              f"{r['ratio']:>7.3f} {r['p25']:>8.3f}-{r['p75']:<8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
