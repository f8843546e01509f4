"""A run's progress lines say where each attempt's state came from."""

from __future__ import annotations

from controller.cli.render import describe

PLACEMENT = [{"rank": 0, "node": "node-0"}, {"rank": 1, "node": "node-4"}]


def started(**detail: object) -> dict:
    return {"kind": "attempt_started", "attempt": 1, "detail": {"placement": PLACEMENT, **detail}}


def test_an_attempt_says_whether_it_started_from_peers_the_store_or_scratch() -> None:
    assert describe(started(restore_from="peer", start_step=25, resume_step=None)).endswith(
        "from peer snapshots of step 25")
    assert describe(started(restore_from="store", start_step=20, resume_step=20)).endswith("from checkpoint step 20")
    assert describe(started(restore_from=None, start_step=0, resume_step=None)) == \
        "attempt 1 started on ['node-0', 'node-4'] from scratch"
