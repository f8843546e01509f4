"""What a quarantine means on Kubernetes: the node is cordoned and tainted, so the scheduler stops
landing new pods on it (goodput's own placement already avoids it). Through the official `kubernetes`
client, only when the service runs in a cluster with a service account (off in local mode).

- quarantine(node, reason): `spec.unschedulable = true` plus the taint
  `goodput.dev/quarantined=<reason>:NoSchedule`, in one patch carrying the node's resourceVersion,
  so a concurrent change to the node (another controller's taint, an operator's cordon) is never
  overwritten: the API answers 409 Conflict and the node is read again. 429 and 5xx are retried with
  backoff; 403 says which RBAC rule is missing.
- release(node): only on an operator's explicit `goodput nodes release NODE`, never automatically:
  the taint goes, and the cordon too unless someone else had cordoned the node first (the
  annotation `goodput.dev/cordoned-by` says whether goodput did).
- node_labels(): every node's labels, for topology discovery (controller.k8s.topology); node_facts():
  those and the nodes about to go (`departing`: cordoned by someone else, or tainted by the cluster
  autoscaler, Karpenter or a spot interruption handler), which the service drains.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

TAINT_KEY = "goodput.dev/quarantined"
CORDONED_BY = "goodput.dev/cordoned-by"
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"

T = TypeVar("T")

DEPARTING_TAINTS = {
    "ToBeDeletedByClusterAutoscaler": "the cluster autoscaler deletes it",
    "DeletionCandidateOfClusterAutoscaler": None,  # (a candidate only: it may stay; not a departure)
    "karpenter.sh/disrupted": "Karpenter disrupts it",
    "karpenter.sh/disruption": "Karpenter disrupts it",
    "cloud.google.com/impending-node-termination": "GKE reclaims it (spot or preemptible)",
    "aws-node-termination-handler/spot-itn": "AWS spot interruption notice",
    "aws-node-termination-handler/scheduled-maintenance": "AWS scheduled maintenance",
    "aws-node-termination-handler/asg-lifecycle-termination": "its autoscaling group terminates it",
    "aws-node-termination-handler/rebalance-recommendation": "AWS spot rebalance recommendation",
}
"""Taints that say a node is about to go, and why (None: seen but not a departure)."""


def departure(node: Any) -> str | None:
    """Why the Node object `node` is about to go, or None: a taint of DEPARTING_TAINTS, or a cordon that
    goodput's quarantine did not make (an operator's `kubectl drain`, an upgrade)."""
    for taint in node.spec.taints or []:
        why = DEPARTING_TAINTS.get(taint.key)
        if why:
            return f"taint {taint.key}: {why}"
    if node.spec.unschedulable and not any(t.key == TAINT_KEY for t in node.spec.taints or []):
        return "cordoned"
    return None


class KubeError(Exception):
    """A Kubernetes call that did not succeed, in one line that says what to fix."""


@dataclass
class Outcome:
    node: str
    action: str
    """cordoned, already, released, not_found."""
    detail: str = ""


def in_cluster() -> bool:
    """Running in a pod with a service account (what `--kubernetes auto` looks for)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(SERVICE_ACCOUNT_TOKEN)


def taint_value(reason: str) -> str:
    """A taint value is a label value: at most 63 of [A-Za-z0-9._-], starting and ending alphanumeric."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", reason)[:63].strip("-._")
    return value or "quarantined"


class KubeNodes:
    """Cordon, taint and release nodes; read their labels. `api` is a kubernetes.client.CoreV1Api."""

    def __init__(self, api: Any, *, attempts: int = 6, backoff_s: float = 0.2,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.api = api
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.sleep = sleep

    @classmethod
    def from_service_account(cls) -> "KubeNodes":
        from kubernetes import client, config

        config.load_incluster_config()
        return cls(client.CoreV1Api())

    @classmethod
    def from_url(cls, url: str, token: str | None = None, **kwargs: Any) -> "KubeNodes":
        """An API server at `url` (tests, or a kubeconfig-less setup) with a bearer token."""
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = url
        if token:  # the whole header value: client releases differ in which key their prefix hangs on
            configuration.api_key = {"authorization": f"Bearer {token}"}
        configuration.retries = 0  # ours below see every status
        return cls(client.CoreV1Api(client.ApiClient(configuration)), **kwargs)

    # -- the three operations ----------------------------------------------------------------------------
    def quarantine(self, node: str, reason: str) -> Outcome:
        def attempt() -> Outcome:
            current = self.api.read_node(node)
            taints = list(current.spec.taints or [])
            ours = next((t for t in taints if t.key == TAINT_KEY), None)
            if ours is not None and current.spec.unschedulable:
                return Outcome(node, "already", f"taint {TAINT_KEY}={ours.value}")
            annotations = current.metadata.annotations or {}
            cordoned_by = annotations.get(CORDONED_BY) or ("goodput" if not current.spec.unschedulable else "other")
            kept = [_taint_dict(t) for t in taints if t.key != TAINT_KEY]
            body = {"metadata": {"resourceVersion": current.metadata.resource_version,
                                 "annotations": {CORDONED_BY: cordoned_by}},
                    "spec": {"unschedulable": True,
                             "taints": kept + [{"key": TAINT_KEY, "value": taint_value(reason), "effect": "NoSchedule"}]}}
            self.api.patch_node(node, body)
            return Outcome(node, "cordoned", f"taint {TAINT_KEY}={taint_value(reason)}:NoSchedule")

        return self._retry(f"quarantine node {node}", "patch", attempt)

    def release(self, node: str) -> Outcome:
        def attempt() -> Outcome:
            current = self.api.read_node(node)
            taints = list(current.spec.taints or [])
            annotations = current.metadata.annotations or {}
            ours = any(t.key == TAINT_KEY for t in taints)
            uncordon = annotations.get(CORDONED_BY) == "goodput"
            if not ours and CORDONED_BY not in annotations:
                return Outcome(node, "released", "nothing of goodput's on the node")
            spec: dict[str, Any] = {"taints": [_taint_dict(t) for t in taints if t.key != TAINT_KEY]}
            if uncordon:
                spec["unschedulable"] = False
            body = {"metadata": {"resourceVersion": current.metadata.resource_version,
                                 "annotations": {CORDONED_BY: None}}, "spec": spec}
            self.api.patch_node(node, body)
            return Outcome(node, "released", "taint removed" + ("; uncordoned" if uncordon else
                                                                "; left cordoned (someone else cordoned it)"))

        return self._retry(f"release node {node}", "patch", attempt)

    def node_labels_of(self, node: str) -> dict[str, str]:
        return self._retry(f"read node {node}", "get",
                           lambda: dict(self.api.read_node(node).metadata.labels or {}))

    def node_labels(self) -> dict[str, dict[str, str]]:
        return self.node_facts()[0]

    def node_facts(self) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
        """Every node's labels, and the nodes about to go with why (`departure`), from one listing."""
        def attempt() -> tuple[dict[str, dict[str, str]], dict[str, str]]:
            listed = self.api.list_node()
            going = {n.metadata.name: why for n in listed.items if (why := departure(n)) is not None}
            return {n.metadata.name: dict(n.metadata.labels or {}) for n in listed.items}, going

        return self._retry("list nodes", "list", attempt)

    # -- retries -----------------------------------------------------------------------------------------
    def _retry(self, what: str, verb: str, fn: Callable[[], T]) -> T:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        last = ""
        for i in range(self.attempts):
            try:
                return fn()
            except ApiException as e:
                status = int(e.status or 0)
                if status == 409:  # the node changed since we read it: read it again, now
                    last = "409 Conflict (the node changed meanwhile)"
                    continue
                if status == 404:
                    raise KubeError(f"{what}: no such Kubernetes node (404)") from None
                if status in (401, 403):
                    raise KubeError(f"{what}: {status} {e.reason}: the service account may not {verb} nodes; apply "
                                    "deploy/'s ClusterRole goodput-nodes (get, list, watch, patch on nodes)") from None
                if status != 429 and status < 500:
                    raise KubeError(f"{what}: {status} {e.reason}: {(e.body or '')[:200]}") from None
                last = f"{status} {e.reason}"
            except HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            self.sleep(self.backoff_s * 2 ** i)
        raise KubeError(f"{what}: gave up after {self.attempts} attempts (last: {last})")


def _taint_dict(taint: Any) -> dict[str, Any]:
    out = {"key": taint.key, "effect": taint.effect}
    if taint.value is not None:
        out["value"] = taint.value
    if getattr(taint, "time_added", None) is not None:
        out["timeAdded"] = taint.time_added.isoformat() if hasattr(taint.time_added, "isoformat") else taint.time_added
    return out
