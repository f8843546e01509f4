"""What a submission must pass before it is queued: its size and shape, its store (does it take a
write; which ids already hold checkpoints), and the id it gets. Every refusal is a ServiceError with a
code (app.py maps codes to HTTP statuses) and a message that says what to fix.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

from checkpointing.store import anchored
from controller.errors import ServiceError
from controller.spec import RunSpec, SpecError, parse_spec

MAX_SPEC_BYTES = 64 * 1024
MAX_DRILLS_PER_RUN = 64
MAX_RUN_ID = 64
MAX_EVENTS_PAGE = 1000
MAX_HISTORY_PAGE = 10000
MAX_RUNS = 10_000

STORE_PROBE_WAIT_S = 0.5
"""How long a submission waits for its store's answers (a store that answers later is the run's to
wait for at launch: store_unavailable, not the request's)."""
ID_CANDIDATES = 8
"""Ids a submission asks the store about (name, name-2, ...), within STORE_PROBE_WAIT_S in all."""

StoreFactory = Callable[[RunSpec], Any]
StoreProbe = Callable[[Any, str], None]
"""(store, uri) -> None, or SpecError saying why the store cannot be written."""


def parse_submission(raw: Any, *, relative_root: Path | None) -> RunSpec:
    """A spec submitted to the service (JSON-like), validated and within its limits; a relative
    checkpoint path lands under `relative_root` (not the cwd of wherever the service was started)."""
    spec = parse_limited(raw)
    if spec.cluster.address is not None:
        raise ServiceError("invalid_spec", "cluster.address is for `goodput run`; the service runs every "
                                           "run on its own cluster: remove it")
    uri = spec.checkpoint.uri if relative_root is None else anchored(spec.checkpoint.uri, relative_root)
    if uri != spec.checkpoint.uri:
        spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"uri": uri})})
    return spec


def parse_limited(raw: Any) -> RunSpec:
    """A spec (JSON-like), validated and within the service's limits."""
    try:
        size = len(json.dumps(raw))
    except (TypeError, ValueError):
        raise ServiceError("invalid_spec", "the run spec must be a JSON object") from None
    if size > MAX_SPEC_BYTES:
        raise ServiceError("spec_too_large", f"the run spec is {size} bytes; at most {MAX_SPEC_BYTES}")
    try:
        spec = parse_spec(raw)
    except SpecError as e:
        raise ServiceError("invalid_spec", str(e)) from None
    if len(spec.name) > MAX_RUN_ID - 8:
        raise ServiceError("invalid_spec", f"name is {len(spec.name)} characters; at most {MAX_RUN_ID - 8}")
    if len(spec.drills) > MAX_DRILLS_PER_RUN:
        raise ServiceError("invalid_spec", f"{len(spec.drills)} drills; at most {MAX_DRILLS_PER_RUN} per run")
    return spec


def run_store(spec: RunSpec, store_factory: StoreFactory | None, *, probe: StoreProbe | None = None,
              candidates: list[str] | None = None, fresh: bool = False) -> tuple[Any, dict[str, list[int]]]:
    """The run's checkpoint store, and {candidate id: its committed steps} for the candidates whose
    prefix already holds objects. Given candidate ids, the store is also asked, for at most
    STORE_PROBE_WAIT_S in all, whether it takes a write (invalid_spec saying why not); then, for a fresh
    run, which candidates are occupied (in order, until a free one), else whether the first holds
    another model's checkpoints (checkpoint_mismatch). A fresh run launched over an occupied prefix it
    could not see here refuses at launch (checkpoints_in_the_way) instead of loading them."""
    if store_factory is None:
        return None, {}
    try:
        store = store_factory(spec)
    except SpecError as e:
        raise ServiceError("invalid_spec", str(e)) from None
    if not candidates:
        return store, {}
    from checkpointing.manifest import IdentityMismatch, check_identity, committed_steps, read_manifest
    from trainer.config import state_fingerprint, state_identity

    occupied: dict[str, list[int]] = {}

    def ask() -> None:
        if probe is not None:
            probe(store, spec.checkpoint.uri)
        if fresh:
            for run_id in candidates:
                if not store.list(f"{run_id}/"):
                    return
                occupied[run_id] = committed_steps(store, run_id)
            return
        steps = committed_steps(store, candidates[0])
        if steps:
            model = spec.to_model_config()
            check_identity(read_manifest(store, candidates[0], steps[-1]), state_fingerprint(model),
                           state_identity(model), store.uri)

    error = within(STORE_PROBE_WAIT_S, ask)
    if isinstance(error, SpecError):
        raise ServiceError("invalid_spec", str(error)) from None
    if isinstance(error, IdentityMismatch):
        raise ServiceError("checkpoint_mismatch", str(error)) from None
    return store, dict(occupied)


def resume_spec(spec: RunSpec, *, run_id: str, at: int, step: int | None, steps: int | None,
                committed: set[int]) -> RunSpec:
    """The spec an ended run at step `at` resumes with: `steps` raised if asked (never below `at`), from
    the committed `step` if given (one of `committed`)."""
    if steps is not None:
        if steps < at:
            raise ServiceError("invalid_request", f"steps = {steps} is below the run's step {at}")
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": steps})})
    if step is not None and step not in committed:
        raise ServiceError("no_such_checkpoint", f"run {run_id!r} has no committed step {step}; "
                                                 f"committed: {sorted(committed) or 'none'}")
    return spec


def drill_allowed(run_id: str, *, pending: int, injected: int) -> None:
    """A run takes at most MAX_DRILLS_PER_RUN drills, requested and injected."""
    if pending + injected >= MAX_DRILLS_PER_RUN:
        raise ServiceError("too_many_drills", f"run {run_id!r} has had {MAX_DRILLS_PER_RUN} drills")


def free_ids(name: str, count: int, taken: Callable[[str], bool]) -> list[str]:
    """The first `count` ids of name, name-2, name-3, ... not `taken` (ids are checkpoint prefixes:
    never shared)."""
    out: list[str] = []
    n = 1
    while len(out) < count:
        run_id = name if n == 1 else f"{name}-{n}"
        if not taken(run_id):
            out.append(run_id)
        n += 1
    return out


def within(seconds: float, fn: Callable[[], None]) -> BaseException | None:
    """Run fn in a thread for at most `seconds`: the exception it raised in time, else None (it
    succeeded, or is still waiting on something slow and is left to finish on its own)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.append(e)

    thread = threading.Thread(target=run, name="goodput-bounded-call", daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else None
