"""A survivor's cross-replica collective whose communicator failed is not voted on: NCCL's work may
say completed when it failed or was aborted, so the group's own error is asked first (torchft's
errored()); gloo raises in the wait and has nothing more to say."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

from trainer.abandon import errored


class NcclLike:
    """The part of a ProcessGroupNCCL errored() reads: get_error()."""

    def __init__(self, error: ErrorType) -> None:
        self.error = error

    def get_error(self) -> ErrorType:
        return self.error


def test_a_communicator_error_is_said_and_success_is_not() -> None:
    assert errored(NcclLike(ErrorType.SUCCESS)) is None
    for error in (ErrorType.TIMEOUT, ErrorType.COMM_ERROR, ErrorType.REMOTE_ERROR):
        said = errored(NcclLike(error))
        assert said is not None and error.name in said


def test_a_gloo_group_has_nothing_more_to_say() -> None:
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    t = torch.ones(2)
    group.allreduce([t]).wait()
    assert errored(group) is None


def test_a_reduce_whose_communicator_failed_is_a_failed_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """CrossReplica.reduce reports False (the step is discarded by the vote) and drops the group."""
    from trainer import replica

    done = SimpleNamespace(is_completed=lambda: True, wait=lambda: None)
    group = SimpleNamespace(allreduce=lambda bufs, opts: done, get_error=lambda: ErrorType.REMOTE_ERROR,
                            abort=lambda: None)
    cross = replica.CrossReplica.__new__(replica.CrossReplica)
    cross.group, cross._works, cross.graveyard, cross.timeout_s = group, [], replica.abandon.Graveyard(), 5.0
    cross.superseded = lambda: None  # type: ignore[method-assign]
    cross.last_error, cross.faults, cross.at_step = None, [], 1
    monkeypatch.setattr(replica.CrossReplica, "live", property(lambda self: 2))
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    assert cross.reduce([layer]) is False
    assert "REMOTE_ERROR" in cross.last_error and cross.group is None
