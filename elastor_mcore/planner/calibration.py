"""From ``elastor profile``'s raw figures (``elastic.rank.measure``) to a hardware profile.

Pure arithmetic, so it can be checked by hand (and ``provenance``, the record of where
and when the figures were taken):

* **Stages.** Per TP degree and quantity, each stage role (``single``: embedding and
  output layer; ``first``; ``last``) was measured at two layer counts. One slope (the
  per-layer cost) is fitted to all three roles, each with its own intercept; then the
  embedding is what a single stage has over a last one, the output layer what it has
  over a first one, and a stage's own cost what first and last share:
  ``embedding = single - last``, ``output = single - first``,
  ``stage = first + last - single`` (intercepts; negative noise is clamped to 0).
* **Repetitions.** Every figure is the median of interleaved repetitions (of the TP
  group's slowest rank), with its spread: the width of the median's distribution-free
  90 % confidence interval (order statistics) over the median (``robust``). ``unstable`` names the figures whose spread exceeds a bound, which
  ``elastor profile`` refuses.
* **Sharing the cores.** ``concurrency[k] = k x alone / together(k)``: a single-layer
  step on one slot alone, then on ``k`` slots at once, for every ``k`` up to the world
  (the cores' worth ``k`` busy slots achieve). A stage's TP group kept ``d = cpu /
  wall`` slots busy while it was timed (its CPU time over its wall time), so its wall
  times are divided by ``max(1, d / cores_worth(d))`` to stand for cores of its own;
  its CPU times are the ``cpu_ms`` table, fitted like the others.
* **Optimizer.** The loop's optimizer step, timed on every measured stage, against the
  stage's local parameters: a least-squares slope through the origin (ns/parameter).
* **Links.** P2P: one-way time at two message sizes gives bandwidth (and latency), for
  a pair of ranks on one node and, under a multi-node launch, a pair on two nodes
  (the inter-node link). Inside a node the latency the cost model charges per boundary
  and micro-batch is the measured 1F1B hand-off (``elastic.rank.measure.measure_handoff``:
  the runtime's own schedule and communicator between two stages that do no work, at
  a small message) less that message's bandwidth time. All-reduce: least squares of the ring model ``2(d-1)/d x
  bytes / bandwidth + 2(d-1) x latency`` over every group size and message size.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import socket
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Any

from elastor_mcore.config.recipe import Recipe
from elastor_mcore.planner.hardware import (HardwareError, HardwareProfile, RecipeMeasurements,
                                            StageTable, recipe_shape)

MEDIAN_CONFIDENCE = 0.9
"""Confidence of the interval ``robust`` measures the spread with."""

MIB = 2**20
QUANTITIES = {"forward_backward_ms": ("forward_backward_ms", 1.0),
              "cpu_ms": ("cpu_ms", 1.0),
              "activation_mib": ("activation_bytes", 1 / MIB),
              "state_mib": ("state_bytes", 1 / MIB)}
"""Table name -> (raw record field, scale)."""


def median_interval(n: int, confidence: float = MEDIAN_CONFIDENCE) -> tuple[int, int]:
    """0-based order statistics ``(j, k)`` of ``n`` sorted values between which the
    median lies with at least ``confidence`` (or, for too few values, the widest pair):
    the distribution-free interval, ``P(x_j <= median <= x_k) = 1 - 2 P(Bin(n, 1/2) <
    j + 1)``, symmetric, narrowest that meets the confidence."""
    tail, j = 0.5**n, 0           # P(Bin(n, 1/2) <= j)
    while j + 1 < n - 1 - (j + 1) and 2 * (tail + math.comb(n, j + 1) * 0.5**n) \
            <= 1 - confidence:
        j += 1
        tail += math.comb(n, j) * 0.5**n
    return j, n - 1 - j


def robust(values: list[float]) -> tuple[float, float]:
    """(median, spread) of repetitions; spread = the width of the median's
    ``MEDIAN_CONFIDENCE`` interval (``median_interval``) over the median: how well the
    repetitions pin down the figure the profile keeps, which more repetitions narrow,
    rather than how much single repetitions scatter, which they do not (0 for fewer than
    two values)."""
    median = statistics.median(values)
    if len(values) < 2 or median <= 0:
        return median, 0.0
    ordered = sorted(values)
    j, k = median_interval(len(ordered))
    return median, (ordered[k] - ordered[j]) / median


def unstable(raw: dict[str, Any], max_spread: float) -> list[str]:
    """The figures of ``raw`` whose repetitions disagree by more than ``max_spread``,
    described for a person (empty: all agree)."""
    out = [f"TP {r['tp']} {r['role']} stage of {r['layers']} layer(s) "
           f"{r['spread']:.0%}" for r in raw.get("stages", []) if r["spread"] > max_spread]
    for busy in (raw.get("parallelism") or {}).get("busy", []):
        if busy["spread"] > max_spread:
            out.append(f"{busy['slots']} slot(s) busy at once {busy['spread']:.0%}")
    handoff = raw.get("handoff")
    if handoff and handoff["spread"] > max_spread:
        out.append(f"1F1B hand-off {handoff['spread']:.0%}")
    return out


def fit_stage_table(points: dict[str, list[tuple[int, float]]]) -> StageTable:
    """Shared slope, one intercept per role, from ``{role: [(layers, value), ...]}``."""
    missing = sorted({"single", "first", "last"} - set(points))
    if missing:
        raise HardwareError(f"profile measurements lack the {missing} stage roles")
    num = den = 0.0
    means = {}
    for role, pts in points.items():
        mean_l = sum(l for l, _ in pts) / len(pts)
        mean_v = sum(v for _, v in pts) / len(pts)
        means[role] = (mean_l, mean_v)
        num += sum((l - mean_l) * (v - mean_v) for l, v in pts)
        den += sum((l - mean_l) ** 2 for l, _ in pts)
    if den == 0:
        raise HardwareError("profile measurements need two layer counts per stage role")
    slope = max(0.0, num / den)
    a = {role: mv - slope * ml for role, (ml, mv) in means.items()}
    return StageTable(layer=slope,
                      stage=max(0.0, a["first"] + a["last"] - a["single"]),
                      embedding=max(0.0, a["single"] - a["last"]),
                      output=max(0.0, a["single"] - a["first"]))


def concurrency(parallelism: dict[str, Any]) -> dict[int, float]:
    """``{k: cores' worth}`` of ``k`` slots busy at once (between 1 and ``k``)."""
    busy = {b["slots"]: b["ms"] for b in parallelism["busy"]}
    alone = busy[1]
    return {k: min(float(k), max(1.0, k * alone / ms)) for k, ms in sorted(busy.items())
            if k > 1}


def fit_p2p(points: list[dict[str, float]]) -> tuple[float, float]:
    """(latency us, bandwidth GB/s) from one-way times at two or more sizes."""
    small = min(points, key=lambda p: p["bytes"])
    large = max(points, key=lambda p: p["bytes"])
    extra_s = max(1e-9, (large["ms"] - small["ms"]) / 1e3)
    bandwidth = (large["bytes"] - small["bytes"]) / extra_s
    latency_s = max(1e-7, small["ms"] / 1e3 - small["bytes"] / bandwidth)
    return latency_s * 1e6, bandwidth / 1e9


def fit_allreduce(points: list[dict[str, float]]) -> tuple[float, float]:
    """(latency us, bandwidth GB/s) of the ring model, least squares (non-negative)."""
    rows = [(2 * (p["ranks"] - 1) / p["ranks"] * p["bytes"], 2 * (p["ranks"] - 1),
             p["ms"] / 1e3) for p in points]
    sxx = sum(x * x for x, _, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    det = sxx * syy - sxy * sxy
    inv_bw = (sxt * syy - syt * sxy) / det if det else 0.0
    latency = (syt * sxx - sxt * sxy) / det if det else 0.0
    if inv_bw <= 0:  # latency-bound at these sizes: fit latency alone
        inv_bw, latency = 1e-12, syt / syy
    if latency <= 0:
        latency, inv_bw = 1e-7, sxt / sxx
    return latency * 1e6, 1 / inv_bw / 1e9


def fit_optimizer(stages: list[dict[str, Any]]) -> float:
    """ns per local parameter of the optimizer step: slope through the origin."""
    num = sum(r["params"] * r["optimizer_ms"] * 1e6 for r in stages)
    den = sum(r["params"] ** 2 for r in stages)
    return max(0.0, num / den) if den else 0.0


def recipe_measurements(raw: dict[str, Any], recipe: Recipe, cores: HardwareProfile,
                        measured_on: dict[str, Any]) -> RecipeMeasurements:
    """The stage tables of ``raw``; wall times scaled to cores of the stage's own
    (``cores.cores_worth``: none on devices of their own)."""
    grouped: dict[int, dict[str, dict[str, list[tuple[int, float]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for record in raw["stages"]:
        busy = record["cpu_ms"] / record["forward_backward_ms"]
        worth = cores.cores_worth(busy)
        for table, (key, scale) in QUANTITIES.items():
            value = record[key] * scale
            if table == "forward_backward_ms" and worth:
                value /= max(1.0, busy / worth)
            grouped[record["tp"]][table][record["role"]].append((record["layers"], value))
    tables = {table: {tp: fit_stage_table(grouped[tp][table]) for tp in sorted(grouped)}
              for table in QUANTITIES}
    return RecipeMeasurements(shape=recipe_shape(recipe), measured_on=measured_on,
                              optimizer_ns_per_param=fit_optimizer(raw["stages"]), **tables)


def measured_step_s(times: list[float]) -> float | None:
    """A run's measured step time: the median over its steps after the first (which
    also pays for warming up), or over all of them if there is only one."""
    kept = times[1:] or times
    return statistics.median(kept) if kept else None


def handoff_latency_us(handoff: dict[str, float], bandwidth_gb_s: float) -> float:
    """Per-message latency of a 1F1B hand-off: its measured time per micro-batch less
    its message's time at ``bandwidth_gb_s``."""
    return max(0.1, handoff["us"] - handoff["bytes"] / (bandwidth_gb_s * 1e3))


def link_profile(base: HardwareProfile, raw: dict[str, Any]) -> HardwareProfile:
    """``base`` with the links ``raw`` measured: all-reduce inside a node, P2P inside a
    node and (when the launch spanned nodes) between nodes; the rest is kept."""
    links: dict[str, float] = {}
    if raw["allreduce"]:
        links["intra_node_latency_us"], links["intra_node_bandwidth_gb_s"] = \
            fit_allreduce(raw["allreduce"])
    if raw["p2p"]:
        links["p2p_latency_us"], links["p2p_bandwidth_gb_s"] = fit_p2p(raw["p2p"])
    if raw.get("handoff"):
        links["p2p_latency_us"] = handoff_latency_us(raw["handoff"],
                                                     links["p2p_bandwidth_gb_s"])
    if raw.get("p2p_inter_node"):
        links["inter_node_latency_us"], links["inter_node_bandwidth_gb_s"] = \
            fit_p2p(raw["p2p_inter_node"])
    return replace(base, **links)


def measured_profile(base: HardwareProfile, raw: dict[str, Any], recipe: Recipe,
                     measured_on: dict[str, Any]) -> HardwareProfile:
    """``base`` with what ``raw`` measured: the recipe's tables (other recipes' tables
    are kept), the links and, on CPU slots, how they share the cores."""
    cores = link_profile(base, raw)
    if measured_on.get("device") == "cpu":
        table = concurrency(raw["parallelism"])
        cores = replace(cores, concurrency=table,
                        concurrent_slots=table[max(table)] if table else 1.0)
    else:
        cores = replace(cores, concurrency={}, concurrent_slots=None)
    tables = recipe_measurements(raw, recipe, cores, measured_on)
    return replace(cores, measured={**base.measured, recipe.name: tables})


def device_name(device: str) -> str:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def provenance(recipe_path: str, device: str, repeats: int) -> dict:
    """Where and when a measurement was taken."""
    return {"host": socket.gethostname(), "device": device, "device_name": device_name(device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": importlib.metadata.version("torch"),
            "megatron_core": importlib.metadata.version("megatron-core"),
            "recipe": str(recipe_path), "repeats": repeats,
            "load_average_1min": round(os.getloadavg()[0], 2)}
