"""Recovery times of ``elastor demo``, in place against today's relaunch, side by side.

    python tools/bench_recovery.py [--runs 3] [--work DIR] [--out bench_recovery.json]
                                   [-- DEMO FLAGS...]

Runs the README's demo ``--runs`` times in each of two modes, alternating (so both see
the same load): ``in place`` (its defaults: recovery in place, ranks from the
pre-imported worker) and ``today`` (``--recovery relaunch --no-zygote``: every failure
relaunches cold from the last checkpoint). Each run's ``timeline.json`` gives, per
failure (the kill and the hang), the time from the failure to the first completed step
of the new layout, the steps redone and the hang timeout that applied; its metrics
give the median step before the first failure and the 99th percentile of the steps the
hung layout ran before the hang. Printed and written to ``--out``: each run's figures
and, per mode and failure, the median over the runs, beside the issue's bounds (kill:
3 s + one median step; hang: the same plus max(3 x that p99, the --heartbeat-timeout
floor)). The demo's corpus is made once under ``--work`` and shared. Minutes per run;
not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastor_mcore.elastic.protocol import percentile  # noqa: E402
from elastor_mcore.elastic.report import read_metrics  # noqa: E402

MODES = {"in place": [], "today": ["--recovery", "relaunch", "--no-zygote"]}
FLOOR_S = 2.0
"""The demo's default ``--heartbeat-timeout``: the hang timeout's floor."""


def step_times(timeline: dict) -> dict[int, float]:
    """Each step's time, the last launch that ran it winning (redone steps)."""
    return {m["step"]: m["time_s"] for launch in timeline["launches"]
            for m in read_metrics(Path(launch["dir"]) / "metrics.jsonl")}


def run_demo(out: Path, data: Path, flags: list[str]) -> dict | None:
    """One demo into ``out`` (its corpus a link to ``data``); its figures (None if it
    ended before the elastic run wrote its timeline: see ``out/demo.log``)."""
    out.mkdir(parents=True, exist_ok=True)
    if data.exists() and not (out / "data").exists():
        (out / "data").symlink_to(data.resolve())
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "elastor_mcore.cli", "demo", "--out",
                             str(out), *flags], cwd=ROOT, env=env, capture_output=True,
                            text=True)
    (out / "demo.log").write_text(result.stdout + result.stderr)
    if not (out / "timeline.json").is_file():
        return None
    return figures(out, result.returncode, time.perf_counter() - start)


def figures(out: Path, code: int, wall_s: float) -> dict:
    """A finished demo's figures, from ``out/timeline.json`` and its metrics."""
    timeline = json.loads((out / "timeline.json").read_text())
    times = step_times(timeline)
    kill, hang = timeline["recoveries"][:2]
    before = [times[s] for s in range(2, kill["failed_at_step"])]
    hung_layout = [times[s] for s in range(kill["resumed_from"] + 2, hang["failed_at_step"])]
    return {"dir": str(out), "exit": code, "wall_s": wall_s,
            "load_average": os.getloadavg()[0],
            "median_step_s": statistics.median(before),
            "hang_layout_p99_s": percentile(sorted(hung_layout), 0.99),
            "recoveries": [{k: r[k] for k in ("failure", "how", "total_s", "steps_redone",
                                                "detect_s", "first_step_s", "detected_by")}
                           for r in timeline["recoveries"]]}


def summary(runs: dict[str, list[dict]], floor_s: float) -> dict:
    """Per mode and failure kind: medians over the runs, and the bounds."""
    out = {}
    for mode, results in runs.items():
        step = statistics.median(r["median_step_s"] for r in results)
        timeout = max(3 * statistics.median(r["hang_layout_p99_s"] for r in results), floor_s)
        for kind in ("kill", "hang"):
            rows = [x for r in results for x in r["recoveries"] if x["failure"].startswith(kind)]
            totals = [x["total_s"] for x in rows if x["total_s"] is not None]
            bound = 3.0 + step + (timeout if kind == "hang" else 0.0)
            out[f"{mode}/{kind}"] = {
                "runs": len(results), "median_total_s": statistics.median(totals) if totals
                else None, "totals_s": totals, "median_step_s": step, "bound_s": bound,
                "steps_redone": [x["steps_redone"] for x in rows],
                "how": sorted({x["how"] for x in rows})}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", default="runs/bench-recovery")
    parser.add_argument("--out", default="bench_recovery.json")
    parser.add_argument("demo_flags", nargs="*", help="after --: flags for every demo")
    args = parser.parse_args(argv)
    work = Path(args.work)
    data = work / "data"
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(args.runs):
        for mode, flags in MODES.items():
            out = work / f"{mode.replace(' ', '-')}-{i}"
            print(f"bench_recovery: run {i + 1}/{args.runs}, {mode}, load average "
                  f"{os.getloadavg()[0]:.1f} ...", flush=True)
            got = run_demo(out, data, [*flags, *args.demo_flags])
            if not data.exists() and (out / "data").is_dir():
                (out / "data").rename(data)
                (out / "data").symlink_to(data.resolve())
            if got is None:
                print(f"  the demo ended before its elastic run: see {out / 'demo.log'}; "
                      f"not counted", flush=True)
                continue
            runs[mode].append(got)
            print("  " + "; ".join(f"{r['failure']}: {r['how']}, {r['total_s']:.2f}s, redone "
                                   f"{r['steps_redone']}" for r in got["recoveries"]
                                   if r["total_s"] is not None)
                  + f" (exit {got['exit']})", flush=True)
    floor = FLOOR_S
    if "--heartbeat-timeout" in args.demo_flags:
        floor = float(args.demo_flags[args.demo_flags.index("--heartbeat-timeout") + 1])
    medians = summary(runs, floor)
    Path(args.out).write_text(json.dumps({"runs": runs, "medians": medians}, indent=1) + "\n")
    print("\n| mode | failure | median to first step | runs | steps redone | bound |\n"
          "|---|---|---|---|---|---|")
    for key, m in medians.items():
        mode, kind = key.split("/")
        total = f"{m['median_total_s']:.2f} s" if m["median_total_s"] is not None else "-"
        print(f"| {mode} | {kind} | {total} | {', '.join(f'{t:.2f}' for t in m['totals_s'])} "
              f"| {m['steps_redone']} | {m['bound_s']:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
