"""A node lost through torch's c10d rendezvous: from the kill to the survivors' first step.

    python tools/bench_node_loss.py [--runs 3] [--work DIR] [--last-call 5]
                                    [--liveness-timeout S] [--out bench_node_loss.json]

Each run is the first event of the multi-node test (``tests/test_elastic_nodes.py``) on
its own: two ``elastor launch`` nodes on 127.0.0.1 (a: 1 CPU slot, hosting the
rendezvous store; b: 2 slots) train the tiny recipe for 10 steps, saved every 2
(synchronously); once both have stepped together, b's elastic agent is SIGKILLed (its
workers die with it: the node is lost) and a finishes alone. a's timeline
(``elastic.node_timeline``) gives the phases of its recovery; the total is timed from
the kill (this tool's clock, on the same machine) to the last ``first_step`` event of
a's next round, and detection from the kill to a's agent seeing its worker fail.
Printed and written to ``--out``: each run's figures, the medians, and the bound of
issue 35: 5 s plus the rendezvous's last-call wait (``--last-call``, torch's
``last_call_timeout``: once a node is in, the round waits that long for more). The
keep-alives are torch's default (5 s x 3): the lost node is evicted once its agent's
liveness stops (``compat.rendezvous``; ``--liveness-timeout 0``: no eviction, torch's
keep-alive expiry). Minutes per run; not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastor_mcore.elastic import node_timeline  # noqa: E402
from elastor_mcore.elastic.protocol import (EVENTS_FILE, LAUNCHER_EVENTS, ROUNDS_DIR,  # noqa: E402
                                             ROUNDS_FILE, read_events)
from elastor_mcore.elastic.torchrun import AGENT_MODULE  # noqa: E402

TINY = ROOT / "recipes" / "tiny-llama.yaml"
CPU_SLOTS = ROOT / "recipes" / "hardware" / "cpu-slots.yaml"
STEPS = 10
DEADLINE_S = 600
PHASES = ("rendezvous_s", "relaunch_s", "probe_s", "plan_s", "build_s", "load_s",
          "first_step_s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(run_dir: Path, port: int, node: str, slots: int, rdzv_conf: str,
               log: Path) -> subprocess.Popen:
    args = ["--recipe", str(TINY), "--hardware", str(CPU_SLOTS), "--steps", str(STEPS),
            "--save-interval", "2", "--no-async-save", "--run-dir", str(run_dir),
            "--devices", "cpu", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "bench-node-loss", "--rdzv-conf", rdzv_conf, "--max-restarts", "3",
            "--heartbeat-timeout", "8", "--slots", str(slots), "--node-name", node]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "elastor_mcore.cli", "launch", *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def store_up(port: int) -> bool:
    """Whether an agent listens on the endpoint (node a, started first, hosts it)."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, condition, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"waiting for {what}: a launcher ended or time ran out")
        time.sleep(0.2)


def both_nodes_stepped(node_dir: Path) -> bool:
    """Whether the node's latest round has both nodes and a rank of it has stepped."""
    path = node_dir / ROUNDS_FILE
    if not path.is_file():
        return False
    latest = json.loads(path.read_text().splitlines()[-1])
    events = node_dir / ROUNDS_DIR / str(latest["round"]) / EVENTS_FILE
    return (len({m["node"] for m in latest["members"]}) == 2
            and bool(read_events(events, "first_step")))


def one_run(work: Path, rdzv_conf: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    run_dir, port = work / "run", free_port()
    a_dir = run_dir / "nodes" / "a" / "0"
    a = start_node(run_dir, port, "a", 1, rdzv_conf, work / "a.log")
    procs = [a]
    try:
        wait_for("node a's agent hosting the rendezvous store", lambda: store_up(port), [a])
        b = start_node(run_dir, port, "b", 2, rdzv_conf, work / "b.log")
        procs.append(b)
        wait_for("both nodes stepping together", lambda: both_nodes_stepped(a_dir), [a, b])
        (agent,) = [p for p in psutil.Process(b.pid).children()
                    if AGENT_MODULE in " ".join(p.cmdline())]
        killed_at = time.time()
        agent.send_signal(signal.SIGKILL)
        b.wait(timeout=60)
        a.wait(timeout=DEADLINE_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if a.returncode:
        raise RuntimeError(f"node a exited {a.returncode}: see {work / 'a.log'}")
    (lost,) = [r for r in node_timeline.build(a_dir).recoveries
               if r.nodes_before == 2 and r.nodes_after == 1]
    seen = [e for e in read_events(a_dir / LAUNCHER_EVENTS)
            if e["event"] in ("agent_failed", "agent_join") and e["time"] >= killed_at]
    stepped = read_events(a_dir / ROUNDS_DIR / str(lost.next_round) / EVENTS_FILE,
                          "first_step")
    return {"dir": str(work), "load_average": os.getloadavg()[0],
            "total_s": max(e["time"] for e in stepped) - killed_at,
            "detect_s": min(e["time"] for e in seen) - killed_at if seen else None,
            **{phase: getattr(lost, phase) for phase in PHASES}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", default="runs/bench-node-loss")
    parser.add_argument("--last-call", type=float, default=5.0)
    parser.add_argument("--liveness-timeout", type=float, default=None,
                        help="compat.rendezvous's liveness_timeout (default: its default; "
                             "0: no eviction)")
    parser.add_argument("--out", default="bench_node_loss.json")
    args = parser.parse_args(argv)
    rdzv_conf = f"last_call_timeout={args.last_call:g}" + (
        "" if args.liveness_timeout is None else f",liveness_timeout={args.liveness_timeout:g}")
    runs = []
    for i in range(args.runs):
        print(f"bench_node_loss: run {i + 1}/{args.runs}, load average "
              f"{os.getloadavg()[0]:.1f} ...", flush=True)
        run = one_run(Path(args.work) / str(i), rdzv_conf)
        runs.append(run)
        print("  " + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in run.items()
                               if k.endswith("_s") and v is not None), flush=True)
    medians = {k: statistics.median(r[k] for r in runs)
               for k in ("total_s", "detect_s", *PHASES) if all(r[k] is not None for r in runs)}
    bound = 5.0 + args.last_call
    Path(args.out).write_text(json.dumps({"runs": runs, "medians": medians,
                                          "rdzv_conf": rdzv_conf,
                                          "last_call_s": args.last_call, "bound_s": bound},
                                         indent=1) + "\n")
    print(f"\nnode loss -> first step through c10d, median of {len(runs)}: "
          f"{medians['total_s']:.2f} s (bound: 5 s + last call {args.last_call:g} s = "
          f"{bound:g} s); phases (medians): "
          + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in medians.items() if k != "total_s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
