"""StepState's disk snapshot: the copies of the weights, buffers and optimizer state in one unnamed temporary
file, mapped, restored in place bit for bit; chosen by default only for a CPU snapshot too big for the memory left."""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt.step import snapshot as step_module
from nanhunt._util._errors import InputError
from nanhunt.cli import main
from nanhunt.hunt.pipeline import hunt
from nanhunt.records import Phase
from nanhunt.step.step import Step, StepState
from tests._support.models import fp16_overflow_mlp, where

MIB = 1 << 20
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (maps, status)")


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of the module on one torch thread (conftest's ``one_thread``)."""


@pytest.fixture()
def every_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor's copy goes to the file (tiny test tensors included)."""
    monkeypatch.setattr(step_module, "_DISK_MIN_BYTES", 0)


@pytest.fixture(params=["unnamed", "named"])
def file_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Linux's O_TMPFILE (never a name), and the fallback elsewhere: a named file unlinked once mapped."""
    if request.param == "named":
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    elif not hasattr(os, "O_TMPFILE"):
        pytest.skip("no O_TMPFILE here")
    return str(request.param)


class _Zoo(nn.Module):
    """One parameter or buffer of each kind a snapshot must copy bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.f32 = nn.Linear(6, 8)
        self.shared = nn.Linear(6, 8)
        self.shared.weight = self.f32.weight  # tied weights: one tensor, one copy
        self.f16 = nn.Parameter(torch.randn(5, 3, generator=g).half())
        self.bf16 = nn.Parameter(torch.randn(7, generator=g).bfloat16())
        self.f64 = nn.Parameter(torch.randn(2, 3, generator=g).double())
        self.strided = nn.Parameter(torch.randn(8, 6, generator=g).t())  # non-contiguous, strides (1, 6)
        self.sliced = nn.Parameter(torch.randn(4, 10, generator=g)[:, ::2])  # not dense: copied contiguous
        self.scalar = nn.Parameter(torch.tensor(-0.0))  # 0-dim, and a sign bit to keep
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45], dtype=torch.float32)
        special[0] = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)  # a NaN payload
        self.register_buffer("special", special)
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("bytes", torch.arange(5, dtype=torch.uint8))
        self.register_buffer("cplx", torch.randn(3, generator=g, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.shared(x).sum() + self.f32(x).sum() + self.f16.float().sum() + self.bf16.float().sum()
                + self.f64.float().sum() + self.strided.sum() + self.sliced.sum() + self.scalar)


def _bits(ts: Iterator[torch.Tensor] | list[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...], bytes]]:
    return [(t.dtype, tuple(t.shape), t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for t in ts]


def _zoo_state(m: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[torch.dtype, tuple[int, ...], bytes]]:
    return _bits([*m.parameters(), *m.buffers(), *(v for s in opt.state.values() for v in s.values())])


def _trained_zoo() -> tuple[_Zoo, torch.optim.Optimizer]:
    m = _Zoo()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 6)).backward()
    opt.step()  # moments of every dtype, and 0-dim `step` tensors
    return m, opt


def _copies(state: StepState) -> list[torch.Tensor]:
    assert state.opt_state is not None
    return [c for _, c in state.values] + [v for s in state.opt_state.values() for v in s.values()
                                           if isinstance(v, torch.Tensor)]


def _scramble(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for t in [*m.parameters(), *m.buffers(), *(v for s in opt.state.values() for v in s.values())]:
            t.copy_(torch.ones_like(t) if t.dtype == torch.bool else t.real.new_full(t.shape, 3).to(t.dtype) if
                    t.is_complex() else torch.full_like(t, 3))


def test_disk_snapshot_restores_every_dtype_and_layout_bit_identical(every_tensor: None, tmp_path: Path) -> None:
    # GIVEN a model with parameters and buffers of every dtype and layout, and AdamW state
    m, opt = _trained_zoo()
    before = _zoo_state(m, opt)
    strides = {n: p.stride() for n, p in m.named_parameters()}
    # WHEN a disk snapshot is taken, everything overwritten, and restored
    state = StepState(m, opt, snapshot="disk", directory=str(tmp_path))
    _scramble(m, opt)
    assert _zoo_state(m, opt) != before
    state.restore()
    # THEN every bit is back (NaN payload, -0.0, bool, complex, 0-dim, the strided and tied weights)
    assert _zoo_state(m, opt) == before
    assert {n: p.stride() for n, p in m.named_parameters()} == strides
    # AND every copy lives in the one mapped file, the tied weight once, the strided one with its strides
    copies = _copies(state)
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    assert state.on_disk >= sum(c.nbytes for c in copies) and state.homes == {}
    assert len(state.values) == len({id(p) for p in m.parameters()}) + len(list(m.buffers()))
    assert dict(zip([n for n, _ in m.named_parameters()], [c.stride() for _, c in state.values]))["strided"] == (1, 6)


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_the_file_s_pages_can_be_dropped_and_still_restore(tmp_path: Path) -> None:
    # GIVEN a disk snapshot of two 4 MiB weights
    m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    before = _bits(list(m.parameters()))
    state = StepState(m, snapshot="disk", directory=str(tmp_path))
    assert state.on_disk == 8 * MIB
    # WHEN its pages are paged out, as the kernel does under memory pressure (MADV_PAGEOUT: written back, dropped)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    resident = _rss_file_kib()
    if libc.madvise(state.values[0][1].untyped_storage().data_ptr(), state.on_disk, 21) != 0:
        pytest.skip(f"no MADV_PAGEOUT here (errno {ctypes.get_errno()})")
    # THEN the process no longer holds them ...
    assert resident - _rss_file_kib() >= state.on_disk // 2 // 1024
    # ... and the restore reads them back bit for bit
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    state.restore()
    assert _bits(list(m.parameters())) == before


def test_only_tensors_of_a_mebibyte_or_more_go_to_the_file(tmp_path: Path) -> None:
    # GIVEN a Linear(512, 512): a weight of exactly 1 MiB, a bias of 2 KiB
    m = nn.Linear(512, 512)
    # WHEN a disk snapshot is taken
    state = StepState(m, snapshot="disk", directory=str(tmp_path))
    # THEN the weight's copy is in the file and the bias's a clone
    (_, w), (_, b) = state.values
    assert state.on_disk == MIB
    assert w.untyped_storage().nbytes() == MIB and b.untyped_storage().nbytes() == 512 * 4
    assert w.untyped_storage().data_ptr() != m.weight.untyped_storage().data_ptr()


def test_the_file_has_no_name_once_the_state_is_made(every_tensor: None, file_kind: str, tmp_path: Path) -> None:
    # GIVEN a trained model and an empty directory
    m, opt = _trained_zoo()
    before = _zoo_state(m, opt)
    # WHEN a disk snapshot is taken there
    state = StepState(m, opt, snapshot="disk", directory=str(tmp_path))
    # THEN the directory is empty while the snapshot lives, mapped from a deleted file
    assert os.listdir(tmp_path) == []
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if str(tmp_path) in line]
    assert mapped and all(line.rstrip().endswith("(deleted)") for line in mapped)
    # AND it still restores
    _scramble(m, opt)
    state.restore()
    assert _zoo_state(m, opt) == before
    # AND once it is gone, so is the mapping
    del state
    with open("/proc/self/maps") as f:
        assert not [line for line in f if str(tmp_path) in line]


def test_no_file_left_when_the_mapping_fails(every_tensor: None, file_kind: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a mapping that fails after the file was made
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("mmap failed")

    monkeypatch.setattr(torch.UntypedStorage, "from_file", failing)
    m, opt = _trained_zoo()
    # WHEN a disk snapshot is taken
    with pytest.raises(RuntimeError, match="mmap failed"):
        StepState(m, opt, snapshot="disk", directory=str(tmp_path))
    # THEN no file is left
    assert os.listdir(tmp_path) == []


def test_a_full_disk_is_one_clear_error_and_leaves_no_file(every_tensor: None, file_kind: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a disk that has no room for the file's blocks
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    m, opt = _trained_zoo()
    # WHEN a disk snapshot is asked for
    with pytest.raises(InputError) as e:
        StepState(m, opt, snapshot="disk", directory=str(tmp_path))
    # THEN the error names the problem, the place and the fixes, and no file is left
    assert str(e.value).startswith("cannot put the step's 0 MiB snapshot in " + str(tmp_path))
    assert "No space left on device" in str(e.value) and "TMPDIR" in str(e.value) and "--snapshot memory" in str(e.value)
    assert os.listdir(tmp_path) == []
    # AND by default (the size rule picked the disk) the snapshot stays in memory, with a warning
    monkeypatch.setattr(step_module, "_available_memory", lambda: 0.0)
    with pytest.warns(UserWarning, match="kept in memory; set TMPDIR"):
        state = StepState(m, opt, directory=str(tmp_path))
    assert state.on_disk == 0 and os.listdir(tmp_path) == []


def test_ctrl_c_while_the_file_is_made_leaves_no_file(every_tensor: None, file_kind: str, tmp_path: Path) -> None:
    # GIVEN a trained model
    m, opt = _trained_zoo()
    target = {step_module._map_file.__wrapped__.__code__}  # type: ignore[attr-defined]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # WHEN Ctrl-C arrives at each line event of the making and mapping of the file
        for at in range(1, 100):
            events = 0

            def trace(frame: FrameType, event: str, arg: Any) -> Any:
                if frame.f_code not in target:
                    return None

                def line(frame: FrameType, event: str, arg: Any) -> Any:
                    nonlocal events
                    if event == "line":
                        events += 1
                        if events == at:
                            signal.raise_signal(signal.SIGINT)
                    return line
                return line

            sys.settrace(trace)
            try:
                StepState(m, opt, snapshot="disk", directory=str(tmp_path))
            except KeyboardInterrupt:
                interrupted = True
            else:
                interrupted = False
            finally:
                sys.settrace(None)
            # THEN the interrupt goes on to the caller once the file has no name, and none is left
            assert interrupted == (events >= at)
            assert os.listdir(tmp_path) == []
            if events < at:
                break
        assert at > 10  # every line was hit
    finally:
        signal.signal(signal.SIGINT, previous)


# ----------------------------------------------------------------------- when the disk is used
def _big_cpu_model() -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """Linear(512, 512) with AdamW state and its .grad: four 1 MiB tensors for the file, the rest tiny."""
    m = nn.Linear(512, 512)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 512)).sum().backward()
    opt.step()
    return m, opt, 4 * MIB


@pytest.mark.parametrize("available_mib, on_disk", [(9, 0), (8, 0), (7, 4 * MIB), (0, 4 * MIB)])
def test_by_default_the_disk_holds_a_cpu_snapshot_bigger_than_half_the_free_memory(
        available_mib: int, on_disk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a CPU model whose file-worthy copies take 4 MiB (weight, two Adam moments, the weight's .grad), and
    # this much memory available (0: unknown)
    m, opt, _ = _big_cpu_model()
    monkeypatch.setattr(step_module, "_available_memory", lambda: float(available_mib * MIB))
    # WHEN a snapshot is taken with no choice given
    state = StepState(m, opt, directory=str(tmp_path))
    # THEN the file holds them only when they exceed half of it, or when it cannot be read
    assert state.on_disk == on_disk
    assert [c.untyped_storage().nbytes() for c in _copies(state) if c.nbytes >= MIB] == [on_disk or MIB] * 3


def test_memory_and_host_snapshots_never_use_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN no memory left at all
    m, opt, _ = _big_cpu_model()
    monkeypatch.setattr(step_module, "_available_memory", lambda: 0.0)
    # WHEN the snapshot is asked for in memory, or in host memory (either spelling)
    states = [StepState(m, opt, snapshot="memory", directory=str(tmp_path)),
              StepState(m, opt, host=False, directory=str(tmp_path)),
              StepState(m, opt, snapshot="host", directory=str(tmp_path)),
              StepState(m, opt, host=True, snapshot="host", directory=str(tmp_path))]
    # THEN none of them maps a file; the host ones went through the host path
    assert [s.on_disk for s in states] == [0, 0, 0, 0]
    assert [bool(s.homes) for s in states] == [False, False, True, True]
    # AND contradicting or unknown choices are refused
    with pytest.raises(ValueError, match="host=True and snapshot='disk' disagree"):
        StepState(m, opt, host=True, snapshot="disk")
    with pytest.raises(ValueError, match="snapshot='ssd': expected one of 'memory', 'host', 'disk'"):
        StepState(m, opt, snapshot="ssd")  # type: ignore[arg-type]


def test_a_temp_dir_in_memory_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a temp dir on tmpfs (a file there takes memory as well) and no memory to spare
    m, opt, total = _big_cpu_model()
    monkeypatch.setattr(step_module, "_available_memory", lambda: 0.0)
    monkeypatch.setattr(step_module, "_in_memory_fs", lambda path: True)
    # WHEN a snapshot is taken by default, then on disk by request
    with pytest.warns(UserWarning, match=r"is in memory \(tmpfs\): kept in memory; set TMPDIR"):
        auto = StepState(m, opt, directory=str(tmp_path))
    with pytest.warns(UserWarning, match=r"a disk snapshot there saves no memory"):
        asked = StepState(m, opt, snapshot="disk", directory=str(tmp_path))
    # THEN the default keeps it in memory; the request is honoured
    assert auto.on_disk == 0 and asked.on_disk == total


# ----------------------------------------------------------------------- Ctrl-C and replay
def _fp16_step(snapshot: Any) -> Step:
    m = fp16_overflow_mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.full((2, 4), 100.0)
    return Step.of(m, (x, torch.zeros(2, 3)), loss_fn=F.mse_loss, dtype=torch.float16, optimizer=opt,
                   scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8), snapshot=snapshot)


def test_replay_and_bisection_on_a_disk_snapshot_name_the_same_culprit(every_tensor: None,
                                                                      snapshots: list[StepState]) -> None:
    # GIVEN the same float16-overflowing step twice, its snapshot in memory and on disk
    made = snapshots
    memory, disk = _fp16_step("memory"), _fp16_step("disk")
    assert disk.optimizer is not None
    before = _bits([*disk.model.parameters()])
    # WHEN both are replayed and bisected
    reports = [hunt(memory, prove=True), hunt(disk, prove=True)]
    # THEN both name the same origin op and culprit, and the disk one went through the file
    assert where(reports[0].first) == where(reports[1].first) == (Phase.FORWARD, "fc1", "aten::addmm", 0, "inf")
    assert reports[0].verdict is not None and reports[1].verdict is not None
    assert [(r.verdict.kind, r.verdict.culprits) for r in reports] == [("precision", ("fc1", "fc2"))] * 2
    assert [s.on_disk > 0 for s in made] == [False, True]
    # AND the model is back bit for bit
    assert _bits([*disk.model.parameters()]) == before


def test_cli_snapshot_flag_reaches_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN the float16-overflow fixture capture, and the steps the replay runs recorded
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    monkeypatch.setenv("PYTHONPATH", str(root))
    seen: list[Any] = []
    init = StepState.__init__

    def recording(self: StepState, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        seen.append(self.snapshot)

    monkeypatch.setattr(step_module.StepState, "__init__", recording)
    files = [str(root / "fixtures" / "overflow" / "checkpoint.pt"), str(root / "fixtures" / "overflow" / "batch.pt")]
    # WHEN it is replayed with --snapshot disk, memory, and the default
    codes = [main(["replay", *files, "--no-bisect", *flag]) for flag in (["--snapshot", "disk"],
                                                                         ["--snapshot", "memory"], [])]
    # THEN each replay's snapshot was taken as asked, and each found the overflow
    assert codes == [1, 1, 1]
    assert seen == ["disk", "memory", None]


def test_the_grads_the_step_began_with_wait_in_the_file_and_come_back_as_the_same_objects(tmp_path: Path) -> None:
    # GIVEN a CPU model whose parameters hold .grad tensors of 1 MiB (as after a user's step), and their bits
    m, opt, _ = _big_cpu_model()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None for g in grads)
    before = [(g.clone(), g.data_ptr() != 0) for g in grads if g is not None]
    big = [g for g in grads if g is not None and g.nbytes >= MIB]
    assert len(big) == 1  # the weight's; the bias's 2 KiB stays in memory
    # WHEN a disk snapshot is used and a step runs inside it
    with StepState(m, opt, snapshot="disk", directory=str(tmp_path)) as state:
        # THEN the big grad's memory is freed meanwhile, its values in the file, and the runs start with no .grad
        assert big[0].untyped_storage().nbytes() == 0
        assert m.weight.grad is None
        state.reset()
        m(torch.randn(2, 512)).sum().backward()
        assert m.weight.grad is not None and m.weight.grad is not big[0]
    # AND on leaving, every parameter holds its own .grad object again, bit for bit
    assert [p.grad for p in m.parameters()] == grads
    for g, (b, _) in zip(grads, before):
        assert g is not None and torch.equal(g, b) and g.untyped_storage().nbytes() == b.nbytes


def test_the_grads_come_back_when_the_block_raises(tmp_path: Path) -> None:
    # GIVEN a disk snapshot holding a model's grad WHEN the block raises
    m, opt, _ = _big_cpu_model()
    g = m.weight.grad
    assert g is not None
    copy = g.clone()
    with pytest.raises(ValueError), StepState(m, opt, snapshot="disk", directory=str(tmp_path)):
        raise ValueError("the user's model failed")
    # THEN the grad is back, the same object, bit for bit
    assert m.weight.grad is g and torch.equal(g, copy)
