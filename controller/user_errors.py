"""A failure of the user's own code, told from the cluster's: the same exception, raised by the model,
data or provider code at the same step, again after a restart on other nodes. A broken node raises
where it is; a bug raises wherever the step runs. Such a run ends after that one retry (`user_error`,
with the traceback) instead of spending `elastic.max_failures` on restarts that cannot help.

Pure: the controller (controller/state.py) keeps the first `Raised` of a run and asks `judge` at the next.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace

from controller.failure_policy import Action, Decision, FailureCause, FailureEvent
from controller.placement import Placement, reseat
from controller.topology import NodeState

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


class Judgement(str, enum.Enum):
    FIRST = "first"
    """Not seen before (or at another step): retry, on other nodes where there are any."""
    USER_ERROR = "user_error"
    """The same exception at the same step on other nodes: the user's code."""
    SAME_NODES = "same_nodes"
    """The same again, but on the same nodes (there were no others): a node may still be the cause."""


@dataclass(frozen=True)
class Raised:
    signature: str
    """The exception's type and message (its last line, object addresses blanked)."""
    step: int
    """The step it was raised in."""
    nodes: frozenset[str]
    """The nodes of the ranks that raised it."""
    ranks: tuple[int, ...]
    traceback: str
    """The first raising rank's whole error text (type, message and the innermost frames)."""


def signature(error: str) -> str:
    """A rank's error text ends with the exception's `Type: message` line (a Python traceback's last
    line; the rank actors' texts start with it too)."""
    last = next((line.strip() for line in reversed(error.splitlines()) if line.strip()), "")
    return _ADDRESS.sub("0x?", last)


def raised(event: FailureEvent, *, step: int, node_of_rank: tuple[str, ...]) -> Raised | None:
    """What a worker error's ranks raised (None for any other failure, or one without their errors)."""
    errors = event.evidence.get("errors") if event.cause is FailureCause.WORKER_ERROR else None
    if not errors:
        return None
    by_rank = {int(r): str(text) for r, text in errors.items()}
    first = min(by_rank)
    signatures = sorted({signature(text) for text in by_rank.values()})
    return Raised(signature=" | ".join(signatures), step=step,
                  nodes=frozenset(node_of_rank[r] for r in by_rank if r < len(node_of_rank)),
                  ranks=tuple(sorted(by_rank)), traceback=by_rank[first])


def judge(first: Raised | None, now: Raised) -> Judgement:
    """The same exception at the same step again is the user's code when it came from other nodes this
    time, or from more than one node (no broken node makes another raise its exception)."""
    if first is None or (first.signature, first.step) != (now.signature, now.step):
        return Judgement.FIRST
    return Judgement.USER_ERROR if now.nodes != first.nodes or len(now.nodes) > 1 else Judgement.SAME_NODES


def elsewhere(decision: Decision, seen: Raised, placement: Placement | None) -> Decision:
    """A restart after a first worker error, with the ranks of the nodes that raised it moved to other
    nodes where some can take them (idle healthy nodes first, then spares; the nodes left stay healthy:
    nothing accuses them yet), so that the same error again tells the code from the node."""
    if decision.action is not Action.RESTART or placement is None or decision.mesh != placement.mesh:
        return decision
    topology = decision.topology
    moved = reseat(placement, topology, seen.nodes)
    if moved is None:
        spares = [n.name for n in topology.spares()][:len(seen.nodes)]
        if len(spares) == len(seen.nodes):
            promoted = topology.with_states({name: NodeState.HEALTHY for name in spares})
            moved = reseat(placement, promoted, seen.nodes, candidates=spares)
            topology = promoted if moved is not None else topology
    if moved is None:
        return decision
    to = sorted(moved.nodes() - placement.nodes())
    return replace(decision, topology=topology, placement=moved, code="retried_elsewhere",
                   reason=f"{decision.reason}; rank(s) {list(seen.ranks)} raised {seen.signature}: the ranks of "
                          f"{sorted(seen.nodes)} move to {to}, so that the same error again is the code's, not a node's")
