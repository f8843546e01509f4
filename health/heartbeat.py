"""Silence verdicts: a pure function of when each node's heartbeat last moved, as the controller saw it.

A silent fault (a host that loses power, a NIC or switch port that dies, a partition, a frozen host)
closes no socket: peers wait in their collectives until a timeout and Ray's own health checks take
tens of seconds. So every node of a run beats: a thread of each of its rank actors adds one to a
counter of the run's store every `HEARTBEAT_PERIOD_S`. The controller reads the counters at each
poll and notes, by its own clock (the nodes' clocks are never compared with it), when each last
moved. A node whose counters have not moved for `HEARTBEAT_TIMEOUT_S` is silent.

Silence alone never loses a node; guards against false positives:
- a controller that finds every node silent at once suspects itself (its own link to the store, or
  its own process stalled): nobody is lost (`SilenceVerdict.self_suspect`);
- the heartbeat does not ride on the training step: a slow step, a long checkpoint or a rank stopped
  on purpose (hang-rank) leave it beating, so they are never silence;
- a slow link delays each beat by its latency only (50 ms against a 1 s timeout);
- silence is corroborated before a node is declared lost (`corroborated`): its raylet does not
  accept a connection within the probe's wait, or its actors left a drain unanswered for as long as
  the silence, or its peers' collectives failed. A silent node that still answers both is left to the
  hang verdict (controller/attribution.py).
"""

from __future__ import annotations

from dataclasses import dataclass

HEARTBEAT_PERIOD_S = 0.2
"""How often a node's rank actors beat."""
HEARTBEAT_TIMEOUT_S = 1.0
"""A node whose beats have not moved for this long is silent (5 missed beats). With the controller's
poll (0.2 s) and the raylet probe's wait (0.3 s), a dark node is declared lost within ~1.5 s."""


@dataclass(frozen=True)
class SilenceVerdict:
    silent: tuple[str, ...]
    """Nodes whose heartbeat has not moved for the timeout (not yet corroborated)."""
    silent_s: dict[str, float]
    """How long each silent node has been silent."""
    self_suspect: bool
    """Every node is silent at once: the controller suspects itself, and no node is declared lost."""


def silence(now: float, last_moved: dict[str, float], *, timeout_s: float = HEARTBEAT_TIMEOUT_S) -> SilenceVerdict:
    """Which of the watched nodes (`last_moved`: node -> when its counter last moved, the
    controller's clock; a node starts watched at its attempt's launch) are silent at `now`."""
    silent = {node: now - t for node, t in last_moved.items() if now - t > timeout_s}
    every = bool(last_moved) and len(silent) == len(last_moved) and len(last_moved) > 1
    if every:
        return SilenceVerdict(silent=(), silent_s=silent, self_suspect=True)
    return SilenceVerdict(silent=tuple(sorted(silent)), silent_s=silent, self_suspect=False)


def corroborated(silent: tuple[str, ...], *, probe_unanswered: set[str], drains_unanswered: set[str],
                 collectives_failed: set[str]) -> set[str]:
    """The silent nodes that other evidence confirms: their raylet did not accept the probe's
    connection in time, or their actors did not answer a drain, or their peers' collectives failed."""
    return {node for node in silent
            if node in probe_unanswered or node in drains_unanswered or node in collectives_failed}
