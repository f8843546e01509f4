"""A Ray cluster seen through Kubernetes: the same nodes, racked by their Kubernetes nodes' labels
(controller.k8s.topology), and the nodes about to go (cordoned, or tainted to be deleted or reclaimed:
the service drains them), read through the API at most every `refresh_s`."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

from controller.k8s.nodes import KubeError, KubeNodes
from controller.k8s.topology import DEFAULT_DOMAIN_LABEL, DEFAULT_RACK_LABEL, discover
from controller.topology import Topology


class KubeTopologyCluster:
    def __init__(self, inner: Any, nodes: KubeNodes, *, rack_label: str = DEFAULT_RACK_LABEL,
                 domain_label: str | None = DEFAULT_DOMAIN_LABEL, refresh_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.nodes = nodes
        self.rack_label = rack_label
        self.domain_label = domain_label
        self.refresh_s = refresh_s
        self.clock = clock
        self._labels: dict[str, dict[str, str]] = {}
        self._departing: dict[str, str] = {}
        self._read_at: float | None = None
        self._warned = False
        self._lock = threading.Lock()

    def topology(self, within_s: float | None = None) -> Topology:
        return discover(self.inner.topology(within_s), self.node_labels(), rack_label=self.rack_label,
                        domain_label=self.domain_label)

    def node_labels(self) -> dict[str, dict[str, str]]:
        """The last labels read; read again once they are `refresh_s` old. When the API does not
        answer, the last good labels stay (said once on stderr)."""
        with self._lock:
            now = self.clock()
            if self._read_at is None or now - self._read_at >= self.refresh_s:
                try:
                    self._labels, self._departing = self.nodes.node_facts()
                    self._warned = False
                except KubeError as e:
                    if not self._warned:
                        print(f"goodput serve: node labels not read ({e}); racks as last known", file=sys.stderr,
                              flush=True)
                        self._warned = True
                self._read_at = now
            return self._labels

    def departing(self) -> dict[str, str]:
        """node -> why it is about to go (controller.k8s.nodes.departure), as last read."""
        self.node_labels()
        return dict(self._departing)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
