"""A provider model's numbers, asked of its code before the controller plans (trainer/provider.py).

The spec names the provider; the planner is pure and needs numbers (parameters, layers, activation
bytes, the tensor-parallel width). Where the model's code can be imported (the service, `goodput
run`), the provider is asked once and the spec carries the answer from then on. The CLI never imports
a user's model: a remote `goodput submit` leaves this to the service, which refuses a provider it
cannot import (invalid_spec, saying what to install).
"""

from __future__ import annotations

import dataclasses

from controller.spec import ModelNumbersSpec, RunSpec, SpecError


def with_model_numbers(spec: RunSpec) -> RunSpec:
    """`spec` with its provider's numbers (unchanged for goodput's decoder); SpecError saying what to fix."""
    if spec.model.provider is None:
        return spec
    from trainer.provider import ask_numbers

    try:
        numbers = ask_numbers(dataclasses.replace(spec.to_model_config(), numbers=None))
    except ValueError as e:
        raise SpecError(str(e)) from None
    model = spec.model.model_copy(update={"numbers": ModelNumbersSpec(**dataclasses.asdict(numbers))})
    return spec.model_copy(update={"model": model})
