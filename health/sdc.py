"""Silent-data-corruption verdicts: pure functions of the evidence each rank gathers (no torch, no ray).

The trainer gathers, per rank (`trainer/probes.py`):
- params_intact: the exact bit checksum of its parameter shard still equals the one taken right after
  its last optimizer step (parameters do not change at rest);
- selftest / selftest_repeat: the bit checksum of a fixed, seeded chain of matmuls, run twice: the two
  must be equal, and equal on every rank of the same hardware;
- replica fingerprints: exact checksums of parameters that several ranks hold identically (parameters
  TP does not shard, across the tp group; everything across HSDP replicas). Disagreement names the
  minority; two replicas that disagree name both unless other evidence picks one;
- local_anomaly: its own loss or gradient shard was NaN/Inf on a re-run of the step.
Step anomalies (NaN/Inf loss or gradient norm, or a gradient-norm spike) are triaged by re-running
the step from the same inputs: not reproduced -> transient; reproduced with evidence on some ranks ->
persistent, those ranks are suspects; reproduced everywhere with no hardware evidence -> the data or
the model, not a device.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class RankEvidence:
    rank: int
    """Global rank."""
    params_intact: bool = True
    """Parameter shard unchanged since the rank's last optimizer step."""
    selftest: int | None = None
    """Bit checksum of the compute self-test (None when not run)."""
    selftest_repeat: int | None = None
    """The same self-test again on the same rank."""
    hardware: str = ""
    """Device model: self-tests must agree across ranks of the same hardware."""
    replicas: dict[str, int] = field(default_factory=dict)
    """Replica group id -> fingerprint of the parameters this rank holds in common with that group."""
    local_anomaly: bool = False
    """Its own loss or gradient shard was non-finite when the step was re-run."""


@dataclass(frozen=True, kw_only=True)
class SdcVerdict:
    suspects: tuple[int, ...]
    """Ranks whose device is suspected of corrupting data."""
    reasons: dict[int, list[str]]
    """rank -> what points at it."""

    @property
    def clean(self) -> bool:
        return not self.suspects


def minority(values: dict[int, int]) -> tuple[set[int], bool]:
    """Ranks that disagree with a strict majority; with no strict majority, (every rank, True)."""
    counts = Counter(values.values())
    if len(counts) <= 1:
        return set(), False
    top, n = counts.most_common(1)[0]
    if 2 * n > len(values):
        return {r for r, v in values.items() if v != top}, False
    return set(values), True


def sdc_verdict(evidence: list[RankEvidence]) -> SdcVerdict:
    reasons: dict[int, list[str]] = {}

    def blame(rank: int, why: str) -> None:
        reasons.setdefault(rank, []).append(why)

    for e in evidence:
        if not e.params_intact:
            blame(e.rank, "parameters changed at rest (checksum differs from the one after its last optimizer step)")
        if e.selftest is not None and e.selftest_repeat is not None and e.selftest != e.selftest_repeat:
            blame(e.rank, "compute self-test not repeatable on this rank")
    by_hardware: dict[str, dict[int, int]] = {}
    for e in evidence:
        if e.selftest is not None:
            by_hardware.setdefault(e.hardware, {})[e.rank] = e.selftest
    for hardware, results in by_hardware.items():
        odd, tie = minority(results)
        if not tie:
            for rank in odd:
                blame(rank, f"compute self-test differs from the other {hardware or 'same-hardware'} ranks")
    groups: dict[str, dict[int, int]] = {}
    for e in evidence:
        for group, fingerprint in e.replicas.items():
            groups.setdefault(group, {})[e.rank] = fingerprint
    for group, fingerprints in sorted(groups.items()):
        odd, tie = minority(fingerprints)
        if not odd:
            continue
        if not tie:
            for rank in odd:
                blame(rank, f"replica fingerprint differs from the majority of {group}")
            continue
        known = [r for r in odd if r in reasons]
        for rank in (known or sorted(odd)):
            blame(rank, f"replicas of {group} disagree with no majority ({len(fingerprints)} replicas)")
    return SdcVerdict(suspects=tuple(sorted(reasons)), reasons=reasons)


def step_anomaly(loss: float | None, grad_norm: float, recent_grad_norms: list[float], *,
                 spike_factor: float, min_history: int = 5) -> str | None:
    """Why this step's numbers are suspect, or None: NaN/Inf loss or gradient norm, or a gradient
    norm above `spike_factor` x the median of the recent ones."""
    if loss is not None and not math.isfinite(loss):
        return f"loss is {loss}"
    if not math.isfinite(grad_norm):
        return f"gradient norm is {grad_norm}"
    if len(recent_grad_norms) >= min_history:
        typical = statistics.median(recent_grad_norms)
        if typical > 0 and grad_norm > spike_factor * typical:
            return f"gradient norm {grad_norm:.3g} is {grad_norm / typical:.1f}x the recent median {typical:.3g}"
    return None


class Triage(str, enum.Enum):
    TRANSIENT = "transient"
    """Not reproduced on a re-run: go on with the re-run's result."""
    PERSISTENT = "persistent"
    """Reproduced, and evidence names ranks: their devices are suspects."""
    NOT_HARDWARE = "not_hardware"
    """Reproduced on every rank with no device evidence: the data or the model; skip the update."""


@dataclass(frozen=True, kw_only=True)
class TriageResult:
    kind: Triage
    """What the anomaly turned out to be."""
    suspects: tuple[int, ...]
    """Ranks to quarantine (PERSISTENT only)."""
    reasons: dict[int, list[str]]
    """rank -> evidence."""


def triage(first: str, rerun: str | None, evidence: list[RankEvidence]) -> TriageResult:
    """`first`: the anomaly seen; `rerun`: the anomaly of the re-run from the same inputs, if any."""
    verdict = sdc_verdict(evidence)
    if verdict.suspects:
        return TriageResult(kind=Triage.PERSISTENT, suspects=verdict.suspects, reasons=verdict.reasons)
    if rerun is None:
        return TriageResult(kind=Triage.TRANSIENT, suspects=(), reasons={})
    local = [e.rank for e in evidence if e.local_anomaly]
    if len(local) == 1:
        reasons = {local[0]: [f"the re-run reproduced it ({rerun}) on this rank only"]}
        return TriageResult(kind=Triage.PERSISTENT, suspects=(local[0],), reasons=reasons)
    return TriageResult(kind=Triage.NOT_HARDWARE, suspects=(), reasons={})
