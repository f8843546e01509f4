"""The run's rendezvous store: a torch TCPStore the ranks build their process groups with and, under
failure_domain replica, read the membership epochs from (trainer/replica.py) and re-form their
cross-replica groups with after every change.

A foreground run keeps it in the controller's process (it ends with the run). A service's run (its
actors named and detached so that they outlive the service) keeps it in a detached actor of its own
on the cluster's head node: a restarted service finds it again by name, so the membership a replica
run trains under, and the groups its survivors must re-form after the next failure, outlive the
service too. The head holds the cluster's GCS already: the store adds no node whose loss ends a run
that the cluster itself would survive."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

NAMESPACE = "goodput"


class RunStore:
    """A detached actor holding a TCPStore server; `address` says where the ranks reach it."""

    def __init__(self) -> None:
        import ray
        import torch.distributed as dist

        self._host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False)

    def address(self) -> tuple[str, int]:
        return self._host, int(self._store.port)


def store_name(run: str) -> str:
    return f"{run}:store"  # (not `{run}/...`: those are the run's rank actors, by node)


def open_store(run: str | None, host: str) -> tuple[Any, str]:
    """(the store, the host the ranks reach it at). `run` None: a server in this process, at `host`.
    Else the run's store actor (found by name, started on the head node if there is none yet) and a
    client of it here."""
    import torch.distributed as dist

    if run is None:
        return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False), host
    import ray

    actor = ray.remote(RunStore).options(  # (one the earlier controller started, if any)
        name=store_name(run), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        resources={"node:__internal_head__": 0.001}).remote()
    store_host, port = _address(actor, timeout_s=120)
    return dist.TCPStore(store_host, port, is_master=False, timeout=timedelta(seconds=30)), store_host


def find_store(run: str) -> tuple[Any, str] | None:
    """The store an earlier controller started for `run` and a client of it, or None (gone)."""
    import ray
    import torch.distributed as dist

    try:
        store_host, port = _address(ray.get_actor(store_name(run), namespace=NAMESPACE), timeout_s=15)
        return dist.TCPStore(store_host, port, is_master=False, timeout=timedelta(seconds=30)), store_host
    except Exception:  # noqa: BLE001 - no store actor, or a dead one
        return None


def end_store(run: str | None) -> None:
    """End the run's store actor (with the run: nothing reads it again)."""
    if run is None:
        return
    import ray

    try:
        ray.kill(ray.get_actor(store_name(run), namespace=NAMESPACE), no_restart=True)
    except Exception:  # noqa: BLE001 - none, or already gone
        return
    deadline = time.monotonic() + 10  # its name is free once it is dead (the next attempt may take it)
    while time.monotonic() < deadline:
        try:
            ray.get_actor(store_name(run), namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


def _address(actor: Any, timeout_s: float) -> tuple[str, int]:
    import ray

    host, port = ray.get(actor.address.remote(), timeout=timeout_s)
    return str(host), int(port)

