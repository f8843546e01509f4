"""Drill switches: what a drill asks of one GPU slot's training process, set from outside it.

The Ray actor that holds a GPU slot owns one shared array (shared memory every training process of the
slot maps: controller/ray/zygote.py), so a drill set on a slot stays with that slot, as a real slow or faulty GPU would, across
attempts. The trainer reads the switches between steps. Pure: no torch.
"""

from __future__ import annotations

from typing import MutableSequence

SLOW, BITFLIP, OUTAGE_UNTIL, COLLECTIVE_FAULTS, FAULT_POINT, FAULT_DELAY = 0, 1, 2, 3, 4, 5
SIZE = 6


class DrillSwitches:
    """Views a shared array of doubles: [slow factor, bit-flip requests, outage end (unix s),
    collective-fault requests, the last one's point (its index in trainer/protocol.PROTOCOL_POINTS),
    its delay in seconds (0: the collective fails)]."""

    def __init__(self, values: MutableSequence[float] | None = None) -> None:
        self.values: MutableSequence[float] = values if values is not None else [1.0] + [0.0] * (SIZE - 1)
        if self.values[SLOW] < 1.0:
            self.values[SLOW] = 1.0

    @property
    def slow_factor(self) -> float:
        """This slot computes this many times slower (1.0: normal)."""
        return float(self.values[SLOW])

    def slow(self, factor: float) -> None:
        if factor < 1.0:
            raise ValueError(f"slow-rank factor = {factor} must be >= 1")
        self.values[SLOW] = factor

    @property
    def bitflips(self) -> int:
        """Bit flips requested so far (the trainer remembers how many it has done)."""
        return int(self.values[BITFLIP])

    def request_bitflip(self) -> None:
        self.values[BITFLIP] = self.values[BITFLIP] + 1

    @property
    def outage_until(self) -> float:
        """Unix time until which the object store refuses writes."""
        return float(self.values[OUTAGE_UNTIL])

    def outage(self, until: float) -> None:
        self.values[OUTAGE_UNTIL] = until

    @property
    def collective_faults(self) -> int:
        """Collective faults requested so far (the trainer remembers how many it has armed)."""
        return int(self.values[COLLECTIVE_FAULTS])

    @property
    def collective_fault(self) -> tuple[int, float | None]:
        """The last one asked for: (its point's index, its delay in seconds or None: it fails)."""
        delay = float(self.values[FAULT_DELAY])
        return int(self.values[FAULT_POINT]), (delay if delay > 0 else None)

    def request_collective_fault(self, point: int, delay_s: float | None) -> None:
        """The collective-fault drill: the point and delay first, then the count the trainer watches."""
        self.values[FAULT_POINT] = point
        self.values[FAULT_DELAY] = delay_s or 0.0
        self.values[COLLECTIVE_FAULTS] = self.values[COLLECTIVE_FAULTS] + 1
