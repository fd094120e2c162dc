"""Fill any layout's training state from the copies the ranks hold in memory
(``memory_tier``), peer to peer, and from the zarr checkpoint for what none holds.

As a checkpoint's load is planned (``checkpoint/plan.py``), each tensor is planned by
its *owner* (``plan.owner_of`` its key), not by every rank for the whole job: every
rank of the new world sends each owner the boxes it holds of the owner's tensors in
its complete copies (``Holding``: whose state, which step, which global boxes) and
the boxes it needs of them (its ``state_shards`` under the new layout). The ranks
agree on the newest step every owner can rebuild its tensors at from the copies of
that step, with the durable checkpoint if it has that step (``newest_plan``: an
integer ``all_reduce`` per step tried, the newest first); each owner then cuts its
tensors' boxes into the cells of their common refinement and picks, for each needed
cell, the rank itself when it holds the cell, else the holder with the fewest bytes
to send so far (``plan_step``), and tells every sender and receiver its moves. Each
(sender, receiver) pair exchanges one packed buffer; cells no copy holds are read
from the checkpoint. What a rank sends and computes follows the tensors it holds and
owns, not the size of the job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from elastor_mcore import checkpoint
from elastor_mcore.checkpoint import LocalShard, comm
from elastor_mcore.checkpoint.format import step_dir_name
from elastor_mcore.checkpoint.plan import owner_of
from elastor_mcore.checkpoint.storage import as_path
from elastor_mcore.geometry import Box, ShardInfo, common_refinement, local_view
from elastor_mcore.runtime.memory_tier import Holding, RestoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    """One cell of one needed box, and where it comes from."""

    key: str
    box: Box
    dst: int
    target: int
    """Index of the box in the receiver's needed list."""
    src: int | None
    """The sending rank; None: read from the durable checkpoint."""
    copy: int = -1
    """Index of the sender's copy (in its reported list), and of the shard in it."""
    shard: int = -1


@dataclass(frozen=True)
class Source:
    """A box some rank holds in one of its complete copies."""

    rank: int
    copy: int
    shard: int
    step: int
    info: ShardInfo


@dataclass(frozen=True)
class Target:
    """A box some rank needs: its ``index``-th target."""

    rank: int
    index: int
    info: ShardInfo


@dataclass
class RestorePlan:
    step: int
    schedule: dict | None
    """The lr schedule's state at ``step`` from a copy (None: from the checkpoint)."""
    moves: list[Move]

    def durable_cells(self) -> int:
        return sum(1 for m in self.moves if m.src is None)


def sources_of(held: dict[int, Sequence[Holding]]) -> list[Source]:
    """Every box of every rank's copies."""
    return [Source(rank, c, s, holding.step, info) for rank in sorted(held)
            for c, holding in enumerate(held[rank]) for s, info in enumerate(holding.shards)]


def targets_of(needed: dict[int, Sequence[ShardInfo]]) -> list[Target]:
    return [Target(rank, t, info) for rank in sorted(needed)
            for t, info in enumerate(needed[rank])]


def plan_restore(held: dict[int, Sequence[Holding]], needed: dict[int, Sequence[ShardInfo]],
                 durable_step: int | None) -> RestorePlan:
    """The whole job's plan in one process: the newest step every needed box can be
    rebuilt at and its moves (see the module docstring); ``RestoreError`` if there is
    none."""
    schedules = {h.step: h.schedule for copies in held.values() for h in copies}
    return newest_plan(sources_of(held), targets_of(needed), durable_step, schedules,
                       lambda values: values)


Agree = Callable[[list[int]], list[int]]
"""The largest of every rank's values, element by element (``comm.Comm.maximum``; in
one process, the values themselves)."""


def newest_plan(sources: Sequence[Source], targets: Sequence[Target],
                durable_step: int | None, schedules: dict[int, dict],
                agree: Agree) -> RestorePlan:
    """The plan of these boxes (an owner's, of its tensors) at the newest step every
    rank's can be rebuilt at: the steps tried newest first, from the newest any copy
    holds or the durable step, each tried by one ``agree`` of (whether this rank's
    boxes fail at it, the newest step below it this rank could try, whether its plan
    raised). ``RestoreError`` on every rank if no step serves them all."""
    steps = {source.step for source in sources} | (
        {durable_step} if durable_step is not None else set())
    step = agree([max(steps, default=-1)])[0]
    while step >= 0:
        plan, error = None, None
        try:
            plan = plan_step(sources, targets, step, durable_step == step, schedules.get(step))
        except RestoreError as exc:
            error = exc
        failed, below, errors = agree([plan is None, max((s for s in steps if s < step),
                                                         default=-1), error is not None])
        if errors:
            raise error or RestoreError(f"restoring step {step} failed on another rank "
                                        f"(its log says why)")
        if not failed:
            return plan
        step = below
    raise RestoreError(
        f"no step can be rebuilt: the copies in memory (steps {sorted(steps) or 'none'} "
        f"here) and the durable checkpoint (step {durable_step}) do not cover the state "
        f"at any one step")


def plan_step(sources: Sequence[Source], targets: Sequence[Target], step: int,
              durable: bool, schedule: dict | None = None) -> RestorePlan | None:
    """The moves that rebuild ``targets`` at ``step`` from the copies of that step (and
    the durable checkpoint where ``durable``), or None where they cannot."""
    wanted = {target.info.key for target in targets}
    held = [s for s in sources if s.step == step and s.info.key in wanted]
    boxes = {i: [box.info] for i, box in enumerate([*held, *targets])}
    moves, load = [], {}
    for cell in common_refinement(boxes):
        holders = [held[h] for h in cell.holders if h < len(held)]
        for h in cell.holders:
            if h < len(held):
                continue
            target = targets[h - len(held)]
            if not holders and not durable:
                return None
            if not holders:
                moves.append(Move(cell.key, cell.box, target.rank, target.index, None))
                continue
            source = min(holders, key=lambda x: (x.rank != target.rank, load.get(x.rank, 0),
                                                 x.rank, x.copy, x.shard))
            if source.info.dtype != target.info.dtype:
                raise RestoreError(
                    f"{cell.key}: a copy holds it as {source.info.dtype}, rank "
                    f"{target.rank} needs {target.info.dtype}; restore needs the same dtype")
            if source.rank != target.rank:
                size = cell.box.numel * torch.empty(
                    (), dtype=getattr(torch, target.info.dtype)).element_size()
                load[source.rank] = load.get(source.rank, 0) + size
            moves.append(Move(cell.key, cell.box, target.rank, target.index, source.rank,
                              source.copy, source.shard))
    return RestorePlan(step, schedule, moves)


@dataclass(frozen=True)
class Restored:
    """What ``restore`` did, for the recovery's timeline."""

    step: int
    schedule: dict | None
    """The lr schedule's state at ``step``."""
    received_bytes: int
    durable_cells: int
    """Cells this rank read from the durable checkpoint (held by no copy)."""


Request = tuple[list[Source], list[Target], dict[int, dict]]
"""What a rank sends the owner of some tensors: the boxes it holds of them in its
copies, those it needs, and the lr schedule's state at each step it holds."""


def requests(rank: int, held: Sequence[Holding], needed: Sequence[ShardInfo],
             ranks: Sequence[int]) -> dict[int, Request]:
    """A rank's part of a restore's plan, by the owner of each tensor."""
    out: dict[int, Request] = {}
    schedules = {holding.step: holding.schedule for holding in held}
    for source in sources_of({rank: held}):
        out.setdefault(owner_of(source.info.key, ranks), ([], [], schedules))[0].append(source)
    for target in targets_of({rank: needed}):
        out.setdefault(owner_of(target.info.key, ranks), ([], [], schedules))[1].append(target)
    return out


def owner_plan(received: dict[int, Request], durable_step: int | None,
               agree: Agree) -> RestorePlan:
    """An owner's plan of its tensors from what the ranks sent it (``newest_plan``)."""
    sources = [s for mine, _, _ in received.values() for s in mine]
    needs = sorted((t for _, mine, _ in received.values() for t in mine),
                   key=lambda t: (t.rank, t.index))
    schedules = {step: schedule for _, _, known in received.values()
                 for step, schedule in known.items()}
    return newest_plan(sources, needs, durable_step, schedules, agree)


def told(plan: RestorePlan) -> dict[int, tuple[dict | None, list[Move]]]:
    """An owner's moves for each rank that sends or receives one, with the schedule."""
    out: dict[int, list[Move]] = {}
    for move in plan.moves:
        out.setdefault(move.dst, []).append(move)
        if move.src is not None and move.src != move.dst:
            out.setdefault(move.src, []).append(move)
    return {rank: (plan.schedule, moves) for rank, moves in out.items()}


def rank_plan(step: int, replies: dict[int, tuple[dict | None, list[Move]]]) -> RestorePlan:
    """A rank's moves from the owners' replies, in one order every pair of ranks
    shares (each packs and unpacks its buffer in it), and the step's schedule."""
    moves = sorted((m for _, mine in replies.values() for m in mine),
                   key=lambda m: (m.key, m.box.offset, m.dst, m.target))
    return RestorePlan(step, next((s for s, _ in replies.values() if s is not None), None),
                       moves)


def restore(targets: Sequence[LocalShard], copies: Sequence[tuple[Holding, torch.Tensor]],
            durable_root: str | None, group=None) -> Restored:
    """Fill ``targets`` (views of this rank's state under the new layout) from the
    copies every rank of ``group`` holds (``MemoryTier.copies`` of the layout before)
    and the durable checkpoint under ``durable_root``. Collective over ``group``."""
    ranks = comm.Comm(group)
    me = ranks.rank
    durable_step = checkpoint.latest_step(durable_root) if durable_root else None
    # A save committing while the ranks looked may show them different steps: the
    # oldest is in the checkpoint root for all (``keep`` >= 2 keeps it).
    unseen, oldest = ranks.maximum([durable_step is None, -(durable_step or 0)])
    durable_step = None if unseen else -oldest
    what = "restoring from the copies in memory"
    try:
        received = ranks.exchange(requests(me, [h for h, _ in copies],
                                           [t.info() for t in targets], ranks.ranks), what)
        owned = owner_plan(received, durable_step, ranks.maximum)
        plan = rank_plan(owned.step, ranks.exchange(told(owned), what))
    except checkpoint.CheckpointError as exc:
        raise RestoreError(str(exc)) from exc
    received_bytes = _exchange(plan, me, targets, copies, group)
    reads = [m for m in plan.moves if m.dst == me and m.src is None]
    schedule = plan.schedule
    if reads or (schedule is None and targets):
        reader = checkpoint.open(as_path(durable_root) / step_dir_name(plan.step))
        with torch.no_grad():
            for move in reads:
                target = targets[move.target]
                local_view(target.data, target.box, move.box).copy_(
                    reader.read(move.key, move.box))
        schedule = schedule or reader.manifest.extra.get("lr_schedule")
    log.info("restored step %d: %d bytes received from peers, %d cells read from %s",
             plan.step, received_bytes, len(reads), durable_root)
    return Restored(plan.step, schedule, received_bytes, len(reads))


def _exchange(plan: RestorePlan, me: int, targets: Sequence[LocalShard],
              copies: Sequence[tuple[Holding, torch.Tensor]], group) -> int:
    """Copy this rank's own cells, send every other's, receive its own; one packed
    buffer per (sender, receiver) pair, all posted at once. Returns the bytes received."""
    views = [h.views(buffer) for h, buffer in copies]
    sends: dict[int, list[torch.Tensor]] = {}
    recvs: dict[int, list[Move]] = {}
    with torch.no_grad():
        for move in plan.moves:
            if move.src == me:
                shard = copies[move.copy][0].shards[move.shard]
                source = local_view(views[move.copy][move.shard], shard.box, move.box)
                if move.dst == me:
                    target = targets[move.target]
                    local_view(target.data, target.box, move.box).copy_(source)
                else:
                    sends.setdefault(move.dst, []).append(source)
            elif move.dst == me and move.src is not None:
                recvs.setdefault(move.src, []).append(move)
        requests, inbox = [], {}
        for dst, parts in sorted(sends.items()):
            packed = torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])
            requests.append(dist.isend(packed, dst, group=group))
        for src, moves in sorted(recvs.items()):
            size = sum(m.box.numel * targets[m.target].data.element_size() for m in moves)
            inbox[src] = torch.empty(size, dtype=torch.uint8)
            requests.append(dist.irecv(inbox[src], src, group=group))
        for request in requests:
            request.wait()
        for src, moves in recvs.items():
            offset = 0
            for move in moves:
                target = targets[move.target]
                size = move.box.numel * target.data.element_size()
                cell = inbox[src][offset:offset + size].view(target.data.dtype)
                local_view(target.data, target.box, move.box).copy_(cell.view(move.box.shape))
                offset += size
    return sum(b.numel() for b in inbox.values())
