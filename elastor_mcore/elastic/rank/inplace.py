"""Recovery in place, the rank side: the survivors of a failure leave the broken
process groups, agree through the store on who is left and on a layout for them, and
form a new world in the same processes (``runtime.train.recover_in_place`` then builds
the stage and restores the state from memory).

1. **Leave.** A collective with a dead peer fails on the ranks that talk to it (gloo:
   the peer's connections close). The rank destroys every process group at once,
   closing its own connections, so every rank blocked on it fails too: the failure
   reaches every survivor within a step. (``ProcessGroup.abort`` does not unblock a
   pending gloo collective in torch 2.13/2.14, measured; closing the connections
   does.)
2. **Agree.** In the launch's store (torchrun's, which outlives the ranks), epoch
   ``e``: each survivor adds itself to ``arrivals`` and writes its slot. The first to
   arrive coordinates: it waits until every rank of the old world has arrived or is
   known dead (its heartbeat's process is gone: one host), or ``JOIN_TIMEOUT_S``
   passes (a rank on another host), then plans on the survivors' slots
   (``planner.plan``, as the supervisor does) and publishes the decision. Nobody lost
   means the failure was not a peer's: the error is raised again.
3. **Regroup.** Every survivor joins a new default process group (``init_process_group``
   on a prefix of the same store): the layout's ranks first (0..n-1, slots in order),
   then the survivors it leaves idle, which hand their copies on in the restore and
   then end (exit 0). A rank that arrives after the decision ends at once.

Anything that fails here raises: the rank exits non-zero, torchrun stops the launch and
the supervisor relaunches from the durable checkpoint. ``ELASTOR_IN_PLACE_FAULT=regroup``
in a rank's environment makes this happen after the decision (tests).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from elastor_mcore import planner
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.elastic.job import renumbered
from elastor_mcore.elastic.protocol import EVENTS_FILE, HEARTBEAT_DIR, append_event, read_beats
from elastor_mcore.elastic.rank.hooks import ElasticHooks
from elastor_mcore.elastic.supervisor import process_running
from elastor_mcore.parallel.layout import layout_from_dict
from elastor_mcore.parallel.teardown import leave_groups
from elastor_mcore.runtime.hooks import Recovery, Regroup

log = logging.getLogger(__name__)

PREFIX = "elastor/inplace"
JOIN_TIMEOUT_S = 30.0
"""How long the coordinator waits for a rank that has neither arrived nor is known
dead (on one host every rank's liveness is known at once)."""
STORE_TIMEOUT = timedelta(seconds=JOIN_TIMEOUT_S + 60)
FAULT_ENV = "ELASTOR_IN_PLACE_FAULT"


class InPlaceError(RuntimeError):
    """The recovery in place cannot continue (the supervisor relaunches)."""


@dataclass(frozen=True)
class Decision:
    """What the coordinator decided for one epoch, as every survivor reads it."""

    epoch: int
    failed_step: int
    layout: dict | None
    """On the new world's ranks; None: no layout (``reason``)."""
    slots: list[int]
    """The physical slot of each new rank: the layout's, then the idle survivors'."""
    ranks: dict[str, int]
    """Old rank -> new rank of every survivor (JSON keys)."""
    lost: list[int]
    """Slots of the old world that did not arrive."""
    describe: str
    reason: str
    plan_s: float
    predicted_step_s: float | None


class InPlaceRecovery(Recovery):
    """``runtime.hooks.Recovery`` for a rank under the supervisor (one per process)."""

    def __init__(self, settings: RunSettings, recipe: Recipe, hooks: ElasticHooks,
                 store: dist.Store, rank: int, slots: tuple[int, ...]) -> None:
        self.settings, self.recipe, self.hooks, self.store = settings, recipe, hooks, store
        self.rank, self.slots, self.epoch = rank, slots, 0
        self.events = Path(settings.elastic_dir) / EVENTS_FILE
        self.backend = dist.get_backend()
        self.store_address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    @classmethod
    def from_settings(cls, settings: RunSettings, recipe: Recipe,
                      hooks: ElasticHooks) -> "InPlaceRecovery":
        """For the rank of the current world; a client of torchrun's store."""
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=STORE_TIMEOUT)
        rank = dist.get_rank()
        slots = settings.rank_slots or tuple(range(dist.get_world_size()))
        return cls(settings, recipe, hooks, store, rank, slots)

    def key(self, epoch: int, name: str) -> str:
        return f"{PREFIX}/{epoch}/{name}"

    def regroup(self, error: BaseException, step: int) -> Regroup | None:
        caught = time.time()
        log.warning("rank %d (slot %d): step %d failed (%s: %s); recovering in place",
                    self.rank, self.slots[self.rank], step, type(error).__name__,
                    str(error)[:200])
        leave_groups(self.store_address)
        epoch = self.epoch + 1
        arrival = self.store.add(self.key(epoch, "arrivals"), 1)
        self.store.set(self.key(epoch, f"arrived/{self.rank}"), str(step))
        arrived = time.time()
        if arrival == 1:
            decision = self.decide(epoch, step, error)
            self.store.set(self.key(epoch, "decision"), json.dumps(asdict(decision)))
        decision = Decision(**json.loads(self.store.get(self.key(epoch, "decision"))))
        decided = time.time()
        if decision.layout is None:
            raise InPlaceError(decision.reason) from error
        if os.environ.get(FAULT_ENV) == "regroup":
            raise InPlaceError(f"injected fault ({FAULT_ENV}=regroup) in epoch {epoch}")
        new_rank = decision.ranks.get(str(self.rank))
        layout = layout_from_dict(decision.layout)
        append_event(self.events, "regroup", epoch=epoch, slot=self.slots[self.rank],
                     rank=self.rank, new_rank=new_rank, caught=caught, arrived=arrived,
                     decided=decided, coordinator=arrival == 1,
                     in_layout=new_rank is not None and new_rank in layout.ranks)
        if new_rank is None:
            log.warning("slot %d arrived after epoch %d was decided without it; ending",
                        self.slots[self.rank], epoch)
            return None
        dist.init_process_group(self.backend, store=dist.PrefixStore(
            self.key(epoch, "world"), self.store), rank=new_rank,
            world_size=len(decision.slots), timeout=STORE_TIMEOUT)
        self.rank, self.slots, self.epoch = new_rank, tuple(decision.slots), epoch
        self.hooks.rank, self.hooks.epoch = new_rank, epoch
        return Regroup(layout, self.slots, epoch)

    def decide(self, epoch: int, step: int, error: BaseException) -> Decision:
        """The coordinator: wait for the survivors, plan on their slots."""
        survivors = self.wait_for_survivors(epoch)
        lost = sorted(self.slots[r] for r in range(len(self.slots)) if r not in survivors)
        start = time.perf_counter()
        if not lost:
            return Decision(epoch, step, None, [], {}, [], "", (
                f"no rank was lost; step {step} failed on its own: {type(error).__name__}: "
                f"{error}"), 0.0, None)
        alive = sorted(self.slots[r] for r in survivors)
        try:
            chosen = planner.plan(self.recipe, planner.load_hardware(self.settings.hardware),
                                  alive, use_all=self.settings.replan_all_slots)
        except planner.PlannerError as exc:
            return Decision(epoch, step, None, [], {}, lost, "", (
                f"the {len(alive)} surviving slots {alive} cannot hold the model: {exc}"),
                time.perf_counter() - start, None)
        ranked = renumbered(chosen.layout, chosen.layout.ranks)
        slots = (*chosen.layout.ranks,
                 *(s for s in alive if s not in chosen.layout.ranks))  # idle ones last
        rank_of_slot = {self.slots[r]: r for r in survivors}
        ranks = {str(rank_of_slot[slot]): new for new, slot in enumerate(slots)}
        decision = Decision(epoch, step, ranked.to_dict(), list(slots), ranks, lost,
                            chosen.layout.describe(), "", time.perf_counter() - start,
                            chosen.step_s)
        append_event(self.events, "inplace_plan", **asdict(decision))
        return decision

    def wait_for_survivors(self, epoch: int) -> list[int]:
        """Old ranks that arrived, once every other one is known dead or
        ``JOIN_TIMEOUT_S`` has passed."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        beats_dir = Path(self.settings.elastic_dir) / HEARTBEAT_DIR
        while True:
            arrived = [r for r in range(len(self.slots))
                       if self.store.check([self.key(epoch, f"arrived/{r}")])]
            beats = read_beats(beats_dir)
            pending = [r for r in range(len(self.slots)) if r not in arrived]
            unknown = [r for r in pending if self.slots[r] not in beats
                       or process_running(beats[self.slots[r]].pid)]
            if not unknown or time.monotonic() > deadline:
                if unknown:
                    log.warning("epoch %d: ranks %s neither arrived nor are known dead "
                                "after %.0fs; continuing without them", epoch, unknown,
                                JOIN_TIMEOUT_S)
                return arrived
            time.sleep(0.02)

    def resumed(self, regroup: Regroup, step: int, phases: dict[str, float],
                received_bytes: int, durable_cells: int) -> None:
        append_event(self.events, "restored", epoch=regroup.epoch, rank=self.rank,
                     slot=self.slots[self.rank], step=step, received_bytes=received_bytes,
                     durable_cells=durable_cells, **{f"{k}_s": v for k, v in phases.items()})
        self.hooks.ready(step, phases["restore"])
