"""Runs a seeded corpus of hostile captures through nanhunt's commands in this one process and writes what happened.

``python tests/security/corpus_driver.py WORK SEED``: builds the corpus under ``WORK/corpus`` (every kind of file a
stranger could attach to a ticket, each drawn with sizes and variants from ``SEED``), then runs each case through
``nanhunt.cli.main`` the way a user would, and writes ``WORK/results.json``: per case its exit code, its stderr, the
package modules it imported, and what the file system, the network and the payloads' markers saw. A crash of the
process (a segfault) leaves ``WORK/running`` naming the case. Run by tests/security/test_hostile_corpus.py.

A payload proves it ran by writing a file into ``WORK/markers``; every socket connection is refused and written to
``WORK/markers/network``; the file system outside ``WORK/out`` is listed (size and modification time) before and
after each case.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import socket
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("NANHUNT_TRUST_NAMES", None)  # the rule as a user meets it

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import nanhunt  # noqa: E402
from nanhunt.cli import main  # noqa: E402
from tests._support.peak import own_peak_bytes  # noqa: E402
from tests.security import hostile  # noqa: E402

WORK = Path(sys.argv[1]).resolve()
SEED = int(sys.argv[2])
CORPUS, OUT, MARKERS, SITE = WORK / "corpus", WORK / "out", WORK / "markers", WORK / "site"
PACKAGE = "nhcorpus_lib"  # a library "installed" for this run (its folder is on sys.path, as site-packages is)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    with open(MARKERS / "network", "a") as f:
        f.write(repr(args[1:2]) + "\n")
    raise OSError("network disabled by the hostile corpus")


def _install_library() -> None:
    """A package whose import, constructors and functions each write a marker: nothing of it may run."""
    pkg = SITE / PACKAGE
    pkg.mkdir(parents=True)
    mark = f"open({str(MARKERS)!r} + '/' + {{!r}}, 'w').close()"
    (pkg / "__init__.py").write_text(mark.format("imported") + "\n")
    (pkg / "__main__.py").write_text(mark.format("main-ran") + "\n")
    (pkg / "models.py").write_text(textwrap.dedent(f"""\
        import torch
        {mark.format("models-imported")}

        class Net(torch.nn.Linear):
            def __init__(self, *args, **kwargs):
                {mark.format("constructed")}
                super().__init__(4, 2)

        class Opt(torch.optim.SGD):
            def __init__(self, *args, **kwargs):
                {mark.format("optimizer-built")}
                super().__init__(*args, **kwargs)

        def loss(output, target):
            {mark.format("loss-called")}
            return torch.nn.functional.mse_loss(output, target)
        """))
    sys.path.insert(0, str(SITE))


# ------------------------------------------------------------------ the corpus
def _capture(where: Path, **fields: Any) -> tuple[str, str]:
    """A tiny capture (torch.nn:Linear 4 -> 2, SGD, mse_loss) with ``fields`` of its checkpoint replaced."""
    where.mkdir(parents=True)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ck, bt = str(where / "checkpoint.pt"), str(where / "batch.pt")
    nanhunt.save_capture(ck, bt, model=model, batch=(torch.randn(3, 4), torch.randn(3, 2)), loss_fn=F.mse_loss,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), model_factory="torch.nn:Linear",
                         model_kwargs={"in_features": 4, "out_features": 2})
    if fields:
        data = torch.load(ck, weights_only=True)
        data.update(fields)
        torch.save(data, ck)
    return ck, bt


Case = tuple[str, list[str]] | tuple[str, list[str], int]  # name, argv, the exit code when not 2


def _names(rng: random.Random) -> list[Case]:
    """Names of code: a library's class, function and optimizer, programs' __main__ modules."""
    cases = []
    mains = [f"{PACKAGE}.__main__:X", "tqdm.__main__:X", "certifi.__main__:X", "numpy.f2py.__main__:X"]
    for i, (field, name) in enumerate([
        ("model_factory", f"{PACKAGE}.models:Net"),
        ("model_factory", rng.choice(mains)),
        ("loss_fn", f"{PACKAGE}.models:loss"),
        ("loss_fn", rng.choice(mains)),
        ("optimizer_class", f"{PACKAGE}.models:Opt"),
        ("model_factory", "torchmetrics.multimodal.clip_score:CLIPScore"),
    ]):
        kwargs: dict[str, Any] = {field: name}
        if "CLIPScore" in name:  # would ask the hub, or run a config's remote code from a folder
            kwargs["model_kwargs"] = {"model_name_or_path": str(CORPUS / "remote")}
        ck, bt = _capture(CORPUS / f"name{i}", **kwargs)
        cases.append((f"name {field}={name}", ["replay", ck, bt, "--no-bisect"]))
    return cases


def _sizes(rng: random.Random) -> list[Case]:
    """Small files that grow or recurse: deep keys, many lists, zeros, overlapping zip members, huge shapes."""
    cases = []
    d = CORPUS / "sizes"
    d.mkdir()
    ck, bt = _capture(CORPUS / "plain")
    files = {
        "deep": hostile.deep_pickle(rng.choice([2_000, 100_000, 1_000_000])),
        "lists": hostile.many_lists(rng.choice([2_000_000, 8_000_000])),
        "zeros": hostile.zero_storage_batch(rng.choice([512, 1024])),
        "overlap": hostile.overlapping_zip(rng.randint(8, 32), mib=rng.choice([256, 1024])),
    }
    for name, data in files.items():
        path = d / f"{name}.pt"
        path.write_bytes(data)
        role = rng.choice(["checkpoint", "batch"]) if name != "zeros" else "batch"
        argv = ["replay", str(path), bt] if role == "checkpoint" else ["replay", ck, str(path)]
        cases.append((f"{name} as {role}", [*argv, "--no-bisect"]))
        if role == "checkpoint":
            cases.append((f"{name} inspected", ["inspect", str(path)]))
    (d / "big.json").write_bytes(hostile.big_json(rng.choice([80, 99])))
    cases.append(("big json report", ["report", str(d / "big.json"), "-o", str(OUT / "big.md")]))
    n = rng.choice([18_000, 25_000])
    ck2, bt2 = _capture(CORPUS / "huge", model_kwargs={"in_features": n, "out_features": n})
    cases.append((f"Linear {n} x {n} over a 4 x 4 weight", ["replay", ck2, bt2, "--no-bisect"]))
    return cases


def _directories(rng: random.Random) -> list[Case]:
    """A capture directory whose files link outside it; a bundle directory of the user's own files."""
    from tests._support.capture_dir import one_rank_capture

    cases = []
    secret = CORPUS / "outside" / "secret.json"
    secret.parent.mkdir(parents=True)
    secret.write_text(json.dumps({"secret": "@everyone https://evil.example"}))
    linked = one_rank_capture(CORPUS / "linked")
    which = rng.choice(["event", "manifest"])
    target = linked / ("event-rank0.json" if which == "event" else "manifest.json")
    target.unlink(missing_ok=True)
    target.symlink_to(secret)
    if which == "event":  # the Guard's event is read only from a regular file: ignored, the replay runs clean
        cases.append(("capture directory with a linked event", ["replay", str(linked), "--no-bisect", "--report",
                                                                str(OUT / "linked.md")], 0))
    else:
        cases.append(("capture directory with a linked manifest", ["replay", str(linked), "--no-bisect"]))
    mine = CORPUS / "my-work"
    mine.mkdir()
    for name in ("repro.py", "report.md"):
        (mine / name).write_text(f"# the user's own {name}\n")
    ck, bt = _capture(CORPUS / "for-bundle")
    cases.append(("bundle into the user's directory", ["replay", ck, bt, "--bundle", str(mine)]))
    return cases


def _checkpoints(rng: random.Random) -> list[Case]:
    """The third campaign's inputs: a Trainer checkpoint whose files link outside it or ask for sizes before any
    check, a safetensors shape past int64, and a capture whose compile options reach a compiler's command line."""
    import struct

    from tests._support.hf import tiny_gpt2

    cases: list[Case] = []
    secret = CORPUS / "outside" / "weights.safetensors"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(b"@everyone https://evil.example " * 4)
    base = CORPUS / "trainer" / "checkpoint-1"
    tiny_gpt2().save_pretrained(base)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = CORPUS / "trainer" / "batch.pt"
    torch.save({"input_ids": ids, "labels": ids}, batch)

    def variant(name: str) -> Path:
        import shutil

        return Path(shutil.copytree(base, CORPUS / "trainer" / name / "checkpoint-1"))

    linked = variant("linked")
    which = rng.choice(["model.safetensors", "config.json"])
    (linked / which).unlink()
    (linked / which).symlink_to(secret if which.endswith("safetensors") else CORPUS / "outside" / "secret.json")
    cases.append((f"checkpoint with a linked {which}", ["replay", str(linked), str(batch), "--no-bisect"]))
    labels = variant("labels")
    config = json.loads((labels / "config.json").read_text())
    config["num_labels"] = rng.choice([50_000_000, 10**9])
    (labels / "config.json").write_text(json.dumps(config))
    cases.append(("checkpoint whose config asks for label maps of GB",
                  ["replay", str(labels), str(batch), "--no-bisect", "--dtype", "float32"]))
    fifo = variant("fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    cases.append(("checkpoint whose config.json is a FIFO", ["replay", str(fifo), str(batch), "--no-bisect"]))
    header = json.dumps({"x": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}).encode()
    shape = CORPUS / "shape.safetensors"
    shape.write_bytes(struct.pack("<Q", len(header)) + header)
    cases.append(("safetensors shape past int64 inspected", ["inspect", str(shape)]))
    payload = rng.choice([{"cpp.march": f"native '-wrapper' '/bin/sh,-c,touch {MARKERS / 'compiler-ran'}'"},
                          {"cpp.cxx": [None, str(CORPUS / "cc.sh")]}, {"trace.debug_dir": str(CORPUS / "debug")}])
    (CORPUS / "cc.sh").write_text(f"#!/bin/sh\ntouch {MARKERS / 'cc-ran'}\n")
    (CORPUS / "cc.sh").chmod(0o755)
    ck, bt = _capture(CORPUS / "compiled", compile={"backend": "inductor", "mode": None, "options": payload,
                                                    "dynamic": None})
    # the options are dropped with one warning and the step replays compiled without them: exit 0
    cases.append((f"capture compiled with options {sorted(payload)}", ["replay", ck, bt, "--no-bisect"], 0))
    return cases


def _listing() -> dict[str, tuple[int, int]]:
    seen = {}
    for base in (CORPUS, SITE, WORK / "cwd"):
        for p in base.rglob("*"):
            if "__pycache__" in p.parts:
                continue
            st = p.lstat()
            seen[str(p)] = (st.st_size, st.st_mtime_ns)
    return seen


def _run(name: str, argv: list[str], expected: int = 2) -> dict[str, Any]:
    (WORK / "running").write_text(name)
    before, modules = _listing(), set(sys.modules)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code: Any = main(argv)
        except BaseException as e:  # noqa: BLE001 - a traceback is what this corpus looks for
            code = f"raised {type(e).__name__}: {e}"[:300]
    after = _listing()
    return {
        "case": name, "argv": argv, "exit": code, "expected": expected, "stderr": err.getvalue(),
        "changed": sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)),
        "imported": sorted(m for m in set(sys.modules) - modules
                           if m.split(".")[0] in (PACKAGE, "tqdm", "certifi", "torchmetrics")
                           or m.endswith("__main__") and m != "__main__"),
        "markers": sorted(p.name for p in MARKERS.iterdir()),
    }


def run() -> None:
    rng = random.Random(SEED)
    for d in (CORPUS, OUT, MARKERS, WORK / "cwd"):
        d.mkdir(parents=True)
    _install_library()
    remote = CORPUS / "remote"  # a model folder whose config asks for remote code
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "evil.Model"}, "model_type": "x"}))
    (remote / "evil.py").write_text(f"open({str(MARKERS / 'remote-code')!r}, 'w').close()\n")
    builders: list[Callable[[random.Random], list[Case]]] = [_names, _sizes, _directories, _checkpoints]
    cases = [c for b in builders for c in b(rng)]
    socket.socket.connect = _refuse  # type: ignore[method-assign]
    socket.create_connection = _refuse  # type: ignore[assignment]
    os.chdir(WORK / "cwd")
    results = [_run(*case) for case in cases]
    (WORK / "running").unlink()
    peak = own_peak_bytes()  # since this process exec'd: its rusage would start at pytest's size
    (WORK / "results.json").write_text(json.dumps({"seed": SEED, "peak_bytes": peak, "out": str(OUT), "results": results}, indent=1))


if __name__ == "__main__":
    run()
