"""Private: every ``torch._``/``torch.utils._`` import of nanhunt lives here."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import TorchDispatchMode

from ._subclass import is_plain, local_tensor, plain_values, subclass_copy

__all__ = [
    "TraceMode",
    "OpInfo",
    "op_info",
    "current_autograd_node",
    "peek_sequence_nr",
    "set_dynamo_disabled",
    "TorchDispatchMode",
    "Mode",
    "eager_only",
    "OP_INFOS",
    "push_mode",
    "pop_mode",
    "mode_on_stack",
    "in_recomputation",
    "checkpoint_frames",
    "graph_task_id",
    "tensor_version",
    "node_sequence_nr",
    "no_autocast",
    "compiled_original",
    "keeps_running_stats",
    "own_weights",
    "amp_check_and_unscale",
    "foreach_norm",
    "nonfinite_kinds",
    "all_finite",
    "foreach_copy",
    "local_tensor",
    "plain_values",
    "is_plain",
    "is_dtensor",
    "complete_collective",
    "collective_label",
]

current_autograd_node: Callable[[], Any] = torch._C._current_autograd_node
# The next autograd sequence number of this thread. The autograd kernel creates an
# op's backward node *before* the op reaches a dispatch mode, so when the number
# moved since the previous op, the node of this op is number - 1.
peek_sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr
# Autocast off until the block ends, for every device (a C++ guard excluding the autocast
# dispatch keys: ~0.6 us, against ~5 us for ``torch.autocast(..., enabled=False)``).
no_autocast: Callable[[], contextlib.AbstractContextManager[None]] = torch._C._DisableAutocast

# Views whose output holds exactly the elements of their input: a NaN in one is a
# NaN in the other, so the output shares the input's record instead of a new pass.
_SAME_SET_VIEWS = frozenset(
    {
        "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute",
        "unsqueeze", "squeeze", "alias", "detach", "expand", "view_as", "expand_as",
        "flatten", "unflatten", "movedim", "swapaxes", "swapdims", "lift_fresh",
        "numpy_T", "mT", "mH", "adjoint", "_conj", "conj", "_neg_view", "view_as_real",
    }
)


# Ops whose output memory is uninitialised: whatever bits it holds (NaN included)
# are no value yet. The op that fills it is the one to judge.
_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
                            "resize_"})  # resize_ may grow into fresh memory


# Ops whose output holds exactly the values of one input, perhaps cast to another dtype:
# the output's min/max are the input's (cast: rounding is monotone, overflow included),
# so they are derived instead of measured. copy_ writes its source into self.
_COPIES = frozenset({"clone", "_to_copy", "_unsafe_view", "contiguous", "lift_fresh_copy", "alias_copy",
                     "detach_copy", "view_copy", "_reshape_copy"})


# In-place ops that overwrite all of ``self`` without reading it.
_OVERWRITE = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "exponential_", "random_",
                        "geometric_", "cauchy_", "log_normal_"})


# Collectives of torch.distributed as the dispatch mode sees them (DDP: ``c10d::allreduce_``; FSDP2:
# ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``; functional collectives: ``_c10d_functional::*``).
# Their outputs hold values that arrived from other ranks: never an origin on this rank.
# name -> (what it is, positions of the arguments it writes the received values into, positions it reads).
_C10D: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] = {
    "allreduce_": ("all-reduce", (0,), (0,)),
    "allreduce_coalesced_": ("all-reduce", (0,), (0,)),
    "broadcast_": ("broadcast", (0,), (0,)),
    "reduce_": ("reduce", (0,), (0,)),
    "_allgather_base_": ("all-gather", (0,), (1,)),
    "allgather_": ("all-gather", (0,), (1,)),
    "allgather_coalesced_": ("all-gather", (0,), (1,)),
    "allgather_into_tensor_coalesced_": ("all-gather", (0,), (1,)),
    "_reduce_scatter_base_": ("reduce-scatter", (0,), (1,)),
    "reduce_scatter_": ("reduce-scatter", (0,), (1,)),
    "reduce_scatter_tensor_coalesced_": ("reduce-scatter", (0,), (1,)),
    "alltoall_base_": ("all-to-all", (0,), (1,)),
    "alltoall_": ("all-to-all", (0,), (1,)),
    "scatter_": ("scatter", (0,), (1,)),
    "gather_": ("gather", (0,), (1,)),
    "recv_": ("receive", (0,), ()),
    "recv_any_source_": ("receive", (0,), ()),
}
_FUNCTIONAL = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
               "reduce_scatter_tensor": "reduce-scatter", "broadcast": "broadcast", "all_to_all_single": "all-to-all"}


def collective_label(name: str) -> str | None:
    """``"all-reduce"`` for ``"c10d::allreduce_"``: what a collective op is, in words; else None."""
    ns, _, base = name.partition("::")
    c = _collective(ns, base)
    return None if c is None else c[0]


def _collective(namespace: str, base: str) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    if namespace == "c10d":
        return _C10D.get(base)
    if namespace in ("_c10d_functional", "c10d_functional"):
        for prefix, label in _FUNCTIONAL.items():
            if base.startswith(prefix):
                return (label, (), (0,))  # received: the outputs (and the schema's written arguments)
    return None


@dataclass(frozen=True)
class OpInfo:
    name: str  # "aten::addmm"
    same_set_view: bool
    is_view: bool
    uninitialised: bool
    copy_of: int | None  # position among the op's floating tensor inputs whose values the output holds
    hidden_writes: tuple[int, ...]  # written although the schema does not say so (batch norm's running stats)
    constant: bool  # lift_fresh: a tensor literal (torch.tensor(nan)) enters, like a Python scalar
    write_only_args: tuple[int, ...]  # written, never read: their old values are no input
    write_only_kwargs: tuple[str, ...]
    written_args: tuple[int, ...]  # positional indices of arguments the op writes to
    written_kwargs: tuple[str, ...]
    writes: bool  # any argument written (schema or hidden)
    run: Callable[..., Any]  # the op itself, called without OpOverload.__call__'s Python frame
    func: Any  # the OpOverload (keeps the id of OP_INFOS' key alive)
    # a collective ("all-reduce", ...): its outputs arrived from other ranks; None for every other op
    collective: str | None = None
    received_args: tuple[int, ...] = ()  # a collective's arguments holding what it received
    read_args: tuple[int, ...] = ()  # a collective's arguments it sends
    # a fused multi-tensor op (_foreach_*, _amp_foreach_*, _fused_adam_ ...): output i is made from the i-th
    # tensor of each list argument (and the shared tensors), never from all of them
    fused: bool = False


OP_INFOS: dict[int, OpInfo] = {}  # id(func) -> its OpInfo, filled by op_info (OpOverload hashes in Python)


def op_info(func: Any) -> OpInfo:
    info = OP_INFOS.get(id(func))
    if info is not None:
        return info
    schema = func._schema
    returns_alias = bool(schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )
    written_pos: list[int] = []
    written_kw: list[str] = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if a.kwarg_only:
                written_kw.append(a.name)
            else:
                written_pos.append(i)
    base = func._overloadpacket.__name__
    coll = _collective(schema.name.split("::", 1)[0], base)
    wo_pos = tuple(i for i in written_pos if base in _OVERWRITE and i == 0)
    wo_kw = tuple(k for k in written_kw if k.startswith("out"))
    # native_batch_norm(input, weight, bias, running_mean, running_var, training, ...) updates
    # the running stats in place when training, without an alias annotation (no version bump).
    hidden = (3, 4) if base in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm") else ()
    info = OpInfo(
        name=schema.name,
        same_set_view=returns_alias and base in _SAME_SET_VIEWS and len(schema.returns) == 1,
        is_view=returns_alias,
        # FSDP2's all-gather buffer: this rank's shard copied into fresh memory, the rest still unwritten
        uninitialised=base in _UNINITIALISED or schema.name == "fsdp::all_gather_copy_in",
        copy_of=0 if base in _COPIES or base == "copy_" else None,
        hidden_writes=hidden,
        constant=base in ("lift_fresh", "lift_fresh_copy"),
        write_only_args=wo_pos,
        write_only_kwargs=wo_kw,
        written_args=tuple(written_pos),
        written_kwargs=tuple(written_kw),
        writes=bool(written_pos or written_kw or hidden),
        run=getattr(func, "_op", func),
        func=func,
        collective=None if coll is None else coll[0],
        received_args=() if coll is None else coll[1],
        read_args=() if coll is None else coll[2],
        fused=base.startswith(("_foreach_", "_amp_foreach_", "_fused_")),
    )
    OP_INFOS[id(func)] = info
    return info


def is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor (a sharded value: its local shard is this rank's part)."""
    return isinstance(getattr(t, "_local_tensor", None), torch.Tensor)


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place write); -1 for inference tensors, which have none."""
    try:
        return t._version
    except RuntimeError:
        return -1


def complete_collective(out: Any, functional: bool) -> None:
    """Wait until a collective's values have arrived (they exist only then; an asynchronous one
    returns at once): the ``Work`` a ``c10d`` op returns, or each output of a functional collective
    (``functional``). The caller's own later wait returns at once."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    for o in items:
        if isinstance(o, torch.Tensor):
            if functional:
                torch.ops._c10d_functional.wait_tensor(o)
        elif isinstance(o, (tuple, list)):
            complete_collective(o, functional)
        elif o is not None and callable(getattr(o, "wait", None)):
            o.wait()


def node_sequence_nr(node: Any) -> int:
    """An autograd node's sequence number: the value :data:`peek_sequence_nr` had when it was made."""
    return node._sequence_nr()  # type: ignore[no-any-return]


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The eager module a ``torch.compile``d one wraps; ``None`` for a module that is not compiled."""
    orig = getattr(model, "_orig_mod", None)
    return orig if isinstance(orig, nn.Module) else None


def keeps_running_stats(module: nn.Module) -> bool:
    """A normalisation layer whose buffers are running statistics (batch norm, instance norm)."""
    return isinstance(module, _NormBase)


def own_weights(module: nn.Module) -> tuple[Iterable[Any], Iterable[Any]]:
    """The module's own parameter and buffer slots (not its children's; shared ones and ``None`` included)."""
    return module._parameters.values(), module._buffers.values()


def push_mode(mode: TorchDispatchMode) -> None:
    """Put ``mode`` on this thread's dispatch-mode stack (what ``with mode:`` does, without its
    Python bookkeeping: callable from an autograd hook, whose thread state autograd restores)."""
    torch._C._push_on_torch_dispatch_stack(mode)


def mode_on_stack(mode: TorchDispatchMode) -> bool:
    return any(torch._C._get_dispatch_stack_at(i) is mode for i in range(torch._C._len_torch_dispatch_stack()))


def pop_mode(mode: TorchDispatchMode) -> bool:
    """Take ``mode`` off the stack if it is on top; say whether it was."""
    n = torch._C._len_torch_dispatch_stack()
    if n and torch._C._get_dispatch_stack_at(n - 1) is mode:
        torch._C._pop_torch_dispatch_stack(None)
        return True
    return False


def in_recomputation() -> bool:
    """Whether torch.utils.checkpoint (non-reentrant) is recomputing a forward right now: its
    saved-tensor hooks are on top while the recomputed ops run, inside some backward node."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(True) if top is not None else None  # absent in some torch versions: assume not
    return hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", "")


# The current backward's id (-1 outside one): a second backward of a retained graph recomputes anew.
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
_top_hooks: Callable[[bool], Any] | None = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _closure(fn: Any, name: str) -> Any:
    """The value ``fn``'s closure holds under ``name`` (``None`` when it holds none)."""
    fn = getattr(fn, "__wrapped__", fn)  # torch._dynamo.disable's wrapper
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells or name not in code.co_freevars:
        return None
    return cells[code.co_freevars.index(name)].cell_contents


def checkpoint_frames() -> tuple[list[Any], tuple[Any, Any] | None]:
    """What torch.utils.checkpoint (non-reentrant) runs now, read off the saved-tensor hooks stack: the
    frames whose forward runs (innermost first) above the innermost recomputation, and that recomputation
    as (its pack hook: one per recomputation, its frame), or ``None``. The stack is popped to be read and
    pushed back as it was; nothing is popped when no saved-tensor hook is set."""
    if _top_hooks is None:
        return [], None
    try:
        top = _top_hooks(True)
    except RuntimeError:  # saved-tensor hooks disabled here (torch.compile internals): no checkpoint runs
        return [], None
    if top is None:
        return [], None
    opened: list[Any] = []
    recomputing: tuple[Any, Any] | None = None
    popped: list[Any] = []
    pop, push = torch._C._autograd._pop_saved_tensors_default_hooks, torch._C._autograd._push_saved_tensors_default_hooks
    try:
        while top is not None:
            kind = getattr(top[0], "__qualname__", "")
            if kind.startswith("_recomputation_hook."):
                ref = _closure(top[0], "target_frame_ref")
                frame = ref() if callable(ref) else None
                if frame is not None:
                    recomputing = (top[0], frame)
                break
            if kind.startswith("_checkpoint_hook."):
                frame = _closure(top[0], "frame")
                if frame is not None:
                    opened.append(frame)
            popped.append(top)
            pop()
            top = _top_hooks(True)
    finally:
        for hooks in reversed(popped):
            push(*hooks)
    return opened, recomputing


@contextlib.contextmanager
def eager_only() -> Iterator[None]:
    """torch.compile'd code runs eagerly inside (a no-op when dynamo was never imported: then
    nothing was compiled)."""
    if "torch._dynamo" not in sys.modules:
        yield
        return
    previous = set_dynamo_disabled(True)
    try:
        yield
    finally:
        if previous is not None:
            set_dynamo_disabled(previous)


def set_dynamo_disabled(disabled: bool) -> bool | None:
    """Turn torch.compile off (compiled models then run eagerly); returns the previous setting,
    or None when this torch has no dynamo."""
    try:
        import torch._dynamo.config as dynamo_config
    except Exception:  # pragma: no cover - torch without dynamo
        return None
    previous = bool(dynamo_config.disable)
    dynamo_config.disable = disabled
    return previous


class Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__
    """A dispatch mode whose handler torch does not wrap in ``torch._disable_dynamo``: the wrapper
    costs ~2 us per op and imports dynamo (~1.2 s) on first use. nanhunt keeps dynamo out of its
    handlers itself, by turning compilation off while a mode of its own is on (see ``eager_only``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class TraceMode(Mode):
    """Hands every aten op to ``on_op(func, args, kwargs)``, which must run it."""

    def __init__(self, on_op: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._on_op = on_op

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return self._on_op(func, args, kwargs or {})


# torch's fused multi-tensor kernels (GradScaler's and the optimizers'): underscored, so wrapped here
def amp_check_and_unscale(tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Set ``found_inf`` to 1 if any of ``tensors`` holds NaN/Inf; multiply them by ``inv_scale`` in place. A
    tensor subclass that has no such kernel (an NF4 weight) is checked on its values and left as it is."""
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
    except (NotImplementedError, RuntimeError, TypeError):
        if all(map(is_plain, tensors)):
            raise
        plain = [t for t in tensors if is_plain(t)]
        if plain:
            torch._amp_foreach_non_finite_check_and_unscale_(plain, found_inf, inv_scale)
        values = [local_tensor(t) for t in tensors if not is_plain(t)]
        torch._amp_foreach_non_finite_check_and_unscale_([v.clone() for v in values], found_inf,
                                                         torch.ones_like(inv_scale))


def foreach_norm(tensors: list[torch.Tensor], ord: float, *, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Each tensor's ``ord``-norm; a tensor subclass without such a kernel is measured on its values."""
    try:
        return list(torch._foreach_norm(tensors, ord, dtype=dtype))
    except (NotImplementedError, RuntimeError, TypeError):
        if all(map(is_plain, tensors)):
            raise
        return list(torch._foreach_norm([local_tensor(t) for t in tensors], ord, dtype=dtype))


def nonfinite_kinds(tensors: Sequence[torch.Tensor]) -> list[str | None]:
    """``"nan"`` / ``"inf"`` for each of ``tensors`` that holds one (NaN first), None for a finite one (or an
    empty, sparse or not floating one), read from the device once. Read-only max-norms (NaN and Inf propagate),
    one fused kernel per (device, dtype), compared in float64 (a float64 1e300 is finite): a per-tensor
    ``isfinite`` would read the host once each and allocate a mask the size of every tensor, memory the allocator
    keeps for the rest of a replay."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and t.numel() and not t.is_sparse:
            groups.setdefault((t.device, t.dtype), []).append(i)
    if not groups:
        return [None] * len(tensors)
    home = tensors[next(iter(groups.values()))[0]].device
    with torch.no_grad():
        peaks = [torch.stack(foreach_norm([tensors[i] for i in idx], math.inf, dtype=None)).double().to(home)
                 for idx in groups.values()]
        values = torch.cat(peaks).tolist()
    kinds: list[str | None] = [None] * len(tensors)
    for i, v in zip((i for idx in groups.values() for i in idx), values):
        kinds[i] = "nan" if math.isnan(v) else "inf" if math.isinf(v) else None
    return kinds


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Every one of ``tensors`` finite, read from the device once (:func:`nonfinite_kinds`)."""
    return not any(nonfinite_kinds(tensors))


def foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, fused; pairs with a tensor subclass one by one, through its own
    ``copy_`` or its inner tensors."""
    try:
        torch._foreach_copy_(dst, src)
    except (NotImplementedError, RuntimeError, TypeError):
        if all(map(is_plain, dst)) and all(map(is_plain, src)):
            raise
        for d, s in zip(dst, src):
            if is_plain(d) and is_plain(s):
                d.copy_(s)
            else:
                subclass_copy(d, s)


def fsdp_modules(model: nn.Module) -> list[Any]:
    """The modules of ``model`` FSDP2 sharded (``fully_shard``); none when FSDP2 was never imported."""
    if "torch.distributed.fsdp" not in sys.modules:
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_fresh_buffers(modules: list[Any], *, reshard: bool = True) -> None:
    """Each run (each traced step) all-gathers into new buffers, as the first one did. FSDP2 keeps a
    parameter's all-gather buffers from one step to the next, frees their memory after use and grows it
    back before the next all-gather (``UntypedStorage.resize_``, no op a trace sees): a later step's trace
    met them as unknown tensors holding whatever the allocator left there (at times NaN) and blamed them as
    non-finite inputs. Dropped, they are made again by ``torch.empty`` (known unwritten). ``reshard``: free
    the unsharded parameters first (a replay's run); without, a module whose parameters are unsharded now
    (a live trace started mid-step) keeps its buffers. FSDP2's private state: revisit with torch."""
    for m in modules:
        if reshard:
            m.reshard()  # the sharded parameters registered, the unsharded ones' memory freed
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # older torch: one group per module
            one = getattr(state, "_fsdp_param_group", None)
            groups = [] if one is None else [one]
        for group in groups:
            if not group.is_sharded:  # left mid-forward by an exception: FSDP2 still uses them
                continue
            for p in group.fsdp_params:
                p.all_gather_outputs = []
                p._unsharded_inner_tensors = []
                if hasattr(p, "_unsharded_param"):
                    del p._unsharded_param


def dcp_storage_info() -> type:
    """DCP's ``_StorageInfo``, the type of a distributed checkpoint's ``storage_data`` values (imported here,
    when a checkpoint is read: ``torch.distributed.checkpoint`` is heavy)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def dcp_mem_format(value: int) -> Any:
    """DCP's memory-format enum member of ``value`` (``_MEM_FORMAT_ENCODING``)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return _MEM_FORMAT_ENCODING(value)


def weights_only_allowed() -> set[str]:
    """The globals torch's weights-only unpickler allows; none when this torch does not say (its allowlist has
    no public name)."""
    try:
        from torch import _weights_only_unpickler as wou

        return set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())  # type: ignore[no-untyped-call]
    except Exception:  # another torch: the caller names every global that is not torch's own
        return set()
