"""Fill any layout's training state from the copies the ranks hold in memory
(``memory_tier``), peer to peer, and from the zarr checkpoint for what none holds.

Every rank of the new world reports the complete copies it holds (``Holding``: whose
state, which step, which global boxes) and the boxes it needs (its ``state_shards``
under the new layout). All compute the same plan from that one gather
(``plan_restore``): the newest step at which the copies, with the durable checkpoint
if it has that step, cover every box needed; then, cell by cell of the common
refinement of all those boxes (``geometry.common_refinement``), one holder sends each
needed cell to each rank that needs it: the rank itself when it holds the cell, else
the holder with the fewest bytes to send so far. Each (sender, receiver) pair
exchanges one packed buffer; cells no copy holds are read from the checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from elastor_mcore import checkpoint
from elastor_mcore.checkpoint import LocalShard
from elastor_mcore.checkpoint.format import step_dir_name
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


@dataclass
class RestorePlan:
    step: int
    schedule: dict | None
    """The lr schedule's state at ``step`` from a copy (None: from the checkpoint)."""
    moves: list[Move]
    sent_bytes: dict[int, int] = field(default_factory=dict)

    def durable_cells(self) -> int:
        return sum(1 for m in self.moves if m.src is None)


def plan_restore(held: dict[int, Sequence[Holding]], needed: dict[int, Sequence[ShardInfo]],
                 durable_step: int | None) -> RestorePlan:
    """The newest step every needed box can be rebuilt at (see the module docstring);
    ``RestoreError`` if there is none."""
    steps = {h.step for copies in held.values() for h in copies}
    if durable_step is not None:
        steps.add(durable_step)
    for step in sorted(steps, reverse=True):
        plan = _plan_step(held, needed, step, durable_step == step)
        if plan is not None:
            return plan
    have = sorted(steps)
    raise RestoreError(
        f"no step can be rebuilt: the copies in memory (steps {have or 'none'}) and the "
        f"durable checkpoint (step {durable_step}) do not cover the state at any one step")


def _plan_step(held: dict[int, Sequence[Holding]], needed: dict[int, Sequence[ShardInfo]],
               step: int, durable: bool) -> RestorePlan | None:
    sources: list[tuple[int, int, int]] = []  # (rank, copy index, shard index)
    boxes: dict[int, list[ShardInfo]] = {}
    schedule = None
    for rank in sorted(held):
        for c, holding in enumerate(held[rank]):
            if holding.step != step:
                continue
            schedule = holding.schedule
            for s, info in enumerate(holding.shards):
                boxes[len(sources)] = [info]
                sources.append((rank, c, s))
    targets: list[tuple[int, int]] = []  # (rank, needed index)
    for rank in sorted(needed):
        for t, info in enumerate(needed[rank]):
            boxes[len(sources) + len(targets)] = [info]
            targets.append((rank, t))
    wanted_keys = {info.key for infos in needed.values() for info in infos}
    boxes = {i: infos for i, infos in boxes.items() if infos[0].key in wanted_keys}
    moves, load = [], {}
    for cell in common_refinement(boxes):
        holders = [sources[h] for h in cell.holders if h < len(sources)]
        for h in cell.holders:
            if h < len(sources):
                continue
            dst, target = targets[h - len(sources)]
            if not holders and not durable:
                return None
            if not holders:
                moves.append(Move(cell.key, cell.box, dst, target, None))
                continue
            rank, c, s = min(holders, key=lambda x: (x[0] != dst, load.get(x[0], 0), x))
            if held[rank][c].shards[s].dtype != needed[dst][target].dtype:
                raise RestoreError(
                    f"{cell.key}: a copy holds it as {held[rank][c].shards[s].dtype}, rank "
                    f"{dst} needs {needed[dst][target].dtype}; restore needs the same dtype")
            if rank != dst:
                size = cell.box.numel * torch.empty(
                    (), dtype=getattr(torch, needed[dst][target].dtype)).element_size()
                load[rank] = load.get(rank, 0) + size
            moves.append(Move(cell.key, cell.box, dst, target, rank, c, s))
    return RestorePlan(step, schedule, moves, load)


@dataclass(frozen=True)
class Restored:
    """What ``restore`` did, for the recovery's timeline."""

    step: int
    schedule: dict | None
    """The lr schedule's state at ``step``."""
    received_bytes: int
    durable_cells: int
    """Cells read from the durable checkpoint (held by no copy)."""


def restore(targets: Sequence[LocalShard], copies: Sequence[tuple[Holding, torch.Tensor]],
            durable_root: str | None, group=None) -> Restored:
    """Fill ``targets`` (views of this rank's state under the new layout) from the
    copies every rank of ``group`` holds (``MemoryTier.copies`` of the layout before)
    and the durable checkpoint under ``durable_root``. Collective over ``group``."""
    durable_step = checkpoint.latest_step(durable_root) if durable_root else None
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, ([h for h, _ in copies], [t.info() for t in targets],
                                      durable_step), group=group)
    # A save committing while the ranks looked may show them different steps: the
    # oldest is in the checkpoint root for all (``keep`` >= 2 keeps it).
    seen = [g[2] for g in gathered]
    durable_step = None if None in seen else min(seen)
    plan = plan_restore({r: g[0] for r, g in zip(ranks, gathered)},
                        {r: g[1] for r, g in zip(ranks, gathered)}, durable_step)
    received = _exchange(plan, dist.get_rank(), targets, copies, group)
    reads = [m for m in plan.moves if m.dst == dist.get_rank() and m.src is None]
    schedule = plan.schedule
    if reads or schedule is None:
        reader = checkpoint.open(as_path(durable_root) / step_dir_name(plan.step))
        with torch.no_grad():
            for move in reads:
                target = targets[move.target]
                local_view(target.data, target.box, move.box).copy_(
                    reader.read(move.key, move.box))
        schedule = schedule or reader.manifest.extra.get("lr_schedule")
    log.info("restored step %d: %d bytes received from peers, %d cells read from %s",
             plan.step, received, len(reads), durable_root)
    return Restored(plan.step, schedule, received, plan.durable_cells())


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
