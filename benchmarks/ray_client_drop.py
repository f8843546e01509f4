"""What happens to a run when the service's connection to its Ray cluster drops: Ray Client against
a driver on a node of its own (how deploy/ runs the service), measured.

A cluster of `ray start` nodes on loopback addresses (head 127.0.0.2 with Ray Client's server, three
labelled workers on .3-.5); `goodput serve` at 127.0.0.9. Each case submits a run, waits for it to
train, disturbs the service for --seconds (40 by default: longer than Ray Client's 30 s reconnect
grace), and then looks at the run and the service:
- ray-client, SIGSTOP: the service process is stopped, then continued (its TCP connections stay up);
- ray-client, connection cut: the service reaches Ray Client's server through a proxy here that drops
  every connection and refuses new ones for the duration;
- joined node, SIGSTOP: the service as deployed (`--address HEAD:PORT`: a node with no resources).
A case that ended the service (exit 3: it lost its cluster and touched no run) starts it again with
the same command and reports whether the run was re-attached.

    python benchmarks/ray_client_drop.py [--seconds 40]

Its record: benchmarks/records/ray_client_drop.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from tests.support.ray_start import RayStartCluster, free_port  # noqa: E402
from tests.support.relay import Relay  # noqa: E402
from tests.support.serve import Serve, write_spec  # noqa: E402

HEAD, WORKERS, SERVICE = "127.0.0.2", ["127.0.0.3", "127.0.0.4", "127.0.0.5"], "127.0.0.9"
TOKEN = "drop-bench-token"
CODE = ["controller/service/main.py", "controller/service/restore.py", "controller/ray/detached.py",
        "controller/ray/pool.py", "controller/ray/worker_group.py", "controller/ray/cluster.py"]
"""What a dropped connection's figures measure: the service losing its cluster, and taking its runs back."""


def case(name: str, address: str, disturb: str, seconds: float, tmp: Path, proxy: Relay | None) -> dict[str, Any]:
    state = tmp / name
    command = [str(Path(sys.executable).parent / "goodput"), "serve", "--host", SERVICE,
               "--port", str(free_port(SERVICE)), "--address", address, "--advertise-host", SERVICE,
               "--state-dir", str(state)]
    serve = Serve(state, tmp / f"{name}.log", command=command,
                  env={**os.environ, "GOODPUT_TOKEN": TOKEN, "GOODPUT_STATE_DIR": str(state)})
    out: dict[str, Any] = {"case": name}
    try:
        serve.start()
        serve.cli("submit", str(write_spec(tmp / f"{name}.yaml", name, steps=100_000, dp=2)))
        deadline = time.monotonic() + 120
        while (status := serve.json("status", name))["step"] < 20:  # type: ignore[index]
            assert time.monotonic() < deadline, status
            time.sleep(1)
        before = status["step"]  # type: ignore[index]
        assert serve.proc is not None
        if disturb == "sigstop":
            serve.proc.send_signal(signal.SIGSTOP)
            time.sleep(seconds)
            serve.proc.send_signal(signal.SIGCONT)
        else:
            assert proxy is not None
            proxy.drop()
            time.sleep(seconds)
            proxy.heal()
        time.sleep(20)
        out["alive"] = serve.proc.poll() is None
        out["service"] = "alive" if out["alive"] else f"exited {serve.proc.returncode}"
        if out["alive"]:
            s1 = serve.json("status", name)
            time.sleep(5)
            s2 = serve.json("status", name)
            out["run"] = (f"{s2['state']}, attempt {s2['attempt']}, step {before} before -> {s2['step']} "  # type: ignore[index]
                          f"({'advancing' if s2['step'] > s1['step'] else 'NOT advancing'})")  # type: ignore[index]
        else:
            serve.start()
            time.sleep(10)
            s2 = serve.json("status", name)
            events = serve.json("events", name)
            assert isinstance(events, list), events
            restarted = [e["detail"].get("action", "") for e in events if e["kind"] == "service_restarted"]
            out["run"] = (f"after a restart: {s2['state']}, attempt {s2['attempt']}, step {s2['step']}; "  # type: ignore[index]
                          f"{restarted[-1] if restarted else 'no service_restarted event'}")
        out["trained"] = s2["step"] - before  # type: ignore[index]
        serve.cli("cancel", name, ok=False)
    finally:
        serve.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=40.0)
    opts = parser.parse_args()
    client_port = free_port(HEAD)
    with tempfile.TemporaryDirectory() as root:
        tmp = Path(root)
        cluster = RayStartCluster(tmp / "ray", head_ip=HEAD, worker_ips=WORKERS)
        (tmp / "ray").mkdir()
        results = []
        try:
            cluster.start(nodes=3, spares=1, client_port=client_port)
            results.append(case("client-sigstop", f"ray://{HEAD}:{client_port}", "sigstop", opts.seconds, tmp, None))
            with Relay((HEAD, client_port), host=SERVICE) as proxy:
                results.append(case("client-cut", f"ray://{SERVICE}:{proxy.port}", "cut", opts.seconds, tmp, proxy))
            results.append(case("node-sigstop", cluster.address, "sigstop", opts.seconds, tmp, None))
        finally:
            cluster.stop()
    print(f"service disturbed for {opts.seconds:.0f} s while a run trained (Ray Client's reconnect grace: 30 s)")
    for r in results:
        print(f"{r['case']:>15}: service {r.get('service')}; run {r.get('run')}")
    figures: list[dict[str, Any]] = []
    for r in results:  # (whether the service outlived it; the steps from just before it to the last look)
        figures += [records.figure(f"{r['case']}: service alive after the disturbance", [int(r["alive"])], "count"),
                    records.figure(f"{r['case']}: steps trained across it", [r["trained"]], "steps")]
    records.write("ray_client_drop", figures, code=CODE, extra={"seconds": opts.seconds, "cases": results})


if __name__ == "__main__":
    main()
