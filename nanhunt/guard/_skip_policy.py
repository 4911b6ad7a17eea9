"""When GradScaler's skipped steps stop being normal: the Guard's skip policy, in plain Python (no torch)."""

from __future__ import annotations

from collections import deque

__all__ = ["SkipPolicy"]


class SkipPolicy:
    """Count the steps GradScaler skipped; say when to stop.

    With a GradScaler a skipped step is normal (the scale was too large and backs off). Not normal:
    ``max_consecutive_skips`` skips in a row, or more than ``max_rate * window`` of the last ``window``
    counted steps skipped (``skip_window=(window, max_rate)``); None switches a rule off. After a reason is
    given both counts start again, so a run that continues (``on_fail="dump"``/``"warn"``) is judged afresh.

    Only a step whose optimizer step was due counts: it ran (``due=True``), or GradScaler skipped it. A
    gradient-accumulation micro-batch that only accumulated gradients is neither and is not counted, so it
    neither breaks a run of skips nor dilutes the window.
    """

    def __init__(self, max_consecutive_skips: int | None = 10,
                 skip_window: tuple[int, float] | None = (1000, 0.05)) -> None:
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError("max_consecutive_skips must be >= 1 or None")
        if skip_window is not None:
            n, rate = skip_window
            if n < 1 or not 0.0 <= rate < 1.0:
                raise ValueError("skip_window is (window >= 1, max_rate in [0, 1))")
        self.max_consecutive_skips = max_consecutive_skips
        self.skip_window = skip_window
        self.consecutive = 0  # skips in a row, up to the last counted step
        self.window: deque[bool] = deque(maxlen=skip_window[0] if skip_window else 1)  # skipped?, per counted step

    @property
    def rate(self) -> float:
        """Fraction of skipped steps among the last ``skip_window[0]`` counted steps (0 before any)."""
        return sum(self.window) / len(self.window) if self.window else 0.0

    def record(self, skipped: bool, *, due: bool = True) -> str | None:
        """Count one step (``skipped``: GradScaler skipped its optimizer step, on any rank); the reason to stop,
        if any. ``due=False``: the optimizer step did not run, so an unskipped step is a micro-batch: not counted.
        """
        if not (due or skipped):
            return None
        self.window.append(skipped)
        if not skipped:
            self.consecutive = 0
            return None
        self.consecutive += 1
        reason = None
        if self.max_consecutive_skips is not None and self.consecutive >= self.max_consecutive_skips:
            reason = (f"GradScaler skipped {self.consecutive} steps in a row "
                      f"(max_consecutive_skips={self.max_consecutive_skips})")
        elif self.skip_window is not None:
            n, rate = self.skip_window
            k = sum(self.window)
            if k > rate * n:
                reason = f"GradScaler skipped {k} of the last {len(self.window)} steps (more than {rate:.0%} of {n})"
        if reason is not None:
            self.consecutive = 0
            self.window.clear()
        return reason
