"""How a rank picks its network interface: the spec's cluster.interface, where the node sets none,
reaches gloo (and NCCL) through their own variables, and gloo binds to it."""

from __future__ import annotations

import os
import subprocess
import sys

from pathlib import Path

import pytest
import yaml

from controller.spec import SpecError, parse_spec
from trainer.parallel import INTERFACE_ENV, use_interface

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny-gpt.yaml"


def spec_with(interface: str) -> dict:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["cluster"]["interface"] = interface
    return spec


@pytest.mark.parametrize("interface", ["eth1", "ib0,eth1", "^docker,lo", "=enp1s0f0", "bond0.100"])
def test_the_spec_takes_an_interface_in_gloo_and_nccl_forms(interface: str) -> None:
    assert parse_spec(spec_with(interface)).cluster.interface == interface


@pytest.mark.parametrize("interface", ["eth 1", "eth1;reboot", "", "eth1,,eth2"])
def test_a_malformed_interface_is_refused_with_the_field_named(interface: str) -> None:
    with pytest.raises(SpecError, match="cluster.interface"):
        parse_spec(spec_with(interface))


def test_the_run_s_interface_is_used_only_where_the_node_names_none(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in INTERFACE_ENV:  # (set, then removed: monkeypatch restores both, whatever use_interface sets)
        monkeypatch.setenv(name, "-")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the node's own
    use_interface("eth1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1" and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    use_interface(None)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1"


GROUP = """
import datetime, sys
import torch.distributed as dist
from trainer.parallel import use_interface
use_interface(sys.argv[1])
store = dist.HashStore()
group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=5))
import torch
t = torch.ones(3)
group.allreduce([t]).wait()
print("ok", float(t.sum()))
"""


def _group_with(interface: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in INTERFACE_ENV}
    return subprocess.run([sys.executable, "-c", GROUP, interface], capture_output=True, text=True, timeout=120,
                          env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_gloo_binds_to_the_interface_it_is_given() -> None:
    assert _group_with("lo").stdout.strip() == "ok 3.0"
    refused = _group_with("nosuchnic0")
    assert refused.returncode != 0 and "nosuchnic0" in refused.stderr, refused.stderr[-2000:]
