"""Where `make run`'s startup goes (issue 46): its first example's mesh (examples/tiny-gpt.yaml: dp2 x
pp2 x tp2 on 5 nodes of 2 GPU slots, one a hot spare), a few steps, no drill, on a fresh embedded
cluster per round, then the same run again on that cluster (what a service's next run, and every
cluster test after the first, starts on). With `--baseline REV`, the same rounds of that commit's code
(a git worktree) alternate with this code's, each round in a process of its own: both measured side
by side in one run, on the same machine.

Figures, per round (wall seconds):

- cluster start: LocalRayCluster.start() (the GCS, 5 raylets, the driver's connection; since the
  host image, controller/ray/host_image.py, also its import of torch and the trainer, which runs
  while the raylets start), and its parts: the head (`import ray`, the host image's start, the GCS,
  Ray's API server, the head's raylet), a node (the median of the 5 `Cluster.add_node`s, one after
  another) and the driver's connection (`ray.init`). The cluster's start is bound by CPU on 2 cores
  (psutil over its processes): a node's dashboard agent takes 0.74 CPU-s and its runtime-env agent
  0.35 (Ray starts both, with no switch), the head's API server 0.8, the host image's torch 2.4. A
  raylet registers once its dashboard agent has imported its modules and written its ports (~0.6 s).
  What was cut (2026-12-07): Ray's own naps, not its work. Ray's lookup of a new node slept 1 s
  between two looks (`GlobalStateAccessor::GetNode`): controller/ray/registration.py waits for the
  registration 50 ms at a time (1.13 -> 0.85 s a node). A raylet connecting to its own object store
  before the store's thread was up slept another 1 s (Ray's ConnectSocketRetry; 13 of 20 nodes took
  1.9-2.0 s in one measurement): the cluster's processes retry every 0.1 s (PROMPT_RAY_ENV). And the
  head starts no log monitor or autoscaler monitor (QUIET_HEAD, 0.33 CPU-s each). Building the nodes
  side by side does not help on 2 cores: five nodes, each built by a process of its own, took
  5.3-5.8 s against 5.7 s one after another (one run each way, with Ray's naps); they must be given
  socket names apart (each node picks the first free `raylet.N`), and Ray's node start sets a SIGTERM
  handler, which only the main thread may;
- launch: the first attempt started -> its worker group started (each node's GPU slots reserved, a
  rank actor per slot, each node's warm image: before the host image, each node's zygote importing
  torch and the trainer). A rank actor's start is Ray's worker start, ~0.63 CPU-s; since 2026-12-07
  the spare's warm actors start once the first attempt has stepped (RunController._warm_spares), not in it
  (2.93 -> 2.16 s);
- first step: the worker group started -> the first step began (the forked training processes'
  rendezvous, process groups, model build and, for pp > 1, the pipeline schedule);
- startup badput: what the run's own accounting charges to `startup` (first attempt started -> first
  step began), the figure issue 46 asks to bring to <= 10 s;
- cluster start + startup badput: the embedded cluster and the first attempt together;
- the same three for the second run ("warm nodes"): its rank actors are new, its nodes' warm images
  are not.

And, in a fresh interpreter each (n = --rounds, on an idle machine), what a warm image imports once:
`import ray` (a Ray worker's own start), `import torch` and the trainer (trainer.checkpoint and
trainer.train, with torch.distributed.checkpoint, DTensor and torch's pipelining, which imports
torch._dynamo). A rank actor imports `import ray` and goodput's torch-free modules only.

    python benchmarks/startup.py [--rounds 3] [--steps 3] [--baseline REV]
    (its record: benchmarks/records/startup.json)
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

REPO = Path(__file__).resolve().parents[1]
CODE_ENV = "GOODPUT_STARTUP_CODE"
"""A round's process: the checkout whose code it measures (default: this one)."""
sys.path.insert(0, os.environ.get(CODE_ENV) or str(REPO))

import yaml  # noqa: E402

from benchmarks import records  # noqa: E402

IMPORTS = {
    "import ray": "import ray",
    "import torch": "import torch",
    "the trainer": "import trainer.checkpoint, trainer.train",
}
"""What a warm image imports, in the order it does (each timed after the ones before it)."""


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
    from controller.state import RunController, RunState  # (a baseline's code may have no controller.run_state)

    raw = yaml.safe_load((REPO / "examples" / "tiny-gpt.yaml").read_text())
    raw.update(drills=[])
    raw["train"]["steps"] = steps
    specs = []
    for k in range(2):
        raw["checkpoint"]["uri"] = f"file://{root}/ckpt-{k}"
        specs.append(parse_spec(raw))
    assert specs[0].cluster.local is not None
    cluster = LocalRayCluster(specs[0].cluster.local)
    node_starts: list[tuple[float, float]] = []
    add_node = LocalRayCluster.add_node

    def timed_add_node(self: LocalRayCluster, index: int) -> str:
        at = time.time()
        try:
            return add_node(self, index)
        finally:
            node_starts.append((at, time.time()))

    LocalRayCluster.add_node = timed_add_node  # type: ignore[method-assign]  # (this round's own process)
    began = time.time()
    cluster.start()
    ended = time.time()
    out = {"cluster start": ended - began, "cluster start: head": node_starts[0][0] - began,
           "cluster start: a node": statistics.median(b - a for a, b in node_starts),
           "cluster start: the driver's connection": ended - node_starts[-1][1]}
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
            if not nodes:
                out["cluster start + startup badput"] = out["cluster start"] + out["startup badput"]
    finally:
        cluster.shutdown()
    return out


def in_process(code: Path, steps: int) -> dict[str, float]:
    """One round, of `code`'s checkout, in a fresh process (its raylets and workers find that code first)."""
    env = {**os.environ, CODE_ENV: str(code),
           "PYTHONPATH": os.pathsep.join([str(code)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    proc = subprocess.run([sys.executable, __file__, "--one-round", "--steps", str(steps)], cwd=code, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"a round of {code} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def worktree(rev: str, folder: Path) -> str:
    """`rev` checked out (detached) in `folder`; its short hash."""
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(folder), rev], cwd=REPO, check=True)
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (only the first one matters)")
    parser.add_argument("--baseline", metavar="REV", help="also measure this commit's code, round by round")
    parser.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_round:
        with tempfile.TemporaryDirectory(prefix="goodput-startup-") as tmp:
            print(json.dumps(one_round(Path(tmp), args.steps)))
        return
    imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(args.rounds):  # (first, on the idle machine)
        for name, seconds in import_costs().items():
            imports[name].append(seconds)
    variants = [("", REPO)]
    with tempfile.TemporaryDirectory(prefix="goodput-baseline-") as tmp:
        if args.baseline:
            short = worktree(args.baseline, Path(tmp) / "tree")
            variants.append((f", before ({short})", Path(tmp) / "tree"))
        try:
            phases: dict[str, list[float]] = {}
            for k in range(args.rounds):
                for suffix, code in variants if k % 2 == 0 else variants[::-1]:  # (alternating, against drift)
                    measured = in_process(code, args.steps)
                    print(f"round {k + 1}{suffix}: " + ", ".join(f"{name} {value:.2f} s" for name, value in measured.items()),
                          flush=True)
                    for name, value in measured.items():
                        phases.setdefault(f"{name}{suffix}", []).append(value)
        finally:
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp) / "tree")], cwd=REPO)
    ratios: dict[str, list[float]] = {}
    if args.baseline:
        for name in ("startup badput", "cluster start + startup badput"):
            before = phases[f"{name}{variants[1][0]}"]
            ratios[f"{name}: now / before"] = [a / b for a, b in zip(phases[name], before)]
    print(f"\nmake run's mesh (examples/tiny-gpt.yaml), {args.rounds} rounds, median (min-max):")
    for name, values in {**phases, **ratios}.items():
        unit = "" if name in ratios else " s"
        print(f"  {name:<48} {statistics.median(values):6.2f}{unit} ({min(values):.2f}-{max(values):.2f})")
    print("a warm image's imports, each in a fresh interpreter on the idle machine:")
    for name, values in imports.items():
        print(f"  {name:<19} {statistics.median(values):6.2f} s ({min(values):.2f}-{max(values):.2f})")
    figures = [records.figure(f"{name}, make run's mesh", values, "s",
                              goal="<= 10" if name == "startup badput" else None)
               for name, values in phases.items()]
    figures += [records.figure(f"{name}, make run's mesh", values, "x",
                               goal="<= 0.5" if name.startswith("cluster start") else None)
                for name, values in ratios.items()]
    figures += [records.figure(f"a warm image's {name}", values, "s") for name, values in imports.items()]
    records.write("startup", figures, code=["controller/ray/worker_group.py", "controller/ray/pool.py",
                                            "controller/ray/rank_actor.py",
                                            "controller/ray/zygote.py", "controller/ray/host_image.py",
                                            "controller/ray/cluster.py", "controller/ray/registration.py", "controller/state.py",
                                            "trainer/worker.py", "trainer/train.py", "examples/tiny-gpt.yaml"],
                  extra={"baseline": args.baseline} if args.baseline else None)


if __name__ == "__main__":
    main()
