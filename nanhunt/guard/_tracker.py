"""The Guard's headroom history in the run's own experiment tracker.

At each window's host read (one in ``READ_STEPS`` steps; never an extra device read) the Guard hands
:meth:`GuardTracker.window` what the host already holds: the series its picture shows (the ``PICTURED`` module
outputs or output gradients nearest their dtype's limit, those warned about first) and the step's loss,
gradient norm and GradScaler scale. They go out as one dict of numbers under ``nanhunt/`` (:func:`window_metrics`
names them); each warning and detection as an event: a count, ``nanhunt/warnings`` or ``nanhunt/detections``,
and its text where the tracker takes text.

A tracker is what the user has: a TensorBoard ``SummaryWriter``, a W&B run, the ``mlflow`` module or an MLflow
run, a Lightning logger, a callable ``(dict, step)``, or a list of them. Nothing is imported for it: each is
known by what it offers. A tracker that raises is warned about once and then left alone: the training goes on.
"""

from __future__ import annotations

import math
import re
import time
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["NAMESPACE", "GuardTracker", "Sink", "adapt", "key_name", "window_metrics"]

NAMESPACE = "nanhunt"
_TEXT = 5000  # characters of an event's text a tag keeps (MLflow refuses longer tag values)
_CONDITION = {"output": "output", "output gradient": "output_grad"}
# the count each kind of event adds to: nanhunt/warnings, nanhunt/detections (a non-finite value or too many
# GradScaler skips), nanhunt/rollbacks
_COUNTED = {"warning": "warnings", "rollback": "rollbacks", "loss": "detections", "grads": "detections",
            "params": "detections", "skips": "detections"}
_NOT_IN_KEY = re.compile(r"[^A-Za-z0-9_.\-]")


def key_name(module: str) -> str:
    """A module's name as it appears in a key: characters other than letters, digits, ``_``, ``.`` and ``-``
    become ``_`` (MLflow refuses them; a ``/`` would add a level): the whole model, ``(model)``, is ``_model_``."""
    return _NOT_IN_KEY.sub("_", module)


def window_metrics(step: int, series: tuple[Mapping[str, Any], ...], since: int, *, loss: float | None,
                   grad_norm: float | None, scale: float | None) -> dict[str, float]:
    """The numbers of one window read at ``step``, from the picture's ``series`` (``HeadroomSeries`` dicts) whose
    last sample is after step ``since`` (a module not called since the last read is not logged again):

    - ``nanhunt/headroom/<module>/<output|output_grad>``: the headroom left, in bits: log2(limit / max), 0 at the
      dtype's limit, each unit a factor of 2 (10 is 1024x);
    - ``nanhunt/max/<module>/<...>``: the largest magnitude itself (an output gradient unscaled);
    - ``nanhunt/forecast_steps/<module>/<...>``: the steps left until its trend meets the limit, where it rises;
    - ``nanhunt/loss``, ``nanhunt/grad_norm``, ``nanhunt/scale``: the step's, where known and finite."""
    out: dict[str, float] = {}
    for s in series:
        steps, log2max = s["steps"], s["log2max"]
        if not steps or steps[-1] <= since:
            continue
        name = f"{key_name(s['module'])}/{_CONDITION.get(s['condition'], key_name(s['condition']))}"
        out[f"{NAMESPACE}/headroom/{name}"] = round(math.log2(s["limit"]) - log2max[-1], 4)
        out[f"{NAMESPACE}/max/{name}"] = float(f"{2.0 ** log2max[-1]:.6g}")
        if s.get("forecast_step") is not None:
            out[f"{NAMESPACE}/forecast_steps/{name}"] = float(max(0, s["forecast_step"] - step))
    for key, x in (("loss", loss), ("grad_norm", grad_norm), ("scale", scale)):
        if x is not None and math.isfinite(x):
            out[f"{NAMESPACE}/{key}"] = float(x)
    return out


class Sink:
    """Where the numbers go: ``metrics`` a dict of floats at a step, ``event`` a warning's or detection's text
    (``kind``: ``"warning"`` or the detection's kind). The framework callbacks subclass it."""

    def metrics(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def event(self, text: str, step: int, *, kind: str) -> None:
        """No text by default: the event's count, a metric, stands for it."""


class _Writer(Sink):
    """A TensorBoard ``SummaryWriter`` (torch's or tensorboardX's): scalars, and the events as text."""

    def __init__(self, writer: Any) -> None:
        self.w = writer

    def metrics(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def event(self, text: str, step: int, *, kind: str) -> None:
        self.w.add_text(f"{NAMESPACE}/events", text, step)
        if callable(getattr(self.w, "flush", None)):
            self.w.flush()  # a warning is worth seeing now; the scalars wait for the writer's own flush


class _Wandb(Sink):
    """A W&B run. The numbers join the row the loop logs next (``commit=False``), so that the run's own step
    never goes back, against their own x-axis ``nanhunt/step``; an event is an alert (W&B sends it where the user
    asked) and a text value."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._defined = False
        self._texts: tuple[int, str] | None = None  # the events of the row not yet committed: one value, so joined

    def metrics(self, values: dict[str, float], step: int) -> None:
        if not self._defined:
            self._defined = True
            self.run.define_metric(f"{NAMESPACE}/step")
            self.run.define_metric(f"{NAMESPACE}/*", step_metric=f"{NAMESPACE}/step")
        self.run.log({**values, f"{NAMESPACE}/step": step}, commit=False)

    def event(self, text: str, step: int, *, kind: str) -> None:
        if self._texts is not None and self._texts[0] == step:
            text_all = f"{self._texts[1]}\n{text}"
        else:
            text_all = text
        self._texts = (step, text_all)
        self.run.log({f"{NAMESPACE}/event": text_all, f"{NAMESPACE}/step": step}, commit=False)
        if callable(getattr(self.run, "alert", None)):
            title = "nanhunt warning" if kind == "warning" else f"nanhunt {kind}"
            self.run.alert(title=f"{title} at step {step}", text=text[:_TEXT],
                           level="ERROR" if _COUNTED.get(kind) == "detections" else "WARN")


class _Mlflow(Sink):
    """MLflow: the ``mlflow`` module (its active run; nothing while none is active: ``mlflow.log_metrics`` would
    start one), or a run by its id through a client (``mlflow.start_run()``'s run, or a Lightning
    ``MLFlowLogger``'s). An event is a tag ``nanhunt/event/<n>``."""

    def __init__(self, module: Any = None, run_id: str | None = None, client: Any = None) -> None:
        self.module, self.run_id, self._client = module, run_id, client
        self._events = 0

    def _run(self) -> tuple[Any, str] | None:
        if self.module is not None:
            active = self.module.active_run()
            return None if active is None else (self.module.MlflowClient(), str(active.info.run_id))
        if self._client is None:
            import mlflow  # the user holds an MLflow run: mlflow is installed

            self._client = mlflow.MlflowClient()
        assert self.run_id is not None
        return self._client, self.run_id

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.module is not None:
            if self.module.active_run() is not None:
                self.module.log_metrics(values, step=step)
            return
        run = self._run()
        if run is not None:
            from mlflow.entities import Metric

            at = int(time.time() * 1000)
            run[0].log_batch(run[1], metrics=[Metric(k, v, at, step) for k, v in values.items()])

    def event(self, text: str, step: int, *, kind: str) -> None:
        run = self._run()
        if run is not None:
            self._events += 1
            run[0].set_tag(run[1], f"{NAMESPACE}/event/{self._events}", f"step {step}: {text}"[:_TEXT])


class _Logger(Sink):
    """A Lightning logger: ``log_metrics(dict, step)``; an event as text where its experiment takes text (a
    TensorBoard writer, a W&B run, an MLflow client with the logger's run), else its count alone (a CSV)."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self._text: Sink | None | bool = False  # False: not looked at yet

    def metrics(self, values: dict[str, float], step: int) -> None:
        self.logger.log_metrics(values, step)

    def event(self, text: str, step: int, *, kind: str) -> None:
        if self._text is False:
            self._text = _text_of(self.logger)
        if isinstance(self._text, Sink):
            self._text.event(text, step, kind=kind)


def _text_of(logger: Any) -> Sink | None:
    """The sink that takes a Lightning logger's events as text, from its ``experiment``; None: numbers only."""
    experiment = logger.experiment
    if callable(getattr(experiment, "add_text", None)):
        return _Writer(experiment)
    if callable(getattr(experiment, "alert", None)) and callable(getattr(experiment, "define_metric", None)):
        return _Wandb(experiment)
    run_id = getattr(logger, "run_id", None)
    if isinstance(run_id, str) and callable(getattr(experiment, "set_tag", None)):
        return _Mlflow(run_id=run_id, client=experiment)
    return None


class _Callable(Sink):
    """A callable ``(dict, step)``: the numbers; an event as ``{"nanhunt/event": text}``, the one string value."""

    def __init__(self, fn: Callable[[dict[str, Any], int], Any]) -> None:
        self.fn = fn

    def metrics(self, values: dict[str, float], step: int) -> None:
        self.fn(values, step)

    def event(self, text: str, step: int, *, kind: str) -> None:
        self.fn({f"{NAMESPACE}/event": text}, step)


class _Many(Sink):
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def metrics(self, values: dict[str, float], step: int) -> None:
        for s in self.sinks:
            s.metrics(dict(values), step)

    def event(self, text: str, step: int, *, kind: str) -> None:
        for s in self.sinks:
            s.event(text, step, kind=kind)


def adapt(target: Any) -> Sink:
    """The :class:`Sink` for what the user passed as ``tracker=``; ValueError naming what is taken otherwise."""
    if isinstance(target, Sink):
        return target
    if isinstance(target, (list, tuple)):
        return _Many([adapt(t) for t in target])
    if callable(getattr(target, "add_scalar", None)) and callable(getattr(target, "add_text", None)):
        return _Writer(target)
    if callable(getattr(target, "log_metrics", None)) and callable(getattr(target, "log_hyperparams", None)):
        return _Logger(target)  # Lightning's Logger API
    if isinstance(target, types.ModuleType) and callable(getattr(target, "log_metrics", None)) \
            and callable(getattr(target, "active_run", None)):
        return _Mlflow(module=target)
    run_id = getattr(getattr(target, "info", None), "run_id", None)
    if isinstance(run_id, str):
        return _Mlflow(run_id=run_id)  # an MLflow run
    if callable(getattr(target, "log", None)) and callable(getattr(target, "define_metric", None)):
        return _Wandb(target)
    if callable(target) and not isinstance(target, type):
        return _Callable(target)
    raise ValueError(f"tracker must be a TensorBoard SummaryWriter, a W&B run, the mlflow module or an MLflow run, "
                     f"a Lightning logger, a callable (dict, step) or a list of them, not {type(target).__name__}")


class GuardTracker:
    """A Guard's tracker (``target`` None: none, every call returns at once): the window's numbers and the
    events. A sink that raises is warned about once (``GuardWarning``, given as ``warning``) and not called
    again."""

    def __init__(self, target: Any, warning: type[Warning] = UserWarning) -> None:
        self.sink: Sink | None = None if target is None else adapt(target)
        self._warning = warning
        self._since = -1  # the step of the last window logged
        self._counts: dict[str, int] = {}

    def window(self, step: int, series: tuple[Mapping[str, Any], ...], *, loss: float | None,
               grad_norm: float | None, scale: float | None) -> None:
        if self.sink is None:
            return
        values = window_metrics(step, series, self._since, loss=loss, grad_norm=grad_norm, scale=scale)
        self._since = step
        if values:
            self._send(lambda sink: sink.metrics(values, step))

    def event(self, step: int, kind: str, text: str) -> None:
        """An event of the Guard at ``step``: its text, and the count of its kind so far (a ``"change"`` of policy
        has none)."""
        if self.sink is None:
            return
        which = _COUNTED.get(kind)
        count: dict[str, float] = {}
        if which is not None:
            self._counts[which] = self._counts.get(which, 0) + 1
            count[f"{NAMESPACE}/{which}"] = float(self._counts[which])

        def send(sink: Sink) -> None:
            if count:
                sink.metrics(count, step)
            sink.event(text, step, kind=kind)

        self._send(send)

    def _send(self, call: Callable[[Sink], Any]) -> None:
        sink = self.sink
        assert sink is not None
        try:
            call(sink)
        except Exception as e:  # the tracker's trouble (a closed writer, a network): the training goes on
            self.sink = None
            warnings.warn(f"nanhunt.Guard: the tracker raised {type(e).__name__}: {e}; nanhunt logs nothing more to "
                          f"it in this run", self._warning, stacklevel=4)
