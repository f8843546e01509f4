"""A model provider with a bug of its own: examples/gpt2_provider's model whose loss raises at a given
step, on every rank that computes it, whichever nodes they are on (the user's code failing, not the
cluster). tests/cluster/test_your_data.py runs it: the run must end `user_error` after one retry on
other nodes, with this file in the traceback and elastic.max_failures untouched."""

from __future__ import annotations

from typing import Any

import torch

from examples.gpt2_provider import build as gpt2


class Buggy:
    """The GPT-2 provider, but its loss raises at its `raise_at_step`th step: counted in loss calls, a
    step being `micro_batches` of them on a rank of the last stage (an attempt starts from step 0: the
    run keeps no checkpoint that early)."""

    def __init__(self, inner: Any, raise_at_step: int, micro_batches: int) -> None:
        self.inner, self.raise_at_step, self.micro_batches = inner, raise_at_step, micro_batches
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == (self.raise_at_step - 1) * self.micro_batches + 1:
            raise ValueError(f"operands could not be broadcast together (a bug in the model's loss, step "
                             f"{self.raise_at_step})")
        return self.inner.loss(output, targets)


def build(*, vocab_size: int, seq_len: int, raise_at_step: int, micro_batches: int, **args: Any) -> Buggy:
    return Buggy(gpt2(vocab_size=vocab_size, seq_len=seq_len, **args), raise_at_step, micro_batches)
