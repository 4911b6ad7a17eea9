"""A model of torch.nn's own classes (a Sequential, ModuleList or ModuleDict of torch.nn layers) in a capture:
its description written (:func:`nn_spec`) and the model rebuilt from it, checked on the meta device first
(:func:`nn_model`)."""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._util._errors import InputError, first_line as _first_line
from .._util._wrappers import user_class
from ..step.step import rng_state, set_rng_state
from . import _names, _nn_structure
from ._resolve import resolve
from ._statedict import map_state_dict

__all__ = ["nn_spec", "nn_model", "built_on_meta"]


def nn_spec(model: nn.Module, model_factory: str | None,
            model_kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A model built by one of torch.nn's own classes (the model's, or ``model_factory`` naming one): its structure
    (``_nn_structure``), or None when ``model_kwargs`` rebuild it. ValueError, asking for a factory, when neither
    rebuilds it exactly."""
    name = model_factory or _names.capture_name(user_class(model))
    if name is None or not _names.torch_own(name.partition(":")[0], "model factory"):
        return None  # your factory or class rebuilds it
    try:
        if model_kwargs:
            _same_on_meta(model, _nn_class(name), model_kwargs)
            return None
        return _nn_structure.structure(model, _nn_class)
    except (ValueError, InputError) as e:
        raise ValueError(f"cannot rebuild the model from torch.nn's classes: {e}; "
                         "pass model_factory='package.module:factory'") from None


def built_on_meta(build: Callable[[], Any], *, quiet: bool = True) -> Any:
    """``build()`` on the meta device (nothing allocated), its random draws undone (torch's, CUDA's, Python's and
    NumPy's generators put back: a check made while your script trains leaves its random numbers alone) and,
    ``quiet``, what it prints and warns dropped (a model that prints its size as it is built prints it once);
    else what it prints goes to stderr."""
    saved = rng_state(python_numpy=True)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.device("meta"))
            stack.enter_context(contextlib.redirect_stdout(io.StringIO() if quiet else sys.stderr))
            if quiet:
                stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
                stack.enter_context(warnings.catch_warnings())
                warnings.simplefilter("ignore")
            return build()
    finally:
        set_rng_state(saved)


def _same_on_meta(model: nn.Module, cls: type[nn.Module], kwargs: Mapping[str, Any]) -> None:
    """``cls(**kwargs)`` (on the meta device) is ``model`` (``_nn_structure.matches``)."""
    try:
        probe = built_on_meta(lambda: cls(**({**kwargs, "device": "meta"} if "device" in kwargs else kwargs)))
    except Exception as e:
        raise ValueError(f"{cls.__name__}(**model_kwargs) raised {_first_line(e)}") from None
    if not _nn_structure.matches(probe, model):
        raise ValueError(f"{cls.__name__}(**model_kwargs) differs from the model")


def _nn_class(path: str) -> type[nn.Module]:
    """One of torch.nn's module classes, named by a capture's description of a model (never anyone else's)."""
    if not isinstance(path, str) or not _names.torch_own(path.partition(":")[0], "model factory"):
        raise ValueError(f"names {path!r}, not one of torch.nn's classes")
    cls = resolve(path, what="model factory", trusted=False)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"names {path!r}, not one of torch.nn's module classes")
    return cls


def nn_model(spec: Mapping[str, Any], where: str, sd: Mapping[str, Any] | None) -> nn.Module:
    """The model a capture's ``nn_model`` describes; with ``sd`` (the file's weights), built on the meta device
    first and checked against them, as a factory the file names is."""
    fix = "save the capture again or pass --model package.module:factory"
    try:
        if sd is not None:
            with torch.device("meta"):
                probe = _nn_structure.build(spec, _nn_class)
            map_state_dict(sd, probe)  # every key and shape, one error line
            held = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
            given = sum(t.numel() for t in sd.values() if isinstance(t, torch.Tensor))
            if held > given:
                raise ValueError(f"holds {held} values, more than the file's {given}")
        return _nn_structure.build(spec, _nn_class)
    except ValueError as e:
        raise InputError(f"{where}: its torch.nn model (field 'nn_model') {e}; {fix}") from None
