"""What ``nanhunt compare`` is given, read: the set of batch files (several files, or a directory of them), each
batch loaded on the model's device, and the acceptance rule, from a JSON file or from clauses given one by one.
A metric function a rule file names is imported only when the caller confirms it, like a file's loss."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .._util._errors import InputError
from ..records import Rule
from ..step.step import Step
from ._rule import rule_from

__all__ = ["batch_files", "load_set", "rule_given"]

_BATCH_SUFFIXES = (".pt", ".pth")


def batch_files(paths: Sequence[str]) -> tuple[list[tuple[str, str]], bool]:
    """(name, path) of every batch file SET names, and whether it is a set (several files or a directory).
    A directory gives its *.pt and *.pth files in name order; a batch is named by its file name, or by the
    path as given when two files share a name."""
    found: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            inside = sorted(f for f in os.listdir(p) if f.endswith(_BATCH_SUFFIXES) and not f.startswith("."))
            inside = [f for f in inside if os.path.isfile(os.path.join(p, f))]
            if not inside:
                raise InputError(f"the directory {p!r} holds no batch file (*.pt, *.pth)")
            found += [os.path.join(p, f) for f in inside]
        else:
            found.append(p)
    if len(set(found)) != len(found):
        raise InputError("a batch file is named twice in the set")
    base = [os.path.basename(f) for f in found]
    names = base if len(set(base)) == len(base) else found
    return list(zip(names, found)), len(found) > 1 or any(os.path.isdir(p) for p in paths)


def rule_given(path: str | None, flags: Mapping[str, Any], *, task: str | None, metric: str | None) -> Rule:
    """The acceptance rule from the JSON file ``path`` or from ``flags`` (clauses given one by one as
    ``--rtol`` ...; not both); ``task`` and ``metric`` fill in what the file leaves out. ``metric`` also confirms a
    metric function the file names."""
    from .._util._json import read_json

    if path is None:
        d: dict[str, Any] = {**flags, "task": task or "none"}
        if metric is not None:
            d["metric"] = metric
        return rule_from(d, where="the rule flags")
    if flags:
        given = ", ".join("--" + k.replace("_", "-") for k in flags)
        raise InputError(f"--rule fixes the acceptance rule; {given} would change it: put the clause in "
                           f"{path!r} or drop --rule")
    where = f"the rule {path!r}"
    d = read_json(path, what="an acceptance rule (JSON)", label=where,
                  fix="give a JSON object of the rule's clauses (task, metric, rtol, ...)")
    if not isinstance(d, dict):
        raise InputError(f"{where} is a JSON {type(d).__name__}, not an object of the rule's clauses")
    for key, flag in (("task", task), ("metric", metric)):
        if flag is not None and d.get(key, flag) != flag:
            raise InputError(f"{where} says {key} {d[key]!r} but --{key} says {flag!r}; give one")
    named = d.get("metric")
    if isinstance(named, str) and ":" in named and metric != named:
        raise InputError(f"{where} names the metric function {named!r}, which nanhunt does not import "
                           f"unconfirmed; if you trust it, pass --metric {named} to confirm")
    if task is not None:
        d.setdefault("task", task)
    if metric is not None:
        d.setdefault("metric", metric)
    return rule_from(d, where=where)


def load_set(files: Sequence[tuple[str, str]], step: Step, *, trust_pickle: bool) -> dict[str, Any]:
    """Every batch of the set, by name, on the model's device (the first is the step's, loaded already)."""
    from torch import nn

    from ..capture.capture import load_file, to_device
    from ..step.step import split_batch

    device = next((p.device for p in step.model.parameters()), None)
    out: dict[str, Any] = {files[0][0]: (step.inputs, step.targets)}
    for name, path in files[1:]:
        bt = load_file(path, what="batch", trust_pickle=trust_pickle)
        if isinstance(bt, nn.Module):
            raise InputError(f"the batch file {path!r} holds a model, not a batch")
        inputs, targets = split_batch(bt)
        out[name] = (inputs, targets) if device is None else (to_device(inputs, device), to_device(targets, device))
    return out
