"""The generic JSON serializer of the result dataclasses: types by hint, strict JSON, old files with keys missing."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, TypedDict

import pytest

from nanhunt.records import _serial
from nanhunt.records._serial import JSONData, absent
from nanhunt.records import (SCHEMA_VERSION, Comparison, Decision, FullStats, GuardEvent, Occurrence, Phase,
                             Record, Regression, Report, Role, Status, TensorDiff, Verdict, VerdictKind)


class Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner(JSONData):
    x: float
    tag: str = "t"


@dataclass(frozen=True)
class Outer(JSONData):
    colour: Colour
    count: int = field(metadata=absent(-1))
    ratio: float = field(metadata=absent(math.nan))
    inner: Inner | None = None
    inners: tuple[Inner, ...] = ()
    pairs: tuple[tuple[int, float], ...] = ()
    fixed: tuple[int, str, float] = (0, "", 0.0)
    names: dict[str, bool] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    maybe: float | None = None


class Settings(TypedDict, total=False):
    scale: float | None
    name: str


@dataclass(frozen=True)
class Configured(JSONData):
    settings: Settings = field(default_factory=Settings)


@dataclass(frozen=True)
class Unsupported:
    value: set[int]


def _json(d: dict[str, Any]) -> str:
    return json.dumps(d, allow_nan=False)  # strict JSON: raises on a NaN/Inf left as a float


def test_writes_by_type_hint() -> None:
    # GIVEN a dataclass with every kind of field, holding non-finite floats everywhere they can be
    obj = Outer(Colour.BLUE, 3, math.inf, Inner(math.nan), (Inner(1.5, "a"),), ((1, -math.inf),), (2, "b", math.nan),
                {"k": True}, {"scale": math.inf, "nested": [1.0, math.nan, {"z": -math.inf}], "t": (1, 2)}, None)
    # WHEN written THEN enums by value, tuples as lists, nested dataclasses as dicts, NaN/Inf as strings
    assert obj.to_dict() == {
        "colour": "blue", "count": 3, "ratio": "inf", "inner": {"x": "nan", "tag": "t"},
        "inners": [{"x": 1.5, "tag": "a"}], "pairs": [[1, "-inf"]], "fixed": [2, "b", "nan"], "names": {"k": True},
        "extra": {"scale": "inf", "nested": [1.0, "nan", {"z": "-inf"}], "t": [1, 2]}, "maybe": None,
    }
    _json(obj.to_dict())


def test_reads_back_what_it_wrote() -> None:
    obj = Outer(Colour.RED, 1, 0.5, Inner(2.0), (Inner(math.inf),), ((3, 0.25),), (1, "x", -math.inf),
                {"a": False}, {"k": [1, 2]}, 4.0)
    back = Outer.from_dict(json.loads(_json(obj.to_dict())))
    assert back == Outer(Colour.RED, 1, 0.5, Inner(2.0), (Inner(math.inf),), ((3, 0.25),), (1, "x", -math.inf),
                         {"a": False}, {"k": [1, 2]}, 4.0)
    assert isinstance(back.colour, Colour) and isinstance(back.inners, tuple) and isinstance(back.pairs[0], tuple)


def test_absent_keys_take_the_default_or_the_absent_value() -> None:
    # GIVEN a file an older version wrote, holding only the required key
    back = Outer.from_dict({"colour": "red"})
    # THEN fields with a default take it, required fields with absent(...) take that
    assert back.count == -1 and math.isnan(back.ratio)
    assert (back.inner, back.inners, back.names, back.extra) == (None, (), {}, {})
    # and a mutable default is a fresh object each time
    assert Outer.from_dict({"colour": "red"}).names is not back.names


def test_a_required_key_missing_raises_and_unknown_keys_are_ignored() -> None:
    with pytest.raises(KeyError, match="colour"):
        Outer.from_dict({"count": 1})
    assert Outer.from_dict({"colour": "red", "added_later": 1}).count == -1


def test_values_are_converted_to_the_field_type() -> None:
    back = Outer.from_dict({"colour": "blue", "count": "7", "ratio": None, "fixed": [1, 2, "3"], "maybe": "nan"})
    assert back.count == 7 and math.isnan(back.ratio)  # a null float reads as NaN
    assert back.fixed == (1, "2", 3.0)
    assert back.maybe is not None and math.isnan(back.maybe)
    with pytest.raises(ValueError):
        Outer.from_dict({"colour": "blue", "fixed": [1, "2"]})  # a fixed-length tuple of the wrong length


def test_a_type_without_a_json_form_is_refused() -> None:
    with pytest.raises(TypeError, match="no JSON form"):
        _serial.to_dict(Unsupported({1}))


def test_a_typeddict_field_is_written_and_read_as_the_dict_it_is() -> None:
    # GIVEN a TypedDict field (a plain dict at run time) holding a non-finite float
    obj = Configured(Settings(name="n", scale=math.inf))
    # WHEN written THEN as a dict[str, Any] field is: in its order, NaN/Inf as strings
    assert obj.to_dict() == {"settings": {"name": "n", "scale": "inf"}}
    assert list(obj.to_dict()["settings"]) == ["name", "scale"]
    # WHEN read back THEN the same plain dict, its values as the file holds them
    back = Configured.from_dict(json.loads(_json(obj.to_dict())))
    assert back.settings == {"name": "n", "scale": "inf"} and type(back.settings) is dict
    assert Configured.from_dict({}).settings == {}
    # and a value that is no JSON object is refused as a dict[str, Any] field refuses it
    for bad in ([1, 2], "x", None):
        with pytest.raises(AttributeError) as typed:
            Configured.from_dict({"settings": bad})
        with pytest.raises(AttributeError) as plain:
            Outer.from_dict({"colour": "red", "extra": bad})
        assert str(typed.value) == str(plain.value)
    with pytest.raises(AttributeError, match="'list' object has no attribute 'items'"):
        Report.from_dict({"config": [1, 2]})


# ------------------------------------------------------------------ the records' own rules
def test_record_from_an_old_file_with_only_index_and_phase() -> None:
    r = Record.from_dict({"index": 4, "phase": "backward"})
    assert (r.index, r.phase, r.module, r.call_index, r.op, r.role, r.dtype, r.shape) == (
        4, Phase.BACKWARD, None, 0, None, Role.OUTPUT, "", ())
    assert math.isnan(r.min) and math.isnan(r.max) and r.full is None and r.input_shapes is None
    with pytest.raises(KeyError):
        Record.from_dict({"phase": "forward"})


def test_nested_defaults_of_old_files() -> None:
    assert FullStats.from_dict({}) == FullStats(0, 0, 0, 0, 0, None, 0, 0, 0)
    occ = Occurrence.from_dict({"phase": "loss", "output": {"index": 0, "phase": "loss"}})
    assert (occ.kind, occ.module, occ.reached, occ.inputs) == ("nan", None, (), ())
    assert Occurrence.from_dict({"phase": "loss", "output": {"index": 0, "phase": "loss"}, "reached": None}).reached \
        is None
    d = Decision.from_dict({"index": 2})
    assert (d.ref_class, d.amp_class, d.ref_runner_up, d.flipped) == (-1, -1, -1, False) and math.isnan(d.ref_score)
    assert math.isnan(Regression.from_dict({}).ref_min)
    assert (TensorDiff.from_dict({}).name, TensorDiff.from_dict({}).kind) == ("", "module")
    c = Comparison.from_dict({})
    assert (c.dtype, c.device_type, c.rtol, c.atol, c.accepted) == ("float16", "cpu", 0.0, 0.0, True)
    assert Verdict.from_dict({}).kind == "clean"


def test_report_layout() -> None:
    # GIVEN an empty file THEN a clean report of the current schema
    r = Report.from_dict({"schema_version": 1})
    assert (r.status, r.first, r.schema_version, r.comparison) == ("clean", None, SCHEMA_VERSION, None)
    # WHEN written THEN schema_version comes first and "comparison" only when there is one
    d = Report("nonfinite", None, loss=math.nan, config={"scale": math.inf}).to_dict()
    assert next(iter(d)) == "schema_version" and "comparison" not in d
    assert (d["loss"], d["config"]) == ("nan", {"scale": "inf"})
    with_cmp = Report("clean", None, comparison=Comparison("float16", "cpu", 1e-3, 1e-5)).to_dict()
    keys = list(with_cmp["comparison"])
    assert keys[keys.index("tie_rule") + 1] == "rule" and list(with_cmp)[-1] == "comparison"
    # a null among the origins is dropped
    assert Report.from_dict({"origins": [None]}).origins == ()


def test_status_and_verdict_kind_read_as_their_enums_and_write_as_before() -> None:
    # GIVEN a file's status and verdict kind
    r = Report.from_dict({"status": "not-reproducible", "verdict": {"kind": "scale-induced"}})
    # THEN they read back as enum members
    assert r.status is Status.NOT_REPRODUCIBLE
    assert r.verdict is not None and r.verdict.kind is VerdictKind.SCALE_INDUCED
    assert Report.from_dict({}).status is Status.CLEAN and Verdict.from_dict({}).kind is VerdictKind.CLEAN
    # and write and format as the same strings
    d = json.loads(_json(r.to_dict()))
    assert (d["status"], d["verdict"]["kind"]) == ("not-reproducible", "scale-induced")
    assert json.dumps([Status.DIVERGED, VerdictKind.NOT_PRECISION]) == '["diverged", "not-precision"]'
    assert f"{r.status}|{r.verdict.kind:>15}|{Status.CLEAN!s}" == "not-reproducible|  scale-induced|clean"
    assert "%s" % VerdictKind.COMPILE_INDUCED == "compile-induced"


def test_an_unknown_status_or_verdict_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="'finished' is not a valid Status"):
        Report.from_dict({"status": "finished"})
    with pytest.raises(ValueError, match="'precise' is not a valid VerdictKind"):
        Report.from_dict({"verdict": {"kind": "precise"}})
    with pytest.raises(ValueError, match="'clen' is not a valid Status"):
        Report("clen", None)  # type: ignore[arg-type]


def test_a_status_or_verdict_kind_given_as_text_is_held_as_the_member() -> None:
    r = Report("nonfinite", None, verdict=Verdict("precision"))  # type: ignore[arg-type]
    assert r.status is Status.NONFINITE and r.verdict is not None and r.verdict.kind is VerdictKind.PRECISION
    assert (r.to_dict()["status"], r.to_dict()["verdict"]["kind"]) == ("nonfinite", "precision")


def test_guard_event_round_trips() -> None:
    ev = GuardEvent(3, "loss", "non-finite loss", rank=1, ranks=(0, 1), checkpoint="c.pt", batch="b.pt",
                    captured_step=3, pre_update=True, scale=math.inf)
    d = ev.to_dict()
    assert d["ranks"] == [0, 1] and d["scale"] == "inf"
    assert GuardEvent.from_dict(json.loads(_json(d))) == ev
