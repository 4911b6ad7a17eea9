"""Low precision beyond autocast in a capture: torchao's float8 training conversion and QLoRA's NF4 weights, recorded
from the live model as plain data (:func:`captured`) and rebuilt after the replay's model is built and loaded
(:func:`read_plan`, :func:`convert_float8`, :func:`quantize_nf4`).

``convert_to_float8_training`` swaps ``nn.Linear`` layers for ``Float8Linear`` once the model is built, so a factory
or a class alone rebuilds a model without them: its step replays in high precision, where a float8 failure is no
failure. A capture therefore says which layers ran in float8 (their fully qualified names, as ``module_filter_fn``
receives them) and with which ``Float8LinearConfig`` (its fields: enums by name, dtypes by name, nested configs as
dicts). A ``Float8Linear`` keeps its weight as a plain high-precision parameter and casts it in ``forward``: its
state dict is a ``nn.Linear``'s, which loads into the rebuilt model before the conversion, the same parameters kept.

An ``NF4Tensor`` base weight (torchao's ``to_nf4``) is saved as its dequantized values, which load into a plain
model, beside its quantized parts (codes, quantized block scalers, the factor and mean that restore them, the
lookup table). Quantizing the dequantized weight again gives other scalers (each block's absolute maximum is no
longer the original's), so the replay rebuilds the weight from the parts: the same values bit for bit.

The record is a suggestion, read as the other fields of a capture are: only fields ``Float8LinearConfig`` (and the
configs it nests) declares, each of its declared type (an enum member by name among torchao's own members, a dtype
by name among torch's floating dtypes); module names the built model holds, each an ``nn.Linear``; NF4 parts of the
shapes and dtypes torchao's own quantization of the weight gives. torchao is imported only to read a record that
says float8 or NF4 ran (a fixed import: torch's own library for these formats, never a name from the file), and
never while capturing: a model holding these layers has imported it already.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import sys
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._util._errors import InputError, first_line
from .._util._text import dtype_name, few, shown
from .._util._wrappers import user_class
from ..step._float8 import float8_layers

__all__ = ["Float8Group", "NF4Weight", "LowpPlan", "captured", "snapshot_copy", "read_plan", "convert_float8", "quantize_nf4",
           "built_class", "built_repr"]

_FLOAT8 = "torchao.float8"
_NF4_HOMES = ("torchao.quantization", "torchao.dtypes")  # where to_nf4 lives (0.18; older releases)
_AGAIN = "save the capture again (nanhunt.save_capture)"


@dataclasses.dataclass(frozen=True)
class Float8Group:
    """Layers converted with one configuration: torchao's ``Float8LinearConfig`` (built from the record) and the
    layers' fully qualified names."""

    config: Any
    modules: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class NF4Weight:
    """A parameter held as an ``NF4Tensor``: its name, block sizes, and its quantized parts (None: the capture
    holds none; the weight is quantized again from its dequantized values)."""

    name: str
    block_size: int
    scaler_block_size: int
    requires_grad: bool
    parts: Mapping[str, torch.Tensor] | None


@dataclasses.dataclass(frozen=True)
class LowpPlan:
    """What the replay rebuilds after the model is built and loaded."""

    float8: tuple[Float8Group, ...] = ()
    nf4: tuple[NF4Weight, ...] = ()
    torchao_version: str | None = None


# ------------------------------------------------------------------ the layers as they were built
def built_class(m: nn.Module) -> type:
    """The class ``m`` was built as: ``nn.Linear`` for a ``Float8Linear`` (the conversion replaced it after the
    model was built, and the replay converts it again), else the class you wrote (:func:`user_class`)."""
    return nn.Linear if _is_float8(m) else user_class(m)


def built_repr(m: nn.Module) -> str:
    """``m``'s arguments (``extra_repr``) as the class it was built as shows them."""
    return nn.Linear.extra_repr(m) if _is_float8(m) else m.extra_repr()  # type: ignore[arg-type]


def _is_float8(m: nn.Module) -> bool:
    cls = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    return isinstance(cls, type) and isinstance(m, cls)


def _is_nf4(t: Any) -> bool:
    """torchao's ``NF4Tensor``, known by its class (nothing imported): its name, its home, its parts."""
    return any(c.__name__ == "NF4Tensor" and c.__module__.startswith("torchao.") for c in type(t).__mro__) \
        and callable(getattr(t, "get_original_weight", None))


# ------------------------------------------------------------------ capturing
def snapshot_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a state tensor on the CPU, for the Guard's last-good snapshot; an NF4 weight is kept itself: torchao
    gives it no in-place arithmetic (a step cannot write it: it is frozen), and moving it would dequantize it."""
    return t.detach() if _is_nf4(t) else t.detach().to("cpu", copy=True)


def captured(model: nn.Module, state: Mapping[str, torch.Tensor]) -> tuple[
        dict[str, torch.Tensor], dict[str, Any] | None, dict[str, dict[str, torch.Tensor]] | None]:
    """``state`` with each NF4 weight dequantized (a plain model loads it), the ``lowp`` record of ``model`` (None:
    no float8 layer and no NF4 weight) and the NF4 weights' parts by name (None: none in ``state``). Nothing is
    imported: without torchao loaded this is two dictionary look-ups."""
    if "torchao" not in sys.modules:
        return dict(state), None, None
    plain = dict(state)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        if _is_nf4(v):
            plain[k] = v.get_original_weight().detach()  # type: ignore[attr-defined]
            names, _ = v.__tensor_flatten__()  # type: ignore[attr-defined]
            parts[k] = {n: getattr(v, n).detach().cpu().clone() for n in names}
    nf4 = [{"weight": n, "block_size": int(getattr(p, "block_size")),
            "scaler_block_size": int(getattr(p, "scaler_block_size")), "requires_grad": bool(p.requires_grad)}
           for n, p in model.named_parameters() if _is_nf4(p)]
    float8 = _float8_record(model)
    record: dict[str, Any] | None = None
    if float8 or nf4:
        record = {"float8": float8, "nf4": nf4, "torchao_version": str(getattr(sys.modules["torchao"],
                                                                                "__version__", ""))}
    return plain, record, parts or None


def _float8_record(model: nn.Module) -> list[dict[str, Any]]:
    """The float8 layers grouped by configuration, in model order: ``[{"config": {...}, "modules": [...]}]``."""
    groups: dict[str, dict[str, Any]] = {}
    for name, layer in float8_layers(model).items():
        config = _encoded(getattr(layer, "config"))
        key = repr(sorted(config.items()))
        groups.setdefault(key, {"config": config, "modules": []})["modules"].append(name)
    return list(groups.values())


def _encoded(config: Any) -> dict[str, Any]:
    """A config dataclass's init fields as plain data. A field of a type nanhunt cannot write plainly (none in
    torchao 0.18) is left out: the replay's torchao gives it its default."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.init:
            try:
                out[f.name] = _plain(getattr(config, f.name))
            except TypeError:
                continue
    return out


def _plain(v: Any) -> Any:
    if v is None or type(v) in (bool, int, float, str):
        return v
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, torch.dtype):
        return dtype_name(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _encoded(v)
    raise TypeError(type(v).__name__)


# ------------------------------------------------------------------ reading a record
def read_plan(ck: Mapping[str, Any], where: str) -> LowpPlan | None:
    """The ``lowp`` record of a capture, checked (its float8 configs built by torchao, which is imported then);
    None when the step ran neither float8 nor NF4. One :class:`InputError` line for anything else."""
    rec = ck.get("lowp")
    if rec is None:
        return None
    bad = f"{where} is not a valid nanhunt capture"
    if not isinstance(rec, Mapping) or not set(rec) <= {"float8", "nf4", "torchao_version"}:
        raise InputError(f"{bad}: field 'lowp' is not a record of float8 layers and NF4 weights; {_AGAIN}")
    f8, nf4, version = rec.get("float8") or [], rec.get("nf4") or [], rec.get("torchao_version")
    if not isinstance(f8, list) or not isinstance(nf4, list) or not (version is None or isinstance(version, str)):
        raise InputError(f"{bad}: field 'lowp' holds no lists of float8 layers and NF4 weights; {_AGAIN}")
    groups = _float8_groups(f8, bad) if f8 else ()
    weights = _nf4_weights(nf4, ck.get("nf4_parts"), bad) if nf4 else ()
    return LowpPlan(groups, weights, version) if groups or weights else None


def _float8_groups(entries: list[Any], bad: str) -> tuple[Float8Group, ...]:
    seen: set[str] = set()
    out = []
    for i, e in enumerate(entries):
        if not (isinstance(e, Mapping) and set(e) == {"config", "modules"} and isinstance(e["config"], Mapping)
                and isinstance(e["modules"], list) and all(isinstance(n, str) for n in e["modules"])):
            raise InputError(f"{bad}: its float8 record's entry {i} is not a config and a list of module names; "
                             f"{_AGAIN}")
        twice = [n for n in e["modules"] if n in seen or seen.add(n)]  # type: ignore[func-returns-value]
        if twice:
            raise InputError(f"{bad}: its float8 record names module {shown(twice[0])!r} twice; {_AGAIN}")
        out.append(Float8Group(_config(e["config"], f"{bad}: its float8 config"), tuple(e["modules"])))
    return tuple(out)


def _torchao(module: str, why: str) -> types.ModuleType:
    """torchao's ``module``, imported (a fixed name, never one from the file)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise InputError(f"the capture's step ran {why} (torchao) and torchao cannot be imported here "
                         f"({first_line(e)}); install it (pip install torchao) to replay it") from e


def _config(rec: Mapping[str, Any], where: str) -> Any:
    """torchao's ``Float8LinearConfig`` with the recorded fields, each checked against its declared type."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's import warns about kernels it cannot load on this machine
        cls = getattr(_torchao(_FLOAT8, "float8 training"), "Float8LinearConfig")
    return _decode(rec, cls, where, "")


def _decode(value: Any, hint: Any, where: str, field: str) -> Any:
    """``value`` (plain data from the file) as a value of the declared type ``hint``; InputError otherwise."""
    said = f"{where} field {field!r}" if field else where
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        if len(args) == 1:
            return _decode(value, args[0], where, field)
    elif dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _dataclass(value, hint, where, field)
    elif hint is bool or hint is int or hint is str:
        if type(value) is hint:
            return value
        raise InputError(f"{said} is {_shown_value(value)}, expected {'true or false' if hint is bool else hint.__name__}"
                         f"; {_AGAIN}")
    elif hint is float:
        if type(value) in (int, float):
            return float(value)
        raise InputError(f"{said} is {_shown_value(value)}, expected a number; {_AGAIN}")
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, str) and value in hint.__members__:
            return hint.__members__[value]
        raise InputError(f"{said} is {_shown_value(value)}, expected one of {', '.join(hint.__members__)}; {_AGAIN}")
    elif hint is torch.dtype:
        dt = getattr(torch, value, None) if isinstance(value, str) and value.isidentifier() \
            and not value.startswith("_") else None
        if isinstance(dt, torch.dtype) and dt.is_floating_point:
            return dt
        raise InputError(f"{said} is {_shown_value(value)}, expected a floating dtype's name; {_AGAIN}")
    raise InputError(f"{said} is of a type nanhunt does not read from a file ({hint!r}); {_AGAIN}")


def _dataclass(value: Any, cls: type, where: str, field: str) -> Any:
    said = f"{where} field {field!r}" if field else where
    if not (isinstance(value, Mapping) and all(isinstance(k, str) for k in value)):
        raise InputError(f"{said} is {_shown_value(value)}, expected the fields of {cls.__name__}; {_AGAIN}")
    declared = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(k for k in value if k not in declared)
    if unknown:
        raise InputError(f"{where} has field(s) {few([shown(k) for k in unknown])} that torchao's {cls.__name__} "
                         f"does not declare; {_AGAIN}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _decode(v, hints[k], where, f"{field}.{k}" if field else k) for k, v in value.items()}
    try:
        return cls(**kwargs)
    except Exception as e:  # torchao's own checks of a combination (__post_init__ asserts)
        raise InputError(f"{said}: torchao refuses it ({shown(first_line(e))}); {_AGAIN}") from e


def _shown_value(v: Any) -> str:
    if isinstance(v, str):
        return repr(shown(v, 40))
    if v is None or type(v) in (bool, int, float):
        return shown(repr(v), 40)
    return f"a {type(v).__name__}"


def _nf4_weights(entries: list[Any], parts: Any, bad: str) -> tuple[NF4Weight, ...]:
    keys = {"weight", "block_size", "scaler_block_size", "requires_grad"}
    if parts is not None and not (isinstance(parts, Mapping) and all(
            isinstance(p, Mapping) and all(isinstance(k, str) and type(t) is torch.Tensor for k, t in p.items())
            for p in parts.values())):
        raise InputError(f"{bad}: field 'nf4_parts' does not hold plain tensors by weight name; {_AGAIN}")
    out = []
    for i, e in enumerate(entries):
        if not (isinstance(e, Mapping) and set(e) == keys and isinstance(e["weight"], str)
                and all(type(e[k]) is int and 0 < e[k] < 2**31 for k in ("block_size", "scaler_block_size"))
                and type(e["requires_grad"]) is bool):
            raise InputError(f"{bad}: its NF4 record's entry {i} is not a weight name, two block sizes and a "
                             f"requires_grad flag; {_AGAIN}")
        out.append(NF4Weight(e["weight"], e["block_size"], e["scaler_block_size"], e["requires_grad"],
                             None if parts is None else parts.get(e["weight"])))
    if len({w.name for w in out}) != len(out):
        raise InputError(f"{bad}: its NF4 record names a weight twice; {_AGAIN}")
    return tuple(out)


# ------------------------------------------------------------------ rebuilding
def convert_float8(model: nn.Module, plan: LowpPlan, *, device: torch.device, notes: list[str],
                   where: str) -> nn.Module:
    """``model`` (built, its weights loaded) with the recorded layers converted by torchao's
    ``convert_to_float8_training``, each group with its config (emulated on a CPU: no float8 matmul there).
    A layer the model already holds in float8 (a factory that converts) is left as it is."""
    if not plan.float8:
        return model
    mods = dict(model.named_modules())
    names = [n for g in plan.float8 for n in g.modules]
    missing = [n for n in names if n not in mods]
    if missing:
        raise InputError(f"{where} ran module(s) {few([shown(n) for n in missing])} in float8, which the model "
                         "does not have: is --model the model that ran?")
    plain = [n for n in names if not isinstance(mods[n], nn.Linear)]
    if plain:
        raise InputError(f"{where} ran module(s) {few([shown(n) for n in plain])} in float8, which are not "
                         "nn.Linear layers in the model (float8 training converts only those): is --model the "
                         "model that ran?")
    torchao = _torchao(_FLOAT8, "float8 training")
    already = {n for n in names if _is_float8(mods[n])}
    emulated = False
    for g in plan.float8:
        todo = frozenset(g.modules) - already
        config = g.config
        if device.type == "cpu" and not config.emulate:
            config, emulated = dataclasses.replace(config, emulate=True), True
        if todo:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = torchao.convert_to_float8_training(
                    model, config=config, module_filter_fn=lambda mod, fqn, todo=todo: fqn in todo)
    got = set(float8_layers(model))
    if not set(names) <= got:
        raise InputError(f"{where}: torchao did not convert {few(sorted(set(names) - got))} to float8; "
                         "is --model the model that ran?")
    notes.append(f"float8 training rebuilt as the capture recorded: {few(names)} converted by "
                 "torchao's convert_to_float8_training" + (" (already float8 in the model built: "
                                                           f"{few(sorted(already))})" if already else "")
                 + (" (emulated on the cpu: no float8 matmul here)" if emulated else ""))
    extra = sorted(got - set(names))
    if extra:
        notes.append(f"float8 layers the capture does not record are left as the model built them: {few(extra)}")
    return model


def quantize_nf4(model: nn.Module, plan: LowpPlan, *, notes: list[str], where: str) -> None:
    """Each recorded weight of ``model`` (built, loaded, on its device) made an ``NF4Tensor`` again: torchao's
    ``to_nf4`` gives its shapes, the capture's parts its values."""
    if not plan.nf4:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_nf4 = _to_nf4()
    params = dict(model.named_parameters())
    again = []
    for w in plan.nf4:
        p = params.get(w.name)
        if p is None:
            raise InputError(f"{where} holds weight {shown(w.name)!r} as NF4, a parameter the model does not have: "
                             "is --model the model that ran?")
        values = p.get_original_weight() if _is_nf4(p) else p.detach()  # type: ignore[attr-defined]
        try:
            q = to_nf4(values.contiguous(), w.block_size, w.scaler_block_size)
        except Exception as e:
            raise InputError(f"{where}: NF4 weight {shown(w.name)!r} cannot be quantized with block sizes "
                             f"{w.block_size} and {w.scaler_block_size} ({shown(first_line(e))}); {_AGAIN}") from e
        if w.parts is None:
            again.append(w.name)
        else:
            _put_parts(q, w, where)
        owner, _, leaf = w.name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(q, requires_grad=w.requires_grad))
    notes.append(f"QLoRA's NF4 weights rebuilt as the capture recorded: {few([w.name for w in plan.nf4])}")
    if again:
        notes.append(f"NF4 weight(s) {few(again)} quantized again from their dequantized values (the capture holds "
                     "no NF4 parts): their values may differ from the step's in the last bits")


def _put_parts(q: torch.Tensor, w: NF4Weight, where: str) -> None:
    """The capture's parts into ``q``, each of the shape and dtype torchao's own quantization gave it."""
    assert w.parts is not None
    names, _ = q.__tensor_flatten__()  # type: ignore[attr-defined]
    if set(w.parts) != set(names):
        raise InputError(f"{where}: the NF4 parts of {shown(w.name)!r} are not torchao's ({few(sorted(names))}); "
                         f"{_AGAIN}")
    for n in names:
        mine, given = getattr(q, n), w.parts[n]
        if given.shape != mine.shape or given.dtype != mine.dtype:
            raise InputError(f"{where}: the NF4 part {n!r} of {shown(w.name)!r} is {dtype_name(given.dtype)} "
                             f"{tuple(given.shape)}, expected {dtype_name(mine.dtype)} {tuple(mine.shape)}; {_AGAIN}")
        with torch.no_grad():
            mine.copy_(given.to(mine.device))


def _to_nf4() -> Any:
    for home in _NF4_HOMES:
        fn = getattr(_torchao(home, "QLoRA's NF4 weights"), "to_nf4", None)
        if callable(fn):
            return fn
    raise InputError("the capture's step held NF4 weights and this torchao has no to_nf4; install torchao>=0.18")
