"""The exit protocol of a replay under torchrun: once every rank agreed on its exit code, SIGTERM is ignored up to
the process's end (torchrun's teardown of a rank still exiting must not change its code), and the command line's
own SIGTERM handler, put back to the default when it is done, leaves a handler set meanwhile in place. The whole
protocol under torchrun: ``tests/integration/test_ddp_capture.py``."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from nanhunt._util._interrupt import terminate_raises


@pytest.fixture
def _sigterm_default() -> Iterator[None]:
    prev = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev)


@pytest.mark.usefixtures("_sigterm_default")
def test_sigterm_ignored_inside_terminate_raises_stays_ignored_after_it() -> None:
    # GIVEN the command line's SIGTERM handler, inside which the replay ignores SIGTERM once the ranks agreed
    with terminate_raises():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # THEN leaving it keeps SIGTERM ignored (before: the default put back, and torchrun's SIGTERM ended the rank)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


@pytest.mark.usefixtures("_sigterm_default")
def test_terminate_raises_still_puts_the_default_back_when_nothing_else_changed_it() -> None:
    with terminate_raises():
        pass
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
