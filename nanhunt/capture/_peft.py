"""PEFT (LoRA) models in captures: the adapters' configs saved as JSON, and the model rebuilt from them alone.

A ``peft.PeftModel`` wraps a ``transformers`` model. Its capture holds the base model's ``hf_model`` spec (class
and JSON config, as for any transformers model) and, inside it under ``"peft"``, each adapter's config as JSON
text, the active adapter and the names of the trainable parameters. The replay builds the base model from its
config, then ``peft.get_peft_model(base, <config class>(**json))``: the config class is the one peft maps the
``peft_type`` string to, limited to adapter types whose construction reads nothing but the config; every field
is checked against the class's declared type; entries naming a Hub model are ignored, unknown ones dropped, each
with a note. Nothing from the file is imported or called, and nothing is downloaded.

``import nanhunt`` never imports peft: a model is recognised through ``sys.modules`` (a PeftModel exists only
if peft was imported), and peft is imported only to rebuild a capture that names it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from .._util._errors import InputError, first_line as _first_line

__all__ = ["is_peft_model", "spec", "rebuild", "json_object"]

# Adapter types whose construction reads only their config (no tokenizer, no other model, no module named in the
# config). Others (prompt tuning loads a tokenizer by name, X-LoRA loads adapters from paths) replay with --model.
ADAPTERS = ("LORA", "LOHA", "LOKR", "IA3")
# Entries that name a Hub repository or a revision: the base model is rebuilt from the capture's config instead.
_HUB = ("base_model_name_or_path", "revision", "auto_mapping")
# Initialisations computed from data or the base weights (PiSSA, EVA, LoftQ...): the capture holds their result.
_CHEAP_INIT = (True, False, "gaussian", "lycoris")
_FIX = "pass --model package.module:factory"
# Fields peft matches against module names as regular expressions (a string) or as names and suffixes (a list,
# whose items some peft code puts inside a pattern too): only plain names are read from a file.
_NAMES = ("target_modules", "exclude_modules", "modules_to_save", "layers_pattern", "feedforward_modules",
          "target_parameters")
_MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")


def is_peft_model(model: Any) -> bool:
    """``model`` is a ``peft.PeftModel`` (without importing peft)."""
    peft = sys.modules.get("peft")
    cls = getattr(peft, "PeftModel", None)
    return inspect.isclass(cls) and isinstance(model, cls)


def spec(model: nn.Module, hf_spec: Callable[[nn.Module], dict[str, Any] | None]) -> dict[str, Any] | None:
    """The base model's ``hf_spec`` with the adapters beside it (``"peft"``); None when the replay could not
    rebuild it from the file (an adapter type it does not rebuild, a config JSON cannot say): it then needs
    ``--model``."""
    peft_config = getattr(model, "peft_config", None)
    active = getattr(model, "active_adapter", None)
    get_base = getattr(model, "get_base_model", None)
    if not (isinstance(peft_config, Mapping) and peft_config and isinstance(active, str) and callable(get_base)):
        return None
    configs: dict[str, str] = {}
    for name, cfg in peft_config.items():
        if not isinstance(name, str) or _type_name(getattr(cfg, "peft_type", None)) not in ADAPTERS:
            return None
        try:
            configs[name] = json.dumps(_plain(cfg.to_dict()))
        except (TypeError, ValueError):
            return None
    base = hf_spec(get_base())
    if base is None or active not in configs:
        return None
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return {**base, "peft": {"peft_config": configs, "active_adapter": active, "trainable": trainable}}


def _type_name(t: Any) -> Any:
    return t.value if isinstance(t, enum.Enum) else t


def _plain(obj: Any) -> Any:
    """``to_dict()``'s values as JSON says them: sets (``target_modules``) and tuples as lists, enums by value."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(_plain(v) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def rebuild(base: nn.Module, saved: Any, where: str, notes: list[str] | None = None) -> nn.Module:
    """``base`` wrapped in the adapters ``saved`` (the capture's ``hf_model["peft"]``) describes, only the
    parameters trained in the run requiring gradients; ``base`` itself when the capture has no adapter."""
    if saved is None:
        return base
    notes = notes if notes is not None else []
    configs, active, trainable = _fields(saved, where)
    try:
        peft: Any = importlib.import_module("peft")
    except ImportError:
        raise InputError(f"{where} holds a PEFT adapter, and peft is not installed here; install it (pip install "
                           f"nanhunt[transformers]) or {_FIX}") from None
    built = [(name, _config(peft, name, text, where, notes)) for name, text in configs.items()]
    for name, cfg in built:
        _check_sizes(peft, name, cfg, base)
    (first, cfg), rest = built[0], built[1:]
    try:
        model = peft.get_peft_model(base, cfg, adapter_name=first)
        for name, more in rest:
            model.add_adapter(name, more)
        if active != first:
            model.set_adapter(active)
    except Exception as e:
        raise InputError(f"cannot build the PEFT adapter from the capture's config: {_first_line(e)}; {_FIX}") \
            from e
    if not isinstance(model, nn.Module):
        raise InputError(f"peft built a {type(model).__name__}, not an nn.Module; {_FIX}")
    params = dict(model.named_parameters())
    unknown = [n for n in trainable if n not in params]
    if unknown:
        raise InputError(f"{where} is not a valid nanhunt capture: its trainable parameters "
                           f"{', '.join(unknown[:3])} are not the rebuilt PEFT model's; save the capture again")
    wanted = set(trainable)
    for n, p in params.items():  # requires_grad as in the run (a base weight the user unfroze stays unfrozen)
        p.requires_grad_(n in wanted)
    return model


def _fields(saved: Any, where: str) -> tuple[dict[str, str], str, list[str]]:
    """The ``peft`` entry's parts, each of the type it must be."""
    configs = saved.get("peft_config") if isinstance(saved, Mapping) else None
    active = saved.get("active_adapter") if isinstance(saved, Mapping) else None
    trainable = saved.get("trainable") if isinstance(saved, Mapping) else None
    if not (isinstance(configs, Mapping) and configs and all(isinstance(k, str) and isinstance(v, str)
                                                              for k, v in configs.items())
            and isinstance(active, str) and active in configs
            and isinstance(trainable, list) and all(isinstance(n, str) for n in trainable)):
        raise InputError(f"{where} is not a valid nanhunt capture: field 'hf_model.peft' does not hold adapter "
                           f"configs (JSON text by adapter name), the active adapter and the trainable parameters' "
                           f"names; {_FIX}")
    return dict(configs), active, list(trainable)


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object a capture stores as text (a model's or an adapter's config); None if it is none."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _config(peft: Any, name: str, text: str, where: str, notes: list[str]) -> Any:
    """The config object of adapter ``name``: peft's own class for its ``peft_type``, built from checked JSON."""
    data = json_object(text)
    if data is None:
        raise InputError(f"{where} is not a valid nanhunt capture: adapter {name!r}'s config is not a JSON "
                           f"object; {_FIX}")
    kind = data.get("peft_type")
    mapping = {_type_name(k): v for k, v in getattr(peft, "PEFT_TYPE_TO_CONFIG_MAPPING", {}).items()}
    cls: Any = mapping.get(kind) if isinstance(kind, str) else None
    if not (inspect.isclass(cls) and issubclass(cls, peft.PeftConfig)
            and cls.__module__.partition(".")[0] == "peft"):
        raise _refused(name, f"its peft_type {kind!r} is not an adapter type peft defines")
    if kind not in ADAPTERS:
        raise _refused(name, f"nanhunt rebuilds only {', '.join(ADAPTERS)} adapters from a file, not {kind}")
    fields = {f.name for f in dataclasses.fields(typing.cast(Any, cls)) if f.init}
    dropped = sorted(k for k in data if k not in fields)
    if dropped:
        notes.append(f"adapter {name!r}: config entries this peft ({peft.__version__}) does not know were dropped: "
                     f"{', '.join(dropped[:5])}")
    data = {k: v for k, v in data.items() if k in fields}
    ignored = [f"{k}={data[k]!r}" for k in _HUB if data.get(k) not in (None, "", {})]
    if ignored:
        notes.append(f"adapter {name!r}: {'; '.join(ignored)} ignored: nothing is downloaded, the base model is "
                     "rebuilt from the capture's config")
    data.update({k: None for k in _HUB if k in fields})
    version = data.pop("peft_version", None)
    if isinstance(version, str) and version != peft.__version__:
        notes.append(f"adapter {name!r} was written by peft {version}, rebuilt with peft {peft.__version__}")
    if data.get("megatron_config") is not None:
        raise _refused(name, "its megatron_config makes peft import the module megatron_core names")
    if data.get("layer_replication"):
        raise _refused(name, "its layer_replication makes copies of base layers, as many as the file says")
    for key in ("init_lora_weights", "init_weights"):
        init = data.get(key)
        if key in data and not any(init is c or (isinstance(c, str) and init == c) for c in _CHEAP_INIT):
            notes.append(f"adapter {name!r}: {key}={init!r} not run: the capture holds the weights it made")
            data[key] = True
    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:
        raise _refused(name, f"its config class's field types cannot be read ({_first_line(e)})") from e
    for k, v in data.items():
        if k in hints and not _fits(v, hints[k]):
            raise _refused(name, f"field {k!r} holds {_json_kind(v)} {_short(v)}, not what {cls.__name__} takes "
                                 f"({_type_text(hints[k])})")
    _check_names(name, data)
    try:
        return cls(**data)
    except Exception as e:
        raise InputError(f"cannot build adapter {name!r}'s {cls.__name__} from the capture: {_first_line(e)}; "
                           f"{_FIX}") from e


def _check_names(name: str, data: Mapping[str, Any]) -> None:
    """The fields naming modules hold module names (``lm_head``, ``attn.c_attn``), not regular expressions: peft
    matches them as patterns against every module name, and a pattern from a file (``([\\w.]+)+Z``) can run for
    hours. ``target_modules="all-linear"`` is peft's own word for every linear layer."""
    def pattern(what: str) -> InputError:
        return _refused(name, f"{what} is a pattern, not a module name: nanhunt matches no pattern read from a file "
                              "(one can run for hours); build the adapter in your own factory")

    for key in _NAMES:
        value = data.get(key)
        if value is None or (key == "target_modules" and value == "all-linear"):
            continue
        for n in [value] if isinstance(value, str) else value:
            if not _MODULE_NAME.fullmatch(n):
                raise pattern(f"its {key} {_short(n)}")
    ranks, numbers = data.get("rank_pattern"), data.get("alpha_pattern")
    for key in ("rank_pattern", "alpha_pattern", "trainable_token_indices"):  # module names -> values
        value = data.get(key)
        for k in value if isinstance(value, dict) else ():
            if not _MODULE_NAME.fullmatch(k):
                raise pattern(f"its {key} names {_short(k)}, which")
    for k, v in (ranks or {}).items():
        if not (type(v) is int and v > 0):
            raise _refused(name, f"its rank_pattern gives {_short(k)} {_json_kind(v)} {_short(v)}, not a rank")
    for k, v in (numbers or {}).items():
        if type(v) not in (int, float):
            raise _refused(name, f"its alpha_pattern gives {_short(k)} {_json_kind(v)} {_short(v)}, not a number")


def _check_sizes(peft: Any, name: str, cfg: Any, base: nn.Module) -> None:
    """Refuse, before peft allocates anything, an adapter larger than the layers it adapts: a rank (``r``, a
    ``rank_pattern`` value) above the smallest dimension of a layer it applies to adds nothing an adapter can
    learn, and the file's ``r=4000000`` would take gigabytes; trainable token indices beyond the embedding or
    given twice the same. Which layers: peft's own matching, of plain names (``_check_names``)."""
    rank = getattr(cfg, "r", None)
    if type(rank) is int:
        patterns = dict(getattr(cfg, "rank_pattern", None) or {})
        every_linear = getattr(cfg, "target_modules", None) == "all-linear"
        exists: Callable[[Any, str], Any] = peft.tuners.tuners_utils.check_target_module_exists
        targets = [(key, _smallest(m.parameters(recurse=False))) for key, m in base.named_modules()]
        targets = [(key, dim) for key, dim in targets
                   if key and (dim is not None if every_linear else exists(cfg, key))]
        wanted = set(getattr(cfg, "target_parameters", None) or ())
        targets += [(key, _smallest([p])) for key, p in base.named_parameters()
                    if key in wanted or any(key.endswith("." + w) for w in wanted)]
        for key, dim in targets:
            r = next((v for k, v in patterns.items() if key == k or key.endswith("." + k)), rank)
            if dim is not None and r > dim:
                raise _refused(name, f"its rank {r} is larger than the smallest dimension ({dim}) of {key!r}, which "
                                     "it adapts: a rank beyond it adds nothing an adapter can learn")
    tokens = getattr(cfg, "trainable_token_indices", None)
    rows = max((m.num_embeddings for m in base.modules() if isinstance(m, nn.Embedding)), default=0)
    for ids in (tokens.values() if isinstance(tokens, dict) else [tokens] if tokens else []):
        if len(set(ids)) != len(ids) or not all(0 <= i < rows for i in ids):
            raise _refused(name, f"its trainable_token_indices name a token twice or one beyond the embedding's "
                                 f"{rows} rows")


def _smallest(params: Any) -> int | None:
    """The smallest dimension of the matrices ``params`` hold (a weight of 2 or more dimensions as the matrix
    of its first one by the rest: a convolution's), or None when they hold none."""
    dims = [min(p.shape[0], p.numel() // max(p.shape[0], 1)) for p in params if p.dim() >= 2]
    return min(dims, default=None)


def _fits(v: Any, tp: Any, depth: int = 0) -> bool:
    """``v`` (plain JSON) is a value of the declared type ``tp``; a class that JSON cannot hold takes only None
    (through ``Optional``)."""
    if depth > 16 or tp is Any:
        return depth <= 16
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return any(_fits(v, a, depth + 1) for a in args)
    if origin is typing.Literal:
        return any(type(v) is type(a) and v == a for a in args)
    if tp is type(None):
        return v is None
    if tp is bool:
        return type(v) is bool
    if tp is int:
        return type(v) is int
    if tp is float:
        return type(v) in (int, float)
    if tp is str:
        return type(v) is str
    if inspect.isclass(tp) and issubclass(tp, enum.Enum):
        return type(v) is str and v in {_type_name(m) for m in tp}
    if tp in (list, tuple, set) or origin in (list, tuple, set, frozenset):
        if not isinstance(v, list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(v) == len(args) and all(_fits(x, a, depth + 1) for x, a in zip(v, args))
        return not args or all(_fits(x, args[0], depth + 1) for x in v)
    if tp is dict or origin is dict:
        if not isinstance(v, dict):
            return False
        kt, vt = args if len(args) == 2 else (Any, Any)
        return all(_fits(k, kt, depth + 1) and _fits(x, vt, depth + 1) for k, x in v.items())
    return False


def _json_kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _type_text(tp: Any) -> str:
    """A declared type as JSON would say it: ``str | list[str] | null``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        # sorted, null last: typing caches equal unions, so the order of ``args`` is whichever came first
        parts = sorted({_type_text(a) for a in args} - {"null"})
        return " | ".join(parts + (["null"] if type(None) in args else []))
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if tp is type(None):
        return "null"
    if origin is not None and args:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_text(a) for a in args)}]"
    return str(getattr(tp, "__name__", tp))


def _refused(name: str, why: str) -> InputError:
    return InputError(f"refusing to rebuild PEFT adapter {name!r} from the capture: {why}; {_FIX}")


