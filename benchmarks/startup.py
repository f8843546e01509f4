"""Where `make run`'s startup goes (issue 46): its first example's mesh (examples/tiny-gpt.yaml: dp2 x
pp2 x tp2 on 5 nodes of 2 GPU slots, one a hot spare), a few steps, no drill, on a fresh embedded
cluster per round, then the same run again on that cluster (what a service's next run, and every
cluster test after the first, starts on).

Figures, per round (wall seconds):

- cluster start: LocalRayCluster.start() (the GCS, 5 raylets, the driver's connection);
- launch: the first attempt started -> its worker group started (each node's GPU slots reserved, a
  rank actor per slot plus the spare's warm ones; on fresh nodes, each node's warm image,
  controller/ray/zygote.py, importing torch and the trainer);
- first step: the worker group started -> the first step began (the forked training processes'
  rendezvous, process groups, model build and, for pp > 1, the pipeline schedule);
- startup badput: what the run's own accounting charges to `startup` (first attempt started -> first
  step began), the figure issue 46 asks to bring to <= 10 s;
- the same three for the second run ("warm nodes"): its rank actors are new, its nodes' warm images
  are not.

And, in a fresh interpreter each (n = --rounds, on an idle machine), what a node's warm image imports
once: `import ray` (a Ray worker's own start), `import torch` and the trainer (trainer.checkpoint and
trainer.train, with torch.distributed.checkpoint, DTensor and torch's pipelining, which imports
torch._dynamo). A rank actor imports `import ray` and goodput's torch-free modules only.

    python benchmarks/startup.py [--rounds 3] [--steps 3]    (its record: benchmarks/records/startup.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import yaml  # noqa: E402

from benchmarks import records  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
IMPORTS = {
    "import ray": "import ray",
    "import torch": "import torch",
    "the trainer": "import trainer.checkpoint, trainer.train",
}
"""What a rank actor imports, in the order it does (each timed after the ones before it)."""


def import_costs() -> dict[str, float]:
    """Seconds of each of IMPORTS, in order, in one fresh interpreter."""
    body = ["import json, time", "out = {}"]
    for name, statement in IMPORTS.items():
        body += ["t = time.perf_counter()", statement, f"out[{name!r}] = time.perf_counter() - t"]
    body.append("print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", "\n".join(body)], cwd=REPO, capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_round(root: Path, steps: int) -> dict[str, float]:
    """Two runs of make run's mesh on one fresh cluster: the phases of each."""
    from controller.events import EventKind
    from controller.ray.cluster import LocalRayCluster
    from controller.ray.runner import drive
    from controller.spec import parse_spec
    from controller.state import RunController, RunState

    raw = yaml.safe_load((REPO / "examples" / "tiny-gpt.yaml").read_text())
    raw.update(drills=[])
    raw["train"]["steps"] = steps
    specs = []
    for k in range(2):
        raw["checkpoint"]["uri"] = f"file://{root}/ckpt-{k}"
        specs.append(parse_spec(raw))
    assert specs[0].cluster.local is not None
    cluster = LocalRayCluster(specs[0].cluster.local)
    began = time.time()
    cluster.start()
    out = {"cluster start": time.time() - began}
    try:
        for spec, nodes in zip(specs, ("", ", warm nodes")):
            marks: dict[str, float] = {}

            def on_tick(c: RunController) -> None:
                if c.state is RunState.RUNNING and "running" not in marks:
                    marks["running"] = time.time()

            c = drive(spec, cluster, on_tick=on_tick)
            if c.state is not RunState.SUCCEEDED:
                raise RuntimeError(f"the run did not succeed: {c.error}")
            attempt = next(e.time for e in c.events if e.kind == EventKind.ATTEMPT_STARTED)
            first = min(h["start"] for h in c.progress.history if h["attempt"] == 0 and "start" in h)
            # (the controller sees RUNNING on its first tick after the launch returned: at most one poll late)
            running = min(marks["running"], first)
            out |= {f"launch{nodes}": running - attempt, f"first step{nodes}": first - running,
                    f"startup badput{nodes}": c.goodput(time.time())["badput_seconds"]["startup"]}
    finally:
        cluster.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (only the first one matters)")
    args = parser.parse_args()
    imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(args.rounds):  # (first, on the idle machine)
        for name, seconds in import_costs().items():
            imports[name].append(seconds)
    phases: dict[str, list[float]] = {}
    for k in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="goodput-startup-") as tmp:
            measured = one_round(Path(tmp), args.steps)
        print(f"round {k + 1}: " + ", ".join(f"{name} {value:.2f} s" for name, value in measured.items()), flush=True)
        for name, value in measured.items():
            phases.setdefault(name, []).append(value)
    print(f"\nmake run's mesh (examples/tiny-gpt.yaml), {args.rounds} rounds, median (min-max):")
    for name, values in phases.items():
        print(f"  {name:<27} {statistics.median(values):6.2f} s ({min(values):.2f}-{max(values):.2f})")
    print("a node's warm image's imports, each in a fresh interpreter on the idle machine:")
    for name, values in imports.items():
        print(f"  {name:<19} {statistics.median(values):6.2f} s ({min(values):.2f}-{max(values):.2f})")
    figures = [records.figure(f"{name}, make run's mesh", values, "s",
                              goal="<= 10" if name.startswith("startup badput") else None)
               for name, values in phases.items()]
    figures += [records.figure(f"a node's warm image's {name}", values, "s") for name, values in imports.items()]
    records.write("startup", figures, code=["controller/ray/worker_group.py", "controller/ray/rank_actor.py",
                                            "controller/ray/zygote.py", "controller/ray/cluster.py",
                                            "trainer/worker.py", "trainer/train.py", "examples/tiny-gpt.yaml"])


if __name__ == "__main__":
    main()
