"""transformers models in a capture, rebuilt from their config, never fetched."""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

import torch
from torch import nn

from . import _peft
from .._util._errors import InputError, first_line as _first_line
from .._util._text import few as _few
from .._util._wrappers import user_class
from ._resolve import _refused, callable_path, resolve


# ------------------------------------------------------- transformers models, rebuilt from their config
# Attention kernels that are torch's own. transformers also takes a Hub repository here ("kernels-community/...")
# and downloads and runs its code: a file may not choose that.
_HF_ATTENTION = (None, "eager", "sdpa", "flex_attention")
# Config entries that make a model's constructor fetch something (a pretrained backbone, remote code).
_HF_FETCHING = ("auto_map", "trust_remote_code", "use_pretrained_backbone", "backbone")


def _hf_model_spec(model: nn.Module) -> dict[str, Any] | None:
    """A ``transformers`` model's class, config (JSON text) and attention kernel; None for any other model. A
    PEFT model: its base model's, with the adapters' configs under ``"peft"`` (nanhunt.capture._peft)."""
    if _peft.is_peft_model(model):
        return _peft.spec(model, _hf_model_spec)
    transformers = sys.modules.get("transformers")  # imported already if the model is one of its models
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    try:
        config = json.dumps(model.config.to_dict())
    except (TypeError, ValueError):  # a config holding something JSON cannot say: replay needs --model
        return None
    attn = getattr(model.config, "_attn_implementation", None)
    return {"class": callable_path(user_class(model)), "config": config,
            "attn_implementation": attn if isinstance(attn, str)
            else None}


def _hf_model(spec: Mapping[str, Any], where: str, notes: list[str] | None = None, *,
              weights: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None, exact: bool = True,
              config_label: str = "its config") -> nn.Module:
    """The ``transformers`` model a capture names, built from its config and nothing else from the file: the
    class must be a ``PreTrainedModel`` subclass of the transformers package (vetted as ``resolve`` vets any
    name), its config class the class's own ``config_class``, the config plain JSON that asks to fetch nothing,
    and the attention kernel one of torch's. ``weights`` (names -> dtype and shape): what the model is to hold,
    checked before it is built (see ``_fits``; ``exact``: names and shapes too, not only the size)."""
    fix = "pass --model package.module:factory"
    path, text, attn = spec.get("class"), spec.get("config"), spec.get("attn_implementation")
    if not isinstance(path, str) or not isinstance(text, str) or not (attn is None or isinstance(attn, str)):
        raise InputError(f"{where} is not a valid nanhunt capture: field 'hf_model' holds no class name and JSON "
                           f"config; {fix}")
    if path.partition(":")[0].partition(".")[0] != "transformers":
        raise _refused(path, "model factory", "it is not a class of the transformers package")
    # the one package outside torch whose classes a file may name: built from a config only, checked below
    cls: Any = resolve(path, what="model factory", trusted=False, trust=("transformers",))
    transformers = sys.modules["transformers"]  # resolve imported a module of it
    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    config_cls: Any = getattr(cls, "config_class", None)
    if not (_transformers_class(cls, transformers.PreTrainedModel) and _transformers_class(config_cls, base)):
        raise _refused(path, "model factory", "it is not a transformers PreTrainedModel class")
    config = _peft.json_object(text)
    if config is None:
        raise InputError(f"{where} is not a valid nanhunt capture: the config of {path!r} is not a JSON "
                           f"object; {fix}")
    fetching = _fetching(config)
    if fetching:
        raise _refused(path, "model factory", f"its config asks to fetch something ({fetching}): nanhunt builds a "
                                              "model from the file alone")
    if attn not in _HF_ATTENTION:
        raise _refused(path, "model factory", f"its attention kernel {attn!r} is not one of torch's "
                                              f"({', '.join(a for a in _HF_ATTENTION if a)})")
    _bound_sizes(config, where, config_label, weights)
    with _transformers_quiet():
        try:
            cfg = config_cls.from_dict(config)
            cfg._attn_implementation = attn  # what the run used, set on every sub-config: never what the JSON says
        except Exception as e:
            raise InputError(f"cannot build {path} from the capture's config: {_first_line(e)}; {fix}") from e
        if weights is not None:
            _fits(cls, cfg, base, where, config_label, weights, exact)
        try:
            model = cls(cfg)
        except Exception as e:
            raise InputError(f"cannot build {path} from the capture's config: {_first_line(e)}; {fix}") from e
    if not isinstance(model, nn.Module):
        raise InputError(f"{path} built a {type(model).__name__}, not an nn.Module; {fix}")
    return _peft.rebuild(model, spec.get("peft"), where, notes)  # a PEFT model's adapters, from their JSON configs


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers' logger silenced while a config from a file is made into a model: it writes the config's keys
    and values as they are (a key holding a terminal escape and a line of its own, ``nanhunt: error: ...``, would
    reach the terminal whole), and nothing it says then is nanhunt's to show. Its level is restored after, whatever
    happened."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


# Label maps transformers builds from a config's num_labels alone (id2label and label2id: some 700 bytes and 9 us
# a label): 50 M labels take 6 GB before any model. ImageNet-21k's classifiers, the largest on the Hub, have 21,843.
MAX_LABELS = 1 << 17
_LABELS = ("num_labels", "id2label", "label2id")
_VOCAB_SIZE = re.compile(r"\w*vocab_size")


def _bound_sizes(config: Mapping[str, Any], where: str, label: str,
                 weights: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None) -> None:
    """The sizes a config gives (its sub-configs' too), bounded before transformers sees it: a config's
    constructor builds label maps of ``num_labels`` entries and lists of a layer count's (``layer_types``). The
    labels, all configs together, by :data:`MAX_LABELS`; given the weights the model is to hold, a layer count by
    the tensors holding data (each layer holds one at least) and a vocabulary by the values they hold (its
    embedding holds a row of each)."""
    fix = "the config does not belong to them: pass --model package.module:factory"
    labels, most_labels = 0, ("", 0)
    layers, vocab = ("", 0), ("", 0)
    todo: list[tuple[Mapping[str, Any], int]] = [(config, 0)]
    while todo:  # (depth: bounded as _fetching bounds it, which has walked it first)
        d, depth = todo.pop()
        own = _labels_of(d)
        labels += own[1]
        most_labels = max(most_labels, own, key=lambda kv: kv[1])
        for k, v in d.items():
            if isinstance(v, dict) and depth < 64:
                todo.append((v, depth + 1))
            elif _count(v) and _LAYER_COUNT.fullmatch(k) and v > layers[1]:
                layers = (k, v)
            elif _count(v) and _VOCAB_SIZE.fullmatch(k) and v > vocab[1]:
                vocab = (k, v)
    if labels > MAX_LABELS:
        raise InputError(f"{where}: {label} names {labels:,} labels ({most_labels[0]}), more than the "
                         f"{MAX_LABELS:,} nanhunt lets transformers make label maps of; {fix}")
    if weights is None:
        return
    _layers_fit(layers, weights, where, label)
    values = sum(math.prod(shape) for _, shape in weights.values())
    if vocab[1] > values:
        raise InputError(f"{where}: {label} names a vocabulary of {vocab[1]:,} ({vocab[0]}), more than the "
                         f"{values:,} values its weights hold; {fix}")


def _labels_of(config: Mapping[str, Any]) -> tuple[str, int]:
    """The most labels one config names (its key and count): its num_labels, or the size of a label map it gives."""
    most = ("", 0)
    for k in _LABELS:
        v = config.get(k)
        n = v if k == "num_labels" and _count(v) else len(v) if isinstance(v, dict) else 0
        if n > most[1]:
            most = (k, n)
    return most


def _layers_fit(most: tuple[str, int], weights: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], where: str,
                label: str) -> None:
    """A layer count (its key and value) against the weights' tensors that hold data: each layer holds one at
    least, and an empty tensor is free to list (15,000 of them would have 15,000 layers built)."""
    held = sum(1 for _, shape in weights.values() if math.prod(shape))
    if most[1] > held:
        empty = f" ({len(weights) - held:,} more are empty)" if len(weights) > held else ""
        raise InputError(f"{where}: {label} names {most[1]:,} layers ({most[0]}), more than the {held:,} tensors "
                         f"its weights hold{empty}; the config does not belong to them: pass --model "
                         "package.module:factory")


def _transformers_class(obj: Any, base: type) -> bool:
    """``obj`` is a subclass of ``base`` defined in the transformers package."""
    return inspect.isclass(obj) and issubclass(obj, base) and obj.__module__.partition(".")[0] == "transformers"


def _fetching(obj: Any, key: str = "", depth: int = 0) -> str | None:
    """The first config entry (at any depth) that would make a constructor download or import something."""
    if depth > 64:
        return f"{key}...: nested too deep to check, over 64 levels"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if k in _HF_FETCHING and v not in (None, False, "", {}, []):
            return f"{key}{k}"
        found = _fetching(v, f"{key}{k}.", depth + 1)
        if found:
            return found
    return None


def _through_training_step(model: nn.Module) -> None:
    """Replay a Lightning capture: calling the model runs ``model.training_step(*inputs)`` (the step's loss);
    its own calls of the model inside run the real forward. Set on the instance: the Step calls ``model(*inputs)``."""
    training_step = getattr(model, "training_step", None)
    if not callable(training_step):
        raise InputError(f"the capture replays the step through training_step, which {type(model).__name__} does "
                           "not have; is --model the LightningModule that wrote it?")
    forward = model.forward
    inside = False

    def step(*args: Any, **kwargs: Any) -> Any:
        nonlocal inside
        if inside:
            return forward(*args, **kwargs)
        inside = True
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*self\.log\(\)")  # no Trainer to log to
                out = training_step(*args, **kwargs)
        finally:
            inside = False
        if out is None:
            raise InputError("training_step returned None for the captured batch (it skipped the step)")
        return out

    setattr(model, "forward", step)


# Tensors a model built from the config may hold beyond the weights file (non-persistent buffers: rotary
# frequencies, masks); beyond this many values it is not the model the weights were saved from.
_UNSAVED = 1 << 24


# a config's layer counts (GPT-2's n_layer, BART's encoder_layers, a vision tower's depth), each layer built; not
# a bound on them (Qwen2's max_window_layers, 28 whatever the model's depth)
_LAYER_COUNT = re.compile(r"depth|n_layers?|(?!max_)\w*_layers")


def _most_layers(cfg: Any, base: type) -> tuple[str, int] | None:
    """The largest layer count of the config ``cfg`` (a ``base``), or of a config inside it (a vision tower's),
    with its key: read through the config class, so that ``num_hidden_layers`` is GPT-2's ``n_layer`` (its
    attribute_map)."""
    counts: list[tuple[str, int]] = []
    todo = [cfg]
    while todo:
        c = todo.pop()
        named = getattr(c, "num_hidden_layers", None)
        if _count(named):
            counts.append((str(c.attribute_map.get("num_hidden_layers", "num_hidden_layers")), named))
        counts += [(k, v) for k, v in vars(c).items() if _LAYER_COUNT.fullmatch(k) and _count(v)]
        todo += [v for v in vars(c).values() if isinstance(v, base)]
    return max(counts, key=lambda kv: kv[1], default=None)


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shared(sd: dict[str, torch.Tensor], model: nn.Module) -> None:
    """A weight two names share (GPT-2's ``lm_head`` and its embedding) is saved once, under one of them: the
    others get it too."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for group in names.values():
        saved = next((n for n in group if n in sd), None)
        if saved is not None:
            for n in group:
                sd.setdefault(n, sd[saved])


def _fits(cls: Any, cfg: Any, base: type, where: str, label: str,
          weights: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], exact: bool) -> None:
    """The model ``cls(cfg)`` would be, checked against the weights it is to hold (names -> dtype and shape)
    before it is built: its layers counted first (each takes the meta device some milliseconds to build, and each
    holds at least one of the weights' tensors), then built on the meta device, where a config naming a hidden
    size of a million allocates nothing. ``exact``: its names and shapes are the weights' (a PEFT capture's
    adapters are not in the config: only its size is checked then)."""
    fix = "the config does not belong to them: pass --model package.module:factory"
    _layers_fit(_most_layers(cfg, base) or ("", 0), weights, where, label)
    try:
        with torch.device("meta"):
            probe = cls(copy.deepcopy(cfg))
    except Exception as e:
        raise InputError(f"cannot build {callable_path(cls)} from {label}: {_first_line(e)}; pass --model "
                         "package.module:factory") from e
    meta = {k: torch.empty(shape, dtype=dt, device="meta") for k, (dt, shape) in weights.items()}
    _shared(meta, probe)
    want = probe.state_dict()
    wrong = [(what, found) for what, found in (
        ("missing", [k for k in want if k not in meta]),
        ("unexpected", [k for k in meta if k not in want]),
        ("shape mismatch", [f"{k} {tuple(meta[k].shape)} in the weights vs {tuple(t.shape)}" for k, t in want.items()
                            if k in meta and meta[k].shape != t.shape])) if found] if exact else []
    if wrong:
        raise InputError(f"{where}: the model {label} describes does not fit its weights "
                         f"({'; '.join(f'{what} {_few(found)}' for what, found in wrong)}); {fix}")
    held = sum(t.numel() for t in {id(t): t for t in [*probe.parameters(), *probe.buffers()]}.values())
    given = sum(t.numel() for t in {id(t): t for t in meta.values()}.values())
    if held > given + _UNSAVED:
        raise InputError(f"{where}: the model {label} describes holds {held:,} values, far more than its "
                         f"weights' {given:,}; {fix}")
