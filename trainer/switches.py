"""Drill switches: what a drill asks of one GPU slot's training process, set from outside it.

The Ray actor that holds a GPU slot owns one shared array (fork-inherited by every training process it
starts), so a drill set on a slot stays with that slot, as a real slow or faulty GPU would, across
attempts. The trainer reads the switches between steps. Pure: no torch.
"""

from __future__ import annotations

from typing import MutableSequence

SLOW, BITFLIP, OUTAGE_UNTIL = 0, 1, 2
SIZE = 3


class DrillSwitches:
    """Views a shared array of doubles: [slow factor, bit-flip requests, outage end (unix s)]."""

    def __init__(self, values: MutableSequence[float] | None = None) -> None:
        self.values: MutableSequence[float] = values if values is not None else [1.0, 0.0, 0.0]
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
