"""A rank's training process (forked by its node's zygote, controller/ray/zygote.py, for the slot's rank
actor, controller/ray/rank_actor.py): train the attempt, send reports up the pipe, park after a failed
attempt and train the slot's next one in place."""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any

from trainer.args import WorkerArgs
from trainer.report import StepReport


IN_PLACE_ATTEMPTS = 4
"""Attempts one training process trains at most (it then ends instead of parking): what an attempt
leaves behind in the process (gloo groups that something still holds keep their sockets and threads)
stays bounded."""

HEARTBEAT_S = 0.25
"""How often a training process says it is alive (a thread of its own: a stopped process goes quiet,
one blocked in a collective does not)."""

TRACE_FRAMES = 12
"""Frames of a rank's exception passed on: the innermost (where the user's model, data or provider code
raised: what `goodput status` shows of a user error), not the outermost (goodput's own loop)."""


class _PipeSink:
    """The training process's ReportSink: everything goes up the pipe to its actor."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self._lock = threading.Lock()

    def put(self, kind: str, payload: Any) -> None:
        with self._lock:
            self._send.send((kind, payload))

    def report(self, report: StepReport) -> None:
        self.put("report", report)

    def event(self, kind: str, detail: dict) -> None:
        self.put("event", (kind, detail))


def train_in_child(args: WorkerArgs, send: Any, beat: Any, lifeline: int, switches: Any, commands: Any) -> None:
    """Body of the training process (forked by the node's zygote). It never touches Ray (the fork has
    none of Ray's threads) and ends with its actor: the heartbeat thread exits the process once the
    actor is gone (its `lifeline` reads EOF). An attempt
    that fails under it is torn down (its process group destroyed, its trainer freed); the process
    then parks until its actor hands it the next attempt, or ends when the actor closes the command
    pipe (or when it has trained IN_PLACE_ATTEMPTS)."""
    import gc
    import itertools
    import traceback

    import torch

    from trainer.parallel import can_train_again_in_place
    from trainer.worker import run_worker

    def heartbeat() -> None:
        while True:
            beat.value = time.time()
            gone, _, _ = select.select([lifeline], [], [], HEARTBEAT_S)
            if gone:
                os._exit(1)

    threading.Thread(target=heartbeat, daemon=True).start()
    torch.set_num_threads(1)
    sink = _PipeSink(send)
    try:
        for attempts in itertools.count(1):
            try:
                sink.put("done", run_worker(args, sink, switches=switches,
                                            on_leave=lambda: sink.put("leaving", None)))
                return
            except Exception as e:  # noqa: BLE001 - the error goes to the controller, whatever it is
                error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-TRACE_FRAMES)}"
            gc.collect()  # the failed attempt's trainer and process groups
            stay = attempts < IN_PLACE_ATTEMPTS and can_train_again_in_place()
            sink.put("error", (error, stay))
            if not stay:
                return
            try:
                args = commands.recv()
            except (EOFError, OSError):
                return
    except BaseException as e:  # noqa: BLE001 - the error goes to the controller, whatever it is
        sink.put("error", (f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-TRACE_FRAMES)}", False))
    finally:
        send.close()
