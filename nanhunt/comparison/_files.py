"""``nanhunt compare`` on files, for each front end (the command line, the agent server): the capture and its
batches loaded, the rule fixed before the run, the comparison run and recorded in the history beside the report.
What it says on the way (the capture's notes, the rule and its hash, the history's warnings) goes to ``say``, as
it happens; the front end prints it or keeps it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._util._errors import InputError, NanhuntError
from ..records import Report

__all__ = ["compare_files"]


def compare_files(checkpoint: str, batches: Sequence[str], *, model: str | None, loss: str | None,
                  optimizer: str | None, trust_names: Sequence[str], device: str | None, dtype: Sequence[str] | None,
                  train: bool | None, trust_pickle: bool, rule_file: str | None, rule_flags: Mapping[str, Any],
                  task: str | None, metric: str | None, speed: int, report: str | None, command: str,
                  say: Callable[[str], None], failed: Callable[[str, Exception], InputError]) -> Report:
    """The comparison's report (see the module docstring). ``dtype``: the runs asked for (``float16``,
    ``bfloat16``, ``float8``), None for the model's default; ``failed(what, error)``: the front end's one line for
    the user's model raising on the batch."""
    from ..capture.capture import load_step
    from ._inputs import batch_files, load_set, rule_given
    from ._variant import FLOAT8, asked, float8_autocast
    from .engine import History, compare, settle_rule

    files, is_set = batch_files(list(batches))
    rule, _ = settle_rule(rule_given(rule_file, dict(rule_flags), task=task, metric=metric), metric)
    step = load_step(
        checkpoint, files[0][1], model_factory=model, loss=loss, optimizer=optimizer, trust_names=tuple(trust_names),
        device=device,
        # with float8 asked, the step keeps the capture's autocast dtype: the float8 run's, as it ran
        dtype=None if not dtype or FLOAT8 in dtype else dtype[0], train=train, trust_pickle=trust_pickle,
        eager=True)  # compare runs the step eagerly: a compiled capture is said so
    for n in step.notes:
        say(f"warning: {n}")
    # float8 is refused here, in one line, for a model without float8 layers; a capture taken in float32 has no
    # autocast dtype to compare: float16 then (a float8 model: its float8 layers and bfloat16)
    runs = asked(list(dtype) if dtype else None, step.model, step.dtype)
    sets = load_set(files, step, trust_pickle=trust_pickle) if is_set else None
    # fixed before the run: said, and hashed into the report
    say(f"rule (fixed before the run): {rule.canonical()}")
    say(f"rule sha256: {rule.sha256()}")
    history = History.beside(report, checkpoint, [n for n, _ in files]) if report else None
    for w in history.warnings(rule.sha256()) if history is not None else ():
        say(f"warning: {w}")
    try:
        result = compare(
            step.model, None if is_set else (step.inputs, step.targets), batches=sets, loss_fn=step.loss_fn,
            dtype=runs, device_type=step.device_type, rule=rule, metric=metric, speed=speed, scaler=step.scaler,
            train=train, rng=step.rng, command=command, notes=step.notes, float8_autocast=float8_autocast(step.dtype))
    except NanhuntError:
        raise
    except Exception as e:  # the user's model failed on this batch: an input problem, not ours
        raise failed("running the step", e) from e
    return history.record(result) if history is not None else result
