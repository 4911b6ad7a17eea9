"""transformers models in a capture, rebuilt from their config, never fetched."""

from __future__ import annotations

import inspect
import json
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from . import _peft
from .._util._errors import InputError, first_line as _first_line
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


def _hf_model(spec: Mapping[str, Any], where: str, notes: list[str] | None = None) -> nn.Module:
    """The ``transformers`` model a capture names, built from its config and nothing else from the file: the
    class must be a ``PreTrainedModel`` subclass of the transformers package (vetted as ``resolve`` vets any
    name), its config class the class's own ``config_class``, the config plain JSON that asks to fetch nothing,
    and the attention kernel one of torch's."""
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
    try:
        cfg = config_cls.from_dict(config)
        cfg._attn_implementation = attn  # what the run used, set on every sub-config: never what the JSON says
        model = cls(cfg)
    except Exception as e:
        raise InputError(f"cannot build {path} from the capture's config: {_first_line(e)}; {fix}") from e
    if not isinstance(model, nn.Module):
        raise InputError(f"{path} built a {type(model).__name__}, not an nn.Module; {fix}")
    return _peft.rebuild(model, spec.get("peft"), where, notes)  # a PEFT model's adapters, from their JSON configs


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
