"""The Guard's skip policy on its own: which GradScaler skips are normal, which stop the run (no torch)."""

from __future__ import annotations

import pytest

from nanhunt.guard._skip_policy import SkipPolicy


def _record(policy: SkipPolicy, pattern: str) -> list[str | None]:
    """One record per character: ``s`` a skipped step, ``.`` a step that updated, ``m`` an accumulation
    micro-batch (no update ran, nothing skipped)."""
    return [policy.record(c == "s", due=c != "m") for c in pattern]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_consecutive_skips": 0}, "max_consecutive_skips must be >= 1 or None"),
    ({"skip_window": (0, 0.1)}, r"skip_window is \(window >= 1, max_rate in \[0, 1\)\)"),
    ({"skip_window": (10, 1.0)}, r"skip_window is \(window >= 1, max_rate in \[0, 1\)\)"),
    ({"skip_window": (10, -0.1)}, r"skip_window is \(window >= 1, max_rate in \[0, 1\)\)"),
])
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SkipPolicy(**kwargs)  # type: ignore[arg-type]


def test_consecutive_skips_trip_at_the_limit_and_start_again() -> None:
    # GIVEN at most 3 skips in a row, no window rule
    policy = SkipPolicy(max_consecutive_skips=3, skip_window=None)
    # WHEN 3 steps in a row are skipped, then 3 more
    reasons = _record(policy, "ssssss")
    # THEN the third trips, the counts start again, and the sixth trips again
    expected = "GradScaler skipped 3 steps in a row (max_consecutive_skips=3)"
    assert reasons == [None, None, expected, None, None, expected]
    assert policy.consecutive == 0


def test_a_step_that_updated_breaks_the_run() -> None:
    policy = SkipPolicy(max_consecutive_skips=3, skip_window=None)
    assert _record(policy, "ss.ss") == [None] * 5
    assert policy.consecutive == 2
    assert policy.record(True) is not None


def test_window_rate_trips_when_more_than_the_rate_is_skipped() -> None:
    # GIVEN a window of 6 steps at most 40% skipped (2.4 steps), no run rule
    policy = SkipPolicy(max_consecutive_skips=None, skip_window=(6, 0.4))
    # WHEN skips are spread out: the third within the window trips
    reasons = _record(policy, "s.s.s")
    # THEN the message counts the skips among the steps seen so far
    assert reasons == [None, None, None, None, "GradScaler skipped 3 of the last 5 steps (more than 40% of 6)"]
    # and both counts start again
    assert list(policy.window) == [] and policy.rate == 0.0


def test_window_forgets_old_steps() -> None:
    policy = SkipPolicy(max_consecutive_skips=None, skip_window=(4, 0.5))
    # two skips, then enough clean steps to push them out of the window of 4
    assert _record(policy, "ss....") == [None] * 6
    assert policy.rate == 0.0
    assert _record(policy, "ss") == [None, None]  # 2 of 4 is not more than 50%
    assert policy.record(True) == "GradScaler skipped 3 of the last 4 steps (more than 50% of 4)"


def test_the_run_rule_is_reported_before_the_window_rule() -> None:
    policy = SkipPolicy(max_consecutive_skips=2, skip_window=(4, 0.25))
    assert policy.record(True) is None  # 1 of 4 is not more than 25%
    assert policy.record(True) == "GradScaler skipped 2 steps in a row (max_consecutive_skips=2)"


def test_accumulation_micro_batches_are_not_counted() -> None:
    # GIVEN a run of skips interrupted only by micro-batches that accumulated gradients
    policy = SkipPolicy(max_consecutive_skips=3, skip_window=(10, 0.5))
    # WHEN the optimizer step was not due in them
    reasons = _record(policy, "smmsmm")
    # THEN they neither break the run nor count in the window
    assert reasons == [None] * 6
    assert policy.consecutive == 2 and list(policy.window) == [True, True]
    assert policy.record(True, due=False) is not None  # a skip is a step that was due, whatever `due` says


def test_rate_is_over_the_counted_steps() -> None:
    policy = SkipPolicy(max_consecutive_skips=None, skip_window=(100, 0.9))
    assert policy.rate == 0.0
    _record(policy, "s.m.")
    assert policy.rate == pytest.approx(1 / 3)


def test_no_rule_never_trips() -> None:
    policy = SkipPolicy(max_consecutive_skips=None, skip_window=None)
    assert _record(policy, "s" * 50) == [None] * 50
    assert policy.consecutive == 50
