"""A node's view of a multi-node job: its rounds and the recoveries between them.

Three sources, all timestamped on this node: the launcher's record of the agent's
lines and its hang kills (``launcher.jsonl``), the round records its workers wrote
(``rounds.jsonl``: members, plan) and its ranks' events per round (failure, ready,
first step). A recovery's phases, in the order they happen::

    failure -> detect (agent sees it) -> rendezvous (next round formed) -> relaunch
    (workers start, import, join the round) -> probe -> plan -> build (process groups
    and model; Megatron-LM's start-up) -> load -> first step

A failure's time is its injection (failure plan) or, for a hang, the silent rank's
last heartbeat. A node only times what it saw: the failure of another node's worker,
a worker killed from outside or a lost node has no failure time here (detect is then
unknown), and a node whose ranks were idle in the next round has no load or first
step.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from elastor_mcore.elastic.timeline import markdown_table, secs
from elastor_mcore.elastic.protocol import (EVENTS_FILE, LAUNCHER_EVENTS, ROUNDS_DIR,
                                             ROUNDS_FILE, read_events)

PHASES = ("detect_s", "rendezvous_s", "relaunch_s", "probe_s", "plan_s", "build_s", "load_s",
          "first_step_s")


@dataclass(frozen=True)
class RoundSummary:
    round: int
    nodes: list[str]
    healthy: dict[str, list[int]]
    """Healthy local slots per node."""
    ranks: int
    """Ranks the layout uses."""
    describe: str
    resumed_from: int | None
    gave_up: str


@dataclass(frozen=True)
class NodeRecovery:
    """From an event in one round to the first step of the next."""

    after_round: int
    next_round: int
    cause: str
    nodes_before: int
    nodes_after: int
    ranks_before: int
    ranks_after: int
    resumed_from: int | None
    detect_s: float | None
    rendezvous_s: float | None
    relaunch_s: float | None
    probe_s: float | None
    plan_s: float | None
    build_s: float | None
    """From the plan to every rank of this node ready to load."""
    load_s: float | None
    first_step_s: float | None
    total_s: float | None


@dataclass(frozen=True)
class NodeTimeline:
    rounds: list[RoundSummary]
    recoveries: list[NodeRecovery]


def _first_after(events: list[dict[str, Any]], names: Sequence[str], after: float,
                 before: float) -> dict[str, Any] | None:
    hits = [e for e in events if e["event"] in names and after <= e["time"] <= before]
    return min(hits, key=lambda e: e["time"], default=None)


def _summary(record: dict[str, Any]) -> RoundSummary:
    members = record["members"]
    nodes = sorted({(m["group_rank"], m["node"]) for m in members})
    healthy = {name: sorted(m["slot"] for m in members if m["node"] == name and m["healthy"])
               for _, name in nodes}
    ranks = 0 if record["layout"] is None else sum(
        len(s["ranks"]) for p in record["layout"]["pipelines"] for s in p["stages"])
    return RoundSummary(record["round"], [name for _, name in nodes], healthy, ranks,
                        record["describe"], record["resumed_from"], record["reason"])


def _cause(failures: list[dict[str, Any]], kills: list[dict[str, Any]],
           detected: dict[str, Any] | None, before: RoundSummary, after: RoundSummary) -> str:
    parts = [f"{e['kind']} of slot {e['slot']} at step {e['step']}" for e in failures]
    if kills:
        rule = kills[0].get("timeout")
        parts.append(f"slots {sorted({k['slot'] for k in kills})} killed after "
                     f"{max(k['silent_s'] for k in kills):.0f}s without a heartbeat"
                     + (f" ({rule})" if rule else ""))
    lost = sorted(set(before.nodes) - set(after.nodes))
    joined = sorted(set(after.nodes) - set(before.nodes))
    if lost:
        parts.append(f"node {', '.join(lost)} lost")
    if joined:
        parts.append(f"node {', '.join(joined)} joined")
    if not parts and detected is not None:
        parts.append("a worker failed (of this node or another)"
                     if detected["event"] == "agent_failed" else
                     "a node entered the rendezvous (new, or after its worker failed)")
    return "; ".join(parts) or "unknown"


def _recovery(node_dir: Path, prev: dict[str, Any], nxt: dict[str, Any],
              agent: list[dict[str, Any]]) -> NodeRecovery:
    before, after = _summary(prev), _summary(nxt)
    start_next = min(m["started_at"] for m in nxt["members"])
    window = (prev["planned_at"], start_next)
    rank_events = read_events(node_dir / ROUNDS_DIR / str(prev["round"]) / EVENTS_FILE)
    failures = sorted((e for e in rank_events if e["event"] == "failure"),
                      key=lambda e: e["time"])
    kills = [e for e in agent if e["event"] == "hang_killed" and window[0] <= e["time"]]
    kills = [e for e in kills if e["time"] <= start_next]
    detected = _first_after(agent, ("agent_failed", "agent_join"), *window)
    formed = _first_after(agent, ("rendezvous_done",),
                          detected["time"] if detected else window[0], start_next)
    failed_at = failures[0]["time"] if failures else None
    if failed_at is None and kills:  # a hang: from the last heartbeat
        failed_at = min(k["time"] - k["silent_s"] for k in kills)
    detect_s = detected["time"] - failed_at if detected and failed_at else None
    rendezvous_s = formed["time"] - detected["time"] if formed and detected else None
    probe_s = max(m["probe_s"] for m in nxt["members"])
    joined_at = nxt["planned_at"] - nxt["plan_s"]
    relaunch_s = joined_at - formed["time"] - probe_s if formed else None
    nxt_events = read_events(node_dir / ROUNDS_DIR / str(nxt["round"]) / EVENTS_FILE)
    ready = [e for e in nxt_events if e["event"] == "ready"]
    stepped = [e for e in nxt_events if e["event"] == "first_step"]
    load_s = max((e["load_s"] for e in ready), default=None)
    build_s = max(e["time"] - e["load_s"] for e in ready) - nxt["planned_at"] if ready \
        else None
    first_step_s = total_s = None
    if ready and stepped:
        stepped_at = max(e["time"] for e in stepped)
        first_step_s = stepped_at - max(e["time"] for e in ready)
        origin = failed_at or (detected["time"] if detected else None)
        total_s = stepped_at - origin if origin else None
    return NodeRecovery(
        prev["round"], nxt["round"], _cause(failures, kills, detected, before, after),
        len(before.nodes), len(after.nodes), before.ranks, after.ranks, after.resumed_from,
        detect_s, rendezvous_s, relaunch_s, probe_s, nxt["plan_s"], build_s, load_s,
        first_step_s, total_s)


def build(node_dir: str | os.PathLike) -> NodeTimeline:
    node_dir = Path(node_dir)
    path = node_dir / ROUNDS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines()] \
        if path.is_file() else []
    agent = read_events(node_dir / LAUNCHER_EVENTS)
    return NodeTimeline([_summary(r) for r in records],
                        [_recovery(node_dir, a, b, agent) for a, b in zip(records, records[1:])])


def write_json(path: str | os.PathLike, timeline: NodeTimeline) -> None:
    Path(path).write_text(json.dumps(asdict(timeline), indent=2) + "\n")


def table(timeline: NodeTimeline) -> str:
    """One row per recovery, one column per phase (seconds)."""
    header = ["rounds", "cause", "nodes", "ranks", "resumed from", "detect", "rendezvous",
              "relaunch", "probe", "plan", "build", "load", "first step", "total"]
    rows = [[f"{r.after_round} -> {r.next_round}", r.cause,
             f"{r.nodes_before} -> {r.nodes_after}", f"{r.ranks_before} -> {r.ranks_after}",
             "-" if r.resumed_from is None else r.resumed_from,
             *(secs(getattr(r, p)) for p in PHASES), secs(r.total_s)]
            for r in timeline.recoveries]
    return markdown_table(header, rows)
