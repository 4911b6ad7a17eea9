"""The snapshot engine: StepState saves a step's weights, buffers, gradients, optimizer and RNG state (in memory, on the host, or in a file) and restores them; Hooks."""

from __future__ import annotations

import copy
import dataclasses
import errno
import itertools
import operator
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal, cast

import torch
from torch import nn

from .._util._dispatch import foreach_copy, fsdp_fresh_buffers, fsdp_modules, is_plain
from .._util._subclass import subclass_clone, subclass_copy
from .._util._errors import InputError
from .._util._interrupt import atomic, deferred_interrupts
from ..tracing._tensors import storage_key
from ._inputs import rng_state, set_rng_state


# Where a step's snapshot of its weights, buffers and optimizer state lives (StepState); None: chosen by size.
Snapshot = Literal["memory", "host", "disk"]
SNAPSHOTS: tuple[Snapshot, ...] = ("memory", "host", "disk")


class StepState:
    """A snapshot of everything one training step can change, restorable in place.

    Covers parameter and buffer values *and* the objects registered on each module
    (a step may rebind a buffer), ``.grad`` references, ``requires_grad``,
    ``training`` flags, optimizer state and hyper-parameters, GradScaler state,
    the RNG (torch's, CUDA's, Python's ``random`` and NumPy's global one) and the
    grad mode. Tensors the optimizer updates outside the model (a loss module's
    weights) are parameters too.

    :meth:`reset` and :meth:`restore` run to their end despite Ctrl-C: a SIGINT that
    arrives meanwhile is delivered (``KeyboardInterrupt``) once the state is back.
    As a context manager it also restores on leaving the block, and Ctrl-C is held
    from a restore's first instruction (called alone, a SIGINT just before it
    installs its handler leaves the restore not started, never half done)::

        with StepState(model, optimizer, scaler) as state:
            ...  # run steps; state.reset() between them

    One copy of each parameter, buffer and optimizer state tensor is kept, and restored in place
    (``copy_`` into the live tensor). ``snapshot`` says where those copies live:

    - ``"memory"``: clones, where the tensors are (``host=False``);
    - ``"host"``: host memory, pinned under CUDA, so a replay needs no more device memory than the step
      (``host=True``);
    - ``"disk"``: each tensor of 1 MiB or more in one temporary file in ``directory`` (default: the temp
      dir, or ``/var/tmp`` when that is a tmpfs), mapped: its pages are the page cache's, written back and
      dropped under memory pressure, so a CPU replay needs little more anonymous memory than the step. The
      file has no name by the time it is mapped (nothing left on disk, even after a crash); its space is
      reserved up front. Smaller tensors are kept as with ``None``;
    - ``None`` (default): host memory for tensors on an accelerator; for CPU tensors, the file when their
      copies would take more than half the memory available (MemAvailable, or the cgroup's limit; always
      where it cannot be read), else clones.

    The GradScaler's two scalars stay on the device.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scaler: torch.amp.GradScaler | None = None, *, host: bool | None = None,
                 snapshot: Snapshot | None = None, directory: str | None = None) -> None:
        self.model = model
        self.host = host
        self.snapshot = _snapshot_mode(host, snapshot)
        self._pinned: set[torch.device] = set()  # devices copying into pinned memory: synchronised before use
        self.optimizer = optimizer
        self.scaler = scaler
        self.grad_enabled = torch.is_grad_enabled()
        self.rng = rng_state(python_numpy=True)
        self.modules = [(m, dict(m._parameters), dict(m._buffers), m.training) for m in model.modules()]
        # Hooks and plain attributes a forward may add or change (a counter, a cache, a hook it registers).
        self.hooks = [(d, dict(d)) for m in model.modules() for d in _hook_dicts(m)]
        self._hook_dicts = [d for d, _ in self.hooks]
        self._hook_sizes = [len(saved) for _, saved in self.hooks]
        self._hooked = [(d, saved) for d, saved in self.hooks if saved]
        self.attrs = [(m, {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS}) for m in model.modules()]
        self.homes: dict[int, torch.device] = {}  # id of a host copy -> the device of the tensor it copies
        self.on_disk = 0  # bytes of the copies held in the mapped file
        self._slots = self._map_slots(optimizer, directory)  # id of a tensor -> its copy's place in the file
        self.values: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for _, params, buffers, _ in self.modules:
            for t in (*params.values(), *buffers.values()):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    self.values.append((t, self._save(t)))
        self.params: list[torch.Tensor] = [p for p in model.parameters()]
        if optimizer is not None:
            known = {id(p) for p in self.params}
            for g in optimizer.param_groups:
                for p in g["params"]:
                    if isinstance(p, torch.Tensor) and id(p) not in known:
                        known.add(id(p))
                        self.params.append(p)
                        if id(p) not in seen:
                            seen.add(id(p))
                            self.values.append((p, self._save(p)))
        self._targets = [t for t, _ in self.values]
        self._saved = [saved for _, saved in self.values]
        self.param_hooks = [(p, _param_hooks(p)) for p in self.params]
        self.grads = [p.grad for p in self.params]
        # (grad, its copy in the file, its storage's bytes): values moved there by __enter__, back by restore()
        self._spill: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        # a .grad the step also holds elsewhere (an optimizer keeping the last gradient in its state, a buffer)
        # is restored through that too: its memory stays
        held = {storage_key(t) for t in self._targets}
        if optimizer is not None:
            held.update(storage_key(v) for st in optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        for grad in {id(gr): gr for gr in self.grads if gr is not None}.values():
            slot = self._slots.pop(id(grad), None)
            if slot is not None and _owns_storage(grad) and storage_key(grad) not in held:
                self._spill.append((grad, slot, grad.untyped_storage().nbytes()))
        self._spilled = False
        self.requires_grad = [p.requires_grad for p in self.params]
        self.opt_state: dict[Any, dict[str, Any]] | None = None
        self.opt_groups: list[dict[str, Any]] | None = None
        if optimizer is not None:
            self.opt_state = {p: {k: self._save(v) for k, v in s.items()} for p, s in optimizer.state.items()}
            self.opt_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.scaler_dict: dict[str, Any] | None = None
        if scaler is not None:
            self.scaler_dict = {k: _clone(v) for k, v in vars(scaler).items()}
        self._slots.clear()
        for device in self._pinned:
            torch.cuda.synchronize(device)  # the copies into pinned memory were asynchronous
        self._interrupts: deferred_interrupts | None = None
        self._fsdp = fsdp_modules(model)

    def _save(self, v: Any) -> Any:
        """One value's copy: a tensor in its slot of the file when it has one, on the host when asked (or on
        an accelerator), else where it is."""
        if not isinstance(v, torch.Tensor):
            return copy.deepcopy(v)
        t = v.detach()
        slot = self._slots.pop(id(v), None)
        if slot is not None:
            slot.copy_(t)
            if t.device.type != "cpu":
                self.homes[id(slot)] = t.device
            return slot
        mode = self.snapshot
        to_host = mode == "host" or (mode != "memory" and t.device.type not in ("cpu", "meta"))
        # a tensor subclass (a DTensor shard, an NF4 weight) is copied as it is, its copy_ taking no plain host
        # tensor: rebuilt from copies of its inner tensors (exact), else through its own clone
        if t.__class__ is not torch.Tensor and not is_plain(t):
            return subclass_clone(t)
        if not to_host or t.__class__ is not torch.Tensor or t.device.type == "meta":
            return t.clone()
        pin = t.device.type == "cuda"
        saved = torch.empty_like(t, device="cpu", pin_memory=pin)  # the same strides, as clone() keeps them
        saved.copy_(t, non_blocking=pin)
        if pin:
            self._pinned.add(t.device)
        self.homes[id(saved)] = t.device
        return saved

    def _map_slots(self, optimizer: torch.optim.Optimizer | None, directory: str | None) -> dict[int, torch.Tensor]:
        """The copies that go to the file (see the class docstring): for each such tensor (by id), a tensor
        of its shape, dtype and strides over its part of one new, unnamed temporary file, mapped."""
        mode = self.snapshot
        if mode not in (None, "disk"):
            return {}
        found = [t for _, params, buffers, _ in self.modules for t in (*params.values(), *buffers.values())]
        if optimizer is not None:
            found += [p for g in optimizer.param_groups for p in g["params"]]
            found += [v for s in optimizer.state.values() for v in s.values()]
        # the .grad tensors the step began with: their values wait in the file, their memory freed meanwhile
        found += [t.grad for t in found if isinstance(t, nn.Parameter) and _owns_storage(t.grad)]
        big: dict[int, torch.Tensor] = {}
        for t in found:
            # a tensor subclass (a DTensor shard) keeps its own copy: its copy_ takes no plain tensor
            if (isinstance(t, torch.Tensor) and t.nbytes >= max(_DISK_MIN_BYTES, 1) and t.device.type != "meta"
                    and t.detach().__class__ is torch.Tensor and (mode == "disk" or t.device.type == "cpu")):
                big.setdefault(id(t), t)
        total = sum(map(_slot_bytes, big.values()))
        if not big or (mode is None and (os.name != "posix" or total <= _available_memory() / 2)):
            return {}
        where, on_disk = _disk_dir(directory)
        size = f"{total / 2**20:.0f} MiB"
        if not on_disk:
            if mode is None:  # a file there takes the same memory, and none of it can be dropped
                warnings.warn(f"nanhunt: the step's snapshot ({size}) would take more than half the memory left, and "
                              f"{where} is in memory (tmpfs): kept in memory; set TMPDIR to a directory on a disk",
                              stacklevel=4)
                return {}
            warnings.warn(f"nanhunt: {where} is in memory (tmpfs): a disk snapshot there saves no memory; "
                          "set TMPDIR to a directory on a disk", stacklevel=4)
        try:
            storage = _map_file(where, total)
        except OSError as e:
            why = f"cannot put the step's {size} snapshot in {where} ({e.strerror or e})"
            if mode is None:
                warnings.warn(f"nanhunt: {why}: kept in memory; set TMPDIR to a directory with room", stacklevel=4)
                return {}
            raise InputError(f"{why}; set TMPDIR to a directory with room, or keep it in memory "
                               "(--snapshot memory)") from e
        slots: dict[int, torch.Tensor] = {}
        at = 0
        for key, t in big.items():
            stride = torch.empty_like(t, device="meta").stride()  # clone()'s strides: dense ones kept
            slots[key] = torch.empty(0, dtype=t.dtype).set_(storage, at // t.element_size(), t.shape, stride)
            at += _slot_bytes(t)
        self.on_disk = total
        return slots

    def _back(self, v: Any) -> Any:
        """A new tensor from a saved value, on the device it was taken from (a state entry the step
        deleted or replaced by one of another shape)."""
        if isinstance(v, torch.Tensor):
            home = self.homes.get(id(v))
            return v.detach().clone() if home is None else v.to(home, copy=True)
        return copy.deepcopy(v)

    def __enter__(self) -> StepState:
        if self._interrupts is not None:
            raise RuntimeError("this StepState is already in use as a context manager")
        interrupts = deferred_interrupts()
        interrupts.__enter__()  # nothing has changed yet: a Ctrl-C before this point needs no restore
        self._interrupts = interrupts
        try:
            self._spill_grads()
        except BaseException:
            self._interrupts = None
            try:
                self._unspill_grads()
            finally:
                for param, grad in zip(self.params, self.grads):
                    param.grad = grad
                interrupts.__exit__(None, None, None)
            raise
        return self

    def _spill_grads(self) -> None:
        """A disk snapshot: the ``.grad`` tensors the step began with are copied into the file and their memory
        freed (their storage resized to nothing; the same objects, put back by :meth:`restore`). The runs
        start with no ``.grad``: a plain step's ``zero_grad(set_to_none=True)`` frees them the same way."""
        if not self._spill:
            return
        self._spilled = True
        spilled = {id(g) for g, _, _ in self._spill}
        for g, slot, _ in self._spill:
            slot.copy_(g.detach())
        for p in self.params:
            if p.grad is not None and id(p.grad) in spilled:
                p.grad = None
        for g, _, _ in self._spill:
            g.untyped_storage().resize_(0)
        _release_freed_memory()

    def _unspill_grads(self) -> None:
        """The ``.grad`` tensors' memory and values back (see :meth:`_spill_grads`)."""
        if not self._spilled:
            return
        for g, slot, nbytes in self._spill:
            storage = g.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
                g.detach().copy_(slot)
        self._spilled = False

    @atomic
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        interrupts, self._interrupts = self._interrupts, None
        try:
            self.restore()
        finally:
            if interrupts is not None:
                interrupts.__exit__(None, None, None)  # puts the SIGINT handler back; a held Ctrl-C raises here

    @atomic
    def reset(self, rng: Mapping[str, Any] | None = None) -> None:
        """Back to the snapshot, with no ``.grad`` (a replayed step starts from zero gradients)."""
        self.restore(grads=False)
        for p in self.params:
            p.grad = None
        fsdp_fresh_buffers(self._fsdp)
        if rng is not None:
            set_rng_state(rng)

    @atomic
    def restore(self, *, grads: bool = True) -> None:
        """Everything back as it was; without ``grads``, the ``.grad`` tensors a disk snapshot holds stay in the
        file (a reset, which drops every ``.grad`` next). Those grow back last (an allocation, which may fail
        when memory is short), and are put back on their parameters whatever failed before."""
        unspill = grads and self._spilled
        try:
            self._restore(unspill)
        finally:
            if unspill:
                try:
                    self._unspill_grads()
                finally:
                    for param, grad in zip(self.params, self.grads):
                        # a .grad whose memory could not be grown back stays off its parameter (reading it would
                        # crash), the others are back
                        if grad is None or grad.nbytes == 0 or grad.untyped_storage().nbytes() > 0:
                            param.grad = grad

    def hooks_now(self) -> Hooks:
        """The model's module and parameter hook registries as they are now, for :meth:`put_hooks`."""
        return Hooks([(d, dict(d)) for d in self._hook_dicts], [(p, _param_hooks(p)) for p in self.params])

    def put_hooks(self, hooks: Hooks) -> None:
        """The hook registries back as ``hooks`` (from :meth:`hooks_now`) holds them."""
        for d, saved_hooks in hooks.modules:
            if len(d) != len(saved_hooks) or (saved_hooks and d.keys() != saved_hooks.keys()):
                d.clear()
                d.update(saved_hooks)
        _put_param_hooks(hooks.params)

    def _restore(self, unspill: bool) -> None:
        # unchanged (the common case) when every registry has its old size and the non-empty ones their old keys
        if list(map(len, self._hook_dicts)) != self._hook_sizes or any(
                d.keys() != saved.keys() for d, saved in self._hooked):
            for d, saved_hooks in self.hooks:
                if d.keys() != saved_hooks.keys():
                    d.clear()
                    d.update(saved_hooks)
        _put_param_hooks(self.param_hooks)
        for m, attrs in self.attrs:
            current = vars(m)
            if len(current) != len(attrs) + _N_INTERNALS or not all(map(_is, map(current.get, attrs, _MISSINGS), attrs.values())):
                for k in [k for k in current if k not in attrs and k not in _MODULE_INTERNALS]:
                    del current[k]
                for k, v in attrs.items():
                    if current.get(k, _MISSING) is not v:
                        current[k] = v
        for m, params, buffers, training in self.modules:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            if m.training is not training:
                m.training = training
        dst = [t.data for t in self._targets]  # .data: a restore is no write the tracer or autograd sees
        src = list(self._saved)
        # a disk snapshot's .grad tensors grow back last (restore()): the last run's gradients are freed first
        for param, grad, rg in zip(self.params, self.grads, self.requires_grad):
            param.grad = None if unspill else grad
            param.requires_grad_(rg)
        opt = self.optimizer
        if opt is not None and self.opt_state is not None and self.opt_groups is not None:
            for p in list(opt.state.keys()):
                if p not in self.opt_state:
                    del opt.state[p]
            for p, saved_state in self.opt_state.items():
                cur = opt.state.get(p)
                if cur is None:
                    opt.state[p] = {k: self._back(v) for k, v in saved_state.items()}
                    continue
                for k in list(cur):
                    if k not in saved_state:
                        del cur[k]
                for k, v in saved_state.items():
                    old = cur.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == v.shape and old.dtype == v.dtype:
                        dst.append(old.data)
                        src.append(v)
                    else:
                        cur[k] = self._back(v)
            for g, saved_group in zip(opt.param_groups, self.opt_groups):
                for k in list(g):
                    if k != "params" and k not in saved_group:
                        del g[k]
                g.update(copy.deepcopy(saved_group))
        _copy_into(dst, src)
        if self.scaler is not None and self.scaler_dict is not None:
            for k, v in self.scaler_dict.items():
                cur = getattr(self.scaler, k, None)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                    cur.data.copy_(v)
                else:
                    setattr(self.scaler, k, _clone(v))
        set_rng_state(self.rng)
        torch.set_grad_enabled(self.grad_enabled)


_MISSING = object()
# A module's own bookkeeping, restored separately (parameters, buffers, training) or never
# changed by a forward (the submodules).
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "training"})
_N_INTERNALS = len(_MODULE_INTERNALS)  # every module has them all (nn.Module.__init__ sets them)
_is = operator.is_
_MISSINGS = itertools.repeat(_MISSING)
_HOOK_ATTRS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _hook_dicts(m: nn.Module) -> list[dict[Any, Any]]:
    """A module's hook registries (kept as objects: RemovableHandles point at them)."""
    return [d for d in (getattr(m, name, None) for name in _HOOK_ATTRS) if isinstance(d, dict)]


_ParamHooks = dict[str, tuple[dict[Any, Any] | None, dict[Any, Any]]]


def _param_hooks(p: torch.Tensor) -> _ParamHooks:
    """A parameter's hook registries: ``None`` until a hook is registered, then a dict."""
    out: _ParamHooks = {}
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        d = getattr(p, name, None)
        out[name] = (d, dict(d)) if isinstance(d, dict) else (None, {})
    return out


def _put_param_hooks(saved: list[tuple[torch.Tensor, _ParamHooks]]) -> None:
    for param, registries in saved:
        for name, (obj, content) in registries.items():
            if obj is None:
                if getattr(param, name) is not None:
                    setattr(param, name, None)
            else:
                obj.clear()
                obj.update(content)
                if getattr(param, name) is not obj:
                    setattr(param, name, obj)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """The hook registries of a model's modules and parameters, with their content at one moment
    (:meth:`StepState.hooks_now`)."""

    modules: list[tuple[dict[Any, Any], dict[Any, Any]]]
    params: list[tuple[torch.Tensor, _ParamHooks]]


_DISK_MIN_BYTES = 1 << 20  # smaller tensors stay clones: a file offers them nothing worth a slot


_LIBC: Any = None


def _release_freed_memory() -> None:
    """Give the memory just freed back to the system (glibc keeps large freed blocks in its heap, where the
    runs' new tensors, aligned differently, do not always fit): ``malloc_trim``; nothing elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
        except (OSError, ImportError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _owns_storage(g: torch.Tensor | None) -> bool:
    """A plain tensor that is the whole of its storage (not a view of a bucket, DDP's gradient_as_bucket_view)."""
    return (isinstance(g, torch.Tensor) and g.__class__ is torch.Tensor and g.device.type == "cpu"
            and g.storage_offset() == 0 and g.is_contiguous() and g.untyped_storage().nbytes() == g.nbytes
            # shared memory (model.share_memory()) and memory torch did not allocate (numpy's, DLPack's) cannot
            # be resized to nothing and back
            and not g.untyped_storage().is_shared() and g.untyped_storage().resizable())


def _snapshot_mode(host: bool | None, snapshot: Snapshot | None) -> Snapshot | None:
    if snapshot is not None and snapshot not in SNAPSHOTS:
        raise ValueError(f"snapshot={snapshot!r}: expected one of {', '.join(map(repr, SNAPSHOTS))} or None (by size)")
    implied: Snapshot | None = None if host is None else "host" if host else "memory"
    if snapshot is not None and implied is not None and snapshot != implied:
        raise ValueError(f"host={host} and snapshot={snapshot!r} disagree; give one of them")
    return snapshot if snapshot is not None else implied


def _slot_bytes(t: torch.Tensor) -> int:
    return -(-t.nbytes // 64) * 64  # every slot starts 64-byte aligned, as an allocator's tensors do


def _available_memory() -> float:
    """Bytes of memory this process can still take: MemAvailable, or less under a cgroup (v2) limit;
    0 where neither can be read (not Linux)."""
    avail = []
    try:
        with open("/proc/meminfo") as f:
            avail += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                avail.append(int(limit) - int(g.read()))
    except (OSError, ValueError, IndexError):
        pass
    return float(min(avail, default=0))


def _in_memory_fs(path: str) -> bool:
    """Is ``path`` on a file system held in RAM (tmpfs, ramfs), where a file saves no memory?"""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return False
    real, best, kind = os.path.realpath(path), "", ""
    for point, fs in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fs
    return kind in ("tmpfs", "ramfs")


def _disk_dir(directory: str | None) -> tuple[str, bool]:
    """Where a disk snapshot goes, and whether that is on a disk: ``directory``, else the temp dir, or
    /var/tmp where the temp dir is a tmpfs (Fedora's and Arch's /tmp)."""
    if directory is not None:
        return directory, not _in_memory_fs(directory)
    for d in (tempfile.gettempdir(), "/var/tmp"):
        if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK) and not _in_memory_fs(d):
            return d, True
    return tempfile.gettempdir(), False


@atomic  # Ctrl-C waits until the file has no name left
def _map_file(directory: str, nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of a new file in ``directory``, mapped shared. The file has no name by the time this returns
    (Linux's O_TMPFILE: never one; else unlinked at once): nothing is left on disk, even after a crash, and its
    blocks are freed when the mapping goes."""
    if shutil.disk_usage(directory).free < nbytes:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)
    fd, path, named = -1, "", False
    try:
        if getattr(os, "O_TMPFILE", 0) and os.path.isdir("/proc/self/fd"):
            try:
                fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
                path = f"/proc/self/fd/{fd}"
            except OSError:  # a file system without unnamed files
                pass
        if fd < 0:
            fd, path = tempfile.mkstemp(prefix="nanhunt-snapshot-", dir=directory)
            named = True
        try:
            # blocks reserved now: a full disk fails here, not as a SIGBUS on a write through the mapping
            os.posix_fallocate(fd, 0, nbytes)
        except (AttributeError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)
        return cast(torch.UntypedStorage, torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes))
    finally:
        if fd >= 0:
            os.close(fd)
        if named:
            os.unlink(path)


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i: plain tensors on one device in one fused call (a model of a
    thousand tensors: one call, not a thousand), the rest (a host copy, a tensor subclass) one by one."""
    same: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    with torch.no_grad():
        for d, s in zip(dst, src):
            if d.__class__ is torch.Tensor and s.__class__ is torch.Tensor and d.device == s.device:
                same[0].append(d)
                same[1].append(s)
            elif is_plain(d) and is_plain(s):
                d.copy_(s, non_blocking=True)  # a host copy is pinned or on the CPU and never changes
            else:
                subclass_copy(d, s)  # its own copy_, or inner tensor into inner tensor
        if same[0]:
            foreach_copy(*same)


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return copy.deepcopy(v)
