"""One rendezvous round of a multi-node job, on the rank side: which devices are
healthy, which layout every rank runs, and when the run is over.

Torch's elastic agent (one per node, started by ``elastic.node``) does membership: at
every round it starts a fresh set of workers on the nodes present. Each worker then

1. checks its own device (CPU: no failure was injected into its slot since this
   node's launcher started, and the health file does not list it; CUDA: also a kernel
   under a timeout),
2. joins the round's gloo world and gathers every rank's (node, slot, healthy),
3. rank 0 numbers the round (a counter in the rendezvous store, which outlives the
   rounds) and plans once on the healthy (node, slot) set; the plan reaches every rank
   by broadcast, so all ranks agree on it,
4. trains if the layout holds its rank (from the latest committed step), or idles until
   the round's reporting rank marks the run over in the store.

A device's number for the planner is ``node_index * max_local_slots + local_slot``
(nodes in group-rank order), so the planner sees which devices share a node.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from elastor_mcore import planner
from elastor_mcore.config.launch import RoundSettings
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.elastic.job import Workload, latest_readable
from elastor_mcore.elastic.probe import probe_cuda
from elastor_mcore.elastic.protocol import (EVENTS_FILE, OUTCOME_FILE, ROUNDS_DIR,
                                            ROUNDS_FILE, read_events)

log = logging.getLogger(__name__)

STORE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class NodeContext:
    """Where this worker runs, from the node launcher's flags and torch's environment."""

    settings: RoundSettings

    @property
    def node(self) -> str:
        return self.settings.node_name

    @property
    def node_dir(self) -> Path:
        return Path(self.settings.node_dir)

    @property
    def rank(self) -> int:
        return int(os.environ["RANK"])

    @property
    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])

    @property
    def group_rank(self) -> int:
        return int(os.environ["GROUP_RANK"])

    def round_dir(self, number: int) -> Path:
        return self.node_dir / ROUNDS_DIR / str(number)

    def store(self) -> dist.TCPStore:
        """A client of the rendezvous store (hosted by the endpoint's agent for the
        whole job, unlike each round's worker store)."""
        host, port = self.settings.store_endpoint.rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False, timeout=STORE_TIMEOUT)

    def key(self, name: str) -> str:
        return f"elastor/{self.settings.job_id}/{name}"


@dataclass(frozen=True)
class Member:
    """One rank of the round as it reports itself."""

    rank: int
    node: str
    group_rank: int
    slot: int
    """Local slot (``LOCAL_RANK``) on its node."""
    healthy: bool
    started_at: float
    """When the worker process started (the agent's relaunch)."""
    probe_s: float


@dataclass(frozen=True)
class RoundPlan:
    """What rank 0 decided for the round, as every rank receives it."""

    round: int
    layout: dict[str, Any] | None
    """Ranks are the round's global ranks; None: nothing fits (``reason`` says why)."""
    describe: str
    reason: str
    plan_s: float
    planned_at: float
    resumed_from: int | None
    members: list[Member]
    predicted_step_s: float | None = None
    """The planner's step time for the layout (on its node-aware device numbers)."""

    def active(self, rank: int) -> bool:
        return self.layout is not None and any(
            rank in stage["ranks"] for pipe in self.layout["pipelines"]
            for stage in pipe["stages"])


def dead_slots(ctx: NodeContext) -> set[int]:
    """Local slots of this node known dead: a failure injected into one (as on one
    host), or a slot the health file lists (YAML list of slots). A rank killed as hung
    is not: a hung collective silences every rank in it, and the next round's probe
    (CUDA) tells a dead device from a waiting one."""
    dead = set()
    for events in (ctx.node_dir / ROUNDS_DIR).glob(f"*/{EVENTS_FILE}"):
        dead.update(e["slot"] for e in read_events(events, "failure"))
    health_file = ctx.settings.health_file
    if health_file and Path(health_file).is_file():
        listed = yaml.safe_load(Path(health_file).read_text()) or []
        if not isinstance(listed, list) or not all(isinstance(s, int) for s in listed):
            raise ValueError(f"health file {health_file}: expected a list of this "
                             f"node's dead slots, e.g. [1, 3]; got {listed!r}")
        dead.update(listed)
    return dead


def unreadable_steps(ctx: NodeContext) -> set[int]:
    """Committed steps a round of this node failed to load (its ranks reported
    ``load_failed``): the next rounds resume from an earlier one."""
    path = ctx.node_dir / ROUNDS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines()] \
        if path.is_file() else []
    return {r["resumed_from"] for r in records if r["resumed_from"] is not None
            and read_events(ctx.round_dir(r["round"]) / EVENTS_FILE, "load_failed")}


def check_device(ctx: NodeContext, started_at: float) -> Member:
    """This rank's report: its slot's health (probed on CUDA)."""
    start = time.perf_counter()
    healthy = ctx.local_rank not in dead_slots(ctx)
    if healthy and ctx.settings.devices == "cuda":  # the probe sets CUDA_VISIBLE_DEVICES itself
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = int(visible.split(",")[ctx.local_rank]) if visible else ctx.local_rank
        healthy = probe_cuda([device], ctx.settings.probe_timeout) == [device]
    return Member(ctx.rank, ctx.node, ctx.group_rank, ctx.local_rank, healthy,
                  started_at, time.perf_counter() - start)


def planner_slots(members: list[Member]) -> tuple[dict[int, int], int]:
    """The planner's device number of every healthy rank, and devices per node."""
    per_node = max(m.slot for m in members) + 1
    nodes = sorted({m.group_rank for m in members})
    index = {g: i for i, g in enumerate(nodes)}
    return ({index[m.group_rank] * per_node + m.slot: m.rank for m in members if m.healthy},
            per_node)


def plan_round(members: list[Member], workload: Workload, recipe: Recipe,
               hardware: planner.HardwareProfile, checkpoint_dir: str, use_all: bool,
               number: int, unreadable: set[int]) -> RoundPlan:
    """Rank 0's decision: the fastest layout on the healthy devices that the workload
    runs, on round ranks, resuming from the latest committed step not ``unreadable``."""
    start = time.perf_counter()
    rank_of, per_node = planner_slots(members)
    resumed = latest_readable(workload.committed_steps(checkpoint_dir), unreadable)
    try:
        chosen = workload.plan(recipe, hardware, sorted(rank_of), gpus_per_node=per_node,
                               use_all=use_all)
    except planner.PlannerError as exc:
        healthy = [(m.node, m.slot) for m in members if m.healthy]
        return RoundPlan(number, None, "", f"gave up: the {len(healthy)} healthy devices "
                         f"{healthy} cannot hold the model: {exc}",
                         time.perf_counter() - start, time.time(), resumed, members)
    data = chosen.layout.to_dict()
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            stage["ranks"] = [rank_of[s] for s in stage["ranks"]]
    return RoundPlan(number, data, chosen.layout.describe(), "", time.perf_counter() - start,
                     time.time(), resumed, members, chosen.step_s)


def agree(ctx: NodeContext, workload: Workload, recipe: Recipe,
          hardware: planner.HardwareProfile, checkpoint_dir: str, use_all: bool,
          started_at: float) -> RoundPlan:
    """Every rank of the round calls this inside the round's world; all get one plan."""
    me = check_device(ctx, started_at)
    members: list = [None] * dist.get_world_size()
    dist.all_gather_object(members, me)
    decided: list = [None]
    if dist.get_rank() == 0:
        number = ctx.store().add(ctx.key("rounds"), 1)
        decided[0] = plan_round(members, workload, recipe, hardware, checkpoint_dir,
                                use_all, number, unreadable_steps(ctx))
    dist.broadcast_object_list(decided, src=0)
    return decided[0]


def record_round(ctx: NodeContext, plan: RoundPlan) -> None:
    """The node's local rank 0 appends the round's plan to ``rounds.jsonl``."""
    if ctx.local_rank == 0:
        with open(ctx.node_dir / ROUNDS_FILE, "a") as f:
            f.write(json.dumps(asdict(plan)) + "\n")


def write_outcome(ctx: NodeContext, finished: bool, reason: str) -> None:
    """How the job ended, for this node's launcher (local rank 0 writes it)."""
    if ctx.local_rank == 0:
        (ctx.node_dir / OUTCOME_FILE).write_text(
            json.dumps({"finished": finished, "reason": reason}) + "\n")


def mark_done(ctx: NodeContext, number: int) -> None:
    """The reporting rank: the run is over (idle ranks may exit)."""
    ctx.store().set(ctx.key(f"round{number}/done"), b"1")


def wait_done(ctx: NodeContext, number: int) -> None:
    """Block until the run is over. Idle ranks hold their node in the job this way: a
    node whose workers all exit would leave it. If the round fails, the agent stops us."""
    store = ctx.store()
    key = ctx.key(f"round{number}/done")
    while True:
        try:
            store.wait([key], timedelta(seconds=5))
            return
        except dist.DistStoreError:
            continue
