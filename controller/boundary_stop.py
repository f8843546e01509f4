"""A stop at a step boundary, the controller's side (the ranks' side: trainer/stop.py).

1. Asked: a service preempts the run (`keep` = "store": the step is committed to the store) or drains
   nodes (`keep` = "peers": the step stays in the buddies' memory; the departing nodes are named).
   Asking is safe from any thread; one stop at a time.
2. Sent: the driving thread hands it to the running attempt's ranks. A rank that gets a SIGTERM sends
   one itself (its node is going): that stop is sent already, for its node.
3. Heard: the ranks stopped after the same step (`stopped_at_boundary`), or the group finished short of
   its last step with the stop sent (its word late). The controller then re-queues the run or reseats
   the departing nodes' ranks; a failure of the attempt drops the stop (asked again if still wanted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class EndedStop:
    """A stop the ranks carried out."""
    step: int
    """The step they stopped after."""
    kept: str
    """Where that step's state is: "store" or "peers"."""
    reason: str
    departing: tuple[str, ...]
    """The nodes it was for (a drain or a SIGTERM); empty for a preemption."""


class BoundaryStop:
    def __init__(self) -> None:
        self._asked: tuple[str, str] | None = None
        """(keep, reason) of a stop asked, until sent."""
        self._sent: tuple[str, str] | None = None
        """The stop sent to the running attempt's ranks (kept until they have stopped)."""
        self._heard: dict[str, Any] | None = None
        """The ranks' stopped_at_boundary detail, once heard."""
        self._departing: tuple[str, ...] = ()
        """The nodes it is for (a drain's, a SIGTERM's): reseated without them once the ranks stopped."""

    @property
    def pending(self) -> bool:
        """Asked or sent, and not carried out yet."""
        return self._asked is not None or self._sent is not None

    def ask(self, keep: str, reason: str, *, departing: tuple[str, ...] = ()) -> bool:
        """Safe from any thread: False when a stop is pending already."""
        if self.pending:
            return False
        self._departing = departing  # (before the stop itself: the driving thread reads them together)
        self._asked = (keep, reason)
        return True

    def to_send(self) -> tuple[str, str] | None:
        """The (keep, reason) to send to the ranks now, once."""
        asked, self._asked = self._asked, None
        if asked is not None:
            self._sent = asked
        return asked

    def sigterm(self, node: str) -> None:
        """A rank on `node` got a SIGTERM: the ranks agreed to stop at their next snapshot step by
        themselves; the node's ranks are reseated like a drained node's."""
        if node not in self._departing:
            self._departing += (node,)
        if self._sent is None:
            self._sent = self._asked or ("peers", f"SIGTERM on {node}")
            self._asked = None

    def heard(self, detail: dict[str, Any]) -> None:
        self._heard = dict(detail)

    def carried_out(self, *, step: int, last_step: int) -> bool:
        """Whether a worker group that finished without a failure stopped as asked: the ranks said so,
        or it was sent and they ended short of the last step."""
        return self._heard is not None or (self._sent is not None and step < last_step)

    def end(self, step: int) -> EndedStop:
        """The stop carried out (`step`: the run's, if the ranks' word did not come); cleared."""
        assert self._sent is not None
        (keep, reason), detail = self._sent, self._heard or {}
        ended = EndedStop(step=detail.get("step", step), kept=detail.get("kept", keep), reason=reason,
                          departing=self._departing)
        self.drop()
        return ended

    def drop(self) -> None:
        """The attempt it was for failed."""
        self._asked = self._sent = self._heard = None
        self._departing = ()
