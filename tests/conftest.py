"""Every test (and every process a test starts) keeps goodput's state under a temporary dir, never
in the home directory of whoever runs the suite."""

from __future__ import annotations

import os
import shutil
import tempfile

_STATE = tempfile.mkdtemp(prefix="goodput-test-state-")
os.environ["GOODPUT_STATE_DIR"] = _STATE
os.environ.pop("GOODPUT_TOKEN", None)
os.environ.pop("GOODPUT_URL", None)


def pytest_unconfigure(config) -> None:  # type: ignore[no-untyped-def]
    """The state dir goes with the session (every test's services and runs have ended by now)."""
    shutil.rmtree(_STATE, ignore_errors=True)


def pytest_runtest_setup(item) -> None:  # type: ignore[no-untyped-def]
    from tests.support.tools import require

    for mark in item.iter_markers("needs"):
        require(mark.args[0])
