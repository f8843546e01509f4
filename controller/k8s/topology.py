"""Topology from Kubernetes node labels, matched to Ray nodes. Pure: labels in, Topology out.

A Ray node started by goodput's KubeRay manifests carries the label `node` = its Kubernetes node's
name (the downward API's spec.nodeName). Its rack comes from that Kubernetes node's labels: the
NVLink-domain label when the node has one (a multi-node NVLink domain, e.g. NVIDIA's
`nvidia.com/gpu.clique`, is the closest group there is), else the rack label (`--rack-label`, by
default `topology.kubernetes.io/zone`; an overlay sets the site's own). A Ray node with no match
keeps what Ray says; a run spec's `cluster.racks` overrides both (Topology.with_racks, applied by
the run's controller).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from controller.topology import Topology

DEFAULT_RACK_LABEL = "topology.kubernetes.io/zone"
DEFAULT_DOMAIN_LABEL = "nvidia.com/gpu.clique"


def rack_of(labels: Mapping[str, str], *, rack_label: str = DEFAULT_RACK_LABEL,
            domain_label: str | None = DEFAULT_DOMAIN_LABEL) -> str | None:
    """The rack a Kubernetes node's labels put it in, or None when they say nothing."""
    if domain_label and labels.get(domain_label):
        return labels[domain_label]
    return labels.get(rack_label) or None


def discover(topology: Topology, node_labels: Mapping[str, Mapping[str, str]], *,
             rack_label: str = DEFAULT_RACK_LABEL, domain_label: str | None = DEFAULT_DOMAIN_LABEL) -> Topology:
    """`topology` (from Ray) with each node's rack taken from its Kubernetes node's labels
    (`node_labels`: Kubernetes node name -> labels) where they say one."""
    nodes = []
    for node in topology.nodes:
        labels = node_labels.get(node.name)
        rack = rack_of(labels, rack_label=rack_label, domain_label=domain_label) if labels is not None else None
        nodes.append(replace(node, rack=rack) if rack else node)
    return Topology(tuple(nodes))
