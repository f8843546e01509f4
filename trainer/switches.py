"""Drill switches: what a drill asks of one GPU slot's training process, set from outside it.

The Ray actor that holds a GPU slot owns one shared array (shared memory every training process of the
slot maps: controller/ray/zygote.py), so a drill set on a slot stays with that slot, as a real slow or faulty GPU would, across
attempts. The trainer reads the switches between steps. Pure: no torch.
"""

from __future__ import annotations

from typing import MutableSequence

SLOW, BITFLIP, OUTAGE_UNTIL, COLLECTIVE_FAULTS, FAULT_POINT, FAULT_DELAY, FAULT_FROM_STEP = 0, 1, 2, 3, 4, 5, 6
SIZE = 7


class DrillSwitches:
    """Views a shared array of doubles: [slow factor, bit-flip requests, outage end (unix s),
    collective-fault requests, the last one's point (its index in trainer/protocol.PROTOCOL_POINTS),
    its delay in seconds (0: the collective fails), the step from which it acts (0: the next)]."""

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
    def collective_fault(self) -> tuple[int, float | None, int | None]:
        """The last one asked for: (its point's index, its delay in seconds or None: it fails, the step
        from which it acts or None: the next time the rank reaches the point)."""
        delay = float(self.values[FAULT_DELAY])
        from_step = int(self.values[FAULT_FROM_STEP])
        return int(self.values[FAULT_POINT]), (delay if delay > 0 else None), (from_step if from_step > 0 else None)

    @property
    def holds_collective_fault(self) -> int:
        """1 while the last collective fault waits for its step (no training process has armed it yet)."""
        return int(self.values[FAULT_FROM_STEP] > 0)

    def collective_fault_armed(self) -> None:
        """A training process armed the last one: a process that comes after it on the slot does not."""
        self.values[FAULT_FROM_STEP] = 0

    def request_collective_fault(self, point: int, delay_s: float | None, from_step: int | None = None) -> None:
        """The collective-fault drill: the point, delay and first step first, then the count the
        trainer watches."""
        if from_step is not None and from_step < 1:
            raise ValueError(f"a collective fault acts from a step >= 1 (got {from_step})")
        self.values[FAULT_POINT] = point
        self.values[FAULT_DELAY] = delay_s or 0.0
        self.values[FAULT_FROM_STEP] = from_step or 0
        self.values[COLLECTIVE_FAULTS] = self.values[COLLECTIVE_FAULTS] + 1
