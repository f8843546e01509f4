"""A node's warm image (controller/ray/zygote.py) without Ray: its gate lets heartbeats run together and a
fork alone; a slot's shared memory is one memory in two processes; and a beat it serves moves a real
TCPStore's counter until the lifeline closes, then stops."""

from __future__ import annotations

import os
import shutil
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from controller.ray.zygote import NodeZygote, SlotMemory, ZygoteClient, _Gate
from trainer.switches import DrillSwitches

pytestmark = pytest.mark.timing  # beats counted over 0.6-0.8 s of wall time


def test_beats_share_the_gate_and_a_fork_waits_until_they_are_out() -> None:
    gate = _Gate()
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def beat() -> None:
        with gate.shared():
            inside.set()
            release.wait(5)
            order.append("beat out")

    holder = threading.Thread(target=beat)
    holder.start()
    assert inside.wait(5)
    with gate.shared():  # a second beat is not held back by the first
        order.append("second beat")

    def fork() -> None:
        with gate.alone():
            order.append("fork")

    forker = threading.Thread(target=fork)
    forker.start()
    time.sleep(0.2)
    assert order == ["second beat"], "the fork waits for the beat inside"
    release.set()
    holder.join(5)
    forker.join(5)
    assert order == ["second beat", "beat out", "fork"]


def test_a_slots_memory_is_shared_with_a_process_that_maps_its_fd() -> None:
    memory = SlotMemory()
    switches = DrillSwitches(memory.switches)
    assert switches.slow_factor == 1.0
    pid = os.fork()
    if pid == 0:  # the training process's side: the same fd mapped again
        child = SlotMemory(memory.fd)
        DrillSwitches(child.switches).request_bitflip()
        child.value = 12345.0
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert switches.bitflips == 1 and memory.value == 12345.0


def test_a_beat_moves_the_stores_counter_until_its_lifeline_closes() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    path = NodeZygote().warm()
    client = ZygoteClient(path)
    ours, lifeline = os.pipe()
    client.beat("127.0.0.1", store.port, "beat/0", ours)
    os.close(ours)
    deadline = time.monotonic() + 10
    while store.add("beat/0", 0) < 3:
        assert time.monotonic() < deadline, "the zygote did not beat"
        time.sleep(0.1)
    os.close(lifeline)  # the rank actor moved on (or died)
    time.sleep(0.6)
    stopped = store.add("beat/0", 0)
    time.sleep(0.8)
    assert store.add("beat/0", 0) == stopped, "the beat went on after its lifeline closed"
    shutil.rmtree(os.path.dirname(path))
