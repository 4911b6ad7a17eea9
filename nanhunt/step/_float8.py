"""Float8 layers (torchao) taken out of float8, or given the rowwise recipe, for one replay: a bisection's trials.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` layers for ``Float8Linear``, whose matmuls cast the
input, the weight and the output's gradient to float8 with one scale per tensor (tensorwise) or per row
(rowwise). A trial runs chosen layers as the ``nn.Linear`` a ``module_filter_fn`` leaving them out would have
kept (``F.linear`` on the same weights and bias, under whatever autocast the step runs), or with the rowwise
recipe's casts; every change is undone exactly after the run, also on an exception.

nanhunt never imports torchao: a model holding float8 layers has imported it already, and one without any pays
one dictionary look-up.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Collection, Mapping
from typing import Any

from torch import nn

from .._util._wrappers import user_modules

__all__ = ["float8_layers", "out_of_float8", "float8_fix", "ROWWISE"]

_LINEAR = "torchao.float8.float8_linear"
_CONFIG = "torchao.float8.config"
# what a Float8Linear's forward reads of its configuration: a rowwise trial replaces them, then puts them back
_CONFIG_ATTRS = ("config", "linear_mm_config", "scaling_type_input", "scaling_type_weight",
                 "scaling_type_grad_output")
ROWWISE = "rowwise"  # torchao's recipe name


def float8_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's torchao ``Float8Linear`` layers by the names a trace gives them (empty when torchao's float8
    is not loaded)."""
    cls = getattr(sys.modules.get(_LINEAR), "Float8Linear", None)
    if not isinstance(cls, type):
        return {}
    return {n: m for n, m in user_modules(model).items() if isinstance(m, cls)}


def _rowwise_attrs(layer: nn.Module) -> dict[str, Any]:
    """The configuration attributes ``layer`` would have had if converted with the rowwise recipe (its
    ``emulate`` kept: a layer emulated on a device without float8 matmuls stays emulated)."""
    config_cls: Any = getattr(sys.modules[_CONFIG], "Float8LinearConfig")
    own: Any = getattr(layer, "config")
    config = dataclasses.replace(config_cls.from_recipe_name(ROWWISE), emulate=own.emulate)
    # torchao's own constructor builds them; the module it makes shares the layer's parameters and is dropped
    made = type(layer).from_float(layer, config=config)  # type: ignore[attr-defined]
    return {k: made.__dict__[k] for k in _CONFIG_ATTRS}


def out_of_float8(layers: Mapping[str, nn.Module], out: Collection[str] = (),
                  rowwise: Collection[str] = ()) -> Callable[[], None]:
    """Run the layers named in ``out`` as plain ``nn.Linear`` and those in ``rowwise`` with the rowwise recipe,
    until the returned undo is called. ``layers``: :func:`float8_layers`."""
    undos: list[Callable[[], None]] = []
    try:
        for name in out:
            undos.append(_swap(layers[name], {"forward": types.MethodType(nn.Linear.forward, layers[name])}))
        for name in rowwise:
            if name not in out:
                undos.append(_swap(layers[name], _rowwise_attrs(layers[name])))
    except BaseException:
        _undo_all(undos)
        raise
    return lambda: _undo_all(undos)


def _undo_all(undos: list[Callable[[], None]]) -> None:
    for u in reversed(undos):
        u()


def _swap(module: nn.Module, attrs: Mapping[str, Any]) -> Callable[[], None]:
    """Set ``attrs`` in the module's ``__dict__``; the undo puts back each one exactly (absent when it was)."""
    before = {k: module.__dict__[k] for k in attrs if k in module.__dict__}
    module.__dict__.update(attrs)

    def undo() -> None:
        for k in attrs:
            if k in before:
                module.__dict__[k] = before[k]
            else:
                module.__dict__.pop(k, None)

    return undo


def float8_fix(names: Collection[str], *, rowwise: bool) -> str:
    """The conversion to paste for ``names`` (fully qualified names, as ``module_filter_fn`` receives them):
    converted with the rowwise recipe (``rowwise``), else left out of float8."""
    fqns = "{" + ", ".join(repr(n) for n in sorted(names)) + "}"
    if not rowwise:
        return ("from torchao.float8 import convert_to_float8_training\n"
                f"keep_high_precision = {fqns}  # measured: the step is finite with these left as nn.Linear\n"
                "convert_to_float8_training(model, config=config,  # the Float8LinearConfig you convert with\n"
                "                           module_filter_fn=lambda mod, fqn: fqn not in keep_high_precision)")
    return ("from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
            f"rowwise = {fqns}  # measured: the step is finite with these scaled per row\n"
            "convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(\"rowwise\"),\n"
            "                           module_filter_fn=lambda mod, fqn: fqn in rowwise)\n"
            "convert_to_float8_training(model, config=config,  # the Float8LinearConfig you convert with\n"
            "                           module_filter_fn=lambda mod, fqn: fqn not in rowwise)")
