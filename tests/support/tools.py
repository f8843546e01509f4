"""Tests that need a tool of the machine (kubectl, promtool, a Prometheus server): skipped where it is
missing, except under CI=true, where a missing tool fails them: CI installs every tool the tests use
(`make test-deps`), so a skip there would hide a test that never ran."""

from __future__ import annotations

import os

import pytest


def require(missing: str | None) -> None:
    """Skip the calling test because of `missing` (what it lacks, and how to get it); under CI, fail."""
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run this test, but {missing}")
    pytest.skip(missing)


def needs(missing: str | None) -> pytest.MarkDecorator:
    """A marker for a test (or a module's `pytestmark`) that cannot run while `missing` is not None;
    tests/conftest.py applies `require` before each such test."""
    return pytest.mark.needs(missing)
