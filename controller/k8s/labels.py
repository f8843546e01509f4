"""`goodput k8s-node-labels`: what a Ray worker pod's init container runs so its raylet starts with the
node labels goodput's placement reads — `node` (the Kubernetes node's name), `rack` (from the node's
NVLink-domain or rack label), `gpu_memory_gb` (NVIDIA GPU feature discovery's `nvidia.com/gpu.memory`,
MiB) and `spare` — as a YAML file for `ray start --labels-file`."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import yaml

from controller.k8s.topology import rack_of

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"


def ray_labels(node: str, labels: Mapping[str, str], *, rack_label: str, domain_label: str | None,
               spare: bool) -> dict[str, str]:
    out = {"node": node, "rack": rack_of(labels, rack_label=rack_label, domain_label=domain_label) or "rack-0"}
    memory = labels.get(GPU_MEMORY_LABEL)
    if memory and memory.isdigit():
        out["gpu_memory_gb"] = f"{int(memory) / 1024:g}"
    if spare:
        out["spare"] = "true"
    return out


def write_labels(node: str, out: Path, *, rack_label: str, domain_label: str | None, spare: bool,
                 url: str | None = None, token: str | None = None) -> dict[str, str]:
    """Read the node's labels (through the pod's service account, or `url`) and write the file."""
    from controller.k8s.nodes import KubeNodes

    nodes = KubeNodes.from_url(url, token) if url else KubeNodes.from_service_account()
    labels = nodes.node_labels_of(node)
    result = ray_labels(node, labels, rack_label=rack_label, domain_label=domain_label, spare=spare)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(result, sort_keys=True))
    return result
