"""Private: ``torchrun --nproc-per-node N -m nanhunt replay DIR``, a capture directory replayed as it ran.

Every rank rebuilds the model, wraps it as the capture recorded (FSDP2: ``fully_shard`` on the same modules,
with the same options, ``manifest.json`` field ``fsdp``; DDP: ``DistributedDataParallel`` with the options of
field ``ddp``), loads its own shards of the model and optimizer state (FSDP2: ``torch.distributed.checkpoint.load``
through nanhunt's weights-only reader, ``_dcp.safe_reader``; DDP: the whole replicated state, read as the
one-process replay reads it) and replays its own batch from its own RNG state. Each trace gathers every rank's leading origin, so each
rank knows which rank went first; the bisection runs the same trials on every rank (rank 0 decides each
and sends it, each trial's finiteness is agreed). The ranks' reports are gathered: every rank holds the
report of the rank that went first, with every rank's part in its notes, and only rank 0 shows it.

Anything that can fail on one rank only (a missing batch file, a factory that raises) is agreed before the
next collective, so no rank waits on a collective another rank never reaches.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import _dcp
from .._util._errors import InputError
from .._util._files import write_file
from ..capture.capture import load_replay
from ._options import ReplayOptions
from .pipeline import hunt
from ..records import Occurrence, Report, Repro, Status
from ..tracing.tracer import Trace

__all__ = ["under_torchrun", "replay_ranks"]

TIMEOUT = timedelta(minutes=10)  # a rank that died leaves the others waiting this long at most
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "float64": torch.float64}
_T = TypeVar("_T")


def under_torchrun() -> bool:
    """Started by ``torchrun`` (or another launcher) with more than one rank."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def replay_ranks(path: str, *, batch: str | None, rank: int | None, options: ReplayOptions,
                 progress: Callable[[int, str], None] | None, command: str, show: Callable[[Report], int],
                 bundle: str | None = None) -> int:
    """This rank's part of the distributed replay of the capture directory ``path``. Rank 0 hands the report
    (the same on every rank) to ``show``, which returns the exit code; every rank returns that code, once rank 0
    is done (a launcher that stops the others when one exits then finds them all done)."""
    options.check_ranks()
    world, me = _env_int("WORLD_SIZE"), _env_int("RANK")
    local = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else me
    if batch is not None:
        raise InputError("under torchrun, nanhunt replay takes a capture directory the Guard wrote under FSDP2 or DDP "
                           "(nanhunt replay DIR); replay a checkpoint and a batch file in one process, without "
                           "torchrun")
    if rank is not None:
        raise InputError("under torchrun every rank replays its own batch: leave --rank out (it picks one rank's "
                           "batch for a replay in one process, without torchrun)")
    if not os.path.isdir(path):
        raise InputError(f"{path!r} is not a capture directory" + (
            "; under torchrun nanhunt replay takes the directory the Guard wrote under FSDP2 or DDP" if os.path.exists(path)
            else ": it does not exist; check the path"))
    man = _dcp.read_manifest(path)
    captured = int(man["world_size"])
    if captured != world:
        seen = _dcp.pick_rank(man, None, path)
        raise InputError(f"captured on {captured} ranks, run with --nproc-per-node {captured}, or without torchrun "
                           f"to replay rank {seen}'s batch in one process")
    layout = _layout(man, path)
    dev = _device(options.load.device, local)
    own_group = not dist.is_initialized()
    if own_group:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=TIMEOUT)
    try:
        if dist.get_world_size() != world:
            raise InputError(f"the process group holds {dist.get_world_size()} ranks but WORLD_SIZE says {world}; "
                               "start the replay with torchrun alone")
        ranks = _Ranks(me, world, dev)
        # this rank's device (under cuda, its own GPU); each rank replays eagerly (a compiled capture is said so)
        load = dataclasses.replace(options.load, device=str(dev), eager=True)
        if layout is None:  # DDP: every rank loads the whole state, then wraps (a collective: all loaded by then)
            loaded = ranks.together(lambda: load_replay(path, None, load, rank=me))
            step = dataclasses.replace(loaded.step, model=_ddp(loaded.step.model, _ddp_options(man, path), dev))
        else:
            loaded = ranks.together(lambda: load_replay(path, None, load, rank=me,
                                                        shard=lambda m: _wrap(m, layout, dev)))
            step = loaded.step
            _dcp.load_sharded(os.path.join(path, _dcp.STATE), step.model, step.optimizer)  # a collective: raises on all
        said = (f"capture of {world} ranks ({man['wrapper']}) replayed on {world} ranks under torchrun, each rank "
                "its own batch and RNG state")
        step = dataclasses.replace(step, notes=(said, *step.notes[1:]))
        report = hunt(step, level=options.level, allow=options.allow, prove=options.prove,
                      progress=progress if me == 0 else None, bundle=bundle, command=command, ranks=ranks,
                      event=loaded.event)
        code = ranks.finish(ranks.merged(report), show)
        if own_group:  # this process is nanhunt's command: it exits with ``code`` once the group is torn down
            _exit_with_the_others()
        # every rank done with every collective before any tears the group down: gloo aborts a process
        # (std::terminate) whose peer closes the connection while it is still being used; and every rank past
        # _exit_with_the_others before any exits
        dist.barrier()
        return code
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_the_others() -> None:
    """The exit protocol across ranks, once every rank agreed on the exit code (``_Ranks.finish``: rank 0 has shown
    the report and written its files) and before the barrier that lets any rank exit: what this rank said is
    flushed, and SIGTERM is ignored from here to the process's end.

    torchrun stops every rank still running (SIGTERM) as soon as its poll (0.1 s by default) sees one exit with a
    non-zero code, and after the barrier each rank only tears down (the process group, the interpreter), which takes
    its own time, seconds on a loaded machine. Ended by that signal, a rank's exit code would be -15 (or 143) for
    the agreed 1 or 3, and torchrun's summary would blame it; ignoring it, every rank exits with the agreed code.
    torchrun still ends a rank that hangs in its teardown (SIGKILL after its grace period, 30 s); a Ctrl-C still
    stops it. A SIGTERM before this point (a rank failed on its own) ends the rank as before."""
    sys.stdout.flush()
    sys.stderr.flush()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _env_int(name: str) -> int:
    text = os.environ.get(name, "0")
    try:
        return int(text)
    except ValueError:
        raise InputError(f"the environment variable {name}={text!r} is not a number; start the replay with "
                           "torchrun") from None


def _device(device: str | None, local: int) -> torch.device:
    """``--device``: cpu (default) or cuda, each rank on its own GPU (``LOCAL_RANK``)."""
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device} was given but no CUDA device is available here; use --device cpu")
        if dev.index is not None:
            raise InputError(f"--device {device}: under torchrun each rank takes the GPU of its LOCAL_RANK; give "
                               "--device cuda")
        if local >= torch.cuda.device_count():
            raise InputError(f"rank with LOCAL_RANK {local} has no GPU of its own ({torch.cuda.device_count()} "
                               "here); run at most one rank per GPU")
        return torch.device("cuda", local)
    if dev.type != "cpu":
        raise InputError(f"--device {device}: the distributed replay runs on cpu (gloo) or cuda (nccl)")
    return dev


# ------------------------------------------------------------- the wrapper
def _ddp_options(man: Mapping[str, Any], path: str) -> dict[str, bool]:
    """The manifest's ``ddp`` field, checked: the options ``DistributedDataParallel`` is built with again."""
    got = man.get("ddp", {})
    keys = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph")
    if not isinstance(got, dict) or not all(isinstance(got.get(k, False), bool) for k in keys):
        raise InputError(f"capture directory {path!r} is not a valid nanhunt capture: manifest.json field 'ddp' is "
                           f"{_dcp._short(got)}, expected the DDP options {', '.join(keys)} as true or false")
    return {k: bool(got.get(k, False)) for k in keys}


def _ddp(model: nn.Module, options: Mapping[str, bool], device: torch.device) -> nn.Module:
    """``model`` wrapped in ``DistributedDataParallel`` as in training (its gradients averaged over the ranks)."""
    from torch.nn.parallel import DistributedDataParallel

    static = options.get("static_graph", False)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  find_unused_parameters=options.get("find_unused_parameters", False),
                                  gradient_as_bucket_view=options.get("gradient_as_bucket_view", False))
    if static:
        ddp._set_static_graph()  # type: ignore[no-untyped-call]  # untyped in torch
    return ddp


def _layout(man: Mapping[str, Any], path: str) -> list[dict[str, Any]] | None:
    """The manifest's ``fsdp`` field, checked (the manifest came with the capture: untrusted); None for DDP."""
    where = f"capture directory {path!r}"
    if man["wrapper"] == "ddp":
        _ddp_options(man, path)  # judged before any process group is made
        return None
    if man["wrapper"] != "fsdp2":
        raise InputError(f"{where} was written under {man['wrapper']}, which the distributed replay does not "
                           "rebuild; replay it in one process, without torchrun")
    layout = man.get("fsdp")
    if layout is None:
        raise InputError(f"{where} does not record which modules fully_shard wrapped (written by an earlier "
                           "nanhunt); replay it in one process, without torchrun, or capture it again")
    world = int(man["world_size"])

    def bad(expected: str) -> InputError:
        return InputError(f"{where} is not a valid nanhunt capture: manifest.json field 'fsdp' is "
                            f"{_dcp._short(layout)}, expected {expected}")

    if not isinstance(layout, list) or not layout:
        raise bad("a list of the modules fully_shard wrapped")
    for e in layout:
        if not isinstance(e, dict) or not isinstance(e.get("module"), str):
            raise bad("entries naming a module")
        mesh, reshard, mp = e.get("mesh"), e.get("reshard_after_forward"), e.get("mp_policy")
        names = e.get("mesh_dim_names")
        if mesh is not None and not (isinstance(mesh, list) and all(type(n) is int and n > 0 for n in mesh)):
            raise bad("a mesh shape (a list of positive integers) or null")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)
                                      and isinstance(mesh, list) and len(names) == len(mesh) == len(set(names))):
            raise bad("mesh dimension names (distinct strings, one per mesh dimension) or none")
        if mesh is not None and (len(mesh) > 2 or math.prod(mesh) != world):
            raise InputError(f"{where}: module {e['module']!r} was sharded on a device mesh of shape {mesh}; the "
                               f"distributed replay rebuilds a 1-D (FSDP) or 2-D (HSDP) mesh of the {world} ranks "
                               "only; replay it in one process, without torchrun")
        if reshard is not None and not isinstance(reshard, bool):
            raise bad("reshard_after_forward true, false or null")
        if mp is not None and not (isinstance(mp, dict) and isinstance(mp.get("cast_forward_inputs", True), bool)
                                   and all(mp.get(k) is None or mp.get(k) in _DTYPES
                                           for k in ("param_dtype", "reduce_dtype", "output_dtype"))):
            raise bad("a mixed precision policy of dtype names or null")
    if len({e["module"] for e in layout}) != len(layout):
        raise bad("each module once")
    return layout


def _wrap(model: nn.Module, layout: list[dict[str, Any]], device: torch.device) -> None:
    """``fully_shard`` on the modules the capture recorded, children first, with the recorded options, on a
    device mesh of the recorded shape (2-D: HSDP, replicated over the first dimension, sharded over the second)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    named = dict(model.named_modules())
    missing = [e["module"] for e in layout if e["module"] not in named]
    if missing:
        raise InputError(f"the capture was sharded on module(s) {_dcp._few(missing)}, which this model does not "
                           "have; is --model the factory that built this capture?")
    meshes: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}
    for e in layout:
        shape = tuple(e.get("mesh") or ())
        if len(shape) == 2:
            names = tuple(e.get("mesh_dim_names") or ("replicate", "shard"))
            if (shape, names) not in meshes:
                meshes[(shape, names)] = init_device_mesh(device.type, shape, mesh_dim_names=names)
    # a module with no parameters of its own (the root, often) records no mesh: the others' one, when they share it
    shared = next(iter(meshes.values())) if len(meshes) == 1 else None
    for e in layout:
        kw: dict[str, Any] = {}
        shape = tuple(e.get("mesh") or ())
        if len(shape) == 2:
            kw["mesh"] = meshes[(shape, tuple(e.get("mesh_dim_names") or ("replicate", "shard")))]
        elif not shape and shared is not None:
            kw["mesh"] = shared
        if e.get("reshard_after_forward") is not None:
            kw["reshard_after_forward"] = e["reshard_after_forward"]
        mp = e.get("mp_policy")
        if mp is not None:
            kw["mp_policy"] = MixedPrecisionPolicy(
                **{k: None if mp.get(k) is None else _DTYPES[mp[k]]
                   for k in ("param_dtype", "reduce_dtype", "output_dtype")},
                cast_forward_inputs=bool(mp.get("cast_forward_inputs", True)))
        fully_shard(named[e["module"]], **kw)


# ---------------------------------------------------------------- the ranks
class _Ranks:
    """This rank among the others: the collectives of one distributed replay (``nanhunt.hunt.pipeline.Ranks``)."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.leads = rank == 0
        self.first_rank: int | None = None
        self.summary: str | None = None

    def together(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on every rank; when it failed on any, every rank raises (its own error, or which rank
        failed), none goes on to a collective the failed rank will never join."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as e:
            error = e
        said: list[str | None] = [None] * self.world
        dist.all_gather_object(said, None if error is None else str(error) or type(error).__name__)
        if error is not None:
            raise error
        failed = [(r, s) for r, s in enumerate(said) if s is not None]
        if failed:
            r, s = failed[0]
            raise InputError(f"rank {r} could not load its part of the capture: {s}")
        return result  # type: ignore[no-any-return]

    # -------------------------------------------------- bisect.Team
    def send(self, order: tuple[Any, ...] | None) -> tuple[Any, ...]:
        # gathered, not broadcast: gloo's object broadcast was seen to hang after an FSDP2 step (torch 2.13)
        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, order)
        return tuple(got[0])

    def all_finite(self, ok: bool) -> bool:
        failed = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(failed)
        return float(failed) == 0.0

    # -------------------------------------------------- hunt.Ranks
    def traced(self, final: Trace) -> None:
        self.first_rank, self.summary = final.first_rank, final.rank_summary

    def agreed_status(self, status: Status) -> Status:
        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, status)
        return _overall(got)

    def leading(self, first: Occurrence | None, origins: tuple[Occurrence, ...], first_rank: int | None,
                ) -> tuple[Occurrence | None, tuple[Occurrence, ...]]:
        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, (first, origins))
        got_first, got_origins = got[first_rank or 0]
        return got_first, tuple(got_origins)

    # -------------------------------------------------- the report
    def repro(self, make: Callable[[str], Repro | None], bundle: str) -> Repro | None:
        """The first rank (rank 0's word for which; rank 0 when none went first) writes and verifies the repro in
        a directory of its own, never running the step again (``make`` is built so); the small Repro is gathered
        by every rank, its files (inputs capped at ``repro.DEFAULT_CAP``) sent to rank 0 alone, which writes them
        into ``bundle`` (the ranks may not share a filesystem)."""
        said: list[Any] = [None] * self.world
        dist.all_gather_object(said, self.first_rank)
        maker = said[0] if said[0] is not None else 0
        mine: Any = None
        files: dict[str, bytes] = {}
        raised: BaseException | None = None
        if self.rank == maker:
            with tempfile.TemporaryDirectory(prefix="nanhunt-repro-") as d:
                try:
                    rp = make(d)
                    files = {} if rp is None else {f: Path(d, f).read_bytes() for f in rp.files}
                    mine = (rp, None)
                except BaseException as e:  # said to every rank (none left waiting in the gather), raised here after
                    mine, raised = (None, f"{type(e).__name__}: {e}"), e
        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, mine)
        if raised is not None:
            raise raised
        rp, error = got[maker]
        if error is not None:
            raise InputError(f"rank {maker} could not write the repro of its culprit op: {error}")
        if rp is not None and maker != 0:  # the files, from the maker to rank 0 only
            box: list[Any] = [files]
            if self.rank == maker:
                dist.send_object_list(box, dst=0)
            elif self.leads:
                dist.recv_object_list(box, src=maker)
                files = box[0]
        if self.leads and rp is not None:
            os.makedirs(bundle, exist_ok=True)
            for name, data in files.items():
                write_file(os.path.join(bundle, os.path.basename(name)), data)  # never through a link
        return rp  # type: ignore[no-any-return]

    def merged(self, report: Report) -> Report:
        """Every rank's report gathered: the report of the rank that went first (rank 0's when none did), the
        step's status over every rank, and each rank's part in its notes."""
        texts: list[Any] = [None] * self.world
        dist.all_gather_object(texts, report.to_json())
        reports = [Report.from_json(t) for t in texts]
        status = _overall([r.status for r in reports])
        shown = self.first_rank if self.first_rank is not None else 0
        base = reports[shown]
        notes = [base.notes[0]] if base.notes else []
        if self.first_rank is not None:
            notes.append(f"rank {self.first_rank} went first: the report is its replay; {self.summary}")
        else:
            by = [str(r) for r, rep in enumerate(reports) if rep.status == Status.NONFINITE]
            notes.append("no rank made a non-finite value of its own" + (
                f" (non-finite values on rank(s) {', '.join(by)})" if by else "") + "; the report is rank 0's replay")
        return dataclasses.replace(base, status=status, notes=(*notes, *base.notes[1:]))


    def finish(self, report: Report, show: Callable[[Report], int]) -> int:
        """Rank 0 shows the report; every rank returns its exit code (rank 0 failing to show it: 2 elsewhere)."""
        code, error = 2, None
        if self.leads:
            try:
                code = show(report)
            except BaseException as e:
                error = e
        codes: list[Any] = [None] * self.world
        dist.all_gather_object(codes, code)
        if error is not None:
            raise error
        return int(codes[0])


def _overall(statuses: Iterable[Status]) -> Status:
    """Non-finite on any rank is a non-finite step; else not reproducible on any is not reproducible."""
    got = set(statuses)
    for status in (Status.NONFINITE, Status.NOT_REPRODUCIBLE):
        if status in got:
            return status
    return Status.CLEAN
