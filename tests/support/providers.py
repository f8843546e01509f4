"""Providers that break trainer/provider.py's contract, each in one way (tests/unit/test_provider.py)."""

from __future__ import annotations

from typing import Any


class _NoLoss:
    def numbers(self) -> Any: ...

    def build_stage(self, layers: range, *, first: bool, last: bool) -> Any: ...

    def init_weights(self, part: Any, seed: int) -> None: ...

    def parallelize(self, part: Any, plan: Any) -> None: ...


def no_loss(**_: Any) -> _NoLoss:
    return _NoLoss()


class _BadNumbers(_NoLoss):
    def numbers(self) -> Any:
        return {"parameters": 10}

    def loss(self, output: Any, targets: Any) -> Any: ...


def bad_numbers(**_: Any) -> _BadNumbers:
    return _BadNumbers()


NOT_A_FUNCTION = 3
